"""Ways to run the pass: `inductor_options()`, and `install()` / `uninstall()` for code that calls
torch.compile itself (vllm-omni compiles repeated blocks with no options).

`install()` sets Inductor's global `post_grad_custom_post_pass`, after any pass already configured there
(both run, in that order; where that setting is a list of passes, which newer torch takes, ours joins the end of
the list). It is idempotent: a second call returns the pass already installed.
`uninstall()` takes out exactly what `install()` put in and nothing that was configured around it.

A compile that passes its own `options={"post_grad_custom_post_pass": p}` replaces the global setting for
that compile, which would skip the installed pass without a word; while installed, `torch.compile` is
wrapped so that such an explicit pass is chained with the installed one (the explicit pass first), with one
INFO line on the `rope_fusion` logger.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .report import Report
from .rope_pass import RopeFusionPass

log = logging.getLogger("rope_fusion")


def inductor_options(pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> dict:
    """Options for `torch.compile(m, options=...)` that run the pass (a new one unless given)."""
    return {"post_grad_custom_post_pass": _checked(pass_, pass_kwargs)}


def _checked(pass_: Any, pass_kwargs: dict) -> RopeFusionPass:
    if pass_ is None:
        return RopeFusionPass(**pass_kwargs)
    if not isinstance(pass_, RopeFusionPass):
        raise TypeError(f"pass_ must be a rope_fusion.RopeFusionPass, got {type(pass_).__name__}: {pass_!r}")
    if pass_kwargs:
        raise TypeError("give either a pass or its options, not both")
    return pass_


def _callable_uuid(p: Any) -> Any:
    """A cache key for a pass that is not ours: its own uuid(), else a hash of a plain function's source
    (never a memory address); None when neither exists, which makes Inductor bypass its cache."""
    if isinstance(p, CustomGraphPass):
        return p.uuid()
    try:
        src = inspect.getsource(p)
    except (OSError, TypeError):
        return None
    name = getattr(p, "__qualname__", type(p).__qualname__)
    return hashlib.sha256(f"{getattr(p, '__module__', '')}.{name}\n{src}".encode()).hexdigest()


class ChainedPass(CustomGraphPass):
    """Runs a pass that was configured before, then ours; both uuids make its own."""

    def __init__(self, first: Any, second: RopeFusionPass) -> None:
        self.first = first
        self.second = second

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        first = _callable_uuid(self.first)
        return None if first is None else ("chain", first, self.second.uuid())

    @property
    def report(self) -> Report:
        return self.second.report


def _with(previous: Any, ours: RopeFusionPass) -> Any:
    """Ours after what was configured. A list (or tuple) of passes, which Inductor runs one after another, gets
    ours at its end; a chain around it would call the list itself and fail every compile."""
    if previous is None:
        return ours
    if isinstance(previous, (list, tuple)):
        return type(previous)((*previous, ours))
    return ChainedPass(previous, ours)


def contains(configured: Any, p: RopeFusionPass) -> bool:
    if configured is p:
        return True
    if isinstance(configured, (list, tuple)):
        return any(contains(c, p) for c in configured)
    return isinstance(configured, ChainedPass) and (configured.second is p or contains(configured.first, p))


def has_rope_pass(configured: Any) -> bool:
    """Whether a configured pass is, chains or lists a RopeFusionPass."""
    if isinstance(configured, RopeFusionPass):
        return True
    if isinstance(configured, (list, tuple)):
        return any(has_rope_pass(c) for c in configured)
    return isinstance(configured, ChainedPass) and (has_rope_pass(configured.first) or
                                                    has_rope_pass(configured.second))


def _without(configured: Any, p: RopeFusionPass) -> Any:
    """The configuration with our pass taken out (whatever was set around it stays)."""
    if configured is p:
        return None
    if isinstance(configured, (list, tuple)):
        return type(configured)(c for c in (_without(c, p) for c in configured) if c is not None)
    if isinstance(configured, ChainedPass):
        if configured.second is p:
            return configured.first
        return _with(_without(configured.first, p), configured.second)
    return configured


_installed: RopeFusionPass | None = None
_original_compile = None


def installed() -> RopeFusionPass | None:
    """The pass `install()` put in, or None."""
    return _installed


def install(pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> RopeFusionPass:
    """Run the pass in every later torch.compile of this process (chained after any pass already set).

    Returns the installed pass, whose `report` fills as graphs compile. Calling it again returns the pass
    already installed (with other options or another pass: that one replaces it). `uninstall()` undoes it.
    Use this, not `options=`, with `torch.compile(mode=...)`: torch.compile takes one or the other.
    """
    global _installed
    import torch._inductor.config as cfg

    p = _checked(pass_, pass_kwargs) if (pass_ is not None or pass_kwargs) else None
    if _installed is not None and contains(cfg.post_grad_custom_post_pass, _installed):
        if p is None or p is _installed or (pass_ is None and p.uuid() == _installed.uuid()):
            return _installed
        uninstall()
    p = p or RopeFusionPass()
    cfg.post_grad_custom_post_pass = _with(cfg.post_grad_custom_post_pass, p)
    _installed = p
    _wrap_compile()
    return p


def uninstall() -> None:
    """Take the installed pass out of Inductor's configuration; any other pass configured stays."""
    global _installed
    import torch._inductor.config as cfg

    if _installed is None:
        return
    if contains(cfg.post_grad_custom_post_pass, _installed):
        cfg.post_grad_custom_post_pass = _without(cfg.post_grad_custom_post_pass, _installed)
    else:
        log.warning("rope_fusion.uninstall: post_grad_custom_post_pass was replaced after install() "
                    "(now %r); left as it is", cfg.post_grad_custom_post_pass)
    _installed = None
    _unwrap_compile()


def _wrap_compile() -> None:
    global _original_compile
    if _original_compile is not None:
        return
    _original_compile = original = torch.compile

    @functools.wraps(original)
    def compile_with_installed_pass(*args: Any, **kwargs: Any) -> Any:
        options = kwargs.get("options")
        p = _installed
        if p is not None and options and options.get("post_grad_custom_post_pass") is not None:
            explicit = options["post_grad_custom_post_pass"]
            if not has_rope_pass(explicit):
                log.info("rope_fusion: torch.compile(options=...) sets its own post_grad_custom_post_pass; "
                         "the installed pass runs after it")
                kwargs["options"] = {**options, "post_grad_custom_post_pass": _with(explicit, p)}
        return original(*args, **kwargs)

    torch.compile = compile_with_installed_pass


def _unwrap_compile() -> None:
    global _original_compile
    if _original_compile is not None and getattr(torch.compile, "__wrapped__", None) is _original_compile:
        torch.compile = _original_compile
    _original_compile = None


__all__ = ["ChainedPass", "contains", "has_rope_pass", "inductor_options", "install", "installed", "uninstall"]
