"""What Inductor sees of a post-grad pass: the base class it expects, and the hash of the package's sources.

Inductor keys its FX graph cache on a custom pass's `uuid()`, which `CustomGraphPass` asks for; a pass whose code
changed must key a new entry, so the uuid of ours covers every source file (`source_hash`). Both the pass and the
chain that `install()` builds around it (integrations/installation.py) derive from `PassBase`, and `auto`'s stored
decisions (passes/auto/auto_decisions.py) name the sources they were measured with, so this sits below all three.
"""

from __future__ import annotations

import functools
import hashlib
import os

try:  # torch passes `is_inference` to such passes (inference graph or training forward)
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as PassBase
except ImportError:  # older torch
    from torch._inductor.custom_graph_pass import CustomGraphPass as PassBase


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of every .py file of the package: any code change changes the pass's uuid."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


__all__ = ["PassBase", "source_hash"]
