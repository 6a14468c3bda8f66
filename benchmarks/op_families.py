"""Host time per call of each op family's eager op, repeated at one tiny geometry, with the Triton kernel's launch
replaced by a no-op: what the library itself costs the host on a call it has planned before.

Families: the public function's direct path (`apply_rotary_qk`), the op through the dispatcher (`rotary_qk`), the
slice op (`rotary_qk_slice_`), the into op (`rotary_qk_into_`), the cat op (`rotary_qk_cat`), the join runner
(`ops.joins.plan_join`'s) and the KV-cache op (`rotary_qk_kv_cache`). CPU tensors are served as CUDA tensors are (the
Triton backend's planners and runners registered for the CPU, the kernel `INTERPRETED`), and the kernels'
`kernel[grid](...)` does nothing: no compiled kernel comes back, so every replay goes through the JIT launcher's
call, as on a Triton without a compiled-kernel launcher. On the GPU the launch itself adds its driver call.

    python -m benchmarks.op_families            # every family, median of 5 rounds of 2000 calls
    python -m benchmarks.op_families --quick    # 3 rounds of 500 calls
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402

T, HQ, HK, D = 8, 4, 2, 32  # tokens, q heads, k heads, head dim: a tiny geometry


class NoLaunch:
    """A kernel whose `kernel[grid](*args, **kw)` launches nothing: the host path without the device's work."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return _nothing


def _nothing(*args: Any, **kw: Any) -> None:
    return None


@contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """CPU tensors served by the Triton backend's host path with the launches replaced by `NoLaunch`."""
    import rope_fusion.kernels.triton_join as tj
    import rope_fusion.kernels.triton_launch as launching
    import rope_fusion.kernels.triton_rotary  # noqa: F401  (registers the CUDA kernels)
    from rope_fusion.ops import cat_rotary, device_runners, joins, kv_cache_op, slice_write

    saved = (launching.rotary_kernel, launching.INTERPRETED, tj.join_kernel)
    launching.rotary_kernel, launching.INTERPRETED, tj.join_kernel = NoLaunch(), True, NoLaunch()
    registries = (device_runners.ROTARY_KERNELS, slice_write.IN_PLACE_KERNELS, cat_rotary.CAT_KERNELS,
                  joins.JOIN_KERNELS, kv_cache_op.CACHE_KERNELS)
    tables = [registry.kernels for registry in registries]
    for table in tables:
        table["cpu"] = table["cuda"]
    kernel = device_runners.ROTARY_KERNELS.kernels["cuda"]  # the op's dispatcher too: its CPU kernel stays registered
    device_runners.ROTARY_KERNELS.register("cpu", kernel.impl, plan=kernel.plan, takes_packed=kernel.takes_packed)
    rope_fusion.clear_caches()
    try:
        yield
    finally:
        for table in tables:
            table.pop("cpu", None)
        launching.rotary_kernel, launching.INTERPRETED, tj.join_kernel = saved
        rope_fusion.clear_caches()


