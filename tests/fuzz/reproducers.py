"""The reduced reproducers of FINDINGS.md, as cases the fuzz harness runs (test_fuzz.test_reproducer).

Each is `fn` and `make(g, S)`, as a generated case is. They are the fuzz suite's findings and issue 27's own,
reduced by hand, so that a fix that regresses shows as the class it was.
"""

from __future__ import annotations

import dataclasses

from tests.fuzz.generator import Case


@dataclasses.dataclass(frozen=True)
class Reproducer:
    case: Case
    full: bool  # through real Inductor (the lowering's own behaviour is the point)
    what: str


def _case(name: str, fn_and_make: str, S: int, rotations: int = 1, S2: int | None = None, full: bool = False,
          what: str = "") -> Reproducer:
    """S2: compiled with dynamic=True and run again at S2."""
    source = "import torch\nimport torch.nn.functional as F\n\n\n" + fn_and_make
    case = Case(0, f"reproducer:{name}", ("reproducer",), rotations, S2 is not None, S, S2 or S, source)
    return Reproducer(case, full, what)


_NORM_FP32_ON_FP64 = """\
def fn(q, w, cos, sin):  # q fp64: the norm computed in fp32 (HF's .float() ... .to(q.dtype)), the rotation in fp64
    x = q.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype) * w
    rot = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    return x * cos + rot * sin

def make(g, S):
    a = torch.rand(S, 1, 8, generator=g, dtype=torch.float64) * 25
    q = torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64)
    return q, 1 + 0.3 * torch.randn(8, generator=g, dtype=torch.float64), a.cos(), a.sin()
"""

_COMPLEX_FP32_ON_FP64 = """\
def fn(q, freqs):  # q fp64 [1, S, 2, 8]: complex64 math (view_as_complex of q.float()), the result cast back to fp64
    xc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).double()

def make(g, S):
    a = torch.rand(S, 1, 4, generator=g, dtype=torch.float64) * 25
    q = torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64)
    return q, torch.polar(torch.ones_like(a), a).to(torch.complex64)
"""

_HEAD_FP32_ON_FP64 = """\
def fn(q, cos, sin):  # q, cos, sin fp64; lanes 2:8 rotated in fp32 (a pass-through head of 2)
    x = q[..., 2:8].float()
    rot = torch.cat((-x[..., 3:], x[..., :3]), dim=-1)
    o = (x * cos.float() + rot * sin.float()).double()
    return torch.cat((q[..., :2], o), dim=-1)

def make(g, S):
    a = torch.rand(S, 6, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64), a.cos(), a.sin()
"""

_ROLL = """\
def fn(q, cos, sin):  # q [1, S, 2, 8], cos/sin [S, 1, 8]
    r = torch.roll(q, 4, dims=-1)
    rot = torch.cat((-r[..., :4], r[..., 4:]), dim=-1)
    return q * cos + rot * sin

def make(g, S):
    a = torch.rand(S, 1, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 2, 8, generator=g), a.cos().float(), a.sin().float()
"""

_ACROSS_TRANSPOSE_DYN = """\
def fn(q, cos, sin):  # q [2, S, 16], a norm across heads, then [B, H, S, D]; cos/sin [S, 4]
    n = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 0.01)
    x = n.unflatten(-1, (4, 4)).transpose(1, 2)
    rot = torch.cat((-x[..., 2:], x[..., :2]), dim=-1)
    return x * cos + rot * sin

def make(g, S):
    a = torch.rand(S, 4, generator=g, dtype=torch.float64) * 25
    return torch.randn(2, S, 16, generator=g), a.cos().float(), a.sin().float()
"""

_FP32_ON_FP64 = """\
def fn(q, cos, sin):  # q fp64 [1, S, 2, 8], cos/sin fp32 [S, 1, 8]
    qf = q.float()
    rot = torch.cat((-qf[..., 4:], qf[..., :4]), dim=-1)
    return (qf * cos.float() + rot * sin.float()).double()

def make(g, S):
    a = torch.rand(S, 1, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64), a.cos().float(), a.sin().float()
"""

_ITEM_OFFSET = """\
def fn(q, cos_sin_cache, offset):  # a data-dependent window of a cos|sin cache: rows offset .. offset + S
    off = offset.item()
    torch._check(off >= 0)
    torch._check(off + q.shape[1] <= 16)
    cos, sin = cos_sin_cache[off:off + q.shape[1]].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = q[..., :4], q[..., 4:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

def make(g, S):
    a = torch.rand(16, 4, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 2, 8, generator=g), torch.cat((a.cos(), a.sin()), -1).float(), torch.tensor(3)
"""

