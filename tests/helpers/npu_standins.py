"""Stand-ins for torch_npu's rotary ops, as the Ascend bridge (rope_fusion/kernels/npu.py) calls them eagerly.

torch_npu needs the CANN runtime, so the stand-ins here are registered in a test namespace (not `npu`)
with the schemas of torch_npu's ops and their documented semantics:

- npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor
  out = r1*x + r2*rotate(x); 'half': rotate = cat(-x2, x1) over the halves; 'interleave':
  rotate = stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2). x, r1, r2 4-D, one dtype, D even and < 896.
- npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND',
  str rotary_mode='half') -> (Tensor, Tensor): the 'half' rotation of query and key, written IN PLACE
  (torch_npu's kernel returns its inputs); the bridge may use it only for BSND/TND, 'half', D 64 or 128, one
  dtype.

Each stand-in asserts those constraints and logs its arguments, so the tests check what the bridge passes
(layouts, table widths, modes, copies) as well as its results against rotary_reference.
"""

from __future__ import annotations

import torch

from rope_fusion.passes import fusion_check

NS = "rope_fusion_test_npu"
CALLS: list = []

_lib = torch.library.Library(NS, "DEF")
_lib.define("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor")
_lib.define("npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', "
            "str rotary_mode='half') -> (Tensor, Tensor)")


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _stand_in_rotary_mul(x, r1, r2, rotary_mode="half"):
    assert rotary_mode in ("half", "interleave"), rotary_mode
    assert x.dim() == r1.dim() == r2.dim() == 4, (x.shape, r1.shape, r2.shape)
    assert x.dtype == r1.dtype == r2.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    d = x.shape[-1]
    assert d % 2 == 0 and d < 896 and r1.shape[-1] == d and r2.shape[-1] == d
    torch.broadcast_shapes(x.shape, r1.shape, r2.shape)
    if not fusion_check.checking():  # the pass's self-check evaluating the graph at compile time
        CALLS.append(("rotary_mul", tuple(x.shape), tuple(r1.shape), rotary_mode, x.dtype))
    xf = x.float()
    return (r1.float() * xf + r2.float() * _rotate(xf, rotary_mode)).to(x.dtype)


def _stand_in_apply(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    assert layout in ("BSND", "TND") and rotary_mode == "half", (layout, rotary_mode)
    assert query.dtype == key.dtype == cos.dtype == sin.dtype
    d = query.shape[-1]
    assert d in (64, 128) and key.shape[-1] == d
    assert query.dim() == key.dim() == cos.dim() == (4 if layout == "BSND" else 3)
    expected = (*query.shape[:-2], 1, d)
    assert tuple(cos.shape) == tuple(sin.shape) == expected, (cos.shape, expected)
    if not fusion_check.checking():  # the pass's self-check evaluating the graph at compile time
        CALLS.append(("apply", tuple(query.shape), tuple(key.shape), tuple(cos.shape), layout, query.dtype))
    for t in (query, key):  # in place, as torch_npu's kernel does
        tf = t.float()
        t.copy_(cos.float() * tf + sin.float() * _rotate(tf, "half"))
    return query, key


_lib.impl("npu_rotary_mul", _stand_in_rotary_mul, "CompositeExplicitAutograd")
_lib.impl("npu_apply_rotary_pos_emb", _stand_in_apply, "CompositeExplicitAutograd")
