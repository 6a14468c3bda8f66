"""A generator of RoPE-like functions, and of non-rotations that must not fuse.

Each case is Python source: `fn(...)`, the function compiled, and `make(g, S)`, which builds its inputs from a
seeded generator for a sequence length (or token count) S. Source rather than closures so that a failing case
is its own reproducer: `Case.source` runs as it is, and the harness prints it.

The choices are independent draws from one `random.Random(seed)`, so the generator is not told the cases it
should find; the families only bias the draws (a "norm" case always has a QK-norm, a "gather" case always
gathers its tables by positions), so that a few dozen seeds cover every axis:
- spellings: cat rotate-half (halves by slicing, chunk, split, unflatten+unbind), the half-table formula,
  strided slice assignment into `empty_like` or a clone, stack+flatten interleaved, unflatten+unbind,
  reshape+select, view_as_complex, torch.roll; partial rotary (a pass-through tail), a pass-through head;
- tables: full or half width (duplicated in the graph, or sliced to half), given in their broadcast shape or
  unsqueezed in the graph, per sequence / batch / head, strided views, packed cos|sin (`[.., 2W]` sliced or
  chunked, negative-start slices, `[.., 2, W]` selected), scaled, negated (a rotation by the angle plus pi),
  sums, angle-sum identities, gated by a mask, rows selected from computed tables, computed in the graph from
  positions and inverse frequencies (fp32 or fp64 angles, cast to the data's dtype), gathered from caches by
  positions (index_select, embedding, advanced indexing; positions out of range or negative);
- layouts: [B,S,H,D], [B,H,S,D] (a transposed view or contiguous), [T,H,D], flat [B,S,H*D];
- QK-norms (per head, across heads; with and without weight; eps as `+ eps`, `add(.., alpha=)`, `.add`;
  rsqrt, `1/sqrt`, `pow(-0.5)`, F.rms_norm), then view / transpose / permute chains that may move the lane
  axis;
- dtypes: fp32, fp16, bf16, fp64, upcast math cast back, fp32 tables on low-precision data, fp32 math on
  fp64 data, fp64 angles cast to fp16 / bf16 at large positions;
- dynamic sizes (compiled with dynamic=True and run at a second size);
- non-rotations: one table for cos and sin, tables computed from x, wrong signs, pairings that are no
  rotation (or one the op does not have), a complex reflection `conj(x) * freqs`.
"""

from __future__ import annotations

import dataclasses
import linecache
import random

import torch

FAMILIES = ("spelling", "tables", "norm", "gather", "dtype", "non_rotation")

DTYPES = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16", "fp64": "torch.float64"}


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    family: str
    tags: tuple  # every feature the case has ("spelling:cat", "norm:across", "dtype:fp16", ...)
    rotations: int  # RoPE-like tensors the function rotates (0: a non-rotation)
    dynamic: bool  # compiled with dynamic=True (and run again at S2)
    S: int
    S2: int
    source: str
    # how the harness runs it (tests/fuzz/hazards.py): "forward" (compiled and called), "backward" (its gradients
    # too), "fx_pass" (traced without decompositions, then FxPass), "host_table" (a host table written between calls)
    run: str = "forward"
    pass_options: tuple = ()  # RopeFusionPass keyword arguments, as (name, value) pairs
    marks: tuple = ()  # (argument index, dim) pairs marked dynamic before the first call
    sizes: tuple = ()  # more sizes after S (and S2) to call the compiled function at: graphs and guards counted
    needs_full: bool = False  # only real Inductor shows what can go wrong (its reinplacing, its scheduler)

    @property
    def filename(self) -> str:
        return f"<fuzz case {self.seed}>"

    def build(self):
        """(fn, make) from the source; the source is registered with linecache so that tracebacks and the
        pass's source lines show it."""
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True), self.filename)
        ns: dict = {}
        exec(compile(self.source, self.filename, "exec"), ns)
        return ns["fn"], ns["make"]

    def inputs(self, make, S: int | None = None) -> tuple:
        g = torch.Generator().manual_seed(self.seed)
        return make(g, self.S if S is None else S)

    def reproducer(self) -> str:
        return (f"# fuzz case {self.seed} ({', '.join(self.tags)})\n{self.source}\n"
                f"args = make(torch.Generator().manual_seed({self.seed}), {self.S})\n")


# -- the source builder --------------------------------------------------------------------------------------