_NORM_LANE_TRANSPOSED = """\
def fn(q, cos, sin):  # q [1, 8, 8, 8] (H == D): a per-head norm, then the lanes transposed with the heads
    x = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = x.transpose(-1, -2)
    rot = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    return x * cos + rot * sin

def make(g, S):
    a = torch.rand(S, 1, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 8, 8, generator=g), a.cos().float(), a.sin().float()
"""

_NORM_ACROSS_WEIGHT_LANES = """\
def fn(q, w, cos, sin):  # q [1, S, 64], w [64]: a norm across heads, then view(1, S, 16, 4).transpose(-1, -2)
    x = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    x = x.view(1, -1, 16, 4).transpose(-1, -2)
    rot = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    return x * cos + rot * sin

def make(g, S):
    a = torch.rand(S, 1, 16, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 64, generator=g), 1 + 0.3 * torch.randn(64, generator=g), a.cos().float(), a.sin().float()
"""

_EPS_ALPHA = """\
def fn(q, cos, sin):  # eps = 1e-2 * 50 = 0.5
    x = q * torch.rsqrt(torch.add(q.pow(2).mean(-1, keepdim=True), 1e-2, alpha=50.0))
    rot = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    return x * cos + rot * sin

def make(g, S):
    a = torch.rand(S, 1, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 2, 8, generator=g), a.cos().float(), a.sin().float()
"""

_SELECT_OF_COMPUTED = """\
def fn(k, c, s):  # k [1, 4, 2, 8]; c, s [2, 8]: row 0 of the computed c * 2, for every row of k
    rot = torch.cat((-k[..., 4:], k[..., :4]), dim=-1)
    return k * (c * 2)[0] + rot * (s * 2)[0]

def make(g, S):
    a = torch.rand(2, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, 4, 2, 8, generator=g), a.cos().float(), a.sin().float()
"""

_PACKED_PAIR_SCALED = """\
def fn(q, cs):  # q [S, 2, 8]; cs [S, 2, 8] = cos | sin rows, scaled
    t = cs * 0.9
    rot = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    return q * t[:, 0] + rot * t[:, 1]

def make(g, S):
    a = torch.rand(S, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(S, 2, 8, generator=g), torch.stack((a.cos(), a.sin()), 1).float()
"""

_FP64_ANGLES_FP16 = """\
def fn(q, positions, inv_freq):  # angles in fp64 at positions near 1e7, tables cast to fp16
    f = positions[:, None].double() * inv_freq[None, :]
    emb = torch.cat((f, f), dim=-1)
    cos, sin = emb.cos().half()[:, None], emb.sin().half()[:, None]
    rot = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    return q * cos + rot * sin

def make(g, S):
    pos = 10_000_000 + torch.randint(0, 1000, (S,), generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 4, dtype=torch.float64) / 4))
    return torch.randn(1, S, 2, 8, generator=g).half(), pos, inv
"""

_NEGATED_TABLES = """\
def fn(q, cos, sin):  # a rotation by the angle plus pi
    rot = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    return q * (-cos) + rot * (-sin)

def make(g, S):
    a = torch.rand(S, 1, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, S, 2, 8, generator=g), a.cos().float(), a.sin().float()
"""

_OUT_OF_RANGE = """\
def fn(q, cache, positions):  # vLLM-style: a 16-row cos|sin cache gathered by positions, one of them 1000
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = q[..., :4], q[..., 4:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

def make(g, S):
    a = torch.rand(16, 4, generator=g, dtype=torch.float64) * 25
    pos = torch.randint(0, 16, (S,), generator=g); pos[-1] = 1000
    return torch.randn(S, 2, 8, generator=g), torch.cat((a.cos(), a.sin()), -1).float(), pos
"""

_CONV_GUARDS = """\
def fn(x, w):  # no RoPE: x [1, 4, S] time last; compiled with dynamic=True at two lengths
    y = torch.nn.functional.conv1d(x, w, padding=1)
    return torch.nn.functional.gelu(y) * 0.5 + y

def make(g, S):
    return torch.randn(1, 4, S, generator=g), torch.randn(4, 4, 3, generator=g)
"""


