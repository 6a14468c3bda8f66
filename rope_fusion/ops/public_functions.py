"""The public functions `apply_rotary`, `apply_rotary_qk` and `apply_rotary_qkv`: the rotary ops as a library.

Their signatures derive from the schema (`option_parameters`, `field_docs`), so a new field of
`schema.RotaryParams` is a keyword of every public function, documented from the schema's docstring. Eagerly, a
call skips the op's dispatcher: it is validated and planned once per call geometry (`direct_key`) and each later
call of that geometry runs its device's planned runner (device_runners.py); under tracing, a dispatch mode or
autograd it calls the op (op_definition.py), so the tracer and autograd see `rope_fusion::rotary*`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .device_runners import ROTARY_KERNELS, Runner, device_runner
from .op_definition import OPS
from .optional_backends import load_backends
from .schema import (
    PACKED_NAMES,
    TENSOR_NAMES,
    RotaryCall,
    RotaryParams,
    check_call,
    optional_tensor_names,
)

# Public defaults of the options the schema requires: derived from x where None (rotary_dim: the head dim
# after rotary_offset; out_dtype: x's dtype). A new required field of RotaryParams without an entry here fails
# at import, so the public functions cannot silently lack it.
PUBLIC_DEFAULTS: dict[str, Any] = {"interleaved": False, "rotary_dim": None, "full_tables": False,
                                   "conjugate": False, "out_dtype": None}
_DERIVED = ("rotary_dim", "out_dtype")  # None: derived from x


def tensor_keywords(arity: int) -> tuple[str, ...]:
    """The public functions' tensor keywords: positions, the packed sequences' cu_seqlens and seqlen_offsets,
    `norm_weight` (one weight for every rotated tensor, or one per tensor) and, for q/k(/v), each tensor's own
    `<name>_norm_weight` (the op schema's names)."""
    names = optional_tensor_names(arity)
    own = names[1:1 + arity] if arity > 1 else ()
    return (names[0], *PACKED_NAMES, "norm_weight", *own)


# the public annotations of the tensor keywords that are not a plain optional tensor
_KEYWORD_TYPES = {"norm_weight": torch.Tensor | Sequence[torch.Tensor | None] | None,
                  "seqlen_offsets": torch.Tensor | int | None}


def option_parameters(arity: int, params_type: type = RotaryParams) -> list[inspect.Parameter]:
    """The keyword-only parameters of the public function of an arity, every field of `params_type` (the
    schema) with its type and default, after the tensor keywords."""
    hints = typing.get_type_hints(params_type)
    out = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=torch.Tensor | None)
           for n in tensor_keywords(arity)]
    out = [p.replace(annotation=_KEYWORD_TYPES[p.name]) if p.name in _KEYWORD_TYPES else p for p in out]
    for f in dataclasses.fields(params_type):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.name in PUBLIC_DEFAULTS:
            default = PUBLIC_DEFAULTS[f.name]
        else:
            raise TypeError(f"{params_type.__name__}.{f.name} has no default: give it a public default in "
                            "ops/public_functions.PUBLIC_DEFAULTS (or one in the schema)")
        hint = hints[f.name] | None if default is None else hints[f.name]
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
    return out


def field_docs(params_type: type = RotaryParams) -> dict[str, str]:
    """Each field's description from the schema's docstring (`name: text`, continued on indented lines)."""
    docs: dict[str, str] = {}
    current = None
    for line in inspect.getdoc(params_type).splitlines():
        m = re.match(r"(\w+): (.*)", line)
        if m and m.group(1) in params_type.__dataclass_fields__:
            current = m.group(1)
            docs[current] = m.group(2)
        elif current and line.startswith(" ") and line.strip():
            docs[current] += " " + line.strip()
        else:
            current = None
    return docs


_TENSOR_DOCS = {
    "positions": "int32/int64 positions: cos and sin are [max_positions, width] caches and the tables are their "
                 "rows cos[positions], which broadcast against x like plain tables ([T, 1] for x [T, H, D]).",
    "cu_seqlens": "int32/int64 [batch + 1]: x packs sequences back to back, [total_tokens, ..., D], sequence b "
                  "holding tokens cu_seqlens[b] <= t < cu_seqlens[b + 1] (0 first, total_tokens last; flash-attn's "
                  "varlen form). Token t rotates by row t - cu_seqlens[b] (+ seqlen_offsets) of the [max_positions, "
                  "width] caches cos and sin; a row outside the caches, or a token outside every sequence, raises.",
    "seqlen_offsets": "with cu_seqlens: the row of each sequence's first token, an int for every sequence or an "
                      "int32/int64 [batch] tensor (default 0).",
    "norm_weight": "the norm's weight (broadcast against the lanes), for every rotated tensor; or a sequence "
                   "of one per tensor.",
}


