"""What the pass does to a graph: each rewrite's FX graph before and after the pass, one `name = target(args)` line
a node. docs/design.md ("What the pass does to a graph") shows this script's output; from a checkout's root,

    python -m examples.show_rewrites                 # every rewrite, both graphs whole
    python -m examples.show_rewrites --changed       # only the nodes the pass removes and makes (what the doc shows)
    python -m examples.show_rewrites slice_write     # the ones named

Each rewrite is a small function compiled on the CPU by real Inductor with the pass; "before" is the post-grad graph
Inductor hands the pass, "after" the same graph once the pass has run, and the fused kernel's report line says what
it took over. What each needs, beside torch and the package:
- `qk` (a plain q/k site): nothing more; on the CPU the site becomes the op's Inductor lowering (`rotary_qk`);
- the folds, `slice_write`, `cat_read` and `joined_write`: folds of the Triton kernel's opaque node, which Inductor
  cannot fuse with the data movement around it (the lowering fuses it anyway, so no fold is needed there). The script
  serves the Triton backend on CPU tensors as the tests do, the kernel run by Triton's interpreter
  (tests/helpers/triton_cpu.py: a source checkout, triton and pytest, all in `pip install -e ".[test]"`). The folds'
  ops are the ones a GPU's graph holds, each launched through the dispatcher (a plain site the Triton kernel takes
  is Inductor's user-kernel node on a GPU, `triton_kernel_wrapper_functional`);
- `kv_cache`: vLLM (its Python package; its CUDA runtime is not used). The attention layer is a stand-in, said so:
  its `do_kv_cache_update` writes the cache as vLLM's FlashAttention backend does, and it is registered with
  FlashAttention's cache record (ops/layer_caches.py); the forward context is vLLM's own.
A rewrite whose needs are missing prints what it needs and is skipped; the script fails only on a rewrite that ran
and did not fold as shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

import rope_fusion

LINE = 116  # a node's line is broken here (the graphs are pasted, indented, into docs/design.md: 120 columns)
B, S, TEXT, H, D = 1, 6, 2, 2, 8


class Missing(Exception):
    """A rewrite's need is not installed here: the rewrite is skipped with this message."""


class NotShown(Exception):
    """The rewrite ran and the graph after the pass is not what the design doc shows."""


@dataclasses.dataclass
class Case:
    """One compiled example: the function, its inputs, and the context its calls run in."""

    fn: Callable
    args: tuple
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    written: torch.Tensor | None = None  # what a call writes besides its outputs (a layer's KV cache)


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One rewrite as the design doc shows it: how to build its example, the backend the pass is asked for, what the
    CPU must serve as CUDA does for it (tests/helpers/triton_cpu.SERVES), the op the after-graph calls, and the ops
    whose data movement the rewrite removes (in the before-graph, gone from the after-graph)."""

    name: str
    title: str
    build: Callable[[], Case]
    fused: str
    removed: tuple[str, ...]
    backend: str = "auto"
    serves: tuple[str, ...] | None = None  # None: the CPU's own backends, no Triton


@dataclasses.dataclass
class Shown:
    """What a run of one rewrite gives: the graphs as nodes, the fused kernels' report lines and the outputs."""

    before: list[fx.Node]
    after: list[fx.Node]
    kernels: list[str]
    out: Any
    case: Case


class ShowingPass(rope_fusion.RopeFusionPass):
    """The pass, keeping a copy of the graph it is handed and of the graph it leaves."""

    def __call__(self, graph: fx.Graph, *args: Any, **kwargs: Any) -> None:
        self.before = _copied(graph)
        super().__call__(graph, *args, **kwargs)
        self.after = _copied(graph)


