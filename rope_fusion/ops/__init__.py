"""The fused rotary op: definition, reference semantics and Inductor lowering."""

from .library import apply_rotary, apply_rotary_qk, register_eager_kernel  # noqa: F401
from .reference import check_args, math_dtype, rotary_reference  # noqa: F401
from . import lowering  # noqa: F401  (registers the Inductor lowering)
from . import backends  # noqa: F401