def _signature_doc(arity: int, summary: str) -> str:
    docs = field_docs()
    lines = [summary, "", "Keyword options (every field of ops/schema.RotaryParams, docs/api.md has examples):"]
    for p in option_parameters(arity):
        if p.name in _TENSOR_DOCS:
            text = _TENSOR_DOCS[p.name]
        elif p.name.endswith("_norm_weight"):
            text = f"the norm's weight for {p.name[:-len('_norm_weight')]} only."
        else:
            text = docs.get(p.name, "")
            if p.name in _DERIVED:
                text += " Default: " + ("the head dim after rotary_offset." if p.name == "rotary_dim" else
                                        "x's dtype (q and k of two dtypes need it).")
        lines.append(f"    {p.name}={p.default!r}: {text}")
    lines += ["", "Raises ValueError naming the argument for bad shapes, dtypes, devices or option values (a position "
              "outside the caches: IndexError naming positions), TypeError for an unknown option or an option of "
              "the wrong type. Differentiable (the gradient of a rotation is the inverse rotation)."]
    return "\n".join(lines)


class _Eager:
    """One validated call geometry: its params and how its device runs it (the plan's runner)."""

    __slots__ = ("params", "run", "kwargs")

    def __init__(self, params: RotaryParams, run: Runner | None) -> None:
        self.params, self.run, self.kwargs = params, run, params.kwargs()


# call key -> _Eager: validation and launch planning once per geometry
_EAGER_PLANS = ROTARY_KERNELS.plan_cache("rotary.direct")


def _resolve(xs: Sequence[torch.Tensor], options: dict) -> RotaryParams:
    """The call's RotaryParams from the public options (None: the derived defaults)."""
    fields = RotaryParams.__dataclass_fields__
    names = TENSOR_NAMES[len(xs)]
    for name, x in zip(names, xs):
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ValueError(f"{name} must be a tensor with at least one dimension (the head dim)")
    if options.get("out_dtype") is None and len({x.dtype for x in xs}) > 1:
        raise ValueError(f"q is {xs[0].dtype} and {names[1]} is {xs[1].dtype}: pass out_dtype=, all are written "
                         "in it")
    chosen = {k: v for k, v in options.items() if v is not None and k in fields}
    defaults = {k: v for k, v in PUBLIC_DEFAULTS.items() if k not in _DERIVED}
    rotary_dim = options.get("rotary_dim")
    if rotary_dim is None:  # derived only where it was not given: rotary_dim=0 is checked, not replaced
        offset = options.get("rotary_offset")
        offset = offset if isinstance(offset, (int, torch.SymInt)) and not isinstance(offset, bool) else 0
        rotary_dim = xs[0].shape[-1] - offset  # a wrong offset is named by the schema's check
    out_dtype = options.get("out_dtype")
    return RotaryParams(**{**defaults, **chosen, "rotary_dim": rotary_dim,
                           "out_dtype": xs[0].dtype if out_dtype is None else out_dtype})


def _weights(arity: int, shared: Any, own: list) -> list | None:
    if shared is not None:
        if any(w is not None for w in own):
            raise TypeError("pass norm_weight or the per-tensor <name>_norm_weight keywords, not both")
        if isinstance(shared, (list, tuple)):
            if len(shared) != arity:
                raise ValueError(f"norm_weight holds {len(shared)} weights for {arity} tensors")
            return list(shared)
        return [shared] * arity
    return own if any(w is not None for w in own) else None


def _is_plain(t: Any) -> bool:
    return t is None or (type(t) is torch.Tensor and not torch._is_functional_tensor(t))


