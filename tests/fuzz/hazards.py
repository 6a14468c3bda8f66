"""A generator of the hazards that round 4's adversarial sweep found: cases where the pass must not give a wrong
number, break a compile, add a recompile or miss a rotation silently, each drawn at random within its class.

Each family builds a `Case` (generator.py) whose source is its own reproducer, plus how the harness runs it
(`Case.run`, `pass_options`, `marks`, `sizes`, `needs_full`):
- "slice_base": a rotation written back into the rows it reads (`slice_scatter` or slice assignment) of a base
  that is contiguous, a view with gaps, steps or an offset, rows that overlap (`as_strided`), an `expand`ed
  tensor (also k expanded over q's heads), or a graph input; the base read again after the write or not. The
  Triton backend's in-place fold takes these; only Inductor's reinplacing shows its failures: real Inductor;
- "marked_dynamic": `torch._dynamo.mark_dynamic` on the flat dim of vLLM's [T, H*D], on a head dim, on the
  sequence or batch dim, then run at another size of that dim;
- "recompile": `dynamic=True` over several sizes: a write-back at a symbolic start (`q[:, :, t:] = rope(...)`
  with t from the shapes), a head dim that changes between calls, and a sequence length as a control; graphs and
  shape guards counted with and without the pass;
- "backward_rows": the gradient of a rotation of a row slice (`rope(y[:, r:])`, CogVideoX's training step), of
  the rows with a pass-through prefix re-joined, and of the whole tensor as a control;
- "fx_pass": `rope_fusion.FxPass` on a graph traced by make_fx without decompositions (`unbind`, `stack`,
  `chunk`, `cat`, `unflatten`, complex views kept whole);
- "host_table": a host-resident table (Qwen-Image's complex freqs, a cos/sin pair) written in place between
  calls through each path that keeps or bumps its version counter (`.data`, the storage, `set_`, numpy views, the
  array `torch.from_numpy` aliases), served by the pass's cached copy;
- "matrix_regrouped": a 2x2 rotation-matrix table (Kandinsky's `(F * x_pairs).sum(-1)`) whose token axis is
  regrouped into tiles (reshape -> permute -> flatten, Kandinsky6-SR's `_local_patch`) with x, or left in order.

`generate(seed)` draws the family from the seed (HAZARD_FAMILIES[seed % 7]); the draws are independent of the
outcome. The harness (harness.py) classifies each case: fused, near miss, wrong numbers, broken compile, added
recompile, silent miss.
"""

from __future__ import annotations

import random

from tests.fuzz.generator import Case

HAZARD_FAMILIES = ("slice_base", "marked_dynamic", "recompile", "backward_rows", "fx_pass", "host_table",
                   "matrix_regrouped")

_HEADER = "import torch\nimport torch.nn.functional as F\n\n\n"

_ROPES = {
    "interleaved": '''\
def rope(x, c, s):  # interleaved pairs (2j, 2j+1), one table entry per lane
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return x * c + torch.stack([-imag, real], -1).flatten(-2) * s
''',
    "neox": '''\
def rope(x, c, s):  # NeoX halves, one table entry per lane
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat((-x2, x1), -1) * s
''',
}


class _Draw:
    def __init__(self, seed: int, family: str) -> None:
        self.rng = random.Random(seed * 104729 + 7)
        self.tags = [f"family:{family}"]

    def pick(self, options, weights=None):
        return self.rng.choices(list(options), weights=weights)[0]

    def p(self, prob: float) -> bool:
        return self.rng.random() < prob

    def tag(self, t: str) -> None:
        if t not in self.tags:
            self.tags.append(t)


def _dtype(d: _Draw) -> str:
    dt = d.pick(["float32", "bfloat16", "float16"], [6, 2, 1])
    d.tag(f"dtype:{dt}")
    return dt


# -- slice-write bases ----------------------------------------------------------------------------------------------

