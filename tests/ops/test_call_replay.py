"""One key per call of an op behind the dispatcher, and the tensors a planned runner takes picked from the call's own
arguments (rope_fusion/ops/call_replay.py).

A replay that picked its tensors by what they were in the call that planned it would compute a later call with the
first call's data; these tests give each call fresh random values and check its result against the fp64 reference,
and they plan a key on a call whose arguments are one tensor in two places, then call it with two.
"""

from __future__ import annotations

import pytest
import torch

from rope_fusion.ops import call_replay
from tests.helpers.triton_cpu import CountingLaunches


def test_the_key_holds_each_tensors_geometry_and_every_other_value():
    a, b = torch.randn(4, 3), torch.randn(2, 8)
    key, leaves = call_replay.flatten((a, [b, None], 3), {"flag": True, "dtype": torch.float32})
    assert leaves[0] is a and leaves[1] is b and len(leaves) == 2
    same, _ = call_replay.flatten((torch.randn(4, 3), [torch.randn(2, 8), None], 3),
                                  {"flag": True, "dtype": torch.float32})
    assert key == same and hash(key) == hash(same)
    others = [
        ((a.t(), [b, None], 3), {"flag": True, "dtype": torch.float32}),  # strides
        ((a, [b.double(), None], 3), {"flag": True, "dtype": torch.float32}),  # dtype
        ((a, [b, None], 4), {"flag": True, "dtype": torch.float32}),  # a value
        ((a, [b, b], 3), {"flag": True, "dtype": torch.float32}),  # None against a tensor
        ((a, [b, None], 3), {"flag": False, "dtype": torch.float32}),  # a keyword's value
        ((a, [b], None, 3), {"flag": True, "dtype": torch.float32}),  # the nesting
    ]
    for args, kw in others:
        assert call_replay.flatten(args, kw)[0] != key, (args, kw)
    # the 16-byte alignment of the data, on which Triton specialises a launch
    base = torch.randn(13)
    assert call_replay.flatten((base[1:].view(4, 3),), {})[0] != call_replay.flatten((base[:12].view(4, 3),), {})[0]


def test_the_key_holds_each_pointers_residue_modulo_16():
    """Two unaligned pointers of other residues are other keys (a view a replay cuts at a fixed offset from one may
    be aligned where the other's is not, and Triton compiled the planned launch for the first); pointers of one
    residue share a key. The drop-ins' key reads pointers the same way."""
    from rope_fusion.compat.direct import call_key

    buffer = torch.randn(80)
    at = {offset: buffer[offset:offset + 32] for offset in (0, 1, 3, 4, 5)}  # fp32: residues 0, 4, 12, 0, 4
    for key in (lambda t: call_replay.flatten((t,), {})[0], lambda t: call_key((t,), ())):
        assert key(at[1]) != key(at[3])
        assert key(at[1]) == key(at[5])
        assert key(at[0]) == key(at[4]) != key(at[1])


def test_a_parameter_is_keyed_and_a_subclass_is_not():
    w = torch.nn.Parameter(torch.randn(4))
    key, leaves = call_replay.flatten((w,), {})
    assert leaves == [w] and key == call_replay.flatten((torch.randn(4),), {})[0]

    class Sub(torch.Tensor):
        pass
    assert call_replay.flatten((torch.randn(4).as_subclass(Sub),), {}) is None
    assert call_replay.flatten(([{}],), {}) is None  # an unhashable value


def test_arguments_that_are_one_tensor_are_told_apart():
    """`select` sees each argument as an object of its own: the same tensor passed twice gives two indices."""
    t, u = torch.randn(3), torch.randn(3)
    args, kw = (t, [t, u]), {"w": t}

    indices = call_replay.leaf_indices(args, kw, lambda a, k: [k["w"], a[1][0], None, a[0], a[1][1]])
    assert indices == [3, 1, None, 0, 2]
    _, leaves = call_replay.flatten(args, kw)
    assert call_replay.picked(leaves, indices)[4] is u
    # a tensor made from an argument is not one of the call's: no replay from the arguments
    assert call_replay.leaf_indices(args, kw, lambda a, k: [a[0].contiguous().clone()]) is None


