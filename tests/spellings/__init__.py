"""Plain-PyTorch RoPE spellings, one function per catalogue row and variation (written from catalogue.md).

Each spelling is a `Case`: the function under test, a maker of fresh random inputs for a dtype, a reference
built on `rope_fusion.ops.reference.rotary_reference` (used by the self-check tests that prove the test data)
and what the pass should report for it.

Conventions that keep every spelling dtype-generic, so that the numerics contract can evaluate the very same
function in fp64: an upcast is written `up(x)` (in a bf16/fp16 graph it is the same node as `x.float()`, and
in the fp64 evaluation it keeps fp64), a cast back is `.to(x.dtype)` / `.type_as(x)`.
"""

from . import catalogue, near_misses, variations  # noqa: F401
from .case import Case, Expect  # noqa: F401

CATALOGUE = catalogue.CASES
VARIATIONS = variations.CASES
NEAR_MISSES = near_misses.CASES
ALL = {c.id: c for c in CATALOGUE + VARIATIONS + NEAR_MISSES}