_BASES = {
    # name: (the lines that build the base y from x [B, H, S0, D], rows of x for S rotated ones, rows of y)
    "contiguous": (["y = x * 1.0"], "S", "S"),
    "offset": (["t = x * 2.0", "y = t[:, :, 2:]"], "S + 2", "S"),
    "gaps": (["t = torch.cat([x, x], 2) * 2.0", "y = t[:, :, 1:1 + x.shape[2]]"], "S", "S"),
    "steps": (["t = torch.cat([x, x], 2) * 2.0", "y = t[:, :, ::2]"], "S", "S"),
    "lanes_view": (["t = torch.cat([x, x], -1) * 2.0", "y = t[..., :x.shape[-1]]"], "S", "S"),
    "overlap": (["B, H, S, D = x.shape",
                 "y = (x * 1.0).reshape(-1).as_strided((B, H, S - 1, D), (H * S * D, S * D, D // 2, 1))"],
                "S", "S - 1"),
    "expanded": (["y = (x * 1.0).expand(2, -1, -1, -1)"], "S", "S"),
    "input": (["y = x"], "S", "S"),
}


def _slice_base(seed: int) -> Case:
    d = _Draw(seed, "slice_base")
    base = d.pick(list(_BASES), [2, 1, 2, 2, 1, 2, 2, 2])
    style = d.pick(["interleaved", "neox"])
    pair = d.p(0.4)
    k_expanded = pair and d.p(0.5)
    # a write into rows that overlap or broadcast raises in eager: those are written functionally only
    write = "assign" if base == "input" else ("scatter" if base in ("overlap", "expanded")
                                              else d.pick(["scatter", "assign"]))
    k_write = "scatter" if k_expanded else write
    read_again = base != "input" and d.p(0.5)
    B, H = (1 if base == "expanded" else d.pick([1, 2])), d.pick([1, 2, 4])
    D, S, text = d.pick([8, 16]), d.pick([7, 9, 11]), d.pick([1, 2, 3])
    dt = _dtype(d)
    for t in (f"base:{base}", f"spelling:{style}", f"write:{write}", f"read_again:{read_again}",
              "pair" if pair else "single", "k_expanded" if k_expanded else ""):
        if t:
            d.tag(t)
    build, x_rows, y_rows = _BASES[base]

    def written(name: str, y: str, write: str = write) -> list:
        if write == "scatter":
            return [f"    {name} = torch.slice_scatter({y}, rope({y}[:, :, {text}:], c, s), 2, {text})"]
        return [f"    {y}[:, :, {text}:] = rope({y}[:, :, {text}:], c, s)", f"    {name} = {y}"]

    lines = [f"def fn(x, {'kin, ' if pair else ''}c, s):"] + ["    " + b for b in build] + written("z", "y")
    outs = ["z"]
    if read_again:  # the intermediate the base is a view of, else the base's values after the scatter
        outs.append("t * 1.0" if any(b.startswith("t = ") for b in build) else "y * 1.0 + 1.0")
    if pair:
        lines.append(f"    k = (kin * 1.0).expand(-1, {H}, -1, -1)" if k_expanded else "    k = kin * 1.0")
        lines += written("zk", "k", k_write)
        outs.append("zk")
    lines.append(f"    return {', '.join(outs)},")
    rows = eval(y_rows, {"S": S}) - text
    make = ["def make(g, S):",
            f"    x = torch.randn({B}, {H}, {x_rows.replace('S', str(S))}, {D}, generator=g).to(torch.{dt})"]
    if pair:
        make.append(f"    kin = torch.randn({B}, {1 if k_expanded else H}, {rows + text}, {D}, generator=g)"
                    f".to(torch.{dt})")
    make += [f"    a = torch.rand({rows}, {D}, generator=g, dtype=torch.float64) * 12",
             f"    return (x, {'kin, ' if pair else ''}a.cos().to(torch.{dt}), a.sin().to(torch.{dt}))"]
    src = _HEADER + _ROPES[style] + "\n\n" + "\n".join(lines) + "\n\n\n" + "\n".join(make) + "\n"
    return Case(seed, "slice_base", tuple(d.tags), 2 if pair else 1, False, S, S, src,
                pass_options=(("backend", "triton"),), needs_full=True)


# -- marked-dynamic dims ----------------------------------------------------------------------------------------------

