"""The fused rotary op: its one schema, reference semantics, Inductor lowering and backend registry; the op with a
KV-cache write (kv_cache*.py).

Importing this package defines every `rope_fusion::*` op (torch.library only: no Inductor, no Triton). The
Inductor lowering (lowering.py) needs Inductor's lowering table, so it registers the moment Inductor imports
that table (import_hooks.py), before Inductor lowers any graph: importing the package does not load Inductor,
and a compile of model code that calls the op still lowers it.
"""

from .. import import_hooks
from . import (
    backends,  # noqa: F401
    cat_rotary,  # noqa: F401  (defines the cat ops)
    host_tables,  # noqa: F401  (defines the host table copy op)
    slice_write,  # noqa: F401  (defines the slice and into ops)
)
from .kv_cache_api import apply_rotary_qk_kv_cache  # noqa: F401
from .op_definition import define_rotary_ops  # noqa: F401
from .plan_cache import clear_caches  # noqa: F401
from .public_functions import apply_rotary, apply_rotary_qk, apply_rotary_qkv  # noqa: F401
from .reference import rotary_reference  # noqa: F401
from .schema import RotaryParams, check_args, math_dtype  # noqa: F401


def _register_lowering(_: object) -> None:
    from . import lowering  # noqa: F401  (registers the lowerings on import)


import_hooks.after_import(import_hooks.INDUCTOR_LOWERING_MODULE, _register_lowering)
