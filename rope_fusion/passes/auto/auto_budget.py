"""What `auto` measures, and how long it times: the compile-time budget of measuring (passes/auto/auto_timing.py).

Measuring is all of what the pass adds to a cold compile. On the H200 (torch 2.11, caches off) the analysis took
0.14-0.6 s a model, while each measured site signature took 6-13 s: an Inductor compile per candidate (1.3-4.5 s
"left", 2.6-3.6 s the lowering, 0.3-3.1 s the kernel's inputs and first JIT) and 0.1-1.3 s of timing. Plain
compile of those models took 5-15 s, so a single measured signature doubled some compiles (Qwen-Image 2.35x,
Flux 2.19x). So a site is measured only where the factor table (ops/cost_model.py) cannot call the choice.

**Clear-cut**, from the table's own estimates and what measuring found where the table was wrong:
- the best fused estimate at most `FUSED_CLEAR` (half) of left's: taken unmeasured. The table's estimates are off
  by up to 2.2x in the ratio of fused to left (Wan's norm across heads: estimated 0.34 of left, measured 0.46-0.75;
  Flux's per-head norm 0.41, measured 0.56; Qwen-Image's kernel 0.41-0.44, measured 0.69, and 1.31 in a loop of
  calls whose region copied its host tables to the GPU every call, which the fused graph does not), but at or
  under half of left every such site ran at or faster than plain compile in its model (Wan 1.04x, Helios 1.02x,
  Qwen-Image 1.28x with the kernel the table picks, HunyuanVideo 1.02x). The one fused choice the
  table got wrong in a model was estimated at 0.69 of left: LTX-Video's norm over the whole [.., 2048] row, whose
  lowering measured level with left (142.1 against 141.3 us) and ran 0.958x plain under CUDA graphs. It is measured.
- every fused estimate at least `LEFT_CLEAR` (twice) left's: left unmeasured. The table has been pessimistic about
  fused choices by up to 1.5x (Qwen3-8B's lowering under a per-head norm: estimated 1.48x left, measured faster and
  taken, 1.04x in the model; the Qwen2.5-VL vision tower's kernel estimated 1.16x left, measured 0.94x in one run,
  1.5x in another), so only a wider margin leaves a site unmeasured. Leaving a site is plain compile's own code.
- in between: measured. A fused candidate estimated at `RULED_OUT` times the best fused estimate or more is not
  compiled (the lowering's estimate has been 2.9x off against the kernel's: Wan, estimated 2.7x the kernel,
  measured 0.94x), nor one that measured slower than plain compile at the site's form (`NEVER`), and "left"
  always is.

**Timing**: each candidate is timed briefly first (`QUICK`); where that already separates the decision by more than
`SETTLED` (the best fused candidate and left, and the two best fused ones), that stands, else all are timed again
in full (`FULL`, auto_clock's repeats). The first call of a candidate (its Triton JIT and autotuning) is the same
either way; the repeats after it are what this saves.

**The compile's allowance**: the pass may cost at most a tenth of the compile it runs in, and one measured signature
costs more than a whole small compile (H100, one block: LTX-Video's 4.4 s against plain compile's 2.6 s, Flux's 5.0 s
against 6.5 s; each candidate's standalone compile 0.9-2.0 s, timing 0.3-1.1 s). So under "auto" a signature that
no decision on disk covers is measured only where the compile's `Allowance` affords it: `SHARE` of the compile's
estimated seconds (`NODE_SECONDS` per node of the graphs it compiled, the pieces of one Dynamo compile together),
less what measuring has spent there, must cover the signature's estimated cost (`CANDIDATE_SECONDS` per candidate,
"left" included, and `TIMING_SECONDS`). A model of many layers earns it (a 28-block model about 6 s, one
signature); a one-block graph does not, and its undecided sites stay as plain compile writes them ("left": never
slower than plain compile), the report saying so. `ROPE_FUSION_MEASURE_SHARE` sets the share; decisions measured
once (`measure=True`, a large compile) are read from disk by every later compile at no cost.

The policy is `RopeFusionPass(measure=...)`: "auto" (the default) measures as above, True measures every site that
can be measured (each candidate, timed in full, whatever the allowance), False never measures (the table decides).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from ...ops.cost_model import Factors, SiteCost, estimates
from .auto_clock import REPEATS, TARGET_SECONDS

log = logging.getLogger("rope_fusion")

FUSED_CLEAR = 0.5  # best fused estimate / left's at or under this: the table's fused choice, unmeasured
LEFT_CLEAR = 2.0  # every fused estimate / left's at or over this: left, unmeasured
RULED_OUT = 2.0  # a fused candidate estimated at this multiple of the best fused one or more is not compiled
SETTLED = 0.10  # a quick timing stands where its decision clears the threshold (and the runner-up) by this share

POLICIES = ("auto", True, False)

SHARE = 0.10  # of a compile's estimated seconds, what measuring may take under "auto"
SHARE_ENV = "ROPE_FUSION_MEASURE_SHARE"  # overrides SHARE (a float; "inf": no limit)
# plain compile's cold seconds per call_function node of a post-grad graph, at the low end of what was measured
# (H100, torch 2.11, one block: LTX-Video 2.6 s for 338 nodes, 7.7 ms; Flux under CUDA graphs 6.5 s for 569, 11.4)
NODE_SECONDS = 0.007
CANDIDATE_SECONDS = 1.5  # one candidate's standalone compile, cold (0.9-2.0 s measured)
TIMING_SECONDS = 0.5  # the timing of one signature's candidates (0.3-1.1 s measured)


@dataclasses.dataclass(frozen=True)
class NeverTaken:
    """A fused candidate that measured slower than plain compile at a form of site, and is not compiled there: under
    a folded norm `norm`, with tables that the graph computes and that are at least `table_share` of x's bytes (a
    table per head: one shared by the heads is a small fraction of them)."""

    candidate: str
    norm: str
    table_share: float
    why: str

    def rules_out(self, candidate: str, cost: SiteCost) -> bool:
        return (candidate == self.candidate and cost.norm == self.norm and cost.tables_computed
                and cost.x_bytes is not None and cost.table_bytes >= self.table_share * cost.x_bytes)


# LTX-Video's site (a norm across its 32 heads of 64, a table per head computed from the positions): the kernel
# took 109 us where plain compile took 63.2 (1.7x) on the H200. It reads the per-head tables, as large as x, after
# another kernel has written them; plain compile and the lowering compute them inline from the angles. Its norm
# across heads was not the cost (1.05-1.10x the floor with tables shared by the heads): so not a kernel to fix but
# a choice never to take at that form.
NEVER = (NeverTaken("triton", "rms_across_heads", 1 / 8,
                    "the kernel measured 1.7x plain compile's time under a norm across heads with per-head tables "
                    "computed in the graph (LTX-Video)"),)


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long a candidate is timed: the median of `repeats` repeats of about `target_seconds` each."""

    repeats: int
    target_seconds: float