def _marked_dynamic(seed: int) -> Case:
    d = _Draw(seed, "marked_dynamic")
    form = d.pick(["vllm_flat", "head_dim", "seq", "batch"])
    style = d.pick(["interleaved", "neox"])
    dt = _dtype(d)
    d.tag(f"marked:{form}")
    d.tag(f"spelling:{style}")
    H, D, T = d.pick([2, 4]), d.pick([8, 16]), d.pick([5, 6, 7])
    if form == "vllm_flat":  # [T, H*D] with the flat dim marked: H = S varies
        fn = ["def fn(q, c, s):", f"    x = q.view(q.shape[0], -1, {D})",
              "    return rope(x, c[:, None, :], s[:, None, :]).flatten(1)"]
        make = [f"    q = torch.randn({T}, S * {D}, generator=g).to(torch.{dt})",
                f"    a = torch.rand({T}, {D}, generator=g, dtype=torch.float64) * 12"]
        marks, sizes = ((0, 1),), (H, H + 2)
    elif form == "head_dim":  # HF [B, H, S, D] with D = 2 * S marked
        fn = ["def fn(q, c, s):", "    return rope(q, c, s)"]
        make = [f"    q = torch.randn(1, {H}, {T}, 2 * S, generator=g).to(torch.{dt})",
                f"    a = torch.rand({T}, 2 * S, generator=g, dtype=torch.float64) * 12"]
        marks, sizes = ((0, 3), (1, 1), (2, 1)), (D // 2, D // 2 + 2)
    else:  # a sequence or batch dim marked, as users mark them
        dim = 2 if form == "seq" else 0
        fn = ["def fn(q, c, s):", "    return rope(q, c, s)"]
        shape = f"S, {H}, {T}, {D}" if form == "batch" else f"1, {H}, S, {D}"
        rows = "S" if form == "seq" else str(T)
        make = [f"    q = torch.randn({shape}, generator=g).to(torch.{dt})",
                f"    a = torch.rand({rows}, {D}, generator=g, dtype=torch.float64) * 12"]
        marks = ((0, dim),) + (((1, 0), (2, 0)) if form == "seq" else ())
        sizes = (d.pick([4, 5]), d.pick([7, 9]))
    src = (_HEADER + _ROPES[style] + "\n\n" + "\n".join(fn) + "\n\n\ndef make(g, S):\n" + "\n".join(make)
           + f"\n    return q, a.cos().to(torch.{dt}), a.sin().to(torch.{dt})\n")
    return Case(seed, "marked_dynamic", tuple(d.tags), 1, False, sizes[0], sizes[1], src, marks=marks,
                sizes=sizes[1:])


# -- recompiles under dynamic=True ----------------------------------------------------------------------------------

def _recompile(seed: int) -> Case:
    d = _Draw(seed, "recompile")
    form = d.pick(["write_back_start", "head_dim", "seq_control"], [3, 2, 1])
    style = d.pick(["interleaved", "neox"])
    dt = _dtype(d)
    d.tag(f"recompile:{form}")
    d.tag(f"spelling:{style}")
    H, D, R = d.pick([1, 2, 4]), d.pick([8, 16]), d.pick([4, 6])
    if form == "write_back_start":  # t = S - R text rows before R image rows, only those rotated
        fn = ["def fn(q, c, s):", "    t = q.shape[2] - c.shape[0]", "    q = q * 1.0",
              "    q[:, :, t:] = rope(q[:, :, t:], c, s)", "    return q,"]
        make = [f"    q = torch.randn(1, {H}, S, {D}, generator=g).to(torch.{dt})",
                f"    a = torch.rand({R}, {D}, generator=g, dtype=torch.float64) * 12"]
        sizes = tuple(sorted(d.rng.sample(range(R + 2, R + 12), 4)))
    elif form == "head_dim":  # D = 2 * S
        fn = ["def fn(q, c, s):", "    return rope(q, c, s),"]
        make = [f"    q = torch.randn(1, {H}, 5, 2 * S, generator=g).to(torch.{dt})",
                "    a = torch.rand(5, 2 * S, generator=g, dtype=torch.float64) * 12"]
        sizes = tuple(sorted(d.rng.sample(range(3, 12), 3)))
    else:
        fn = ["def fn(q, c, s):", "    return rope(q, c, s),"]
        make = [f"    q = torch.randn(1, {H}, S, {D}, generator=g).to(torch.{dt})",
                f"    a = torch.rand(S, {D}, generator=g, dtype=torch.float64) * 12"]
        sizes = tuple(sorted(d.rng.sample(range(3, 14), 4)))
    src = (_HEADER + _ROPES[style] + "\n\n" + "\n".join(fn) + "\n\n\ndef make(g, S):\n" + "\n".join(make)
           + f"\n    return q, a.cos().to(torch.{dt}), a.sin().to(torch.{dt})\n")
    return Case(seed, "recompile", tuple(d.tags), 1, True, sizes[0], sizes[1], src, sizes=sizes[1:])


# -- the backward of row-slice rotations ----------------------------------------------------------------------------

def _backward_rows(seed: int) -> Case:
    d = _Draw(seed, "backward_rows")
    form = d.pick(["rows", "rows_rejoined", "rows_written_back", "whole"], [3, 2, 2, 1])
    style = d.pick(["interleaved", "neox"])
    dt = d.pick(["float32", "float64"], [3, 1])
    d.tag(f"backward:{form}")
    d.tag(f"spelling:{style}")
    d.tag(f"dtype:{dt}")
    H, D, S = d.pick([1, 2]), d.pick([8, 16]), d.pick([5, 7, 9])
    r = 0 if form == "whole" else d.pick([1, 2, 3])
    layout = d.pick(["bshd", "bhsd"])
    d.tag(f"layout:{layout}")
    dim = 1 if layout == "bshd" else 2
    rows = "[:, " + f"{r}:]" if dim == 1 else "[:, :, " + f"{r}:]"
    head = "[:, " + f":{r}]" if dim == 1 else "[:, :, " + f":{r}]"
    tables = "c[:, None, :], s[:, None, :]" if layout == "bshd" else "c, s"
    pre = d.pick(["scaled", "input", "upcast"])
    d.tag(f"pre:{pre}")
    fn = ["def fn(x, w, c, s):", {"scaled": "    y = x * w", "input": "    y = x",
                                  "upcast": "    y = (x * w).float()"}[pre]]
    back = ".to(x.dtype)" if pre == "upcast" else ""
    if form == "rows_rejoined":
        fn.append(f"    return torch.cat((y{head}, rope(y{rows}, {tables})), {dim}){back},")
    elif form == "rows_written_back":  # CogVideoX: y[:, :, r:] = rope(y[:, :, r:])
        fn[-1] = fn[-1] + (" * 1.0" if pre == "input" else "")  # a tensor of its own to write into
        fn += [f"    y{rows} = rope(y{rows}, {tables})", f"    return y{back},"]
    else:
        fn.append(f"    return rope(y{rows}, {tables}){back},")
    shape = f"2, {S}, {H}, {D}" if layout == "bshd" else f"2, {H}, {S}, {D}"
    make = [f"    x = torch.randn({shape}, generator=g, dtype=torch.{dt}).requires_grad_()",
            f"    w = (1.0 + 0.1 * torch.randn({D}, generator=g, dtype=torch.{dt})).requires_grad_()",
            f"    a = torch.rand({S - r}, {D}, generator=g, dtype=torch.float64) * 12",
            f"    return x, w, a.cos().to(torch.{dt}), a.sin().to(torch.{dt})"]
    src = _HEADER + _ROPES[style] + "\n\n" + "\n".join(fn) + "\n\n\ndef make(g, S):\n" + "\n".join(make) + "\n"
    # rotations: the forward's and its gradient's (the backward rotates the incoming gradient by the inverse)
    return Case(seed, "backward_rows", tuple(d.tags), 2, False, S, S, src, run="backward")


# -- fx_pass on graphs without decompositions ------------------------------------------------------------------------

_FX_SPELLINGS = {
    "unbind_stack": '''\
def fn(x, c, s):
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rot = torch.stack((-imag, real), -1).flatten(-2)
    return x * c + rot * s,
''',
    "chunk_cat": '''\
def fn(x, c, s):
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat((-x2, x1), -1) * s,
''',
    "split_halves": '''\
def fn(x, c, s):
    x1, x2 = torch.split(x, x.shape[-1] // 2, -1)
    h = c.shape[-1] // 2
    return torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), -1),
''',
    "stack_pairs": '''\
def fn(x, c, s):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c2, s2 = c[..., 0::2], s[..., 0::2]
    return torch.stack((x1 * c2 - x2 * s2, x2 * c2 + x1 * s2), -1).flatten(-2),
''',
}


def _fx_pass(seed: int) -> Case:
    d = _Draw(seed, "fx_pass")
    sp = d.pick(list(_FX_SPELLINGS))
    dt = _dtype(d)
    d.tag(f"spelling:{sp}")
    H, D, S = d.pick([1, 2, 4]), d.pick([8, 16]), d.pick([3, 5, 8])
    make = [f"    x = torch.randn(1, {S}, {H}, {D}, generator=g).to(torch.{dt})",
            f"    a = torch.rand({S}, 1, {D // 2}, generator=g, dtype=torch.float64) * 12",
            "    a = a.repeat_interleave(2, -1)" if sp in ("unbind_stack", "stack_pairs") else
            "    a = torch.cat((a, a), -1)",
            f"    return x, a.cos().to(torch.{dt}), a.sin().to(torch.{dt})"]
    src = _HEADER + _FX_SPELLINGS[sp] + "\n\ndef make(g, S):\n" + "\n".join(make) + "\n"
    return Case(seed, "fx_pass", tuple(d.tags), 1, False, S, S, src, run="fx_pass")


# -- host tables written in place -------------------------------------------------------------------------------------

WRITE_PATHS = {
    "in_place": "t.mul_(W)",
    "data_copy": "t.data.copy_(t * W)",
    "data_mul": "t.data.mul_(W)",
    "storage_fill": "t.untyped_storage().fill_(0x3F)",
    "alias_set": ("torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, "
                  "t.stride()).mul_(W)"),
    "set_": "t.set_(t * W)",
    "numpy_view": "t.numpy().__imul__(W)",
    "from_numpy_array": "ARRAY.__imul__(W)",
    "one_entry": "t.data[1, 1].mul_(-1)",
    "no_write": "None",
}


def _host_table(seed: int) -> Case:
    d = _Draw(seed, "host_table")
    kind = d.pick(["complex", "cos_sin"])
    dt = {"complex": d.pick(["complex64", "complex128"]), "cos_sin": d.pick(["float32", "float64", "bfloat16"])}[kind]
    layout = d.pick(["contiguous", "row_slice", "transposed"], [3, 1, 1])
    paths = [d.pick(list(WRITE_PATHS)) for _ in range(3)]
    if kind == "cos_sin" and dt == "bfloat16":  # numpy has no bfloat16
        paths = [p if p not in ("numpy_view", "from_numpy_array") else "data_mul" for p in paths]
    for t in (f"table:{kind}", f"dtype:{dt}", f"layout:{layout}", *(f"write:{p}" for p in paths)):
        d.tag(t)
    S, P, H = d.pick([6, 8]), d.pick([4, 8]), d.pick([1, 2])
    W = "0.7" if kind == "cos_sin" else "complex(0.6, 0.8)"
    shape = {"contiguous": f"({S}, {P})", "row_slice": f"({S + 3}, {P})", "transposed": f"({P}, {S})"}[layout]
    view = {"contiguous": "t0", "row_slice": "t0[2:2 + S]", "transposed": "t0.t()"}[layout]
    if kind == "complex":
        rot = ["def fn(x, t):  # Qwen-Image: x [S, H, 2P] rotated by complex freqs t [S, P]",
               "    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))",
               "    return torch.view_as_real(xc * t[:, None, :]).flatten(-2).type_as(x),"]
        table = (f"    a = torch.rand({shape}, generator=g, dtype=torch.float64) * 12\n"
                 f"    t0 = torch.polar(torch.ones_like(a), a).to(torch.{dt})")
    else:
        rot = ["def fn(x, t):  # NeoX by a packed table t [S, 2P]: cos | sin of P pairs",
               "    c, s = t.to(x.dtype).chunk(2, -1)",
               "    x1, x2 = x.chunk(2, -1)",
               "    c, s = c[:, None, :], s[:, None, :]",
               "    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1),"]
        table = (f"    a = torch.rand({shape}, generator=g, dtype=torch.float64) * 12\n"
                 f"    t0 = torch.cat((a.cos(), a.sin()), -1 if {layout!r} != 'transposed' else 0).to(torch.{dt})")
    writes = "\n".join(f"def write{i}(t, ARRAY):\n    W = {W}\n    {WRITE_PATHS[p]}\n" for i, p in enumerate(paths))
    numpy_backed = "from_numpy_array" in paths
    make = ["def make(g, S):", table,
            "    ARRAY = t0.numpy().copy() if NUMPY_BACKED else None" if dt != "bfloat16" else "    ARRAY = None",
            "    t0 = torch.from_numpy(ARRAY) if NUMPY_BACKED else t0",
            f"    x = torch.randn(S, {H}, {2 * P}, generator=g)",
            f"    return x, {view}, ARRAY"]
    src = (_HEADER + f"NUMPY_BACKED = {numpy_backed}\nWRITES = {len(paths)}\n\n\n" + "\n".join(rot) + "\n\n\n"
           + writes + "\n\n" + "\n".join(make) + "\n")
    return Case(seed, "host_table", tuple(d.tags), 1, False, S, S, src, run="host_table")


# -- 2x2 matrix tables with the token axis regrouped ------------------------------------------------------------------

def _matrix_regrouped(seed: int) -> Case:
    d = _Draw(seed, "matrix_regrouped")
    regroup = d.pick(["tiles", "in_order"], [3, 1])
    normed = d.p(0.3)
    dt = _dtype(d)
    d.tag(f"tokens:{regroup}")
    if normed:
        d.tag("norm:per_head")
    h, w, p = d.pick([(4, 4, 2), (4, 2, 2), (6, 4, 2)])
    H, D = d.pick([1, 2]), d.pick([8, 16])
    T = h * w
    if regroup == "tiles":
        tiles = (f"def tiles(t):  # [B, h*w, ...] -> tiles of {p}x{p} tokens, each tile's tokens together\n"
                 f"    return t.reshape(t.shape[0], {h // p}, {p}, {w // p}, {p}, *t.shape[2:]).transpose(2, 3)"
                 ".flatten(1, 4)\n")
    else:
        tiles = "def tiles(t):\n    return t\n"
    norm = "    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n" if normed else ""
    fn = ("def fn(x, c, s):  # Kandinsky's rotation: (F * x_pairs).sum(-1), F = [[c, -s], [s, c]] per pair\n"
          f"{norm}"
          "    m = torch.stack((c, -s, s, c), -1).unflatten(-1, (2, 2))  # [1, T, D/2, 2, 2]\n"
          "    m, x = tiles(m)[:, :, None], tiles(x)\n"
          "    out = (m * x.float().unflatten(-1, (-1, 1, 2))).sum(-1).flatten(-2)\n"
          "    return out.type_as(x),\n")
    make = ["def make(g, S):", f"    x = torch.randn(1, {T}, {H}, {D}, generator=g).to(torch.{dt})",
            f"    a = torch.rand(1, {T}, {D // 2}, generator=g, dtype=torch.float64) * 12",
            "    return x, a.cos().float(), a.sin().float()"]
    src = _HEADER + tiles + "\n\n" + fn + "\n\n" + "\n".join(make) + "\n"
    return Case(seed, "matrix_regrouped", tuple(d.tags), 1, False, T, T, src)


_BUILDERS = {"slice_base": _slice_base, "marked_dynamic": _marked_dynamic, "recompile": _recompile,
             "backward_rows": _backward_rows, "fx_pass": _fx_pass, "host_table": _host_table,
             "matrix_regrouped": _matrix_regrouped}


def generate(seed: int, family: str | None = None) -> Case:
    """Hazard case `seed`; its family is HAZARD_FAMILIES[seed % 7] unless given."""
    return _BUILDERS[family or HAZARD_FAMILIES[seed % len(HAZARD_FAMILIES)]](seed)


__all__ = ["HAZARD_FAMILIES", "WRITE_PATHS", "generate"]
