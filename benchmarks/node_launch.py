"""The cat fold's user-kernel node against the cat op's own launch of the same plan, side by side on the GPU.

The fold runs as Inductor's user-kernel node in a compiled graph (`cat_rotary.emit_node`), where it ran as the
`rotary_qk_cat` op called through the dispatcher before, whose planned runner launches the kernel through Triton's
JIT launcher. In graph replay both run one launch of one plan, yet the node measured 1.349x the floor at Flux's
joint attention (M13) where the op had measured 1.175-1.237x in earlier runs. This compiles each row twice with
`backend="triton"` (the node, and the op: `device_registry.NODE_DEVICES` emptied), then per variant:
- GPU time in CUDA-graph replay and in do_bench, alternating rounds, as multiples of the row's copy floor;
- every kernel one call launches, with its GPU time (the profiler): a copy around the node would show here;
- the compiled rotary kernel each variant ran, read from Triton's cache (a fresh TRITON_CACHE_DIR, which Inductor's
  compiles use too): its compile options (num_warps, num_stages, debug, ...), the arguments Triton took as
  16-divisible (its TTIR's `tt.divisibility`), its PTX instructions by opcode, and whether the two variants ran the
  same binary;
- the user-kernel node's decorator in Inductor's generated code (its configs and triton_meta) and its call line;
- each variant's planned launch (grid, scalars, constants: the node's planned on fake values when traced, the op's
  on the call's tensors) and where its outputs lie (strides, address modulo 2 MiB).

    python -m benchmarks.node_launch --out $OUT/node_launch.json            # M13 (GPU)
    python -m benchmarks.node_launch --quick                                # CPU smoke test (nothing timed)
    python -m benchmarks.node_launch --dump $OUT/ir   # and each variant's compiled kernel as text, for a diff
    python -m benchmarks.node_launch --placement      # and the op's launch into outputs placed as the node's are

`--placement` asks whether where the outputs lie is the node's difference. Each variant's call is captured in a CUDA
graph of its own, where its outputs' addresses are read (do_bench_cudagraph allocates in a pool of its own, so the
placement read outside capture need not be the one timed), and its replay timed. Then the op's replayed launch
(`_CatRunner.replay`, the same binary) writes into outputs at chosen offsets of one 2 MiB-aligned arena: apart on
page boundaries (the op's own), back to back as Inductor places its two buffers, and the node's placement in
capture; each timed in graph replay and by the profiler, alternating rounds. Each compiled binary's cubin hash is
recorded too: the same PTX can still assemble differently.

`--dump DIR` writes `<row>.<variant>.ir` per variant: the TTIR, TTGIR and PTX of each rotary kernel it compiled,
one after the other, so that `diff` shows where two binaries of one plan differ line by line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import hashlib
import json
import os
import re
import statistics
import sys
import tempfile
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
# before Triton is imported: every kernel of this process (the JIT's and Inductor's) compiles into a cache we read
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="node-launch-triton-"))

import torch  # noqa: E402

from benchmarks import device_check  # noqa: E402
from benchmarks import kernels as kb  # noqa: E402

VARIANTS = ("node", "op")
KERNEL = "rotary_kernel"


def _cache_entries() -> dict[str, float]:
    """Triton's cache entries of the rotary kernel: the metadata file of each compiled specialisation -> mtime."""
    root = os.environ["TRITON_CACHE_DIR"]
    return {p: os.path.getmtime(p) for p in glob.glob(os.path.join(root, "*", f"{KERNEL}.json"))}


def _describe(meta_path: str) -> dict:
    """One compiled kernel: every scalar of its metadata (the compile options: num_warps, num_stages, debug, ...),
    the parameters its TTIR marks 16-divisible, and its PTX instructions counted by opcode (`_ptx_ops`): what two
    binaries of one plan differ in, where their options and specialisation are the same."""
    with open(meta_path) as f:
        meta = json.load(f)
    out = {k: v for k, v in meta.items() if isinstance(v, (bool, int, float, str, type(None)))}
    cubin = meta_path[:-len(".json")] + ".cubin"
    if os.path.exists(cubin):
        with open(cubin, "rb") as f:
            out["cubin_sha1"] = hashlib.sha1(f.read()).hexdigest()[:16]
    ptx = meta_path[:-len(".json")] + ".ptx"
    if os.path.exists(ptx):
        with open(ptx) as f:
            out["ptx_ops"] = _ptx_ops(f.read())
    ttir = meta_path[:-len(".json")] + ".ttir"
    if os.path.exists(ttir):
        with open(ttir) as f:
            text = f.read()
        head = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", text, re.S)
        # each parameter as `%name: type {attributes} loc(...)` (`%argN` in older Triton)
        args = re.findall(r"%(\w+)\s*:\s*[^,{()]+(\{[^}]*\})?", head.group(1)) if head else []
        out["params"] = len(args)
        out["divisible_16"] = [name for name, attrs in args if "tt.divisibility = 16" in attrs]
    return out


