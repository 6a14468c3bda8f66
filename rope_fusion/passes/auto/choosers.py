"""How a pass picks the backend of a site: a `Chooser` record, and the `Choice` it returns.

A choice is one record that travels with the planned group into the report: the backend, why not the one asked for
(`fallback`), how it was decided (`how`: "measured" on the device or read from the decisions measuring cached,
"bound" by the cost model's estimate of the bytes and launches, "rule" by a fixed order, "forced" by the backend
asked for) and what `auto` says of it (`why`), and what takes the site where the backend refuses it at emission
(`instead`). `RopeFusionPass` takes its chooser as an argument: `AUTO_CHOOSER` below (the backend asked for, or
`auto`), or integrations/fx_pass.py's for graphs no Inductor compiles.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ...ops.backends import AUTO_ORDER, Backend, Refusal, SiteSpec, choose_backend, get_backend
from . import auto_budget, auto_timing

HOWS = ("measured", "bound", "rule", "forced")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One site's backend, and how and why it was chosen."""

    backend: Backend
    how: str
    why: str = ""  # what `auto` did ("" where no choice was made: a backend asked for by name)
    fallback: str = ""  # why the backend asked for did not take the site ("" when it did)
    instead: Backend | None = None  # what takes the site where `backend` refuses it at emission
    instead_words: str = "the lowering"  # how the report names `instead`

    def __post_init__(self) -> None:
        if self.how not in HOWS:
            raise ValueError(f"a choice is {', '.join(HOWS)}, got {self.how!r}")

    def refused(self, refusal: Refusal) -> Choice:
        """The choice once the backend refused the site at emission: `instead` takes it, and the fallback says why."""
        if self.instead is None:
            raise RuntimeError(f"backend {self.backend.name!r} refused a site ({refusal.reason}) and nothing is "
                               "named to take it instead")
        return dataclasses.replace(self, backend=self.instead, instead=None,
                                   fallback=f"{self.backend.name}: {refusal.reason}; {self.instead_words} instead")


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What a chooser knows of the graph being fused, beyond the site: whether a compiled call of it waits on the
    host (ops/cost_model.py), and the config the compiler called the pass with (None under Inductor)."""

    host_bound: bool = False
    config: Any = None


@dataclasses.dataclass(frozen=True)
class Chooser:
    """`choose(pass, spec, facts)` -> Choice for one site (it may raise LeftToInductor: the site is better left).
    `reads_decisions`: whether what it picks can follow `auto`'s decisions and calibrated tables on disk, which the
    pass's cache key must then cover."""

    name: str
    choose: Callable[[Any, SiteSpec, GraphFacts], Choice]
    reads_decisions: bool = True


def _auto_choose(p: Any, spec: SiteSpec, facts: GraphFacts) -> Choice:
    """The backend asked for, or under `auto` the measured, estimated or fixed-order choice."""
    if spec.cost is not None:
        spec = dataclasses.replace(spec, cost=dataclasses.replace(spec.cost, host_bound=facts.host_bound))
    decision, how, why = _auto_decision(p, spec)
    backend, reasons = choose_backend(p.backend, spec, decision)
    fallback = "; ".join(reasons)
    if fallback:
        p.log_once(("fallback", fallback), logging.WARNING,
                    "rope_fusion: backend %r did not take a site, using %r (%s)", p.backend, backend.name, fallback)
    site = spec.measure
    if how == "measured" and site is not None and site.fold is not None and site.fold.runner is None:
        why = f"{why}; the {site.fold.name} timed as the plain kernel"
    return Choice(backend, how, why, fallback, instead=get_backend("inductor"))


def _auto_decision(p: Any, spec: SiteSpec) -> tuple[tuple[str, str] | None, str, str]:
    """(decision for `choose_backend`, how, why). Under `auto` on a device that measures (CUDA): the measured or
    cached choice, else the factor table's (a calibrated one where present), with why it was not measured; elsewhere
    the fixed order, or the cost model's estimate on a GPU."""
    if p.backend != "auto":
        return None, "forced", ""
    site = spec.measure
    if site is None or not auto_timing.measured_device(spec.device_type):
        return None, ("bound" if spec.device_type == "cuda" and spec.cost is not None else "rule"), ""
    from ...ops.cost_model import cheapest
    from .auto_decisions import calibrated_factors

    device = site.call.xs[0].meta["val"].device
    on, why_not = auto_timing.enabled(p.measure)
    if on:
        candidates = [n for n in AUTO_ORDER.get(spec.device_type, ["inductor"])
                      if get_backend(n) is not None and get_backend(n).supports(spec) is None]
        budget = auto_budget.plan(spec.cost, candidates, p.measure, calibrated_factors(device))  # what to measure
        if budget.measure:
            # under "auto", what the compile can pay for measuring (measure=True: every site, whatever it costs)
            allowance = auto_budget.allowance(site.outputs[0].graph) if p.measure == "auto" else None
            outcome = auto_timing.decide(site, device, list(budget.candidates), p.replayed_in_cuda_graphs(),
                                         p.measure, allowance)
        else:
            auto_timing.STATS["clear"] += 1
            outcome = auto_timing.Outcome(budget.choice, "table", budget.why)
        if outcome.choice is not None:
            how = "bound" if outcome.how == "table" else "measured"
            return (outcome.choice, outcome.why), how, outcome.why
        why_not = outcome.why
    else:
        auto_timing.STATS["table"] += 1
    if spec.cost is None or device.type != "cuda":  # the table is a GPU's: elsewhere the fixed order
        return None, "rule", f"fixed order, not measured: {why_not}"
    best, why = cheapest(spec.cost, calibrated_factors(device))
    why = f"{why}; table, not measured: {why_not}"
    return (best, why), "bound", why


AUTO_CHOOSER = Chooser("auto", _auto_choose)
"""The backend asked for by name, or `auto`: measured on the compile's GPU, else estimated, else a fixed order."""

__all__ = ["AUTO_CHOOSER", "Choice", "Chooser", "GraphFacts", "HOWS"]
