"""The QK-norm before a rotation, folded into the fused op as its prologue (docs/design.md section 2).

Plain torch.compile fuses the per-head (or across-heads) RMSNorm of q and k with the RoPE after it into one
kernel; a fused rotary node that takes the normed x loses that fusion and costs a round trip of q and k
through memory. So when x of a site is the output of an RMSNorm whose only consumer is the rotation, the op
takes the raw tensor, the norm's weight and epsilon, and normalises in the same pass.

The norm is recognised by its arithmetic in the post-grad graph, never by a module name:
`x * rsqrt(mean(x^2 over the last dim) + eps) [* weight]`, in any order of the products and with any casts
between them (Hugging Face casts back to the input dtype before the weight, diffusers does not). The fused
op computes it in fp32 and rounds once, so its error is at most the original's (the numerics contract).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from .fx_util import CASTS, as_int

aten = torch.ops.aten
prims = torch.ops.prims

# Layout ops between the norm and the rotation (attention processors transpose q to [B, H, S, D], Wan
# unflattens [B, S, H*D] to heads): replayed on the raw tensor when the norm is folded.
_VIEWS = (aten.permute.default, aten.transpose.int, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default,
          aten.clone.default, aten.expand.default)


@dataclasses.dataclass(frozen=True)
class NormPrologue:
    raw: fx.Node  # x before the norm
    kind: str  # "rms" (each head) or "rms_across_heads" (every head of a token)
    eps: float
    weight: fx.Node | None  # [D] or [H*D]
    nodes: frozenset = frozenset()  # the norm's own nodes (products, casts, rsqrt, mean, square)
    views: tuple = ()  # layout ops from the norm's output to x, outermost last


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


def _rsqrt_of(r: fx.Node, inner: set) -> tuple | None:
    """(x, eps) when r = rsqrt(mean(x^2, [-1], keepdim) + eps); its nodes into `inner`."""
    if not _is_rsqrt(r):
        return None
    inner.add(r)
    add = _strip(r.args[0], inner)
    # aten.add.Scalar is torch.nn.RMSNorm / F.rms_norm's decomposition, add.Tensor a hand-written norm's
    if not (isinstance(add, fx.Node) and add.target in (aten.add.Tensor, aten.add.Scalar)
            and isinstance(add.args[1], (int, float))):
        return None
    inner.add(add)
    mean = _strip(add.args[0], inner)
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
    return base, float(add.args[1])


def _view_chain(x: fx.Node) -> tuple:
    """(base, views): x is `base` after the layout ops `views` (single-input, in order from base)."""
    views = []
    while x.target in _VIEWS and x.args and isinstance(x.args[0], fx.Node) and \
            all(not isinstance(a, fx.Node) for a in x.args[1:]) and len(views) < 8:
        views.append(x)
        x = x.args[0]
    return x, tuple(reversed(views))


def norm_prologue(x: fx.Node, head_dim: int, blocks: tuple) -> NormPrologue | str | None:
    """The RMSNorm that computes x (as the site reads it: heads `blocks` of `head_dim` lanes), a reason when
    x is normed in a way the op cannot take, or None when x is no RMSNorm output at all."""
    normed, views = _view_chain(x)
    leaves: list = []
    inner: set = set(views)
    if not _factors(normed, leaves, inner) or len(leaves) < 2:
        return None
    rsqrts = [n for n in leaves if _is_rsqrt(n)]
    if len(rsqrts) != 1:
        return None
    got = _rsqrt_of(rsqrts[0], inner)
    if got is None:
        return "x is scaled by an rsqrt that is not rsqrt(mean(x^2) + eps) over the last dim"
    raw, eps = got
    rest = [n for n in leaves if n is not rsqrts[0]]
    if raw not in rest:
        return "the rsqrt of the norm is taken over another tensor than the one it scales"
    rest.remove(raw)
    width = as_int(raw.meta["val"].shape[-1])
    weights = [n for n in rest if n.meta["val"].dim() == 1 and as_int(n.meta["val"].shape[0]) == width]
    if len(rest) > 1 or len(weights) != len(rest):
        return "the norm is multiplied by something else than a weight over its lanes"
    xshape = x.meta["val"].shape
    heads = math.prod(blocks) if blocks else (as_int(xshape[-2]) if len(xshape) > 1 else 1)
    if width == head_dim and (not views or as_int(xshape[-1]) == head_dim):
        kind = "rms"
    elif width == head_dim * heads and heads and heads > 1:
        kind = "rms_across_heads"
    else:
        return f"the norm spans {width} lanes, neither one head ({head_dim}) nor all heads of the token"
    if tuple(normed.meta["val"].shape) != tuple(raw.meta["val"].shape):
        return "the norm's input has another shape than its output"
    return NormPrologue(raw=raw, kind=kind, eps=eps, weight=weights[0] if weights else None,
                        nodes=frozenset(inner | {normed}), views=views)


def dies_with(norm: NormPrologue, replaced: fx.Node, depends_on) -> bool:
    """Whether every use of the norm's own nodes is inside the norm or the rotation that `replaced` computes:
    then folding the norm removes it; else (a training graph saves its rsqrt for the backward, say) the norm
    stays in the graph anyway and folding it would read q and k twice."""
    return all(u in norm.nodes or u is replaced or depends_on(replaced, u) for n in norm.nodes for u in n.users)