def _copied(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


# ----------------------------------------------------------------------------------------------------------------
# the examples: each a model's spelling, at a tiny size


def _neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half rotation on [B, S, H, D] with [S, D] tables."""
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb (use_real, unbind -1) on [B, H, S, D] with [S, D] tables."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return x * cos + rotated * sin


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _tables(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(rows, D // 2).repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


def qk_case() -> Case:
    def qk(q, k, cos, sin):
        return _neox(q, cos, sin), _neox(k, cos, sin)

    return Case(qk, (torch.randn(B, S, H, D), torch.randn(B, S, H, D), *_tables(S)))


def slice_write_case() -> Case:
    def cogvideox(q, k, cos, sin):
        """CogVideoX: only the video rows rotate, written back into q and k."""
        q, k = q * 1.0, k * 1.0
        q[:, :, TEXT:] = _interleaved(q[:, :, TEXT:], cos, sin)
        k[:, :, TEXT:] = _interleaved(k[:, :, TEXT:], cos, sin)
        return q, k

    return Case(cogvideox, (torch.randn(B, H, S, D), torch.randn(B, H, S, D), *_tables(S - TEXT)))


def cat_read_case() -> Case:
    def flux(q, k, eq, ek, wq, wk, weq, wek, cos, sin):
        """Flux: text and image q (and k) normed apart, joined along the sequence, then rotated."""
        q = torch.cat([_rms(eq, weq), _rms(q, wq)], 1)
        k = torch.cat([_rms(ek, wek), _rms(k, wk)], 1)
        return _neox(q, cos, sin), _neox(k, cos, sin)

    image, text = (torch.randn(B, S - TEXT, H, D) for _ in range(2)), (torch.randn(B, TEXT, H, D) for _ in range(2))
    weights = (1.0 + 0.1 * torch.randn(D) for _ in range(4))
    return Case(flux, (*image, *text, *weights, *_tables(S)))


def joined_write_case() -> Case:
    def hunyuan(q, k, eq, ek, cos, sin):
        """HunyuanVideo's dual stream: the image q (and k) rotated, the text stream joined after the rotation."""
        return (torch.cat([_interleaved(q, cos, sin), eq], 2), torch.cat([_interleaved(k, cos, sin), ek], 2))

    image, text = (torch.randn(B, H, S - TEXT, D) for _ in range(2)), (torch.randn(B, H, TEXT, D) for _ in range(2))
    return Case(hunyuan, (*image, *text, *_tables(S - TEXT)))


class StandInFlashImpl:
    """A stand-in for vLLM's FlashAttention impl (its attention package needs the CUDA runtime): it writes its
    `[blocks, kv_heads, block_size, 2 * head_dim]` cache as vLLM's does, k and v split along the lanes, slot s at
    block s // block_size, offset s % block_size, slot -1 skipped."""

    BLOCK = 4
    head_size = D

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        kc, vc = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                kc[s // self.BLOCK, s % self.BLOCK] = key[t]
                vc[s // self.BLOCK, s % self.BLOCK] = value[t]


def kv_cache_case() -> Case:
    try:
        import vllm.forward_context as fc
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
        from vllm.utils.torch_utils import _encode_layer_name
        with contextlib.suppress(ImportError):
            import vllm.model_executor.layers.attention  # noqa: F401  (registers the cache-update op first)
        torch.ops.vllm.unified_kv_cache_update.default  # noqa: B018  (raises where vLLM did not register it)
    except Exception as e:
        raise Missing(f"needs vLLM's layers ({type(e).__name__}: {e})") from None
    from rope_fusion.ops.layer_caches import FLASH_ATTENTION, AttentionCache, register_attention_cache

    register_attention_cache(AttentionCache(f"{__name__}.StandInFlashImpl", FLASH_ATTENTION.split))
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(D, max_position=64, is_neox_style=True, dtype=torch.float32)
    layer_name = "model.layers.0.self_attn.attn"
    name = _encode_layer_name(layer_name)

    def llama_layer(positions, qkv):
        """vLLM's attention prologue: the q/k rotation, then k and v written into the layer's paged cache."""
        q, k, v = qkv.split([H * D, H * D, H * D], dim=-1)
        q, k = rope.forward_native(positions, q, k)
        q, k, v = q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D)
        return q, torch.ops.vllm.unified_kv_cache_update(k, v, name)

    slots = torch.tensor([3, -1, 9, 12, 5, 0])
    layer = types.SimpleNamespace(impl=StandInFlashImpl(), kv_cache=torch.zeros(4, H, StandInFlashImpl.BLOCK, 2 * D))
    context = fc.ForwardContext(no_compile_layers={layer_name: layer}, attn_metadata=None,
                                slot_mapping={layer_name: slots})
    return Case(llama_layer, (torch.randint(0, 64, (S,)), torch.randn(S, 3 * H * D)),
                lambda: fc.override_forward_context(context), layer.kv_cache)


REWRITES = (
    Rewrite("qk", "a plain q/k site (NeoX rotate_half, [B, S, H, D])", qk_case, "rope_fusion.rotary_qk",
            ("aten.cat",)),
    Rewrite("slice_write", "a rotation written back into its slice (CogVideoX)", slice_write_case,
            "rope_fusion.rotary_qk_slice_", ("aten.slice_scatter",), "triton", ("slice_write",)),
    Rewrite("cat_read", "a joined x read from its pieces (Flux's normed text and image streams)", cat_read_case,
            "rope_fusion.rotary_qk_cat", ("aten.cat", "aten.rsqrt"), "triton", ("cat",)),
    Rewrite("joined_write", "a rotation joined after it (HunyuanVideo's dual stream)", joined_write_case,
            "rope_fusion.rotary_qk_into_", ("aten.cat",), "triton", ("slice_write",)),
    Rewrite("kv_cache", "the KV-cache write (vLLM's rotary layer and unified_kv_cache_update)", kv_cache_case,
            "rope_fusion.rotary_qk_into_layer_cache", ("vllm.unified_kv_cache_update",)),
)


# ----------------------------------------------------------------------------------------------------------------
# running and printing


@contextlib.contextmanager
def served(serves: tuple[str, ...] | None) -> Iterator[None]:
    """The Triton backend on CPU tensors, serving `serves` as CUDA does (nothing to do for None)."""
    if serves is None:
        yield
        return
    try:
        import triton  # noqa: F401

        from tests.helpers.triton_cpu import triton_on_cpu
    except ImportError as e:
        raise Missing(f"needs triton and the checkout's tests/helpers (pip install -e \".[test]\"): {e}") from None
    with triton_on_cpu(serves):
        yield


def run(rewrite: Rewrite) -> Shown:
    """Compile the rewrite's example with the pass (real Inductor, caches off so the pass runs) and call it once."""
    case = rewrite.build()
    torch._dynamo.reset()
    p = ShowingPass(backend=rewrite.backend)
    options = {"post_grad_custom_post_pass": p, "fx_graph_cache": False}
    with served(rewrite.serves), case.context(), torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(case.fn, fullgraph=True, options=options)(*case.args)
    kernels = [f"{k.op}[{k.backend}]" + (f": {k.fold}" if k.fold else "") for k in p.report.kernels]
    return Shown(list(p.before.nodes), list(p.after.nodes), kernels, out, case)


def op_name(node: fx.Node) -> str:
    """What a node calls, as the graph's reader names it: `aten.mul.Tensor`, `rope_fusion.rotary_qk.default`; an
    `auto_functionalized` node is named by the op it calls."""
    target = node.args[0] if _functionalized(node) else node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # namespace.op.overload, as FX prints it
    return getattr(target, "__name__", str(target))


def _functionalized(node: fx.Node) -> bool:
    """An `auto_functionalized` call: the functional form of a call of an op that writes its inputs."""
    return getattr(node.target, "__name__", "") == "auto_functionalized" and bool(node.args)


def calls(nodes: list[fx.Node], name: str) -> int:
    """How many nodes call `name` (an op, `namespace.op`, with any overload, or one overload)."""
    return sum(op_name(n) == name or op_name(n).startswith(name + ".") for n in nodes if n.op == "call_function")


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(map(_arg, a))
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    if isinstance(a, torch._ops.OpOverload):
        return str(a)
    return repr(a)


def node_line(node: fx.Node) -> str:
    """`name = target(args, key=value)`; the op's keyword arguments at their schema's defaults left out."""
    if node.op == "placeholder":
        return f"{node.name} = input"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    parts = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in _given(node).items()]
    label = getattr(node.target, "__name__", "") if _functionalized(node) else op_name(node)
    return f"{node.name} = {label}({', '.join(parts)})"


def _given(node: fx.Node) -> dict:
    """The node's keyword arguments less those equal to the called op's schema defaults."""
    target = node.args[0] if _functionalized(node) else node.target
    schema = getattr(target, "_schema", None)
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()} if schema else {}
    return {k: v for k, v in node.kwargs.items() if k not in defaults or not _same(v, defaults[k])}


