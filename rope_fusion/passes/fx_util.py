"""The op sets the passes follow through a post-grad graph: casts, ops that pass a value on, copies, splits.

One table for every pass, so that a view or cast the matcher looks through is one the rewriter and the cost
model look through too. Reading nodes and sizes is below passes/, in rope_fusion/fx_nodes.py and fx_sizes.py,
where the kernels' graph-side code reaches them as well.
"""

from __future__ import annotations

import operator

import torch

# dtype casts, as the post-grad graph spells them
CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)

_aten = torch.ops.aten
# The ops that pass their first input through: the result holds its numbers unchanged, as a view, a copy or a
# cast of it (`chain_back` follows them back to where the values arise). The one such set of the passes; each use
# that needs fewer or more says which and why where it is used.
PASS_THROUGH = frozenset({
    *CASTS, _aten.clone.default, _aten.contiguous.default, _aten.alias.default, _aten.view.default,
    _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default, _aten.transpose.int,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.expand.default, _aten.slice.Tensor,
    _aten.select.int, _aten.view_as_real.default, _aten.view_as_complex.default,
})
# The pass-through ops that write a new tensor (casts also round): what a view is not.
COPIES = frozenset({*CASTS, _aten.clone.default, _aten.contiguous.default})
# Views with several outputs, read through `getitem` (not first-input ops, so not in PASS_THROUGH).
SPLITS = frozenset({operator.getitem, _aten.split.Tensor, _aten.unbind.int})