def _calls() -> dict[str, Callable[[], Any]]:
    """Each family's repeated call, its tensors made once."""
    from rope_fusion.ops.joins import plan_join

    r = torch.randn
    ops = torch.ops.rope_fusion
    q, k, v = r(T, HQ, D), r(T, HK, D), r(T, HK, D)
    cos, sin = r(T, 1, D // 2), r(T, 1, D // 2)
    opts = dict(interleaved=False, rotary_dim=D, full_tables=False, conjugate=False, out_dtype=torch.float32)
    bases = [r(T + 4, HQ, D), r(T + 4, HK, D)]
    bounds = dict(slice_dims=[0, 0], slice_starts=[4, 4], slice_ends=[T + 4, T + 4])
    halves = [r(2, HQ, D), r(2, HK, D)]
    seconds = [r(T - 2, HQ, D), r(T - 2, HK, D)]
    cat = dict(opts, second_pieces=seconds, second_norm_weights=[None, None], cat_dims=[0, 0])
    a, b = r(T, HK, 2 * D)[..., :D], r(T, HK, 2 * D)[..., :D]
    join = plan_join(a, b, 0)
    caches = [torch.zeros(4, 4, HK, D) for _ in range(2)]
    slots = torch.arange(T) * 2
    floor = {name: dispatcher_floor(getattr(ops, name).default)
             for name in ("rotary_qk", "rotary_qk_slice_", "rotary_qk_into_", "rotary_qk_cat", "rotary_qk_kv_cache")}
    return {
        "apply_rotary_qk (direct)": lambda: rope_fusion.apply_rotary_qk(q, k, cos, sin),
        "floor: rotary_qk's dispatch": lambda: floor["rotary_qk"](q, k, cos, sin, **opts),
        "floor: rotary_qk_slice_'s dispatch": lambda: floor["rotary_qk_slice_"](*bases, cos, sin, **opts, **bounds),
        "floor: rotary_qk_into_'s dispatch": lambda: floor["rotary_qk_into_"](*bases, q, k, cos, sin, **opts,
                                                                               **bounds),
        "floor: rotary_qk_cat's dispatch": lambda: floor["rotary_qk_cat"](*halves, cos, sin, **cat),
        "floor: rotary_qk_kv_cache's dispatch": lambda: floor["rotary_qk_kv_cache"](q, k, v, cos, sin, *caches, slots,
                                                                                     **opts),
        "rotary_qk (op)": lambda: ops.rotary_qk(q, k, cos, sin, **opts),
        "rotary_qk_slice_": lambda: ops.rotary_qk_slice_(*bases, cos, sin, **opts, **bounds),
        "rotary_qk_into_": lambda: ops.rotary_qk_into_(*bases, q, k, cos, sin, **opts, **bounds),
        "rotary_qk_cat": lambda: ops.rotary_qk_cat(*halves, cos, sin, **cat),
        "join (planned runner)": lambda: join(a, b),
        "apply_rotary_qk_kv_cache": lambda: rope_fusion.apply_rotary_qk_kv_cache(q, k, v, cos, sin, *caches, slots),
        "rotary_qk_kv_cache (op)": lambda: ops.rotary_qk_kv_cache(q, k, v, cos, sin, *caches, slots, **opts),
    }


_FLOOR_LIBRARY: list = []  # keeps the floor ops' fragment registered


def dispatcher_floor(op: Any) -> Callable[..., Any]:
    """An op of `op`'s schema whose kernel does nothing (it hands back its first tensors): what the dispatcher itself
    costs a call of that schema, converting each argument to and from C++. A fold op's 25-30 arguments cost more
    there than the library's own host path."""
    schema = op._schema
    name = f"floor_{schema.name.split('::')[-1]}_{len(_FLOOR_LIBRARY)}"
    if not _FLOOR_LIBRARY:
        _FLOOR_LIBRARY.append(torch.library.Library("rope_fusion_floor", "FRAGMENT"))
    lib = _FLOOR_LIBRARY[0]
    signature = str(schema).split("(", 1)[1]
    signature = signature.replace("(a!)", "").replace("(b!)", "").replace("(c!)", "")  # nothing is written
    lib.define(f"{name}({signature}")
    n_out = len(schema.returns)
    lib.impl(name, (lambda *a, **k: None) if n_out == 0 else (lambda *a, **k: a[0]) if n_out == 1 else
             (lambda *a, **k: tuple(a[:n_out])), "CompositeExplicitAutograd")
    return getattr(torch.ops.rope_fusion_floor, name).default


def host_us(fn: Callable[[], Any], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def measure(calls: int = 2000, rounds: int = 5) -> dict[str, float]:
    """Median host us per call of each family, rounds taken family after family (a round high at every family is
    the host's noise)."""
    with torch.no_grad(), kernels_on_cpu():
        fns = _calls()
        for fn in fns.values():
            for _ in range(5):  # planned, then replayed
                fn()
        times: dict[str, list] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(host_us(fn, calls))
    return {name: statistics.median(v) for name, v in times.items()}


def print_table(result: dict[str, float]) -> None:
    """Each family's us a call; an op's row also its dispatcher floor (an op of its schema that does nothing) and
    what is left, the library's own host time, against the direct path's."""
    print(f"host us per call, {T} tokens x {HQ}/{HK} heads x {D}, fp32, CPU, kernel launch a no-op:")
    direct = result["apply_rotary_qk (direct)"]
    print("| family | us/call | dispatcher floor | library's own | own / direct |\n|---|---|---|---|---|")
    for name, us in result.items():
        if name.startswith("floor: "):
            continue
        op = name.split(" ")[0]
        floor = result.get(f"floor: {op}'s dispatch")
        own = us - floor if floor is not None else us
        cells = (f"{floor:.1f}", f"{own:.1f}") if floor is not None else ("-", f"{own:.1f}")
        print(f"| {name} | {us:.1f} | {cells[0]} | {cells[1]} | {own / direct:.2f} |")


def main(quick: bool = False) -> dict[str, float]:
    result = measure(calls=500 if quick else 2000, rounds=3 if quick else 5)
    print_table(result)
    return result


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