class _Src:
    def __init__(self) -> None:
        self.params: list = []  # fn's parameters = make's outputs, in order
        self.make: list = []  # make's body
        self.body: list = []  # fn's body
        self.n = 0

    def fresh(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def param(self, name: str, make_lines: list) -> str:
        self.params.append(name)
        self.make += make_lines
        return name

    def line(self, text: str) -> None:
        self.body.append(text)

    def source(self, outputs: list) -> str:
        fn = [f"def fn({', '.join(self.params)}):"] + ["    " + b for b in self.body]
        fn.append(f"    return {', '.join(outputs)}" + ("," if len(outputs) == 1 else ""))
        mk = ["def make(g, S):", "    F64 = torch.float64"] + ["    " + m for m in self.make]
        mk.append(f"    return ({', '.join(self.params)},)")
        return "\n".join(["import torch", "import torch.nn.functional as F", "", ""] + fn + ["", ""] + mk) + "\n"


def _shape(exprs) -> str:
    return "(" + ", ".join(str(e) for e in exprs) + ("," if len(exprs) == 1 else "") + ")"


def _randn(name: str, shape, dtype: str, scale: float = 1.0) -> str:
    sc = "" if scale == 1.0 else f" * {scale}"
    return f"{name} = (torch.randn({_shape(shape)}, generator=g, dtype=F64){sc}).to({DTYPES[dtype]})"


def _angles(name: str, shape) -> str:
    """Angles over several turns, one per entry (tables distinct per lane: a wrong lane shows in the numbers)."""
    return f"{name} = (torch.rand({_shape(shape)}, generator=g, dtype=F64) * 2 - 1) * 12.566"


@dataclasses.dataclass
class _Dim:
    name: str  # B, S, H, D, HD
    expr: str  # size in make's source ("S" is the variable one)
    size: int


class _Gen:
    """One case's draws. `build()` returns the Case."""

    def __init__(self, seed: int, family: str) -> None:
        self.seed, self.family = seed, family
        self.rng = random.Random(seed * 7919 + 17)
        self.src = _Src()
        self.tags: list = [f"family:{family}"]

    # -- draws
    def p(self, prob: float) -> bool:
        return self.rng.random() < prob

    def pick(self, options, weights=None):
        return self.rng.choices(list(options), weights=weights)[0]

    def tag(self, t: str) -> None:
        if t not in self.tags:
            self.tags.append(t)

    # -- the case
    def build(self) -> Case:
        fam = self.family
        self.dynamic = self.p(0.2)
        self.B = self.pick([1, 2])
        self.H = self.pick([1, 2, 4, 8], [1, 3, 3, 2])
        self.D = self.pick([4, 8, 16, 32], [1, 4, 4, 2])
        taken = {self.B, self.H, self.D} if self.dynamic else set()
        sizes = [s for s in (2, 3, 4, 5, 6, 8) if s not in taken] or [7]
        self.S = self.pick(sizes)
        self.S2 = self.pick([s for s in (3, 5, 6, 7, 9, 11) if s != self.S and s not in taken] or [13])
        if self.dynamic:
            self.tag("dynamic")
        self.nonrot = None
        if fam == "non_rotation":
            self.nonrot = self.pick(["same_table", "table_from_x", "wrong_sign", "flip_pairing", "shift_pairing",
                                     "self_pairing", "complex_reflection", "no_rope"])
            if self.nonrot == "no_rope" and not self.dynamic:  # a graph without RoPE: the pass adds no guard
                self.dynamic = self.p(0.5)
                taken = {self.B, self.H, self.D}
                self.S = self.pick([s for s in (2, 3, 4, 5, 6, 8) if s not in taken] or [7])
                self.S2 = self.pick([s for s in (3, 5, 6, 7, 9, 11) if s != self.S and s not in taken] or [13])
            self.tag(f"nonrot:{self.nonrot}")
        self._dtypes()
        self._layout()
        self._spelling()
        self._extent()
        n_tensors = 2 if self.p(0.6) else 1
        gqa = n_tensors == 2 and self.H >= 2 and self.lanes_are == "D" and self.raw_kind != "flat" and self.p(0.25)
        heads = [self.H, (1 if self.H == 2 else self.H // 2) if gqa else self.H][:n_tensors]
        names = ["q", "k"][:n_tensors]
        for pfx, h in zip(names, heads):
            self._declare(pfx, h)
        tables = self._tables(per_head_ok=not gqa) if self.nonrot != "no_rope" else {}
        if gqa:
            self.tag("gqa")
        outs = [self._tensor(pfx, tables, h) for pfx, h in zip(names, heads)]
        rotations = 0 if self.nonrot else n_tensors
        src = self.src.source(outs)
        return Case(self.seed, fam, tuple(self.tags), rotations, self.dynamic, self.S, self.S2, src)

    # -- dtypes
    def _dtypes(self) -> None:
        fam = self.family
        self.special = None
        if fam == "dtype":
            self.special = self.pick(["fp64_angles_lowp", "fp32_math_fp64", "mixed_tables", "cast_back", "fp64"])
        x = {"fp64_angles_lowp": self.pick(["fp16", "bf16"]), "fp32_math_fp64": "fp64",
             "mixed_tables": self.pick(["bf16", "fp16"]), "cast_back": self.pick(["bf16", "fp16", "fp32"]),
             "fp64": "fp64"}.get(self.special) or self.pick(["fp32", "bf16", "fp16", "fp64"], [11, 4, 3, 2])
        self.xdt = x
        if self.special == "fp32_math_fp64" or (x == "fp64" and self.p(0.3)):
            self.math = "fp32_on_fp64"
        elif self.special == "cast_back" or (x in ("bf16", "fp16") and self.p(0.5)):
            self.math = self.pick(["upcast", "promote"], [3, 1])
        else:
            self.math = "native"
        self.tdt = "fp32" if (self.special == "mixed_tables" or (x in ("bf16", "fp16") and self.p(0.3))) else x
        if self.math == "fp32_on_fp64":
            self.tdt = self.pick(["fp64", "fp32"])
        self.tag(f"dtype:{x}")
        if self.tdt != x:
            self.tag(f"tables:{self.tdt}")
        self.tag(f"math:{self.math}")

    # -- data layout, the norm and the layout ops after it
    def _layout(self) -> None:
        fam = self.family
        norm = None
        if fam == "norm" or self.p(0.12):
            norm = self.pick(["per_head", "across"])
        if norm == "across" and self.H < 2:
            self.H = 4
        kind = "flat" if norm == "across" else self.pick(["bshd", "bhsd", "thd", "flat"], [4, 2, 2, 2])
        if fam == "spelling" and not norm and not self.nonrot and self.p(0.05):
            kind = "wide"  # one rotation over a whole flat hidden, feeding a projection
            self.B, self.H, self.D = 1, 1, self.pick([2048, 5120])
        self.raw_kind, self.norm = kind, norm
        self.tag(f"layout:{kind}")
        # the layout ops: pre (before the norm), post (after it)
        pre, post = [], []
        if kind == "flat":
            (pre if norm != "across" else post).append(("view_heads", None))
        moves = [[]]
        if kind in ("bshd", "flat"):
            moves += [[("transpose", (1, 2))], [("permute", (0, 2, 1, 3))]]
            if norm:  # the lane axis moved after a norm: what the norm normalised is no longer the lanes
                moves += [[("transpose", (-1, -2))], [("transpose", (-1, -2)), ("transpose", (1, 2))]]
        elif kind == "thd":
            moves += [[("transpose", (0, 1))]]
        post += self.pick(moves, [3] + [1] * (len(moves) - 1) if not norm else [2] * len(moves))
        self.pre, self.post = pre, post
        if ("transpose", (-1, -2)) in post and (self.H < 2 or self.H % 2):
            self.H = 4 if self.H < 2 else self.H + 1  # the heads become the rotated lanes: an even count
        B, S, H, D = (_Dim("B", str(self.B), self.B), _Dim("S", "S", self.S), _Dim("H", str(self.H), self.H),
                      _Dim("D", str(self.D), self.D))
        HD = _Dim("HD", str(self.H * self.D), self.H * self.D)
        dims = {"bshd": [B, S, H, D], "bhsd": [B, H, S, D], "thd": [S, H, D], "flat": [B, S, HD],
                "wide": [B, S, D]}[kind]
        self.raw_dims = dims
        for op, a in pre + post:
            dims = self._apply_dims(dims, op, a)
        self.y_dims = dims
        self.lanes_are = dims[-1].name
        if norm:
            self.tag(f"norm:{norm}")
            if self.lanes_are != "D":
                self.tag("norm:lane_axis_moved")
            if post:
                self.tag("norm:layout_ops")
        for op, a in pre + post:
            self.tag(f"layout_op:{op}{a if a else ''}".replace(" ", ""))

    def _apply_dims(self, dims, op, a):
        dims = list(dims)
        if op == "view_heads":
            hd = dims[-1]
            assert hd.name == "HD"
            return dims[:-1] + [_Dim("H", str(self.H), self.H), _Dim("D", str(self.D), self.D)]
        if op == "transpose":
            i, j = a
            dims[i], dims[j] = dims[j], dims[i]
            return dims
        if op == "permute":
            return [dims[k] for k in a]
        raise AssertionError(op)

    # -- spelling and extent
    def _spelling(self) -> None:
        style = self.pick(["neox", "interleaved"], [11, 9])
        if self.nonrot == "complex_reflection":
            style = "interleaved"
        if style == "neox":
            sp = self.pick(["cat", "halves", "slice_assign", "roll"], [8, 4, 2, 1])
        else:
            sp = self.pick(["stack", "unbind", "select", "slice_assign", "complex"], [4, 3, 2, 2, 3])
        if self.nonrot in ("same_table", "table_from_x", "wrong_sign", "flip_pairing", "shift_pairing"):
            # wrong signs with one entry per pair (per-lane tables could absorb a sign into the sin table)
            style, sp = "neox", {"same_table": self.pick(["cat", "halves"]), "wrong_sign": "halves"}.get(
                self.nonrot, "cat")
        if self.nonrot == "self_pairing":
            style, sp = "interleaved", "stack"
        if self.nonrot == "complex_reflection":
            sp = "complex"
        self.style, self.sp = style, sp
        self.halves = self.pick(["slice", "chunk", "split", "unflatten"], [4, 2, 2, 1])
        self.sign = "standard"
        if not self.nonrot:
            self.sign = self.pick(["standard", "conjugate"], [5, 1])
        self.tag(f"spelling:{style}_{sp}")
        if sp in ("cat", "halves", "slice_assign") and style == "neox":
            self.tag(f"halves:{self.halves}")
        if self.sign != "standard":
            self.tag(f"sign:{self.sign}")

    def _extent(self) -> None:
        L = self.y_dims[-1].size
        self.L = L
        kind = self.pick(["full", "tail", "head", "two"], [14, 4, 2, 1]) if L >= 8 else "full"
        if self.sp == "roll" or self.nonrot:
            kind = "full" if L < 8 or self.p(0.7) else "tail"
        if kind == "full":
            self.P, self.R = 0, L
        elif kind == "tail":
            self.P, self.R = 0, L // 2
        elif kind == "two":  # rotary dim 2: one pair, the rest passes through
            self.P, self.R = 0, 2
        else:
            self.P = self.pick([2, L // 4, L // 2]) if L >= 8 else 2
            self.R = L - self.P
        if self.R % 2 or (self.style == "interleaved" and self.R < 2):
            self.P, self.R = 0, L
        self.tag(f"extent:{kind}")

    # -- tables
    @property
    def full_width(self) -> bool:
        """The spelling multiplies by tables of width R (else R/2, one per pair)."""
        return self.sp in ("cat", "stack", "roll")

    def _tables(self, per_head_ok: bool) -> dict:
        """The table variables, broadcast against y's rotated part; {"c", "s"} or {"f"} (complex)."""
        fam = self.family
        lead = self.y_dims[:-1]
        seq = [d for d in lead if d.name == "S"]
        dims = []
        for d in lead:
            if d.name == "S":
                if self.p(0.92) or fam == "gather":
                    dims.append(d)
            elif d.name == "B" and self.B > 1 and self.p(0.15):
                dims.append(d)
            elif d.name in ("H", "D") and d.size > 1 and (per_head_ok or d.name != "H") and \
                    self.p(0.15 if d.name == "H" else 0.3):
                dims.append(d)
        if fam == "gather" and seq and seq[0] not in dims:
            dims.append(seq[0])
        self.table_dims = [d.name for d in dims]
        W = self.R if self.full_width else self.R // 2
        if self.sp == "complex":
            return self._complex_tables(dims, lead)
        c, s = self._table_source(dims, W)
        c, s = self._table_transforms(c, s, dims, W)
        c, s = self._broadcast(c, s, dims, lead)
        return {"c": c, "s": s}

    def _table_source(self, dims, W) -> tuple:
        """Tables of the natural shape [dims..., Wsrc], adapted to width W: (c, s) variable names."""
        fam, src = self.family, self.src
        gathered = fam == "gather" or self.p(0.08)
        computed = not gathered and (self.special == "fp64_angles_lowp" or (fam in ("tables", "dtype") and
                                                                           self.p(0.35)) or self.p(0.12))
        if self.special == "fp64_angles_lowp":
            computed, gathered = True, False
        if self.nonrot == "same_table":  # only table inputs pass one tensor as both cos and sin
            computed = gathered = False
        seq = [d for d in self.y_dims[:-1] if d.name == "S"]
        if computed and [d.name for d in dims] != ["S"]:
            dims[:] = seq
            self.table_dims = [d.name for d in dims]
        if gathered and "S" not in [d.name for d in dims]:
            gathered = False
        if gathered and [d.name for d in dims] not in (["S"], ["B", "S"]):
            dims[:] = [d for d in dims if d.name in ("B", "S")]
            self.table_dims = [d.name for d in dims]
        full_src = self.full_width if self.p(0.6) else not self.full_width
        wsrc = self.R if full_src else self.R // 2
        self.tag(f"table_width:{'full' if full_src else 'half'}")
        if gathered:
            c, s = self._gathered(dims, wsrc)
        elif computed:
            c, s = self._computed(dims, wsrc)
        else:
            c, s = self._table_inputs(dims, wsrc)
        if self.tdt != self.xdt and self.math == "native" and self.p(0.4):
            src.line(f"{c} = {c}.to({self.y_dtype_expr()})")
            src.line(f"{s} = {s}.to({self.y_dtype_expr()})")
            self.tag("tables:cast_to_x")
        return self._adapt_width(c, s, wsrc, W)

    def y_dtype_expr(self) -> str:
        return f"{self.src.params[0]}.dtype"

    def _adapt_width(self, c, s, wsrc, W) -> tuple:
        if wsrc == W:
            return c, s
        src = self.src
        c2, s2 = src.fresh("c"), src.fresh("s")
        if W > wsrc:  # duplicate per lane in the graph
            if self.style == "neox":
                src.line(f"{c2} = torch.cat(({c}, {c}), dim=-1)")
                src.line(f"{s2} = torch.cat(({s}, {s}), dim=-1)")
                self.tag("table:dup_cat")
            elif self.p(0.5):
                src.line(f"{c2} = {c}.repeat_interleave(2, dim=-1)")
                src.line(f"{s2} = {s}.repeat_interleave(2, dim=-1)")
                self.tag("table:dup_repeat_interleave")
            else:
                src.line(f"{c2} = torch.stack(({c}, {c}), dim=-1).flatten(-2)")
                src.line(f"{s2} = torch.stack(({s}, {s}), dim=-1).flatten(-2)")
                self.tag("table:dup_stack")
        else:  # one entry per pair out of a per-lane table
            sl = f"[..., :{W}]" if self.style == "neox" else "[..., ::2]"
            src.line(f"{c2} = {c}{sl}")
            src.line(f"{s2} = {s}{sl}")
            self.tag("table:per_lane_sliced_to_pairs")
        return c2, s2

    def _nat_shape(self, dims, w) -> list:
        return [d.expr for d in dims] + [w]

    def _table_inputs(self, dims, w) -> tuple:
        src, fam = self.src, self.family
        shape = self._nat_shape(dims, w)
        form = self.pick(["pair", "packed", "packed_pair", "select_computed"], [6, 2, 1, 1] if fam != "tables"
                         else [2, 2, 2, 2])
        if self.nonrot == "same_table":
            form = "pair"
        a = "a_" + str(self.seed % 1000)
        strided = self.p(0.2 if fam == "tables" else 0.08)
        if form == "pair":
            view = ""
            if strided:  # strided views of a wider table
                view = self.pick(["[..., ::2]", f"[..., {w}:]"])
                mk = [_angles(a, shape[:-1] + [2 * w])]
                self.tag("table:strided_input")
            else:
                mk = [_angles(a, shape)]
            mk += [f"cos = {a}.cos().to({DTYPES[self.tdt]}){view}", f"sin = {a}.sin().to({DTYPES[self.tdt]}){view}"]
            src.param("cos", mk)
            if self.nonrot == "same_table":
                return "cos", "cos"
            src.param("sin", [])
            return "cos", "sin"
        if form == "packed":
            mk = [_angles(a, shape), f"cos_sin = torch.cat(({a}.cos(), {a}.sin()), -1).to({DTYPES[self.tdt]})"]
            src.param("cos_sin", mk)
            c, s = src.fresh("c"), src.fresh("s")
            how = self.pick(["slice", "chunk", "negative_slice"])
            if how == "chunk":
                src.line(f"{c}, {s} = cos_sin.chunk(2, dim=-1)")
            elif how == "slice":
                src.line(f"{c} = cos_sin[..., :{w}]")
                src.line(f"{s} = cos_sin[..., {w}:]")
            else:
                src.line(f"{c} = cos_sin[..., :{w}]")
                src.line(f"{s} = cos_sin[..., -{w}:]")
            self.tag(f"table:packed_{how}")
            return c, s
        if form == "packed_pair":  # [.., 2, W] cos|sin, scaled in the graph, rows selected
            mk = [_angles(a, shape), f"cos_sin = torch.stack(({a}.cos(), {a}.sin()), -2).to({DTYPES[self.tdt]})"]
            src.param("cos_sin", mk)
            t, c, s = src.fresh("t"), src.fresh("c"), src.fresh("s")
            sc = self.pick([0.9, 1.0, 1.25])
            src.line(f"{t} = cos_sin * {sc}" if sc != 1.0 else f"{t} = cos_sin")
            src.line(f"{c} = {t}[..., 0, :]")
            src.line(f"{s} = {t}[..., 1, :]")
            self.tag("table:packed_pair_select" + ("_scaled" if sc != 1.0 else ""))
            return c, s
        # rows of a computed table: a leading dim whose size coincides with a dim of x, then a select
        lead_sizes = sorted({d.size for d in self.y_dims[:-1]} | {2})
        E = self.pick(lead_sizes)
        idx = self.pick(range(E))
        mk = [_angles(a, [E] + shape), f"cos = {a}.cos().to({DTYPES[self.tdt]})",
              f"sin = {a}.sin().to({DTYPES[self.tdt]})"]
        src.param("cos", mk)
        src.param("sin", [])
        c, s = src.fresh("c"), src.fresh("s")
        sc = self.pick([2.0, 0.5])
        src.line(f"{c} = (cos * {sc})[{idx}]")
        src.line(f"{s} = (sin * {sc})[{idx}]")
        self.tag("table:select_of_computed")
        return c, s

    def _computed(self, dims, w) -> tuple:
        """cos/sin of positions x inverse frequencies, in the graph."""
        src = self.src
        lowp = self.special == "fp64_angles_lowp"
        adt = "fp64" if lowp or (self.tdt == "fp64") or self.p(0.15) else "fp32"
        big = lowp or (adt == "fp64" and self.p(0.5))
        npairs = self.R // 2
        pos_from = "input" if big or self.p(0.5) else "arange"
        if pos_from == "input":
            hi = "10_000_000" if big else "4096"
            src.param("positions", [f"positions = torch.randint(0, {hi}, (S,), generator=g)"])
            pos = "positions"
        else:
            seq_axis = [i for i, d in enumerate(self.y_dims) if d.name == "S"][0]
            pos = src.fresh("pos")
            src.line(f"{pos} = torch.arange({src.params[0]}.shape[{self._raw_axis_of_seq(seq_axis)}])")
        src.param("inv_freq", [f"inv_freq = (1.0 / (10000.0 ** (torch.arange(0, {npairs}, dtype=F64) / "
                               f"{npairs}))).to({DTYPES[adt]})"])
        fr, c, s = src.fresh("freqs"), src.fresh("c"), src.fresh("s")
        src.line(f"{fr} = {pos}[:, None].to({DTYPES[adt]}) * inv_freq[None, :]")
        if w == self.R:
            if self.style == "neox":
                src.line(f"{fr} = torch.cat(({fr}, {fr}), dim=-1)")
            else:
                src.line(f"{fr} = {fr}.repeat_interleave(2, dim=-1)")
        scale = self.pick([None, None, 0.8, 1.3])
        sc = f" * {scale}" if scale else ""
        src.line(f"{c} = ({fr}.cos(){sc}).to({DTYPES[self.tdt]})")
        src.line(f"{s} = ({fr}.sin(){sc}).to({DTYPES[self.tdt]})")
        self.tag(f"table:computed_{adt}_angles" + ("_large_positions" if big else ""))
        if scale:
            self.tag("table:attention_scaling")
        if adt != self.tdt:
            self.tag(f"table:angles_{adt}_cast_to_{self.tdt}")
        return c, s

    def _raw_axis_of_seq(self, y_axis: int) -> int:
        """The axis of the raw input (fn's first parameter) that holds the sequence."""
        return [i for i, d in enumerate(self.raw_dims) if d.name == "S"][0]

    def _gathered(self, dims, w) -> tuple:
        """Rows of a [P, W] cache picked by positions: index_select, embedding or advanced indexing."""
        src = self.src
        rows = self.pick([16, 64])
        per_batch = [d.name for d in dims] == ["B", "S"]
        how = self.pick(["index_select", "embedding", "index", "item_offset"], [3, 3, 3, 1]) if not per_batch \
            else self.pick(["embedding", "index"])
        bad = self.pick([None, None, "out_of_range", "negative"], [5, 2, 2, 1] if self.family == "gather"
                        else [1, 0, 0, 0])
        if bad == "negative":
            how = "index"  # index_select and embedding raise on a negative row; indexing wraps it
        pshape = "(" + str(self.B) + ", S)" if per_batch else "(S,)"
        mk = [f"positions = torch.randint(0, {rows}, {pshape}, generator=g)"]
        if bad == "out_of_range":
            mk.append(f"positions.view(-1)[-1] = {rows} + 984")
        elif bad == "negative":
            mk.append("positions.view(-1)[0] = -3")
        a = "a_cache"
        packed = self.p(0.5)
        if packed:
            mk_c = [_angles(a, [rows, w]),
                    f"cos_sin_cache = torch.cat(({a}.cos(), {a}.sin()), -1).to({DTYPES[self.tdt]})"]
            src.param("cos_sin_cache", mk_c)
            caches = ["cos_sin_cache"]
        else:
            src.param("cos_cache", [_angles(a, [rows, w]), f"cos_cache = {a}.cos().to({DTYPES[self.tdt]})",
                                    f"sin_cache = {a}.sin().to({DTYPES[self.tdt]})"])
            src.param("sin_cache", [])
            caches = ["cos_cache", "sin_cache"]
        if how == "item_offset" and not bad:  # a data-dependent window: rows offset .. offset + S of the cache
            src.param("offset", [f"offset = torch.randint(0, {rows} - S + 1, (), generator=g)"])
            off, seq = src.fresh("off"), self._raw_axis_of_seq(0)
            src.line(f"{off} = offset.item()")
            if self.p(0.5):
                src.line(f"torch._check({off} >= 0)")
                src.line(f"torch._check({off} + {src.params[0]}.shape[{seq}] <= {rows})")
                self.tag("gather:item_offset_checked")
        else:
            if how == "item_offset":
                how = "index"
            src.param("positions", mk)
        got = []
        for cache in caches:
            v = src.fresh("rows")
            if how == "item_offset":
                src.line(f"{v} = {cache}[{off}:{off} + {src.params[0]}.shape[{seq}]]")
            elif how == "index_select":
                src.line(f"{v} = {cache}.index_select(0, positions)")
            elif how == "embedding":
                src.line(f"{v} = F.embedding(positions, {cache})")
            else:
                src.line(f"{v} = {cache}[positions]")
            got.append(v)
        if packed:
            c, s = src.fresh("c"), src.fresh("s")
            split = self.pick(["chunk", "slice", "negative_slice"])
            if split == "chunk":
                src.line(f"{c}, {s} = {got[0]}.chunk(2, dim=-1)")
            else:
                src.line(f"{c} = {got[0]}[..., :{w}]")
                src.line(f"{s} = {got[0]}[..., {w}:]" if split == "slice" else f"{s} = {got[0]}[..., -{w}:]")
            self.tag(f"gather:packed_{split}")
        else:
            c, s = got
        self.tag(f"gather:{how}")
        if bad:
            self.tag(f"gather:{bad}")
        return c, s

    def _table_transforms(self, c, s, dims, W) -> tuple:
        src, fam = self.src, self.family
        n = self.pick([0, 1, 2], [1, 3, 1]) if fam == "tables" else (1 if self.p(0.15) else 0)
        if self.nonrot == "same_table":
            n = 0
        for _ in range(n):
            t = self.pick(["scale", "negate", "sum", "angle_sum", "gate"], [3, 3, 1, 2, 2])
            c2, s2 = src.fresh("c"), src.fresh("s")
            shape = self._nat_shape(dims, W)
            if t == "scale":
                sc = self.pick([0.9, 1.25, 2.0])
                src.line(f"{c2} = {c} * {sc}")
                src.line(f"{s2} = {s} * {sc}")
            elif t == "negate":  # a rotation by the angle plus pi
                src.line(f"{c2} = -{c}")
                src.line(f"{s2} = -{s}")
            elif t in ("sum", "angle_sum"):
                b = src.fresh("b")
                src.param(f"cos_{b}", [_angles(f"a_{b}", shape), f"cos_{b} = a_{b}.cos().to({DTYPES[self.tdt]})",
                                       f"sin_{b} = a_{b}.sin().to({DTYPES[self.tdt]})"])
                src.param(f"sin_{b}", [])
                if t == "sum":
                    src.line(f"{c2} = {c} + cos_{b}")
                    src.line(f"{s2} = {s} + sin_{b}")
                else:  # cos(a+b), sin(a+b)
                    src.line(f"{c2} = {c} * cos_{b} - {s} * sin_{b}")
                    src.line(f"{s2} = {s} * cos_{b} + {c} * sin_{b}")
            else:  # gated: rotate only where the mask is set
                m = src.fresh("mask")
                src.param(m, [f"{m} = torch.rand({_shape(shape[:-1] + [1])}, generator=g) < 0.6"])
                src.line(f"{c2} = torch.where({m}, {c}, torch.ones_like({c}))")
                src.line(f"{s2} = torch.where({m}, {s}, torch.zeros_like({s}))")
            self.tag(f"table:{t}")
            c, s = c2, s2
        return c, s

    def _broadcast(self, c, s, dims, lead) -> tuple:
        """Unsqueeze the natural-shape tables to broadcast against y (right-aligned)."""
        for d in dims:
            self.tag(f"table_dim:{d.name}")
        if not dims:
            return c, s
        first = lead.index(dims[0])
        idx = [":" if d in dims else "None" for d in lead[first:]]
        if "None" not in idx:
            return c, s
        src = self.src
        c2, s2 = src.fresh("c"), src.fresh("s")
        if self.p(0.5):
            sub = "[" + ", ".join(idx + [":"]) + "]"
            src.line(f"{c2} = {c}{sub}")
            src.line(f"{s2} = {s}{sub}")
        else:
            ups = [i - len(idx) - 1 for i, v in enumerate(idx) if v == "None"]
            ce, se = c, s
            for u in reversed(ups):  # from the right: each new dim leaves the ones to its right in place
                ce, se = f"{ce}.unsqueeze({u})", f"{se}.unsqueeze({u})"
            src.line(f"{c2} = {ce}")
            src.line(f"{s2} = {se}")
        return c2, s2

    def _complex_tables(self, dims, lead) -> dict:
        src = self.src
        shape = self._nat_shape(dims, self.R // 2)
        a = "a_freqs"
        form = self.pick(["input", "polar", "complex"])
        cdt = "torch.complex128" if self.xdt == "fp64" and self.math != "fp32_on_fp64" else "torch.complex64"
        if form == "input":
            src.param("freqs_cis", [_angles(a, shape),
                                    f"freqs_cis = torch.polar(torch.ones_like({a}), {a}).to({cdt})"])
            f = "freqs_cis"
        else:
            rdt = "torch.float64" if cdt == "torch.complex128" else "torch.float32"
            src.param("angles", [_angles(a, shape), f"angles = {a}.to({rdt})"])
            f = src.fresh("f")
            if form == "polar":
                src.line(f"{f} = torch.polar(torch.ones_like(angles), angles)")
            else:
                src.line(f"{f} = torch.complex(angles.cos(), angles.sin())")
        self.tag(f"table:complex_{form}")
        for d in dims:
            self.tag(f"table_dim:{d.name}")
        if dims:
            first = lead.index(dims[0])
            idx = [":" if d in dims else "None" for d in lead[first:]]
            if "None" in idx:
                f2 = src.fresh("f")
                src.line(f"{f2} = {f}[" + ", ".join(idx + [":"]) + "]")
                f = f2
        return {"f": f}

    # -- one tensor: raw input, norm, layout ops, rotation, output
    def _declare(self, pfx: str, heads: int) -> None:
        H, D, B = heads, self.D, self.B
        raw_shape = {"bshd": [B, "S", H, D], "bhsd": [B, H, "S", D], "thd": ["S", H, D],
                     "flat": [B, "S", H * D], "wide": [B, "S", D]}[self.raw_kind]
        if self.raw_kind == "bhsd" and self.p(0.6):  # the usual transposed projection, not contiguous
            mk = [_randn(pfx, [B, "S", H, D], self.xdt) + ".transpose(1, 2)"]
            self.tag("layout:bhsd_transposed_view")
        else:
            scale = self.pick([1.0, 0.1]) if self.norm else 1.0  # small activations: eps is visible
            mk = [_randn(pfx, raw_shape, self.xdt, scale)]
        self.src.param(pfx, mk)

    def _tensor(self, pfx: str, tables: dict, heads: int) -> str:
        src = self.src
        H = heads
        t = pfx
        for op, a in self.pre:
            t = self._layout_op(t, op, a, H)
        if self.norm:
            t = self._norm(pfx, t, H)
        for op, a in self.post:
            t = self._layout_op(t, op, a, H)
        y = t
        if self.nonrot == "no_rope":  # attention scores: no table at all
            o = src.fresh(pfx + "_attn")
            src.line(f"{o} = torch.softmax({y} @ {y}.transpose(-1, -2) * 0.125, dim=-1) @ {y}")
            return o
        o = self._rotate(pfx, y, tables)
        if self.raw_kind == "wide":
            w = src.param(f"{pfx}_proj", [_randn(f"{pfx}_proj", [self.D, 8], self.xdt, 0.02)])
            o2 = src.fresh(pfx + "_out")
            src.line(f"{o2} = {o} @ {w}.to({o}.dtype)")
            self.tag("output:projection")
            return o2
        if self.raw_kind == "flat" and not self.post and self.p(0.5):
            o2 = src.fresh(pfx + "_out")
            src.line(f"{o2} = {o}.flatten(-2)")
            self.tag("output:flattened")
            o = o2
        return o

    def _layout_op(self, t, op, a, H) -> str:
        src = self.src
        v = src.fresh("t")
        if op == "view_heads":
            form = self.pick(["view", "unflatten", "reshape"])
            if form == "view":
                src.line(f"{v} = {t}.view(*{t}.shape[:-1], {H}, {self.D})")
            elif form == "unflatten":
                src.line(f"{v} = {t}.unflatten(-1, ({H}, {self.D}))")
            else:
                src.line(f"{v} = {t}.reshape({t}.shape[0], {t}.shape[1], {H}, -1)")
        elif op == "transpose":
            src.line(f"{v} = {t}.transpose{a}")
        else:
            src.line(f"{v} = {t}.permute{a}")
        return v

    def _norm(self, pfx, t, H) -> str:
        src = self.src
        width = self.D if self.norm == "per_head" else H * self.D
        weighted = self.p(0.6)
        if weighted:
            w = src.param(f"{pfx}_norm_w", [f"{pfx}_norm_w = (1 + 0.3 * torch.randn({width}, generator=g, "
                                           f"dtype=F64)).to({DTYPES[self.pick([self.xdt, 'fp32'])]})"])
            self.tag("norm:weight")
        eps = self.pick([1e-6, 1e-5, 1e-2, 0.1])
        form = self.pick(["hf", "diffusers", "rms_norm"], [3, 3, 1])
        if form == "rms_norm":
            v = src.fresh(pfx + "_n")
            wexp = f"{w}.to({t}.dtype)" if weighted else "None"
            src.line(f"{v} = F.rms_norm({t}, ({width},), {wexp}, eps={eps})")
            self.tag("norm:F.rms_norm")
            return v
        var_form = self.pick(["pow", "mul", "square"])
        xs = src.fresh("xs")
        up = form == "hf" or self.xdt in ("fp16", "bf16") and self.p(0.5)
        src.line(f"{xs} = {t}.float()" if up else f"{xs} = {t}")
        var = src.fresh("var")
        src.line({"pow": f"{var} = {xs}.pow(2).mean(-1, keepdim=True)",
                  "mul": f"{var} = ({xs} * {xs}).mean(dim=-1, keepdim=True)",
                  "square": f"{var} = {xs}.square().mean(-1, keepdim=True)"}[var_form])
        eps_form = self.pick(["add", "alpha", "method"], [3, 2, 1])
        ve = src.fresh("ve")
        if eps_form == "add":
            src.line(f"{ve} = {var} + {eps}")
        elif eps_form == "alpha":  # torch.add(var, e, alpha=a) adds e * a: sizes where e and e * a differ visibly
            eps, alpha = self.pick([1e-2, 0.1]), self.pick([50.0, 10.0, 0.1])
            src.line(f"{ve} = torch.add({var}, {eps}, alpha={alpha})")
            self.tag("norm:eps_alpha")
        else:
            src.line(f"{ve} = {var}.add({eps})")
        rs = self.pick(["rsqrt", "recip_sqrt", "pow"], [4, 1, 1])
        r = src.fresh("r")
        src.line({"rsqrt": f"{r} = torch.rsqrt({ve})", "recip_sqrt": f"{r} = 1.0 / torch.sqrt({ve})",
                  "pow": f"{r} = {ve}.pow(-0.5)"}[rs])
        n = src.fresh(pfx + "_n")
        if form == "hf":
            src.line(f"{n} = ({xs} * {r}).to({t}.dtype)")
            if weighted:
                src.line(f"{n} = {w} * {n}" if self.p(0.5) else f"{n} = {n} * {w}")
        else:
            src.line(f"{n} = {xs} * {r}")
            if weighted:
                src.line(f"{n} = {n} * {w}")
            if up:
                src.line(f"{n} = {n}.to({t}.dtype)")
        self.tag(f"norm:{form}")
        return n

    def _rotate(self, pfx, y, tables) -> str:
        src = self.src
        P, R, L = self.P, self.R, self.L
        xr = y
        if P or P + R < L:
            xr = src.fresh(pfx + "_r")
            src.line(f"{xr} = {y}[..., {P}:{P + R}]")
        up = {"native": None, "upcast": ".float()", "promote": ".to(torch.promote_types({x}.dtype, torch.float32))",
              "fp32_on_fp64": ".float()"}[self.math]
        back = None
        if up:
            xf = src.fresh(pfx + "_f")
            src.line(f"{xf} = {xr}{up.format(x=xr)}")
            back = {"upcast": f".to({y}.dtype)" if self.p(0.5) else f".type_as({y})",
                    "promote": f".to({y}.dtype)", "fp32_on_fp64": ".double()"}[self.math]
            xr = xf
        if "f" in tables:
            o = self._rotate_complex(pfx, xr, tables["f"])
        else:
            c, s = tables["c"], tables["s"]
            if up:
                c, s = f"{c}.to({xr}.dtype)", f"{s}.to({xr}.dtype)"
            o = self._rotate_real(pfx, xr, c, s)
        if back:
            o2 = src.fresh(pfx + "_o")
            src.line(f"{o2} = {o}{back}")
            o = o2
        if P or P + R < L:
            o2 = src.fresh(pfx + "_o")
            parts = ([f"{y}[..., :{P}]"] if P else []) + [o] + ([f"{y}[..., {P + R}:]"] if P + R < L else [])
            if self.sp == "slice_assign" and self.p(0.5):  # written into a clone of x (vLLM's MLA tail)
                src.line(f"{o2} = {y}.clone()")
                src.line(f"{o2}[..., {P}:{P + R}] = {o}")
                self.tag("extent:written_into_clone")
            else:
                src.line(f"{o2} = torch.cat(({', '.join(parts)}), dim=-1)")
            o = o2
        return o

    def _halves(self, x, h) -> tuple:
        src = self.src
        x1, x2 = src.fresh("x1_"), src.fresh("x2_")
        how = self.halves
        if how == "slice":
            src.line(f"{x1} = {x}[..., :{h}]")
            src.line(f"{x2} = {x}[..., {h}:]")
        elif how == "chunk":
            src.line(f"{x1}, {x2} = {x}.chunk(2, dim=-1)")
        elif how == "split":
            src.line(f"{x1}, {x2} = torch.split({x}, {h}, dim=-1)")
        else:
            src.line(f"{x1}, {x2} = {x}.unflatten(-1, (2, {h})).unbind(-2)")
        return x1, x2

    def _pairs(self, x) -> tuple:
        src = self.src
        x1, x2 = src.fresh("x1_"), src.fresh("x2_")
        if self.sp == "unbind":
            src.line(f"{x1}, {x2} = {x}.unflatten(-1, (-1, 2)).unbind(-1)")
        elif self.sp == "select":
            xp = src.fresh("xp")
            src.line(f"{xp} = {x}.reshape(*{x}.shape[:-1], -1, 2)")
            src.line(f"{x1} = {xp}[..., 0]")
            src.line(f"{x2} = {xp}[..., 1]")
        else:
            src.line(f"{x1} = {x}[..., 0::2]")
            src.line(f"{x2} = {x}[..., 1::2]")
        return x1, x2

    def _rotate_real(self, pfx, x, c, s) -> str:
        src, sp, nr = self.src, self.sp, self.nonrot
        h = self.R // 2
        o = src.fresh(pfx + "_rot")
        pm = "-" if self.sign == "conjugate" else "+"
        mp = "+" if self.sign == "conjugate" else "-"
        if nr == "table_from_x":  # the "tables" are functions of x itself
            c, s = src.fresh("cx"), src.fresh("sx")
            src.line(f"{c} = torch.cos({x})")
            src.line(f"{s} = torch.sin({x}.flip(-1))")
        if self.style == "neox":
            if sp in ("cat", "roll"):
                if sp == "roll":
                    rr = src.fresh("rolled")
                    src.line(f"{rr} = torch.roll({x}, {h}, dims=-1)")
                    rot = src.fresh("rot")
                    src.line(f"{rot} = torch.cat((-{rr}[..., :{h}], {rr}[..., {h}:]), dim=-1)")
                else:
                    x1, x2 = self._halves(x, h)
                    rot = src.fresh("rot")
                    first, second = {"wrong_sign": self.pick([(f"{x2}", f"{x1}"), (f"-{x2}", f"-{x1}")]),
                                     "flip_pairing": (f"-{x2}.flip(-1)", f"{x1}.flip(-1)")}.get(
                        nr, (f"-{x2}", f"{x1}"))
                    src.line(f"{rot} = torch.cat(({first}, {second}), dim=-1)")
                    if nr == "shift_pairing":
                        src.line(f"{rot} = {rot}.roll(1, -1)")
                src.line(f"{o} = {x} * {c} {pm} {rot} * {s}")
                return o
            x1, x2 = self._halves(x, h)
            s1 = "+" if nr == "wrong_sign" else mp
            e1, e2 = f"{x1} * {c} {s1} {x2} * {s}", f"{x2} * {c} {pm} {x1} * {s}"
            if sp == "halves":
                src.line(f"{o} = torch.cat(({e1}, {e2}), dim=-1)")
            else:
                src.line(f"{o} = torch.empty_like({x})")
                src.line(f"{o}[..., :{h}] = {e1}")
                src.line(f"{o}[..., {h}:] = {e2}")
            return o
        x1, x2 = self._pairs(x)
        if sp == "stack":
            rot = src.fresh("rot")
            pair = (f"-{x1}", f"{x2}") if nr == "self_pairing" else (f"-{x2}", f"{x1}")
            src.line(f"{rot} = torch.stack(({pair[0]}, {pair[1]}), dim=-1).flatten(-2)")
            src.line(f"{o} = {x} * {c} {pm} {rot} * {s}")
            return o
        e1, e2 = f"{x1} * {c} {mp} {x2} * {s}", f"{x2} * {c} {pm} {x1} * {s}"
        if sp == "slice_assign":
            src.line(f"{o} = torch.empty_like({x})")
            src.line(f"{o}[..., 0::2] = {e1}")
            src.line(f"{o}[..., 1::2] = {e2}")
        else:
            src.line(f"{o} = torch.stack(({e1}, {e2}), dim=-1).flatten(-2)")
        return o

    def _rotate_complex(self, pfx, x, f) -> str:
        src = self.src
        xc, o = src.fresh("xc"), src.fresh(pfx + "_rot")
        if self.math == "native":
            up = ".float()" if self.xdt != "fp64" else ""
        else:
            up = ""  # already upcast
        if self.lanes_are != "D":  # lanes with a stride: view_as_complex needs them contiguous
            up += ".contiguous()"
        src.line(f"{xc} = torch.view_as_complex({x}{up}.reshape(*{x}.shape[:-1], -1, 2))")
        if self.nonrot == "complex_reflection":
            prod = f"{xc}.conj() * {f}"
        elif self.sign == "conjugate":
            prod = f"{xc} * {f}.conj()"
        else:
            prod = f"{xc} * {f}"
        cast = f".type_as({x})" if self.math == "native" else ""
        src.line(f"{o} = torch.view_as_real({prod}).flatten(-2){cast}")
        return o


def generate(seed: int, family: str | None = None) -> Case:
    """Case `seed`; its family is FAMILIES[seed % 6] unless given."""
    return _Gen(seed, family or FAMILIES[seed % len(FAMILIES)]).build()