_SCALED_TABLES_COMPUTED_X = """\
def fn(q, positions, inv_freq):  # q [1, S, 128] normalised, viewed as 8 heads and transposed (their index rotated)
    x = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = x.reshape(1, q.shape[1], 8, -1).transpose(-1, -2)
    f = positions[:, None].float() * inv_freq[None, :]
    f = torch.cat((f, f), dim=-1)
    c, s = -(f.cos() * 1.3)[:, None, :], -(f.sin() * 1.3)[:, None, :]  # tables scaled and negated
    rot = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    return x * c + rot * s

def make(g, S):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 4, dtype=torch.float32) / 4))
    return torch.randn(1, S, 128, generator=g), torch.randint(0, 4096, (S,), generator=g), inv_freq
"""

_ROLL_SYMBOLIC_LANES = """\
def fn(q, cos, sin):  # dynamic=True: the roll's index is iota(D) of a symbolic lane dim
    rolled = torch.roll(q, 8, dims=-1)
    return q * cos + torch.cat((-rolled[..., :8], rolled[..., 8:]), dim=-1) * sin

def make(g, S):
    a = torch.rand(S, 16, generator=g, dtype=torch.float64) * 25
    return torch.randn(1, 2, S, 16, generator=g), a.cos().float(), a.sin().float()
"""

_SYMBOLIC_HEADS_COMPUTED_TABLE = """\
def fn(q, cos, sin):  # dynamic=True: q [B, S, H, D] with H symbolic, tables computed and given a heads dim
    c, s = (cos * 0.8)[:, None, :], (sin * 0.8)[:, None, :]
    rot = torch.stack((-q[..., 1::2], q[..., 0::2]), dim=-1).flatten(-2)
    return q * c + rot * s

def make(g, S):
    a = torch.rand(S, 16, generator=g, dtype=torch.float64) * 25
    return torch.randn(2, S, 4, 16, generator=g), a.cos().float(), a.sin().float()
"""

_COMPLEX_FREQS_PER_HEAD = """\
def fn(q, angles):  # q [B, S, 64] viewed as 4 heads of 8 complex pairs, times freqs of one head's pairs [8]
    f = torch.complex(angles.cos(), angles.sin())
    xc = torch.view_as_complex(q.reshape(q.shape[0], q.shape[1], 4, -1, 2))
    return torch.view_as_real(xc * f).flatten(-2)

def make(g, S):
    return torch.randn(2, S, 64, generator=g, dtype=torch.float64), torch.rand(8, generator=g, dtype=torch.float64)
"""

_ONE_PAIR = """\
def fn(q, cos, sin):  # lanes 0:2 rotated (one interleaved pair, stack + flatten), the rest passed through
    x = q[..., 0:2]
    rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((x * cos - rot * sin, q[..., 2:]), dim=-1)

def make(g, S):
    a = torch.rand(1, generator=g, dtype=torch.float64) * 25
    return torch.randn(S, 1, 32, generator=g), a.cos().float().repeat(2), a.sin().float().repeat(2)
"""

_TRANSPOSED_PER_HEAD_TABLES = """\
def fn(q, cs):  # lanes transposed (heads' index rotated), interleaved, tables per row of the transposed x
    x = q.unflatten(-1, (8, 8)).transpose(-1, -2).reshape(*q.shape[:-1], 8, 4, 2)
    c, s = cs[..., 0, ::2], cs[..., 1, ::2]
    return torch.stack((x[..., 0] * c - x[..., 1] * s, x[..., 1] * c + x[..., 0] * s), dim=-1).flatten(-2)

def make(g, S):
    a = torch.rand(S, 8, 8, generator=g, dtype=torch.float64) * 25
    return torch.randn(2, S, 64, generator=g), torch.stack((a.cos(), a.sin()), -2).float()
"""


_WIDE_SPLIT_HALVES = """\
def fn(q, cos, sin, w):  # q [1, S, 2048]: the NeoX halves of one split, rotated, then a projection
    x1, x2 = torch.split(q, 1024, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1) @ w

def make(g, S):
    a = torch.rand(S, 1024, generator=g, dtype=torch.float64) * 25
    return (torch.randn(1, S, 2048, generator=g), a.cos().float(), a.sin().float(),
            torch.randn(2048, 8, generator=g) * 0.02)
"""

_WIDE_OVER_CAP_HALVES = """\
def fn(q, cos, sin, w):  # the same at 5120 lanes, over the analysis cap: a near miss that says so
    x1, x2 = q.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1) @ w

def make(g, S):
    a = torch.rand(S, 2560, generator=g, dtype=torch.float64) * 25
    return (torch.randn(1, S, 5120, generator=g), a.cos().float(), a.sin().float(),
            torch.randn(5120, 8, generator=g) * 0.02)
"""