def _needs_grad(tensors: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _direct(tensors: Sequence[Any]) -> bool:
    """Whether an eager call of plain tensors may skip the op's dispatcher: no autograd to record, no dispatch mode
    (fake tensors, FX proxies, functionalization) or functorch transform to see the op."""
    return (not _needs_grad(tensors) and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active())


def tensor_geometry(t: torch.Tensor) -> tuple:
    # the data pointer's 16-byte alignment: Triton specializes a launch on it
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def direct_key(xs: tuple, cos: Any, sin: Any, options: dict) -> tuple | None:
    """The plan key of a call that may go straight to its device's kernel: the arity, each tensor's geometry and
    every other option as the caller spelled it (an order of keywords is a key of its own). None where the call
    must go through the op: tracing, a dispatch mode or functorch transform (fake and functional tensors live
    under one), a tensor subclass, autograd to record; or an option that cannot be a key. One pass over the
    arguments: this is most of the library's host time per call on a cache hit."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active():
        return None
    grad = torch.is_grad_enabled()
    key: list = [len(xs)]
    try:
        for t in (*xs, cos, sin):
            if type(t) is not torch.Tensor or grad and t.requires_grad:
                return None
            key.append(tensor_geometry(t))
        for name, v in options.items():
            if isinstance(v, torch.Tensor):
                if type(v) is not torch.Tensor or grad and v.requires_grad:
                    return None
                v = tensor_geometry(v)
            elif isinstance(v, (list, tuple)):  # norm_weight: one weight per tensor
                if any(isinstance(w, torch.Tensor) and (type(w) is not torch.Tensor or grad and w.requires_grad)
                       for w in v):
                    return None
                v = (type(v), *(tensor_geometry(w) if isinstance(w, torch.Tensor) else w for w in v))
            key.append((name, v))
        out = tuple(key)
        hash(out)
    except (TypeError, RuntimeError):  # an unhashable option, a tensor without storage: nothing to cache
        return None
    return out


def _apply(xs: tuple, cos: torch.Tensor, sin: torch.Tensor, options: dict) -> Any:
    """Every public function's body. Eagerly, a call goes straight to its device's kernel through a plan cached by
    the call's geometry and options (validated once per geometry); with autograd to record, under tracing
    (torch.compile, FX, fake tensors) or a dispatch mode, it calls the op, so the mode, the tracer and autograd
    see `rope_fusion::rotary*`."""
    arity = len(xs)
    key = direct_key(xs, cos, sin, options)
    plan = _EAGER_PLANS.get(key) if key is not None else None
    if plan is None:
        keywords = _KEYWORDS[arity]
        if not keywords.issuperset(options):
            unknown = sorted(set(options) - keywords)
            raise TypeError(f"unknown option(s) {unknown}; expected {sorted(keywords)}")
    cos, sin, positions, weights, cu_seqlens, offsets = _tensor_options(arity, cos, sin, options)
    if plan is None:
        tensors = (*xs, cos, sin, positions, *(weights or ()), cu_seqlens, offsets)
        call = RotaryCall(list(xs), cos, sin, _resolve(xs, options), positions, weights, cu_seqlens, offsets)
        if key is None or not all(_is_plain(t) for t in tensors) or not _direct(tensors):
            return _via_op(call)  # traced, fake, a subclass, autograd: the op runs (and checks) this call
        check_call(call)
        load_backends()  # device kernels (Triton on CUDA) register on import
        plan = _EAGER_PLANS.put(key, _Eager(call.params, device_runner(call)))
    outs = plan.run(xs, cos, sin, positions, weights, cu_seqlens, offsets)
    return outs[0] if arity == 1 else tuple(outs)


def _tensor_options(arity: int, cos: torch.Tensor, sin: torch.Tensor, options: dict) -> tuple:
    """(cos, sin, positions, norm weights, cu_seqlens, seqlen_offsets) of a public call, popped from its options (an
    int seqlen_offsets turned into views of the caches), which keep the RotaryParams fields."""
    positions = options.pop("positions", None)
    cu_seqlens, offsets = options.pop("cu_seqlens", None), options.pop("seqlen_offsets", None)
    if offsets is not None and not isinstance(offsets, torch.Tensor):
        cos, sin = _offset_caches(cos, sin, offsets, cu_seqlens)
        offsets = None
    own = [options.pop(f"{n}_norm_weight", None) for n in TENSOR_NAMES[arity]] if arity > 1 else [None]
    weights = _weights(arity, options.pop("norm_weight", None), own)
    return cos, sin, positions, weights, cu_seqlens, offsets


def rotary_call(xs: tuple, cos: torch.Tensor, sin: torch.Tensor, options: dict) -> RotaryCall:
    """The `RotaryCall` of a public call's tensors and its rotary options (tensor keywords and RotaryParams fields,
    None where not given; popped from `options`): what the public functions build, for the functions of other op
    families that take every rotary option too (ops/kv_cache_api.py). Not checked."""
    cos, sin, positions, weights, cu_seqlens, offsets = _tensor_options(len(xs), cos, sin, options)
    params = _resolve(xs, {k: options.pop(k) for k in list(options) if k in RotaryParams.__dataclass_fields__})
    return RotaryCall(list(xs), cos, sin, params, positions, weights, cu_seqlens, offsets)


def _offset_caches(cos: torch.Tensor, sin: torch.Tensor, offset: Any, cu_seqlens: Any) -> tuple:
    """An int `seqlen_offsets` shifts the rows of every sequence alike: the caches from that row on (views), so
    the op's rows and their bounds check are those of the shifted caches."""
    if isinstance(offset, bool) or not isinstance(offset, (int, torch.SymInt)):
        raise TypeError(f"seqlen_offsets must be an int or an int32/int64 [batch] tensor, got {type(offset).__name__}")
    if cu_seqlens is None:
        raise ValueError("seqlen_offsets are the offsets of packed sequences: they need cu_seqlens")
    if offset < 0:
        raise ValueError(f"seqlen_offsets={offset}: a row offset must be >= 0")
    if offset == 0:
        return cos, sin
    for arg, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"with cu_seqlens, {arg} is a [max_positions, width] cache, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return cos[offset:], sin[offset:]


