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

from ...fx_nodes import nearest_upstream

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


def _assigned_names(node: fx.Node) -> list[str]:
    """The names the model assigned the value to, innermost frame first (`q_embed = q * cos + ...` gives
    "q_embed"); a tuple target or a subscripted buffer says nothing about one tensor and is skipped."""
    out = []
    for _, code in reversed(_frames(node)):
        target = code.split("=", 1)[0] if re.search(r"[^=!<>]=[^=]", code) else ""
        names = _IDENT.findall(target.split("[", 1)[0])
        if len(names) == 1:
            out.append(names[0])
    return out


def role(node: fx.Node) -> str:
    """"q" or "k" when the assignment that produced the rotation names a query or a key, else "x"."""
    for assigned in _assigned_names(arithmetic_node(node)):
        for name, rx in _ROLES:
            if rx.match(assigned.lower()):
                return name
    return "x"


def tensor_name(node: fx.Node) -> str:
    """What a person calls the value: the name the model assigned it to, else its shape and dtype
    ("[2, 8, 16, 64] bfloat16"), for a near miss's line in the report."""
    names = _assigned_names(node) or _assigned_names(arithmetic_node(node))
    if names:
        return names[0]
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"[{', '.join(map(str, val.shape))}] {dtype_name(val.dtype)}"
    return ""


# What an FX node's name looks like in a reason's text: "arg1_1", "add_25", "rsqrt_1" (a name without a digit,
# "add", is also an English word, and is left as it is).
FX_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\d\b")


def value_description(node: fx.Node) -> str:
    """A graph value as a person can place it: an input by its shape and dtype, a computed value by the name the
    model assigned it to (else its shape)."""
    val = node.meta.get("val")
    shape = f"[{', '.join(map(str, val.shape))}] {dtype_name(val.dtype)}" if isinstance(val, torch.Tensor) else ""
    if node.op == "placeholder":
        return f"the input {shape}".rstrip()
    names = _assigned_names(node)
    return names[0] if names else f"a {shape} value" if shape else "a value"


def named_values(text: str, nodes: dict) -> dict:
    """{FX name: description} of the graph's nodes (`nodes`: name -> node) that `text` names, so that the report
    can say them in a person's words and keep the FX names for its verbose form."""
    return {name: value_description(nodes[name]) for name in dict.fromkeys(FX_NAME.findall(text)) if name in nodes}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")
