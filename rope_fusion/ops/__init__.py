"""The fused rotary op: its one schema, reference semantics, Inductor lowering and backend registry; the op with a
KV-cache write (kv_cache*.py)."""

from . import (
    backends,  # noqa: F401
    lowering,  # noqa: F401  (registers the Inductor lowering)
)
from .kv_cache_api import apply_rotary_qk_kv_cache  # noqa: F401
from .library import (  # noqa: F401
    apply_rotary,
    apply_rotary_qk,
    apply_rotary_qkv,
    define_rotary_ops,
    register_device_kernel,
)
from .reference import rotary_reference  # noqa: F401
from .schema import RotaryParams, check_args, math_dtype  # noqa: F401