def _same(value: Any, default: Any) -> bool:
    try:
        return type(value) is type(default) and bool(value == default)
    except (TypeError, RuntimeError):
        return False


def wrapped(line: str, indent: str = "    ") -> list[str]:
    """`line` broken into lines of at most LINE characters, the later ones indented further: after a comma between
    the call's own arguments where one is near enough, else after any comma, else at a space."""
    out, rest, depth = [], indent + line, 0
    while len(rest) > LINE:
        cut = _break(rest, len(indent) + 8, depth)
        if cut is None:
            break
        out.append(rest[:cut].rstrip())
        depth += sum(ch in "([{" for ch in out[-1]) - sum(ch in ")]}" for ch in out[-1])
        rest = indent + "        " + rest[cut:].lstrip()
    return out + [rest]


def _break(text: str, start: int, depth: int) -> int | None:
    """Where to break `text`, which starts inside `depth` brackets (an index past a comma or a space), or None where
    it cannot be broken."""
    top, comma, space = None, None, None
    for i, ch in enumerate(text[:LINE]):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if i > start and ch == " ":
            space = i
            if text[i - 1] == ",":
                comma = i
                top = i if depth <= 1 else top
    return top or comma or space


def _inputs(nodes: list[fx.Node]) -> list[str]:
    """The graph's inputs with their dtypes and shapes, wrapped at LINE characters."""
    words = []
    for n in nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            tensor = isinstance(val, torch.Tensor)
            words.append(f"{n.name} {str(val.dtype).removeprefix('torch.')}{list(val.shape)}" if tensor else n.name)
    lines, line = [], "inputs:"
    for w in words:
        if len(line) + len(w) + 2 > LINE:
            lines.append(line + ",")
            line = "       "
        line += ("" if line.endswith((":", " ")) else ",") + " " + w
    return lines + [line]