QUICK = Timing(3, 0.5e-3)
FULL = Timing(REPEATS, TARGET_SECONDS)


@dataclasses.dataclass(frozen=True)
class Budget:
    """What to do for one site: measure `candidates` (fused ones; "left" is always timed), or take `choice`
    unmeasured; `why` is what the report prints for an unmeasured choice."""

    measure: bool
    candidates: tuple = ()
    choice: str | None = None
    why: str = ""


def plan(cost: SiteCost | None, candidates: list[str], policy: Any = "auto",
         factors: Factors | None = None) -> Budget:
    """The budget for one site whose fused `candidates` can take it, by the table's estimates (`factors`: a
    calibrated table, else the H200's). Sizes known only at run time have no estimates: measuring says why not."""
    never = [n for n in NEVER if cost is not None and any(n.rules_out(c, cost) for c in candidates)]
    if never and all(any(n.rules_out(c, cost) for n in never) for c in candidates):
        return Budget(False, choice="left", why=f"not measured: {never[0].why}")
    candidates = [c for c in candidates if not any(n.rules_out(c, cost) for n in never)]
    if policy is True or cost is None or cost.x_bytes is None or not candidates:
        return Budget(True, tuple(candidates))
    est = estimates(cost, factors)
    fused = sorted(candidates, key=est.__getitem__)
    best = est[fused[0]]
    left = est["left"]
    shown = ", ".join(f"{k} {est[k] / 2**20:.0f}" for k in sorted([*fused, "left"], key=est.__getitem__))
    if factors is not None:
        shown += f" ({factors.source})"
    if best <= FUSED_CLEAR * left:
        return Budget(False, choice=fused[0], why=_clear(shown, f"{fused[0]} at {best / left:.2f} of left's estimate, "
                                                         f"at most {FUSED_CLEAR:.2f} is taken unmeasured"))
    if best >= LEFT_CLEAR * left:
        return Budget(False, choice="left", why=_clear(shown, f"every fused choice at {best / left:.2f}x left's "
                                                       f"estimate or more, at least {LEFT_CLEAR:.1f}x is left "
                                                       "unmeasured"))
    return Budget(True, tuple(c for c in fused if est[c] < RULED_OUT * best))


