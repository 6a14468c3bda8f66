"""The QK-norm before a rotation, folded into the fused op as its prologue (docs/design.md section 2).

Plain torch.compile fuses the per-head (or across-heads) RMSNorm of q and k with the RoPE after it into one
kernel; a fused rotary node that takes the normed x loses that fusion and costs a round trip of q and k
through memory. So when x of a site is the output of an RMSNorm whose only consumer is the rotation, the op
takes the raw tensor, the norm's weight and epsilon, and normalises in the same pass.

The norm is recognised by its arithmetic in the post-grad graph, never by a module name:
`x * rsqrt(mean(x^2 over the last dim) + eps) [* weight]`, in any order of the products and with any casts
between them (Hugging Face casts back to the input dtype before the weight, diffusers does not). The fused
op computes it in fp32 and rounds once, so its error is at most the original's (the numerics contract).

A fold is proven, not assumed. The op normalises the rows it reads (one head's D lanes, or the last two
dims [H, D] across heads), so the layout ops between the norm and the rotation (views, transposes, permutes,
unsqueezes, expands, casts) are followed factor by factor from the normalised axis to the op's x
(`_Layout`): the fold is taken only when every row of the op holds exactly the lanes of one normalised row,
and the weight is then permuted the way those lanes are. A transposed lane dim, or heads that a
`view(B, S, H, D).transpose(1, 2)` moves away from the lanes, would otherwise normalise the wrong elements
with no error (the same sizes can make both layouts look alike): such a norm stays in the graph with the
reason in the report, and the rotation still fuses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from ...fx_sizes import as_int, norm_dim, same_dim
from ..fx_util import CASTS, PASS_THROUGH

aten = torch.ops.aten
prims = torch.ops.prims

# Layout ops between the norm and the rotation (attention processors transpose q to [B, H, S, D], Wan
# unflattens [B, S, H*D] to heads): followed by `_Layout` and replayed on the raw tensor when the norm folds.
# The pass-through ops less: casts (the norm's own rounding, followed apart), lane slices and selects (the rotation
# would then read part of the normed head), complex views (the op's norm reads real lanes), and `contiguous` and
# `squeeze.dims`, which `_Layout` does not replay.
_VIEWS = PASS_THROUGH - {*CASTS, aten.contiguous.default, aten.slice.Tensor, aten.select.int, aten.squeeze.dims,
                         aten.view_as_real.default, aten.view_as_complex.default}
_MAX_CHAIN = 12  # layout ops followed between the norm and the rotation


@dataclasses.dataclass(frozen=True)
class NormPrologue:
    raw: fx.Node  # x before the norm
    kind: str  # "rms" (each head) or "rms_across_heads" (every head of a token)
    eps: float
    weight: fx.Node | None  # [W]: one entry per normalised lane
    nodes: frozenset = frozenset()  # the norm's own nodes (products, casts, rsqrt, mean, square, layout ops)
    views: tuple = ()  # layout ops from the norm's output to x, outermost last (casts left out: replayed on raw)
    # The weight as the op reads it: reshape to `weight_split` (the lanes' factors, outermost first), permute
    # by `weight_perm` (the order in which the op's row reads those factors), reshape to `weight_shape`
    # ([D] per head, [H, D] across heads). An identity permutation is a plain reshape.
    weight_split: tuple = ()
    weight_perm: tuple = ()
    weight_shape: tuple = ()


# -- the norm's arithmetic ----------------------------------------------------------------------------------

def _strip(node, seen: set | None = None):
    while isinstance(node, fx.Node) and node.target in CASTS and node.args:
        if seen is not None:
            seen.add(node)
        node = node.args[0]
    return node


def _factors(node: fx.Node, out: list, inner: set, depth: int = 0) -> bool:
    """The leaves of a product tree (casts seen through, the tree's own nodes into `inner`); False when
    something else is in it."""
    node = _strip(node, inner)
    if isinstance(node, fx.Node) and node.target is aten.mul.Tensor and depth < 8:
        inner.add(node)
        return all(_factors(a, out, inner, depth + 1) for a in node.args[:2])
    out.append(node)
    return isinstance(node, fx.Node)


def _is_rsqrt(n: fx.Node) -> bool:
    """rsqrt(v), or v ** -0.5 (Gemma 4's norm spells it with torch.pow)."""
    return n.target is aten.rsqrt.default or (n.target is aten.pow.Tensor_Scalar and n.args[1] == -0.5)


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def constant_value(node: Any) -> float | None:
    """The value of a one-element constant as the graph holds it: a number, `full` of one element (how
    `torch.tensor(eps)` and `torch.full((), eps)` reach the post-grad graph), `scalar_tensor`, or a lifted
    one-element tensor attribute; rounded to the constant's dtype. None for anything else (a graph input is
    not a constant: its value may change from call to call)."""
    if not isinstance(node, fx.Node):
        return _number(node)
    node = _strip(node)
    val = node.meta.get("val")
    dtype = getattr(val, "dtype", None)
    value = None
    if node.target is aten.full.default and all(as_int(s) == 1 for s in node.args[0]):
        value = _number(node.args[1])
        dtype = node.kwargs.get("dtype") or dtype
    elif node.target is aten.scalar_tensor.default:
        value = _number(node.args[0])
        dtype = node.kwargs.get("dtype") or dtype
    elif node.op == "get_attr":
        t = getattr(node.graph.owning_module, str(node.target), None)
        fake = torch._subclasses.fake_tensor.FakeTensor
        if isinstance(t, torch.Tensor) and not isinstance(t, fake) and t.numel() == 1 and not t.is_complex():
            value, dtype = float(t.item()), t.dtype
    if value is None:
        return None
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        value = float(torch.tensor(value, dtype=dtype).item())
    return value


def _variance_plus_eps(add: Any, inner: set) -> tuple | None:
    """(variance node, eps) of `var + eps` in any form the graph spells it: add.Tensor or add.Scalar with
    its alpha (var + alpha * eps), the constant on either side (a constant first is `eps + alpha * var`,
    taken only with alpha 1), as a number or a one-element constant tensor. None when eps is not exact."""
    if not (isinstance(add, fx.Node) and add.target in (aten.add.Tensor, aten.add.Scalar) and len(add.args) == 2):
        return None
    alpha = add.kwargs.get("alpha", 1)
    alpha = _number(alpha)
    if alpha is None or set(add.kwargs) - {"alpha"}:
        return None
    a, b = add.args
    eps_b, eps_a = constant_value(b), constant_value(a)
    if eps_b is not None and isinstance(a, fx.Node) and eps_a is None:
        var, eps = a, eps_b * alpha
    elif eps_a is not None and isinstance(b, fx.Node) and eps_b is None and alpha == 1:
        var, eps = b, eps_a
    else:
        return None
    if not math.isfinite(eps):
        return None
    inner.add(add)
    for c in (a, b):
        if isinstance(c, fx.Node) and c is not var and len(c.users) == 1:
            inner.add(c)  # a constant only the norm reads dies with it
    return var, eps


def _eps_note(r: fx.Node) -> str:
    """Why eps was not read, where the rsqrt is of a sum with something that is not a constant."""
    add = _strip(r.args[0]) if r.args else None
    if not (isinstance(add, fx.Node) and add.target in (aten.add.Tensor, aten.add.Scalar)):
        return ""
    if any(isinstance(a, fx.Node) and _strip(a).op == "placeholder" and same_dim(_strip(a).meta["val"].numel(), 1)
           for a in add.args[:2]):
        return (": eps is an input of the graph (a tensor argument, or a float that torch.compile did not "
                "specialise), and the op takes eps as a constant")
    return ", with eps a constant"


def _rsqrt_of(r: fx.Node, inner: set) -> tuple | None:
    """(x, eps) when r = rsqrt(mean(x^2, [-1], keepdim) + eps); its nodes into `inner`."""
    if not _is_rsqrt(r):
        return None
    inner.add(r)
    # aten.add.Scalar is torch.nn.RMSNorm / F.rms_norm's decomposition, add.Tensor a hand-written norm's
    got = _variance_plus_eps(_strip(r.args[0], inner), inner)
    if got is None:
        return None
    mean, eps = _strip(got[0], inner), got[1]
    if not (isinstance(mean, fx.Node) and mean.target is aten.mean.dim and len(mean.args) > 2 and mean.args[2]):
        return None
    inner.add(mean)
    sq = _strip(mean.args[0], inner)
    ndim = sq.meta["val"].dim() if isinstance(sq, fx.Node) and "val" in sq.meta else None
    if ndim is None or list(mean.args[1]) not in ([-1], [ndim - 1]):
        return None
    if sq.target is aten.pow.Tensor_Scalar and sq.args[1] == 2:
        base = _strip(sq.args[0], inner)
    elif sq.target is aten.mul.Tensor and _strip(sq.args[0]) is _strip(sq.args[1]):
        base = _strip(sq.args[0], inner)
    else:
        return None
    inner.add(sq)
    return base, eps


# -- the layout between the norm and the rotation -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Factor:
    """One factor of a dim, row-major within it: a piece of the normalised axis (`stride` in lanes of the
    normed row), or anything else (a leading dim of the raw tensor, or a broadcast: `stride` None)."""

    size: Any  # an int, or a SymInt for a leading dim
    stride: int | None = None
    broadcast: bool = False


def _dim_of(size: Any, lane_stride: int | None = None) -> list:
    return [] if same_dim(size, 1) else [_Factor(as_int(size) or size, lane_stride)]


def _split(f: _Factor, outer: int) -> tuple:
    inner = f.size // outer
    if f.stride is None:
        return dataclasses.replace(f, size=outer), dataclasses.replace(f, size=inner)
    return _Factor(outer, f.stride * inner), _Factor(inner, f.stride)


def _regroup(factors: list, sizes) -> list | None:
    """The factors (one row-major sequence) regrouped into dims of `sizes`, splitting a concrete factor where a
    dim boundary falls inside it; None when that cannot be proven without guarding on a symbolic size."""
    out, fs, i = [], list(factors), 0
    for t in sizes:
        dim, acc = [], 1
        while not same_dim(acc, t):
            if i >= len(fs):
                return None
            f = fs[i]
            ti, ai, fi = as_int(t), as_int(acc), as_int(f.size)
            if None in (ti, ai, fi):  # symbolic: only whole factors, until the product is provably the size
                dim.append(f)
                acc, i = acc * f.size, i + 1
            elif ti % (ai * fi) == 0:
                dim.append(f)
                acc, i = ai * fi, i + 1
            elif ti % ai == 0 and fi % (ti // ai) == 0:
                outer, fs[i] = _split(f, ti // ai)
                dim.append(outer)
                acc = ti
            else:
                return None
        out.append(dim)
    return out if i == len(fs) else None


class _Layout:
    """Where the normalised lanes of a tensor are: a list of dims, each a row-major list of `_Factor`s. Each
    layout op maps it exactly or gives up (None), so whatever the sizes, the result never mistakes one dim
    for another."""

    def __init__(self, dims: list):
        self.dims = dims

    @classmethod
    def of_normed(cls, shape) -> _Layout:
        return cls([_dim_of(s) for s in shape[:-1]] + [_dim_of(shape[-1], 1)])

    def apply(self, node: fx.Node) -> _Layout | None:
        dims, t = self.dims, node.target
        out_shape = node.meta["val"].shape
        if t in CASTS or t in (aten.alias.default, aten.clone.default):
            return self
        if t is aten.permute.default:
            order = [norm_dim(d, len(dims)) for d in node.args[1]]
            return _Layout([dims[d] for d in order])
        if t is aten.transpose.int:
            a, b = (norm_dim(d, len(dims)) for d in node.args[1:3])
            new = list(dims)
            new[a], new[b] = dims[b], dims[a]
            return _Layout(new)
        if t is aten.unsqueeze.default:
            d = norm_dim(node.args[1], len(dims) + 1)
            return _Layout(dims[:d] + [[]] + dims[d:])
        if t is aten.squeeze.dim:
            if len(out_shape) == len(dims):
                return self
            d = norm_dim(node.args[1], len(dims))
            if any(f.stride is not None for f in dims[d]):
                return None
            return _Layout(dims[:d] + dims[d + 1:])
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            regrouped = _regroup([f for d in dims for f in d], out_shape)
            return _Layout(regrouped) if regrouped is not None else None
        if t is aten.expand.default:
            new = [_dim_of(s) for s in out_shape[:len(out_shape) - len(dims)]]
            new = [[dataclasses.replace(f, broadcast=True) for f in d] for d in new]
            for d, s in zip(dims, out_shape[len(out_shape) - len(dims):]):
                if not d:
                    new.append([_Factor(f.size, None, True) for f in _dim_of(s)])
                elif same_dim(math.prod(f.size for f in d), s):
                    new.append(d)
                else:
                    return None
            return _Layout(new)
        return None

    def merge_last(self, k: int) -> _Layout:
        """x_input's flatten_tail: the last k dims as one (k == 0: a trailing dim of 1)."""
        if k == 0:
            return _Layout(self.dims + [[]])
        return _Layout(self.dims[:len(self.dims) - k] + [[f for d in self.dims[len(self.dims) - k:] for f in d]])

    def split_last(self, sizes) -> _Layout | None:
        last = _regroup(self.dims[-1], sizes)
        return _Layout(self.dims[:-1] + last) if last is not None else None


def _layout_chain(x: fx.Node) -> tuple:
    """(normed, chain): x is `normed` after the layout ops and float casts `chain`, in order from `normed`
    (casts are not replayed on the raw tensor: the op computes the norm in fp32 and rounds once)."""
    chain = []
    while len(chain) < _MAX_CHAIN and x.args and isinstance(x.args[0], fx.Node) and \
            all(not isinstance(a, fx.Node) for a in x.args[1:]):
        if x.target in CASTS:
            val, src = x.meta.get("val"), x.args[0].meta.get("val")
            if not (all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in (val, src))
                    and val.device == src.device):
                break
        elif x.target not in _VIEWS:
            break
        chain.append(x)
        x = x.args[0]
    # casts right after the norm are the norm's own (its product tree sees through them)
    while chain and chain[-1].target in CASTS:
        x = chain.pop()
    return x, tuple(reversed(chain))


@dataclasses.dataclass(frozen=True)
class _Rows:
    kind: str
    split: tuple
    perm: tuple
    shape: tuple


def _op_rows(normed: fx.Node, chain: tuple, width: int, head_dim: int, blocks: tuple, x_k: int) -> _Rows | str:
    """How the op's rows read the normalised lanes: the op's x is x (the chain's end) with its last x_k dims
    merged and split into `blocks` heads of `head_dim` lanes (emission.x_input); or why it cannot fold."""
    layout: _Layout | None = _Layout.of_normed(normed.meta["val"].shape)
    for node in chain:
        layout = layout.apply(node)
        if layout is None:
            return f"the layout op {node.target} between the norm and the rotation could not be followed exactly"
    layout = layout.merge_last(x_k)
    if blocks:
        layout = layout.split_last([*blocks, head_dim])
        if layout is None:
            return "the rotation's heads split the normed lanes in a way that could not be followed exactly"
    dims = layout.dims

    def lanes(fs):
        return math.prod(f.size for f in fs if f.stride is not None)

    def pure(fs):
        return all(f.stride is not None for f in fs)

    if pure(dims[-1]) and lanes(dims[-1]) == width == head_dim:
        row, kind, shape = dims[-1], "rms", (head_dim,)
    elif len(dims) > 1 and pure(dims[-2] + dims[-1]) and lanes(dims[-2] + dims[-1]) == width \
            and lanes(dims[-1]) == head_dim:
        row, kind, shape = dims[-2] + dims[-1], "rms_across_heads", (width // head_dim, head_dim)
    else:
        return _why_not(dims, width, head_dim)
    ordered = sorted(row, key=lambda f: -f.stride)
    expected = 1
    for f in reversed(ordered):  # the row's factors tile the normed axis once
        if f.stride != expected:
            return "the normed lanes reach the rotation repeated or in pieces"
        expected *= f.size
    strides = [f.stride for f in ordered]
    return _Rows(kind, tuple(f.size for f in ordered), tuple(strides.index(f.stride) for f in row), shape)


def _why_not(dims: list, width: int, head_dim: int) -> str:
    """A reason that says where the normalised lanes are in x as the op reads it, from the layout (never from
    what a dim's position usually holds)."""
    sizes = [math.prod(f.size for f in d) if d else 1 for d in dims]
    shape = "[" + ", ".join(str(s) for s in sizes) + "]"
    held = [i - len(dims) for i, d in enumerate(dims) if any(f.stride is not None for f in d)]
    if any(f.broadcast for f in dims[-1]):
        return "the layout between the norm and the rotation broadcasts into the rotated rows"
    if width < head_dim or width % head_dim:
        return f"the norm spans {width} lanes, neither one head ({head_dim}) nor all heads of the token"
    heads = width // head_dim
    where = ("dims " if len(held) > 1 else "dim ") + ", ".join(map(str, held))
    last = dims[-1]
    if heads > 1 and last and all(f.stride is not None for f in last) and math.prod(f.size for f in last) == head_dim:
        apart = ", ".join(str(i) for i in held if i != -1)
        return (f"the norm spans {width} lanes, all {heads} heads of {head_dim} of a token, but x {shape} holds its "
                f"heads in dim {apart}, not next to the lanes: the op normalises across heads over its last two "
                "dims only")
    if heads == 1:
        return (f"the norm spans one head ({head_dim} lanes), in {where} of x {shape}, not the rotated lanes "
                "(dim -1): the layout between the norm and the rotation moves them")
    return (f"the norm spans {width} lanes ({heads} heads of {head_dim}), in {where} of x {shape}: neither "
            "the rotated lanes nor the two dims before and at them")


def norm_prologue(x: fx.Node, head_dim: int, blocks: tuple, x_k: int = 1) -> NormPrologue | str | None:
    """The RMSNorm that computes x (as the site reads it: its last `x_k` dims merged, heads `blocks` of
    `head_dim` lanes), a reason when x is normed in a way the op cannot take, or None when x is no RMSNorm
    output at all."""
    normed, chain = _layout_chain(x)
    leaves: list = []
    inner: set = set(chain)
    if not _factors(normed, leaves, inner) or len(leaves) < 2:
        return None
    rsqrts = [n for n in leaves if _is_rsqrt(n)]
    if len(rsqrts) != 1:
        return None
    got = _rsqrt_of(rsqrts[0], inner)
    if got is None:
        return "x is scaled by an rsqrt that is not rsqrt(mean(x^2) + eps) over the last dim" + _eps_note(rsqrts[0])
    raw, eps = got
    rest = [n for n in leaves if n is not rsqrts[0]]
    if raw not in rest:
        return "the rsqrt of the norm is taken over another tensor than the one it scales"
    rest.remove(raw)
    width = as_int(raw.meta["val"].shape[-1])
    if width is None:
        return "the norm's lane count is symbolic"
    weights = [n for n in rest if n.meta["val"].dim() == 1 and as_int(n.meta["val"].shape[0]) == width]
    if len(rest) > 1 or len(weights) != len(rest):
        return "the norm is multiplied by something else than a weight over its lanes"
    nshape, rshape = normed.meta["val"].shape, raw.meta["val"].shape
    if len(nshape) != len(rshape) or not all(same_dim(a, b) for a, b in zip(nshape, rshape)):
        return "the norm's input has another shape than its output"
    rows = _op_rows(normed, chain, width, head_dim, blocks, x_k)
    if isinstance(rows, str):
        return rows
    return NormPrologue(raw=raw, kind=rows.kind, eps=eps, weight=weights[0] if weights else None,
                        nodes=frozenset(inner | {normed}), views=tuple(n for n in chain if n.target not in CASTS),
                        weight_split=rows.split, weight_perm=rows.perm, weight_shape=rows.shape)


def dies_with(norm: NormPrologue, replaced: fx.Node, depends_on) -> bool:
    """Whether every use of the norm's own nodes is inside the norm or the rotation that `replaced` computes:
    then folding the norm removes it; else (a training graph saves its rsqrt for the backward, say) the norm
    stays in the graph anyway and folding it would read q and k twice."""
    return all(u in norm.nodes or u is replaced or depends_on(replaced, u) for n in norm.nodes for u in n.users)