def _ptx_ops(ptx: str) -> dict[str, int]:
    """The PTX's instructions by opcode with its type suffixes (`ld.global.v4.b32`, `cvt.f32.bf16`, ...), most
    frequent first, and their total: comments, labels and directives left out."""
    ops = collections.Counter()
    for line in ptx.splitlines():
        line = line.strip()
        if not line or line.startswith(("//", ".", "{", "}", "$")) or line.endswith(":"):
            continue
        if line.startswith("@"):  # a predicated instruction: its guard, then the instruction
            line = line.split(None, 1)[1] if " " in line else line
        ops[line.split(None, 1)[0].rstrip(";")] += 1
    return {"total": sum(ops.values()), **dict(ops.most_common())}


def _decorators(codes: list[str]) -> list[str]:
    """The user-kernel decorators of the rotary kernel in Inductor's generated code (configs and triton_meta)."""
    found = []
    for code in codes:
        for m in re.finditer(r"@triton_heuristics\.user_autotune\((.*?)\)\n@triton\.jit\ndef (\w+)", code, re.S):
            if KERNEL in m.group(2):
                found.append(" ".join(m.group(1).split()))
    return found


@contextlib.contextmanager
def _recording(owner: Any, name: str, record: Any) -> Any:
    """`owner.name` wrapped for the block: each call runs the original, and `record(seen, args, result)` notes it in
    the list the block gets."""
    seen: list = []
    real = getattr(owner, name)

    def wrapped(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        record(seen, a, out)
        return out
    setattr(owner, name, wrapped)
    try:
        yield seen
    finally:
        setattr(owner, name, real)


def _planned_launches() -> Any:
    """Records every launch the cat kernel's planner returns (its grid, scalars and the compile-time constants that
    are numbers), the node's planned on fake values at trace time, the op's on the call's tensors: where the two
    variants' launches of one plan could differ."""
    from rope_fusion.kernels import triton_cat

    def record(seen: list, args: tuple, out: Any) -> None:
        if isinstance(out, triton_cat.CatLaunch):
            seen.append({"grid": [str(g) for g in out.grid], "scalars": [str(v) for v in out.scalars],
                         "meta": {k: v for k, v in out.meta.items() if isinstance(v, (bool, int, float))}})
    return _recording(triton_cat, "plan_cat", record)


def _runner_calls() -> Any:
    """Records each call of the cat op's replayed runner (`_CatRunner.run_sources`: the runner and the call's
    sources), for `--placement` to launch the op's plan into outputs placed at will."""
    from rope_fusion.kernels import triton_cat

    def record(seen: list, args: tuple, out: Any) -> None:
        seen.append((args[0], list(args[1])))  # (the runner, the call's sources)
    return _recording(triton_cat._CatRunner, "run_sources", record)


MIB = 1 << 20
PAGE = 2 * MIB


def _captured(call: Any) -> list[dict]:
    """Where the outputs of the call lie when it is captured in a CUDA graph of its own (a fresh private pool, as
    each of do_bench_cudagraph's captures is)."""
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    torch.cuda.synchronize()
    return _placement(out)


def _arena_layouts(nbytes: int, node_at: list[int] | None) -> dict[str, list[int]]:
    """Named byte offsets of q's and k's outputs in one 2 MiB-aligned arena: the op's placement (each on a page
    boundary), Inductor's (back to back), each shifted by 1 MiB, and the node's placement in capture relative to
    its first output, where it was read."""
    apart = -(-nbytes // PAGE) * PAGE
    layouts = {"apart, page-aligned": [0, apart], "back to back": [0, nbytes],
               "apart, both 1 MiB in": [MIB, apart + MIB], "apart, k 1 MiB in": [0, apart + MIB]}
    if node_at and max(node_at) - min(node_at) < 256 * MIB:  # in one arena of this process's size
        lo = min(node_at)
        layouts["the node's in capture"] = [lo % PAGE + p - lo for p in node_at]
    return layouts


def placement_study(op_calls: list, node_call: Any, op_call: Any, rounds: int) -> dict:
    """Each variant's placement in graph capture, and the op's replayed launch timed into each arena layout."""
    if not op_calls:
        return {"error": "the op variant made no replayed-runner call"}
    runner, sources = op_calls[-1]
    for _ in range(2):  # the first use checks the replay against the JIT launcher
        runner.run_sources(sources)
    if not runner.checked:
        return {"error": "the op's runner kept the JIT launcher (no replay to time)"}
    rec: dict = {"shapes": [list(s) for s in runner.shapes], "variants": {}}
    node_place, op_place = _captured(node_call), _captured(op_call)
    rec["variants"]["node"] = {"in_capture": node_place}
    rec["variants"]["op"] = {"in_capture": op_place}
    nbytes = torch.empty(runner.shapes[0], dtype=runner.dtype, device="meta").untyped_storage().nbytes()
    node_ptrs = [p["ptr"] for p in node_place] if len(node_place) == 2 else None
    layouts = _arena_layouts(nbytes, node_ptrs)
    size = max(off for offs in layouts.values() for off in offs) + nbytes + PAGE
    arena = torch.empty(size, dtype=torch.uint8, device=sources[0].device)
    start = (-arena.data_ptr()) % PAGE  # the arena's first page boundary
    calls = {"node (compiled)": node_call, "op (compiled)": op_call}
    for name, offs in layouts.items():
        outs = [arena[start + off:start + off + nbytes].view(runner.dtype).view(shape)
                for off, shape in zip(offs, runner.shapes)]
        tensors = [[*sources, *outs][i] for i in runner.picks]
        calls[f"op launch, {name}"] = (lambda t=tensors: runner.replay(t))
        rec["variants"][f"op launch, {name}"] = {"offsets_MiB": [o / MIB for o in offs],
                                                 "ptr_mod_2MiB": [(arena.data_ptr() + start + o) % PAGE
                                                                  for o in offs]}
    times: dict = {k: {"graph_us": [], "kernel_us": []} for k in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name]["graph_us"].append(1e3 * kb.graph_ms(call, "cuda"))
            per = kb.kernel_times(call, device="cuda")
            times[name]["kernel_us"].append(sum(us for k, (n, us) in per.items() if KERNEL in k))
    for name, t in times.items():
        r = rec["variants"].setdefault(name, {})
        r.update({k: round(statistics.median(v), 2) for k, v in t.items()})
        r["kernel_us_all"] = [round(v, 2) for v in t["kernel_us"]]
    return rec


def _placement(out: Any) -> list[dict]:
    """Each output tensor's geometry and where it lies: its address modulo 2 MiB and its storage's size."""
    return [{"shape": list(t.shape), "stride": list(t.stride()), "offset": t.storage_offset(),
             "ptr": t.data_ptr(), "ptr_mod_2MiB": t.data_ptr() % PAGE, "storage_bytes": t.untyped_storage().nbytes()}
            for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _compile(row: Any, variant: str, args: tuple) -> tuple[Any, Any, list[str], list[str]]:
    """The row's function compiled with backend="triton" as the variant emits the fold; its output, the pass, the
    generated code and the rotary kernels it compiled (new cache entries)."""
    from torch._inductor.utils import run_and_get_code

    from rope_fusion.ops import device_registry

    saved = device_registry.NODE_DEVICES
    device_registry.NODE_DEVICES = saved if variant == "node" else ()
    import rope_fusion

    rope_fusion.clear_caches()  # each variant plans its own launch
    before = _cache_entries()
    try:
        with _planned_launches() as planned, _runner_calls() as calls:
            fn, p = kb.compiled(row.fn, "triton+cg")
            out, codes = run_and_get_code(fn, *args)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out = fn(*args)  # the op's first calls go through the JIT launcher: let them compile here
    finally:
        device_registry.NODE_DEVICES = saved
    new = sorted(set(_cache_entries()) - set(before))
    p.planned_launches, p.runner_calls = planned, calls
    return (fn, out), p, codes, new


def _dump(meta_paths: list[str], path: str) -> None:
    """The TTIR, TTGIR and PTX of each compiled kernel (Triton's cache entries beside its metadata), into one file."""
    with open(path, "w") as out:
        for meta in meta_paths:
            for ext in (".ttir", ".ttgir", ".ptx"):
                ir = meta[:-len(".json")] + ext
                if os.path.exists(ir):
                    with open(ir) as f:
                        out.write(f"// ===== {os.path.basename(os.path.dirname(ir))}/{os.path.basename(ir)}\n")
                        out.write(f.read())


def run_row(row: Any, device: str, rounds: int, dump: str | None = None, placement: bool = False) -> dict:
    torch.manual_seed(0)
    args = row.make(device)
    floor_args = row.floor(args)
    rec: dict = {"row": row.name, "shape": row.shape, "variants": {}}
    with torch.no_grad():
        want = row.fn(*(a.double() if a.is_floating_point() else a for a in args))
        fns, runner_calls = {}, []
        for v in VARIANTS:
            (fn, out), p, codes, new = _compile(row, v, args)
            runner_calls = p.runner_calls if v == "op" else runner_calls
            fns[v] = (lambda fn=fn: fn(*args))
            decorators = _decorators(codes)
            emitted = "node" if decorators else "op"
            if device == "cuda" and emitted != v:  # a variant that did not take effect measures nothing of its own
                raise SystemExit(f"node_launch: the {v} variant compiled the fold as the {emitted}")
            rec["variants"][v] = {
                "emitted": emitted,
                "kernels": [k.op + (f" [{k.fold[:60]}]" if k.fold else "") for k in p.report.kernels],
                "err_vs_fp64": kb.max_err(out, want),
                "compiled": [_describe(m) for m in new],
                "decorators": decorators,
                "planned": p.planned_launches[:4],
                "outputs": _placement(out),
                "call_lines": [line.strip()[:600] for code in codes for line in code.splitlines()
                               if re.search(rf"{KERNEL}\w*\.run\(", line)],
                "graph": [], "do_bench": [],
            }
            if dump:
                os.makedirs(dump, exist_ok=True)
                _dump(new, os.path.join(dump, f"{re.sub(r'[^A-Za-z0-9]+', '_', row.name)}.{v}.ir"))
        fns["floor"] = lambda: [t.clone() for t in floor_args]
        if device == "cuda":
            for _ in range(rounds):
                for v, call in fns.items():
                    r = rec["variants"].setdefault(v, {"graph": [], "do_bench": []})
                    r["graph"].append(kb.graph_ms(call, device))
                    r["do_bench"].append(kb.bench_ms(call, device))
            for v in VARIANTS:
                rec["variants"][v]["launched"] = {k: [round(n, 2), round(us, 2)]
                                                  for k, (n, us) in kb.kernel_times(fns[v], device=device).items()}
            floor = {k: statistics.median(rec["variants"]["floor"][k]) for k in ("graph", "do_bench")}
            for v in VARIANTS:
                r = rec["variants"][v]
                r["x_floor"] = {k: round(statistics.median(r[k]) / floor[k], 3) for k in ("graph", "do_bench")}
            if placement:
                rec["placement"] = placement_study(runner_calls, fns["node"], fns["op"], rounds)
    node, op = (rec["variants"][v]["compiled"] for v in VARIANTS)
    rec["same_binary"] = bool(node) and not op  # the op's launch found the node's compile in the cache: one binary
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["M13 flux joint cat"])
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (the smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump", default=None, help="write each variant's compiled kernel (TTIR, TTGIR, PTX) here")
    ap.add_argument("--placement", action="store_true",
                    help="time the op's launch into outputs placed as each variant's are (GPU only)")
    args = ap.parse_args(argv)
    if not args.quick and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.node_launch", "python -m benchmarks.node_launch --quick")
    device = "cpu" if args.quick else "cuda"
    # each variant compiled cold: its kernels are the ones this run compiles and reads back from Triton's cache
    kb.no_graph_caches()
    result: dict = {"environment": kb.environment(), "triton_cache": os.environ["TRITON_CACHE_DIR"], "rows": []}
    device_check.announce(device, result)
    rows = [r for r in kb.coverage_rows(args.quick) if r.name in args.rows]
    for row in rows:
        rec = run_row(row, device, args.rounds, args.dump, args.placement)
        result["rows"].append(rec)
        kb.write_json(args.out, result)
        print(json.dumps(rec, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