def share() -> float:
    """The share of a compile that measuring may take: `ROPE_FUSION_MEASURE_SHARE`, else `SHARE`."""
    text = os.environ.get(SHARE_ENV, "").strip()
    if not text:
        return SHARE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        log.warning("rope_fusion: %s=%r is not a share (a float at least 0, or inf): %s used", SHARE_ENV, text, SHARE)
        return SHARE
    return value


@dataclasses.dataclass
class Allowance:
    """The seconds that measuring may still take in one compile: earned by the graphs compiled (each once), spent
    by what measuring took."""

    share: float
    spent: float = 0.0
    nodes: int = 0  # call_function nodes of the graphs that earned
    graphs: set = dataclasses.field(default_factory=set)

    @property
    def earned(self) -> float:
        return self.share * NODE_SECONDS * self.nodes

    def earn(self, graph: fx.Graph) -> None:
        if id(graph) in self.graphs:
            return
        self.graphs.add(id(graph))
        self.nodes += sum(1 for node in graph.nodes if node.op == "call_function")

    @staticmethod
    def cost(fused_candidates: int) -> float:
        """The estimated seconds of measuring one signature: each candidate compiled ("left" too), then timed."""
        return CANDIDATE_SECONDS * (fused_candidates + 1) + TIMING_SECONDS

    def affords(self, fused_candidates: int) -> bool:
        return self.earned - self.spent >= self.cost(fused_candidates)

    def spend(self, seconds: float) -> None:
        self.spent += seconds

    def refusal(self, fused_candidates: int) -> str:
        return (f"not measured: measuring this signature would take about {self.cost(fused_candidates):.1f} s, and "
                f"the compile's allowance for measuring is {max(0.0, self.earned - self.spent):.2f} s ("
                f"{self.share:g} of an estimated {NODE_SECONDS * self.nodes:.1f} s compile of {self.nodes} nodes); "
                f"left as plain compile writes it ({SHARE_ENV}, or measure=True, measures it)")


# the compile (Dynamo's CompileContext, else the graph where no Dynamo compile runs) -> its Allowance, for as long as
# the compile lives: Dynamo's compile ids restart after torch._dynamo.reset(), so they cannot key it
_ALLOWANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def allowance(graph: fx.Graph) -> Allowance:
    """The allowance of the compile that `graph` belongs to (the pieces of one Dynamo compile share one), having
    earned `graph`'s share."""
    import torch._guards

    key = torch._guards.CompileContext.try_get() or graph
    a = _ALLOWANCES.get(key)
    if a is None:
        a = _ALLOWANCES[key] = Allowance(share())
    a.earn(graph)
    return a


def _clear(shown: str, rule: str) -> str:
    return f"table, clear-cut, not measured: estimated MiB-equivalents {shown}; {rule}"


def settled(timings: dict, margin: float) -> bool:
    """Whether quick timings decide clearly: the best fused candidate is more than SETTLED away from the threshold
    (1 - margin) * left, and more than SETTLED ahead of the next fused one."""
    fused = sorted((v, k) for k, v in timings.items() if k != "left")
    if "left" not in timings or not fused:
        return True
    ratio = fused[0][0] / timings["left"]
    if abs(ratio - (1 - margin)) <= SETTLED:
        return False
    return len(fused) < 2 or fused[1][0] > (1 + SETTLED) * fused[0][0]


def time_runs(runs: dict[str, Callable[[], Any]], timer_for: Callable[[Timing], Callable], margin: float,
              policy: Any = "auto") -> dict:
    """Microseconds per call of each run: a quick timing, and a full one where the quick one does not settle the
    decision (always in full under `measure=True`). `timer_for(timing)` gives the timer(name, run) -> seconds."""
    if policy is True:
        quick = None
    else:
        timer = timer_for(QUICK)
        quick = {name: timer(name, run) * 1e6 for name, run in runs.items()}
        if settled(quick, margin):
            return quick
    timer = timer_for(FULL)
    return {name: timer(name, run) * 1e6 for name, run in runs.items()}


__all__ = ["Allowance", "Budget", "CANDIDATE_SECONDS", "FULL", "FUSED_CLEAR", "LEFT_CLEAR", "NEVER", "NODE_SECONDS",
           "NeverTaken", "POLICIES", "QUICK", "RULED_OUT", "SETTLED", "SHARE", "SHARE_ENV", "TIMING_SECONDS", "Timing",
           "allowance", "plan", "settled", "share", "time_runs"]