REPRODUCERS = {
    "norm_fp32_on_fp64": _case("norm_fp32_on_fp64", _NORM_FP32_ON_FP64, S=4,
                    what="a folded norm computed in fp64 where the graph computes it in fp32"),
    "complex_fp32_on_fp64": _case("complex_fp32_on_fp64", _COMPLEX_FP32_ON_FP64, S=4,
                    what="complex64 math on fp64 data, the result cast back to fp64"),
    "head_fp32_on_fp64": _case("head_fp32_on_fp64", _HEAD_FP32_ON_FP64, S=4,
                    what="fp32 math on fp64 data after a pass-through head"),
    "roll": _case("roll", _ROLL, S=4,
                    what="the half swap written with torch.roll"),
    "across_transpose_dynamic": _case("across_transpose_dynamic", _ACROSS_TRANSPOSE_DYN, S=5, S2=7,
                    what="a norm across heads, then [B, H, S, D], dynamic"),
    "across_transpose_s_equals_h": _case("across_transpose_s_equals_h", _ACROSS_TRANSPOSE_DYN, S=4,
                    what="the same, static, S == H"),
    "fp32_on_fp64": _case("fp32_on_fp64", _FP32_ON_FP64, S=4,
                    what="fp64 data, fp32 math"),
    "item_offset_dynamic": _case("item_offset_dynamic", _ITEM_OFFSET, S=5, S2=7,
                    what="a data-dependent window of a cache, dynamic"),
    "norm_lane_transposed": _case("norm_lane_transposed", _NORM_LANE_TRANSPOSED, S=8,
                    what="the lanes transposed after a per-head norm (H == D)"),
    "norm_across_weight_lanes": _case("norm_across_weight_lanes", _NORM_ACROSS_WEIGHT_LANES, S=4,
                    what="a norm across heads with weight, then the lanes transposed"),
    "eps_alpha": _case("eps_alpha", _EPS_ALPHA, S=4,
                    what="eps with alpha"),
    "select_of_computed": _case("select_of_computed", _SELECT_OF_COMPUTED, S=4,
                    what="a row of a computed table"),
    "packed_pair_scaled": _case("packed_pair_scaled", _PACKED_PAIR_SCALED, S=2,
                    what="a packed [S, 2, D] table scaled, then selected"),
    "fp64_angles_fp16": _case("fp64_angles_fp16", _FP64_ANGLES_FP16, S=4,
                    what="fp64 angles cast to fp16 at positions near 1e7"),
    "negated_tables": _case("negated_tables", _NEGATED_TABLES, S=4,
                    what="a rotation by the angle plus pi"),
    "out_of_range": _case("out_of_range", _OUT_OF_RANGE, S=5, full=True,
                    what="a gathered position out of range (real Inductor)"),
    "conv_guards": _case("conv_guards", _CONV_GUARDS, S=5, rotations=0, S2=7,
                    what="no RoPE, dynamic: no more graphs than plain compile"),
    "scaled_tables_computed_x": _case("scaled_tables_computed_x", _SCALED_TABLES_COMPUTED_X, S=4,
                    what="a computed x with scaled, negated tables"),
    "roll_symbolic_lanes": _case("roll_symbolic_lanes", _ROLL_SYMBOLIC_LANES, S=5, S2=7,
                    what="torch.roll over a symbolic lane dim, dynamic"),
    "symbolic_heads_computed_table": _case("symbolic_heads_computed_table", _SYMBOLIC_HEADS_COMPUTED_TABLE, S=5,
                    S2=7, what="a computed table with a heads dim of 1 against a symbolic heads dim, dynamic"),
    "complex_freqs_per_head": _case("complex_freqs_per_head", _COMPLEX_FREQS_PER_HEAD, S=4,
                    what="complex freqs of one head's pairs times x viewed as heads"),
    "one_pair": _case("one_pair", _ONE_PAIR, S=6,
                    what="one rotated pair, stack + flatten, then the pass-through lanes"),
    "transposed_per_head_tables": _case("transposed_per_head_tables", _TRANSPOSED_PER_HEAD_TABLES, S=4,
                    what="lanes transposed, tables per row of them: a near miss, not silence"),
    "wide_split_halves": _case("wide_split_halves", _WIDE_SPLIT_HALVES, S=3,
                    what="a 2048-lane rotation of one split's halves that feeds a projection"),
    "wide_over_cap_halves": _case("wide_over_cap_halves", _WIDE_OVER_CAP_HALVES, S=2,
                    what="a 5120-lane rotation of one split's halves: a near miss over the cap, not silence"),
}