def _cat_inputs(shared: bool):
    """A joint q/k call (text then image rows, joined along dim 1) with q and k of one shape; `shared`: q and k
    are one tensor, the second pieces one tensor and the four norm weights one tensor."""
    r = torch.randn
    heads, d = 2, 16
    q0, q1 = r(2, 3, heads, d), r(2, 5, heads, d)
    k0, k1 = (q0, q1) if shared else (r(2, 3, heads, d), r(2, 5, heads, d))
    w = 1.0 + 0.1 * r(d)
    ws = [w] * 4 if shared else [1.0 + 0.1 * r(d) for _ in range(4)]
    angles = r(8, d // 2)
    args = (q0, k0, angles.cos()[:, None], angles.sin()[:, None], None, ws[0], ws[1])
    kw = dict(interleaved=True, rotary_dim=d, full_tables=False, conjugate=False, out_dtype=torch.float32,
              norm="rms", norm_eps=1e-6, second_pieces=[q1, k1], second_norm_weights=[ws[2], ws[3]], cat_dims=[1, 1])
    return args, kw


def _check(outs, args, kw):
    """Each output against the op's reference on fp64 copies of the call (fp64 math and out)."""
    from rope_fusion.ops import cat_rotary

    def wide(t):
        return t.double() if isinstance(t, torch.Tensor) else t
    exact = cat_rotary.reference(cat_rotary.parse(2, tuple(wide(a) for a in args), dict(
        kw, out_dtype=torch.float64, second_pieces=[wide(t) for t in kw["second_pieces"]],
        second_norm_weights=[wide(t) for t in kw["second_norm_weights"]])))
    for out, ref in zip(outs, exact):
        tol = 4 * torch.finfo(out.dtype).eps * ref.abs().max().item()
        assert out.shape == ref.shape and (out.double() - ref).abs().max().item() <= tol


@pytest.mark.triton_on_cpu(serves=("cat", "cat_planner"), wrap=CountingLaunches)  # as on the GPU; launches counted
def test_the_cat_op_replays_a_key_from_each_calls_own_tensors(triton_on_cpu):
    """The op's first call plans its key on arguments that are one tensor in several places; every later call of
    that key, with distinct fresh tensors, is computed from its own (fp64 reference), through the replay."""
    from rope_fusion.ops import cat_rotary
    from rope_fusion.ops.plan_cache import plan_cache

    op = cat_rotary.CAT_OPS[1]
    args, kw = _cat_inputs(shared=True)
    _check(op(*args, **kw), args, kw)
    replays = plan_cache("cat.replays")
    assert len(replays) == 1 and replays.values()[0], "the key was not planned as a replay"
    for _ in range(3):
        args, kw = _cat_inputs(shared=False)
        _check(op(*args, **kw), args, kw)
    assert len(plan_cache("cat.replays")) == 1 and triton_on_cpu.rotary.launches == 4


@pytest.mark.triton_on_cpu(serves=("slice_write",))
def test_an_into_call_whose_source_shares_the_output_leaves_the_replay(triton_on_cpu):
    """A replayed key of the into op whose sources, in this call, overlap the slice they are written into (same
    geometry as the planned call, other memory) is computed apart first, as the op's own path does: the rotation
    of the sources' values before the write."""
    from rope_fusion.ops.reference import rotary_reference

    heads, d = 2, 16
    kw = dict(interleaved=False, rotary_dim=d, full_tables=False, conjugate=False, out_dtype=torch.float32,
              slice_dims=[1, 1], slice_starts=[2, 2], slice_ends=[7, 7])
    cos, sin = torch.randn(5, 1, d // 2), torch.randn(5, 1, d // 2)

    def call(outs, xs):
        want = [rotary_reference(x.double(), cos.double(), sin.double(), interleaved=False, rotary_dim=d,
                                 full_tables=False, out_dtype=torch.float64) for x in xs]
        torch.ops.rope_fusion.rotary_qk_into_(*outs, *xs, cos, sin, **kw)
        for out, w in zip(outs, want):
            torch.testing.assert_close(out[:, 2:7].double(), w, rtol=1e-6, atol=1e-6)

    for _ in range(2):  # planned, then replayed: sources of their own
        others = [torch.randn(2, 10, heads, d) for _ in range(2)]
        call([torch.randn(2, 10, heads, d) for _ in range(2)], [o[:, 1:6] for o in others])
    outs = [torch.randn(2, 10, heads, d) for _ in range(2)]
    call(outs, [o[:, 1:6] for o in outs])  # the same key: rows 1-5 of the outputs, written at rows 2-6