def _via_op(call: RotaryCall) -> Any:
    check_call(call)
    if not torch.compiler.is_compiling():  # Dynamo cannot trace an import: the op's eager kernel loads them
        load_backends()  # device kernels (Triton on CUDA) register on import
    return OPS[len(call.xs) - 1](*call.tensors(), **call.params.kwargs())


_KEYWORDS = {arity: frozenset(p.name for p in option_parameters(arity)) for arity in TENSOR_NAMES}


def _public(arity: int, name: str, summary: str) -> Callable[..., Any]:
    """The public function of an arity: tensors positionally (or by name), every option from the schema."""
    names = (*TENSOR_NAMES[arity], "cos", "sin")
    n = len(names)

    def fn(*args: Any, **options: Any) -> Any:
        if len(args) != n:
            if len(args) > n:
                raise TypeError(f"{name}() takes {n} positional arguments ({', '.join(names)}), got {len(args)}")
            missing = [m for m in names[len(args):] if m not in options]
            if missing:
                raise TypeError(f"{name}() missing argument(s) {missing}")
            args = (*args, *(options.pop(m) for m in names[len(args):]))
        return _apply(args[:arity], args[arity], args[arity + 1], options)

    out = "torch.Tensor" if arity == 1 else f"tuple[{', '.join(['torch.Tensor'] * arity)}]"
    params = [inspect.Parameter(m, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor) for m in names]
    fn.__signature__ = inspect.Signature([*params, *option_parameters(arity)], return_annotation=out)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = _signature_doc(arity, summary)
    fn.__module__ = __name__
    return fn


apply_rotary = _public(1, "apply_rotary", """Rotate the last dim of x by the tables.

Pairs are (2j, 2j+1) when `interleaved`, else NeoX (j, j + R/2), R = `rotary_dim`. Tables: one entry per pair
(width R/2, the flash-attn / vLLM convention), or with `full_tables` one entry per lane (width R, the Hugging
Face convention); they broadcast against x's leading dims and may be strided views. The math is fp32 (fp64 for
fp64 inputs), rounded once to `out_dtype`. On CUDA the Triton kernel runs (launched directly, its launch planned
once per call geometry), on the CPU the reference, on Ascend torch_npu's RoPE ops where they fit.""")

apply_rotary_qk = _public(2, "apply_rotary_qk", """Rotate q and k by shared tables in one call (one launch on CUDA;
head counts may differ). Options as for `apply_rotary`; both results are written in one dtype: when q and k
differ in dtype, `out_dtype` must say which.""")

apply_rotary_qkv = _public(3, "apply_rotary_qkv", """Rotate q, k and v by shared tables in one call (as CLVP
rotates v too). Options as for `apply_rotary`; all results are written in one dtype.""")