def graph_lines(nodes: list[fx.Node], other: list[fx.Node], changed: bool) -> list[str]:
    """One line a node; with `changed`, only the nodes that are not in `other` as they are (the pass's work)."""
    same = {node_line(n) for n in other} if changed else set()
    return [node_line(n) for n in nodes
            if not (changed and n.op == "placeholder") and not (node_line(n) in same and n.op != "output")]


def show(rewrite: Rewrite, changed: bool = False) -> str:
    """The rewrite's text as docs/design.md shows it; NotShown where the pass did not rewrite it so. `changed`: the
    nodes the pass removed (before) and those it made (after), each graph's other nodes left out."""
    shown = run(rewrite)
    if not calls(shown.after, rewrite.fused):
        raise NotShown(f"the graph after the pass calls no {rewrite.fused}: {shown.kernels}")
    for name in rewrite.removed:
        if not calls(shown.before, name) or calls(shown.after, name):
            raise NotShown(f"{name} is not in the graph before the pass, or is still there after it: {shown.kernels}")
    lines = [f"### {rewrite.name}: {rewrite.title}", *_inputs(shown.before)]
    lines += ["before:" if not changed else "before (the nodes the pass removes):"]
    lines += [w for line in graph_lines(shown.before, shown.after, changed) for w in wrapped(line)]
    lines += ["after:" if not changed else "after (the nodes the pass makes):"]
    lines += [w for line in graph_lines(shown.after, shown.before, changed) for w in wrapped(line)]
    lines += ["kernel:"] + [w for k in shown.kernels for w in wrapped(k)]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    changed = "--changed" in argv
    names = [a for a in argv if a != "--changed"] or [r.name for r in REWRITES]
    unknown = sorted(set(names) - {r.name for r in REWRITES})
    if unknown:
        print(f"unknown rewrites {unknown}; there are {[r.name for r in REWRITES]}", file=sys.stderr)
        return 2
    failed = 0
    for rewrite in (r for r in REWRITES if r.name in names):
        try:
            print(show(rewrite, changed), flush=True)
        except Missing as e:
            print(f"### {rewrite.name}: skipped, {e}\n", flush=True)
        except NotShown as e:
            print(f"show_rewrites: {rewrite.name}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
