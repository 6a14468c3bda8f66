"""Where a site came from in the model source, and what the model calls it (q or k), for the report.

Dynamo records the Python stack of every traced op in `node.meta["stack_trace"]`; the innermost model frame
is the line that wrote the RoPE arithmetic, and the frames around it usually name the tensor
(`q_embed = q * cos + ...`, `query = apply_rotary_emb(query, ...)`). Roles are read from those names and
never from a site's position in a q/k pair: two keys that share tables share a launch and are both "k".
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from .fx_util import nearest_upstream

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ROLES = (("q", re.compile(r"^(?:x?q|quer(?:y|ies))(?:_.*)?$|^.*_(?:q|query)$")),
          ("k", re.compile(r"^(?:x?k|keys?)(?:_.*)?$|^.*_(?:k|key)$")))
# Frames inside rotary-kernel libraries and torch's dispatch machinery: a kernel site (flash-attn's
# rotary_kernel, vLLM's ops) is written by the model line that calls the library, not by the launch inside it.
_LIBRARY = re.compile(r"[/\\](?:flash_attn[/\\]ops|vllm_flash_attn|triton|torch[/\\](?:_library|_ops\.py|"
                      r"_higher_order_ops|_dynamo))[/\\]?")
_ARITHMETIC = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
               torch.ops.aten.addcmul.default)


def _frames(node: fx.Node) -> list[tuple[str, str]]:
    """[(file:line, code line)] of the node's stack trace, outermost first, library frames left out."""
    out = []
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(lines[i + 1]) else ""
            out.append((f"{m.group(1)}:{m.group(2)}", code))
    own = [f for f in out if not _LIBRARY.search(f[0])]
    return own or out


def source_line(node: fx.Node) -> str:
    """The innermost model-code frame of the node's stack trace ("path:line")."""
    frames = _frames(node)
    return frames[-1][0] if frames else "<unknown>"


def arithmetic_node(node: fx.Node, limit: int = 64) -> fx.Node:
    """The nearest add/mul with a stack trace at or before `node`: the replaced node may be a view or transpose
    that the model applies afterwards (attention dispatch code), which is not where the RoPE was written."""
    found = nearest_upstream(node, lambda n: n.target in _ARITHMETIC and bool(n.meta.get("stack_trace")), limit)
    return node if found is None else found


def rotation_source(node: fx.Node) -> str:
    """Where the rotation's arithmetic was written ("path:line")."""
    return source_line(arithmetic_node(node))


def role(node: fx.Node) -> str:
    """"q" or "k" when the assignment that produced the rotation names a query or a key, else "x"."""
    for _, code in reversed(_frames(arithmetic_node(node))):
        target = code.split("=", 1)[0] if re.search(r"[^=!<>]=[^=]", code) else ""
        names = _IDENT.findall(target.split("[", 1)[0])
        if len(names) != 1:
            continue  # a tuple target or a subscripted buffer says nothing about this tensor
        for name, rx in _ROLES:
            if rx.match(names[0].lower()):
                return name
    return "x"


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")
