"""Ways to run the pass: `inductor_options()`, and `install()` / `uninstall()` for code that calls
torch.compile itself (vllm-omni compiles repeated blocks with no options).

`install()` sets Inductor's global `post_grad_custom_post_pass`, after any pass already configured there
(both run, in that order; where that setting is a list of passes, which newer torch takes, ours joins the end of
the list). It is idempotent: a second call returns the pass already installed, and a call with other options
raises rather than replace it (the caller holds the first pass and reads its report).
`uninstall()` takes out exactly what `install()` put in and nothing that was configured around it.

A compile that passes its own `options={"post_grad_custom_post_pass": p}` replaces the global setting for
that compile, which would skip the installed pass without a word; while installed, `torch.compile` is
wrapped so that such an explicit pass is chained with the installed one (the explicit pass first), with one
INFO line on the `rope_fusion` logger.

What Inductor holds is decided at compile time, not when `install()` ran: torch_npu, on its first NPU compile,
*assigns* `post_grad_custom_post_pass = AscendCustomPostPass()` (torch_npu/_inductor/fx_passes/
graph_match_pass.py), which replaced an installed pass, and a pass given in `options=` (what
`inductor_options()` returns) replaced Ascend's ~25 post-grad passes for that compile. So `install()` and
`inductor_options()` also wrap Inductor's `compile_fx` (the call every Inductor compile makes, after torch_npu's
assignment), which composes at that moment (`for_this_compile`):

- installed, and what Inductor holds has no RopeFusionPass (it was replaced after `install()`): ours, then what
  is held;
- `options={"post_grad_custom_post_pass": <a RopeFusionPass>}`: that pass, then whatever else Inductor holds;
- anything else is left as it is (a pass that `install()` found held keeps running first, as above).

Ours runs first there because a pass that replaced it was written as the last word on the graph: Ascend's passes
fold casts, views, clones and nested cats, and turn a cat of slices into a view or a roll (`cat_to_view_pass`),
cleaning up after whatever ran before; ours reads the graph as Inductor normalised it, the form its lane rules
cover (there is no rule for roll or for torch_npu's own fused ops). The composition is a `ChainedPass`, whose
uuid holds both passes' (a plain function's source hash where a pass has no uuid), so Inductor's FX graph cache
and AOTAutograd's cache key on both. The wrapper changes nothing for a compile without a RopeFusionPass in it, and
it stays after `uninstall()` (it then finds nothing installed).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..passes.pass_identity import PassBase
from ..passes.report import Report
from ..passes.rope_pass import RopeFusionPass

log = logging.getLogger("rope_fusion")


def inductor_options(pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> dict:
    """Options for `torch.compile(m, options=...)` that run the pass (a new one unless given), before any other
    post-grad pass that Inductor holds when it compiles (torch_npu's, assigned on the first NPU compile)."""
    p = _checked(pass_, pass_kwargs)
    _wrap_compile_fx()
    return {"post_grad_custom_post_pass": p}


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


class ChainedPass(PassBase):
    """Runs two passes in order, one of them ours: a pass configured before and then ours (`install()`), or ours
    and then a pass that took Inductor's setting after it (`for_this_compile`). Both uuids make its own. Inductor
    tells an inference-aware pass whether the graph is an inference graph; the chain hands that on to ours."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first = first
        self.second = second

    def __call__(self, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
        for p in (self.first, self.second):
            if isinstance(p, RopeFusionPass):
                p(graph, is_inference=is_inference)
            else:
                p(graph)

    def uuid(self) -> Any:
        first, second = _callable_uuid(self.first), _callable_uuid(self.second)
        return None if first is None or second is None else ("chain", first, second)

    @property
    def ours(self) -> RopeFusionPass:
        return self.second if isinstance(self.second, RopeFusionPass) else self.first

    @property
    def report(self) -> Report:
        return self.ours.report


def _with(previous: Any, ours: RopeFusionPass) -> Any:
    """Ours after what was configured. A list (or tuple) of passes, which Inductor runs one after another, gets
    ours at its end; a chain around it would call the list itself and fail every compile."""
    if previous is None:
        return ours
    if isinstance(previous, (list, tuple)):
        return type(previous)((*previous, ours))
    return ChainedPass(previous, ours)


def _ours_first(ours: RopeFusionPass, held: Any) -> Any:
    """Ours, then what Inductor holds (a list of passes gets ours at its front)."""
    if held is None:
        return ours
    if isinstance(held, (list, tuple)):
        return type(held)((ours, *held))
    return ChainedPass(ours, held)


def contains(configured: Any, p: RopeFusionPass) -> bool:
    if configured is p:
        return True
    if isinstance(configured, (list, tuple)):
        return any(contains(c, p) for c in configured)
    return isinstance(configured, ChainedPass) and (contains(configured.first, p) or contains(configured.second, p))


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
        first, second = _without(configured.first, p), _without(configured.second, p)
        if first is None or second is None:
            return second if first is None else first
        return configured if (first, second) == (configured.first, configured.second) else ChainedPass(first, second)
    return configured


def _without_rope_passes(configured: Any) -> Any:
    """The configuration with every RopeFusionPass taken out (None when nothing else is left)."""
    if isinstance(configured, RopeFusionPass):
        return None
    if isinstance(configured, (list, tuple)):
        rest = type(configured)(c for c in (_without_rope_passes(c) for c in configured) if c is not None)
        return rest or None
    if isinstance(configured, ChainedPass):
        first, second = _without_rope_passes(configured.first), _without_rope_passes(configured.second)
        if first is None or second is None:
            return second if first is None else first
        return ChainedPass(first, second)
    return configured


_KEEP = object()  # for_this_compile: leave the compile's setting as it is


def for_this_compile(held: Any, patched: Any = _KEEP, installed: RopeFusionPass | None = None) -> Any:
    """The post_grad_custom_post_pass that one Inductor compile should run, or `_KEEP`.

    `held`: what Inductor's global setting holds when the compile starts (after torch_npu's lazy assignment);
    `patched`: the compile's own `post_grad_custom_post_pass` option, `_KEEP` when it gives none; `installed`:
    the pass `install()` put in. See the module docstring for the three cases and the order."""
    if patched is _KEEP:
        if installed is None or has_rope_pass(held):
            return _KEEP
        return _ours_first(installed, held)
    if isinstance(patched, RopeFusionPass):
        others = _without_rope_passes(held)
        return _KEEP if others is None else _ours_first(patched, others)
    return _KEEP


_installed: RopeFusionPass | None = None
_original_compile = None


def installed() -> RopeFusionPass | None:
    """The pass `install()` put in, or None."""
    return _installed


def install(pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> RopeFusionPass:
    """Run the pass in every later torch.compile of this process (chained after any pass already set).

    Returns the installed pass, whose `report` fills as graphs compile. Calling it again with no options, the same
    options or the installed pass returns the pass already installed. With other options or another pass it raises
    a RuntimeError: replacing the installed pass would leave the one the caller holds reporting nothing, without a
    word; `uninstall()` first. Use this, not `options=`, with `torch.compile(mode=...)`: torch.compile takes one or
    the other.
    """
    global _installed
    import torch._inductor.config as cfg

    p = _checked(pass_, pass_kwargs) if (pass_ is not None or pass_kwargs) else None
    if _installed is not None and contains(cfg.post_grad_custom_post_pass, _installed):
        if p is None or p is _installed or (pass_ is None and _same_options(p, _installed)):
            return _installed
        raise RuntimeError(f"rope_fusion.install: {_installed!r} is installed already, and {p!r} would replace it "
                           "(the installed pass would then see no more graphs); call rope_fusion.uninstall() first, "
                           "or take the installed one from rope_fusion.installed()")
    p = p or RopeFusionPass()
    cfg.post_grad_custom_post_pass = _with(cfg.post_grad_custom_post_pass, p)
    _installed = p
    _wrap_compile()
    _wrap_compile_fx()
    return p


def _same_options(a: RopeFusionPass, b: RopeFusionPass) -> bool:
    """Whether two passes run alike: one class, one set of options (what a copy or a pickle keeps)."""
    return type(a) is type(b) and a.__getstate__() == b.__getstate__()


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


_original_compile_fx = None


def _wrap_compile_fx() -> None:
    """Wrap `torch._inductor.compile_fx.compile_fx` (once per process) so that each compile runs what
    `for_this_compile` says. Every caller reaches the wrapper: torch.compile's Inductor wrapper, Dynamo's
    "inductor" backend and compile_fx's own recursive calls look the function up in its module when they call."""
    global _original_compile_fx
    import torch._inductor.compile_fx as cfx

    if _original_compile_fx is not None:
        return
    _original_compile_fx = original = cfx.compile_fx
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile_fx_composing_rope_fusion(*args: Any, **kwargs: Any) -> Any:
        import torch._inductor.config as cfg

        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # not a call we can read: Inductor says what is wrong with it
            return original(*args, **kwargs)
        patches = bound.arguments.get("config_patches") or {}
        patched = patches.get("post_grad_custom_post_pass", _KEEP)
        chosen = for_this_compile(cfg.post_grad_custom_post_pass, patched, _installed)
        if chosen is not _KEEP:
            log.debug("rope_fusion: this compile runs %r", chosen)
            bound.arguments["config_patches"] = {**patches, "post_grad_custom_post_pass": chosen}
        return original(*bound.args, **bound.kwargs)

    cfx.compile_fx = compile_fx_composing_rope_fusion


__all__ = ["ChainedPass", "contains", "for_this_compile", "has_rope_pass", "inductor_options", "install",
           "installed", "uninstall"]
