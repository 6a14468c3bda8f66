"""Unit tests of the lane algebra's transfer rules (rope_fusion/passes/analysis/lane_rules.py) and of lanes.py.

Each test builds a tiny FX graph by hand whose nodes carry fake tensors in `meta["val"]`, as a post-grad
graph does, runs the LaneInterpreter and checks the exact LaneValue of the node under test: its shape, k
and entries as polynomials over the atoms (node name, k, as_real, flat) of the graph's inputs. Every op in
`lanes.RULES` must be claimed by a test (`@covers`), or `test_every_registered_rule_has_a_test` fails.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from rope_fusion import fx_nodes, fx_sizes
from rope_fusion.passes.analysis import lane_rules, lanes
from rope_fusion.passes.analysis.lanes import LaneInterpreter, LaneValue

aten = torch.ops.aten
prims = torch.ops.prims

COVERED: set = set()


def covers(*targets):
    """Marks a test as the test of the rules of these ops."""

    def mark(test):
        COVERED.update(targets)
        return test

    return mark


class Graph:
    """A hand-built FX graph whose nodes carry fake values, and its lane interpretation."""

    def __init__(self):
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.interp: LaneInterpreter | None = None

    def input(self, name: str, *shape: int, dtype=torch.float32) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def op(self, target, *args, **kwargs) -> fx.Node:
        with self.mode:
            val = target(*fx.node.map_arg(args, lambda n: n.meta["val"]),
                         **fx.node.map_arg(kwargs, lambda n: n.meta["val"]))
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = val
        return node

    def value(self, node: fx.Node):
        """The node's lane value (a LaneValue or a list of them), or None when the rule gave up."""
        if self.interp is None or node.name not in self.interp.nodes:  # (re)run after the graph grew
            self.interp = LaneInterpreter(self.graph)
            self.interp.run()
        return self.interp.values.get(node)


def atom(name: str, flat: int, k: int = 1, as_real: bool = False) -> tuple:
    return (name, k, as_real, flat)


def lanes_of(name: str, flats, k: int = 1, as_real: bool = False, coef: float = 1.0) -> list:
    """The entries `coef * name[flat]` for each flat."""
    return [{(atom(name, f, k, as_real),): coef} for f in flats]


def check(value, shape, k, entries, is_complex=False, wide=False) -> None:
    assert isinstance(value, LaneValue), value
    assert value.shape == tuple(shape)
    assert value.k == k
    assert value.entries == entries
    assert value.is_complex == is_complex
    assert value.wide == wide


X = lanes_of("x", range(4))  # the lanes of a [2, 4] input x
XCOS = [{(atom("cos", f), atom("x", f)): 1.0} for f in range(4)]  # x * cos, for a [4] input cos


@pytest.fixture
def g():
    return Graph()


# -- the registry ----------------------------------------------------------------------------------

def test_every_registered_rule_has_a_test():
    # the complete list of tests is only known once every test function above has been defined: this
    # test reads COVERED at run time, after the module is imported
    assert set(lanes.RULES) - COVERED == set(), "ops with a lane rule but no test"
    assert COVERED - set(lanes.RULES) == set(), "tests for ops without a lane rule"


def test_rules_are_registered_by_importing_lane_rules():
    assert lanes.RULES[aten.neg.default] is lane_rules.rule_neg
    assert lanes.RULES[aten.clone.default] is lanes.RULES[aten.alias.default] is lane_rules.rule_identity


def test_lane_rule_registers_a_rule_for_several_targets(monkeypatch):
    monkeypatch.setattr(lanes, "RULES", {})

    @lanes.lane_rule(aten.sin.default, aten.cos.default)
    def rule_trig(interp, node):
        raise lanes.Unsupported("test")

    assert lanes.RULES == {aten.sin.default: rule_trig, aten.cos.default: rule_trig}

    def other(interp, node):
        return None

    with pytest.raises(ValueError, match="already has the lane rule"):
        lanes.lane_rule(aten.sin.default)(other)


def test_run_without_registered_rules_raises(monkeypatch, g):
    g.op(aten.neg.default, g.input("x", 2, 4))
    monkeypatch.setattr(lanes, "RULES", {})
    with pytest.raises(RuntimeError, match="import rope_fusion.passes.analysis.lane_rules"):
        LaneInterpreter(g.graph).run()


# -- elementwise -----------------------------------------------------------------------------------

@covers(aten.add.Tensor)
def test_add(g):
    x, y = g.input("x", 2, 4), g.input("y", 4)
    node = g.op(aten.add.Tensor, x, y, alpha=2)
    plus = g.op(aten.add.Tensor, x, 1.5)
    check(g.value(node), (2, 4), 1, [{(atom("x", f),): 1.0, (atom("y", f),): 2.0} for f in range(4)])
    check(g.value(plus), (2, 4), 1, [{(atom("x", f),): 1.0, (): 1.5} for f in range(4)])


@covers(aten.sub.Tensor)
def test_sub(g):
    x, y = g.input("x", 2, 4), g.input("y", 4)
    node = g.op(aten.sub.Tensor, x, y)
    check(g.value(node), (2, 4), 1, [{(atom("x", f),): 1.0, (atom("y", f),): -1.0} for f in range(4)])


def test_sub_of_complex_values(g):
    z, w = g.input("z", 2, dtype=torch.complex64), g.input("w", 2, dtype=torch.complex64)
    node = g.op(aten.sub.Tensor, z, w)
    want = [{(atom("z", f, 2, True),): 1.0, (atom("w", f, 2, True),): -1.0} for f in range(4)]
    check(g.value(node), (2, 2), 2, want, is_complex=True)


@covers(aten.rsub.Scalar)
def test_rsub(g):
    node = g.op(aten.rsub.Scalar, g.input("x", 2, 4), 2.0)
    check(g.value(node), (2, 4), 1, [{(): 2.0, (atom("x", f),): -1.0} for f in range(4)])


@covers(aten.neg.default)
def test_neg(g):
    node = g.op(aten.neg.default, g.input("x", 2, 4))
    check(g.value(node), (2, 4), 1, lanes_of("x", range(4), coef=-1.0))


@covers(aten.mul.Tensor, aten.mul.Scalar)
def test_mul(g):
    x, cos = g.input("x", 2, 4), g.input("cos", 4)
    node = g.op(aten.mul.Tensor, x, cos)
    scaled = g.op(aten.mul.Scalar, x, 3.0)
    check(g.value(node), (2, 4), 1, [{(atom("cos", f), atom("x", f)): 1.0} for f in range(4)])
    check(g.value(scaled), (2, 4), 1, lanes_of("x", range(4), coef=3.0))


def test_mul_of_complex_values(g):
    z, w = g.input("z", 2, dtype=torch.complex64), g.input("w", 2, dtype=torch.complex64)
    node = g.op(aten.mul.Tensor, z, w)
    want = []
    for j in range(2):
        zr, zi, wr, wi = atom("z", 2 * j, 2, True), atom("z", 2 * j + 1, 2, True), \
            atom("w", 2 * j, 2, True), atom("w", 2 * j + 1, 2, True)
        want += [{(wr, zr): 1.0, (wi, zi): -1.0}, {(wi, zr): 1.0, (wr, zi): 1.0}]
    check(g.value(node), (2, 2), 2, want, is_complex=True)


def test_mul_of_complex_by_real_scales_both_parts(g):
    z, r = g.input("z", 2, dtype=torch.complex64), g.input("r", 2)
    node = g.op(aten.mul.Tensor, z, r)
    want = [{(atom("r", f // 2), atom("z", f, 2, True)): 1.0} for f in range(4)]
    check(g.value(node), (2, 2), 2, want, is_complex=True)


@covers(aten.div.Tensor, aten.div.Scalar)
def test_div(g):
    x = g.input("x", 2, 4)
    half = g.op(aten.div.Tensor, x, 2.0)
    quarter = g.op(aten.div.Scalar, x, 4.0)
    check(g.value(half), (2, 4), 1, lanes_of("x", range(4), coef=0.5))
    check(g.value(quarter), (2, 4), 1, lanes_of("x", range(4), coef=0.25))


def test_div_by_a_tensor_is_unsupported_and_makes_a_source(g):
    x, y = g.input("x", 2, 4), g.input("y", 2, 4)
    node = g.op(aten.div.Tensor, x, y)
    after = g.op(aten.neg.default, node)
    assert g.value(node) is None
    check(g.value(after), (2, 4), 1, lanes_of(node.name, range(4), coef=-1.0))


@covers(aten.addcmul.default)
def test_addcmul(g):
    s, x, cos = g.input("s", 2, 4), g.input("x", 2, 4), g.input("cos", 4)
    node = g.op(aten.addcmul.default, s, x, cos, value=0.5)
    want = [{(atom("s", f),): 1.0, (atom("cos", f), atom("x", f)): 0.5} for f in range(4)]
    check(g.value(node), (2, 4), 1, want)


@covers(aten.clone.default, aten.alias.default, aten.contiguous.default, aten.resolve_conj.default)
def test_identity(g):
    x = g.input("x", 2, 4)
    for target in (aten.clone.default, aten.alias.default, aten.contiguous.default, aten.resolve_conj.default):
        check(g.value(g.op(target, x)), (2, 4), 1, X)


def test_identity_of_complex_and_of_int_tensors(g):
    z, n = g.input("z", 2, dtype=torch.complex64), g.input("n", 2, 4, dtype=torch.int64)
    resolved = g.op(aten.resolve_conj.default, z)
    cloned = g.op(aten.clone.default, n)
    check(g.value(resolved), (2, 2), 2, lanes_of("z", range(4), 2, True), is_complex=True)
    assert g.value(cloned) is None


@covers(prims.convert_element_type.default, aten._to_copy.default)
def test_convert(g):
    x = g.input("x", 2, 4)
    wide = g.op(prims.convert_element_type.default, x, torch.float64)
    half = g.op(aten._to_copy.default, x, dtype=torch.float16)
    to_int = g.op(prims.convert_element_type.default, x, torch.int32)
    check(g.value(wide), (2, 4), 1, X, wide=True)
    check(g.value(half), (2, 4), 1, X)
    assert g.value(to_int) is None


@covers(aten.copy.default)
def test_copy_broadcasts_the_source(g):
    dst, src = g.input("dst", 2, 4), g.input("src", 4)
    node = g.op(aten.copy.default, dst, src)
    check(g.value(node), (2, 4), 1, lanes_of("src", range(4)))


# -- creation --------------------------------------------------------------------------------------

@covers(aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default)
def test_empty(g):
    x = g.input("x", 2, 4)
    nodes = [g.op(aten.empty.memory_format, [2, 4], dtype=torch.float32, device="cpu"),
             g.op(aten.empty_like.default, x),
             g.op(aten.empty_strided.default, [2, 4], [4, 1], dtype=torch.float32, device="cpu")]
    for node in nodes:
        check(g.value(node), (2, 4), 1, [None] * 4)


@covers(aten.full.default, aten.full_like.default)
def test_full(g):
    full = g.op(aten.full.default, [2, 4], 1.5, dtype=torch.float32, device="cpu")
    like = g.op(aten.full_like.default, g.input("x", 2, 4), 2)
    check(g.value(full), (2, 4), 1, [{(): 1.5}] * 4)
    check(g.value(like), (2, 4), 1, [{(): 2.0}] * 4)


@covers(aten.zeros.default, aten.zeros_like.default)
def test_zeros(g):
    zeros = g.op(aten.zeros.default, [2, 4], dtype=torch.float32, device="cpu")
    like = g.op(aten.zeros_like.default, g.input("x", 2, 4))
    check(g.value(zeros), (2, 4), 1, [{}] * 4)
    check(g.value(like), (2, 4), 1, [{}] * 4)


# -- views and shape changes -----------------------------------------------------------------------

@covers(aten.reshape.default, aten.view.default, aten._unsafe_view.default)
def test_reshape_splits_the_lanes(g):
    x = g.input("x", 2, 8)
    for target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        check(g.value(g.op(target, x, [2, 2, 4])), (2, 2, 4), 2, lanes_of("x", range(8)))


def test_reshape_merging_a_leading_dim_absorbs_it(g):
    node = g.op(aten.view.default, g.input("x", 2, 3, 4), [2, 12])
    # x's middle dim joined the grid: its atoms now have k = 2
    check(g.value(node), (2, 12), 1, lanes_of("x", range(12), k=2))


def test_projection_split_into_heads_is_a_new_source(g):
    """[.., H*D] -> [.., H, D] of a plain projection (1024 lanes, heads of 32): the view starts afresh as a
    source of D lanes; computed lanes, narrow grids and pair splits keep their lanes through the split."""
    x = g.input("x", 2, 1024)
    heads = g.op(aten.view.default, x, [2, 32, 32])
    computed = g.op(aten.view.default, g.op(aten.mul.Tensor, x, x), [2, 32, 32])
    pairs = g.op(aten.view.default, x, [2, 512, 2])  # the interleaved spelling's own split
    narrow = g.op(aten.view.default, g.input("y", 2, 512), [2, 16, 32])  # below 1024 lanes
    assert g.value(heads) is None  # the interpreter reads it as a new source when it is used
    lanes_used = g.value(g.op(aten.neg.default, heads))
    check(lanes_used, (2, 32, 32), 1, lanes_of(heads.name, range(32), coef=-1.0))
    assert g.value(computed).k == 2 and len(g.value(computed).entries) == 1024
    check(g.value(pairs), (2, 512, 2), 2, lanes_of("x", range(1024)))
    check(g.value(narrow), (2, 16, 32), 2, lanes_of("y", range(512)))


def test_reshape_of_leading_dims_only_is_unsupported(g):
    node = g.op(aten.view.default, g.input("x", 6, 4), [2, 3, 4])
    assert g.value(node) is None


@covers(aten.unsqueeze.default)
def test_unsqueeze(g):
    x = g.input("x", 2, 4)
    front = g.op(aten.unsqueeze.default, x, 0)
    last = g.op(aten.unsqueeze.default, x, -1)
    inside = g.op(aten.unsqueeze.default, g.op(aten.mul.Tensor, x, g.input("cos", 4)), -2)
    check(g.value(front), (1, 2, 4), 1, X)
    check(g.value(last), (2, 4, 1), 2, X)
    check(g.value(inside), (2, 1, 4), 2, XCOS)


def test_unsqueeze_unsupported(g):
    x, x3 = g.input("x", 2, 4), g.input("x3", 2, 3, 4)
    between_leading = g.op(aten.unsqueeze.default, x3, 1)
    # `cos.unsqueeze(-2)`: a new source (every lane is one source lane as it is)
    before_plain_lanes = g.op(aten.unsqueeze.default, x, 1)
    assert g.value(between_leading) is None
    assert g.value(before_plain_lanes) is None
    # negated lanes (the -sin of a 2x2 rotation-matrix table) keep their sign: the unit dim joins the grid
    before_negated_lanes = g.op(aten.unsqueeze.default, g.op(aten.neg.default, x), 1)
    v = g.value(before_negated_lanes)
    assert v is not None and v.k == 2 and tuple(v.grid) == (1, 4)
    assert all(next(iter(e.values())) == -1.0 for e in v.entries)


def _matrix(g, batch: int) -> fx.Node:
    """stack([c, -s, s, c], -1) of [batch, 3, 2] tables, as post-grad graphs spell it: unsqueeze + cat."""
    c, s = g.input("c", batch, 3, 2), g.input("s", batch, 3, 2)
    parts = [g.op(aten.unsqueeze.default, t, -1) for t in (c, g.op(aten.neg.default, s), s, c)]
    return g.op(aten.cat.default, parts, -1)


def test_unsqueeze_between_leading_dims_of_a_computed_value(g):
    # a rotation matrix given a heads dim in front of its sequence dim: with a batch of 1 every atom keeps its
    # right-aligned meaning, and the lanes (c, -s, s, c) stay as they are
    m = _matrix(g, 1)
    heads = g.op(aten.unsqueeze.default, m, 1)
    v = g.value(heads)
    assert v.shape == (1, 1, 3, 2, 4) and v.k == 2 and v.entries == g.value(m).entries


def test_unsqueeze_between_leading_dims_identifies_equal_lanes(g):
    # with a batch of 2 the tables' batch dim would align with the new unit dim: the result is a source, whose
    # lanes that the matrix proves equal (c and c) or negated (-s and s) share one atom, positive first
    m = _matrix(g, 2)
    heads = g.op(aten.unsqueeze.default, m, 1)
    v = g.value(heads)
    name = heads.name
    want = []
    for j in range(2):
        a, b = atom(name, 4 * j, k=2), atom(name, 4 * j + 2, k=2)
        want += [{(a,): 1.0}, {(b,): -1.0}, {(b,): 1.0}, {(a,): 1.0}]
    check(v, (2, 1, 3, 2, 4), 2, want)
    assert g.interp.identified[name] is g.value(m)
    # a computed value with no two related lanes stays a plain source
    x = g.input("x", 2, 3, 4)
    unrelated = g.op(aten.unsqueeze.default, g.op(aten.mul.Tensor, x, g.input("cos", 2, 3, 4)), 1)
    assert g.value(unrelated) is None


@covers(aten.sum.dim_IntList)
def test_sum_over_a_pair(g):
    # a 2x2 matrix applied to pairs as a product and a sum: (m * x.view(3, 1, 2)).sum(-1)
    x, m = g.input("x", 3, 2), g.input("m", 2, 2)
    pairs = g.op(aten.view.default, x, [3, 1, 2])  # a view in front of plain lanes: a source of its own
    product = g.op(aten.mul.Tensor, m, pairs)
    x0, x1 = atom(pairs.name, 0, k=2), atom(pairs.name, 1, k=2)
    rows = [{(atom("m", 2 * r, k=2), x0): 1.0, (atom("m", 2 * r + 1, k=2), x1): 1.0} for r in range(2)]
    check(g.value(g.op(aten.sum.dim_IntList, product, [-1])), (3, 2), 1, rows)
    check(g.value(g.op(aten.sum.dim_IntList, product, [-1], True)), (3, 2, 1), 2, rows)


def test_sum_over_many_lanes_or_a_leading_dim_is_a_source(g):
    x = g.input("x", 3, 8)
    assert g.value(g.op(aten.sum.dim_IntList, x, [-1])) is None  # a statistic over 8 lanes
    assert g.value(g.op(aten.sum.dim_IntList, x, [0])) is None  # a leading dim that is no pair
    assert g.value(g.op(aten.sum.dim_IntList, g.input("y", 3000, 2), [-1])) is None  # its row dim is too wide


@covers(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def test_squeeze(g):
    x = g.input("x", 2, 4)
    unsqueezed = g.op(aten.unsqueeze.default, g.op(aten.mul.Tensor, x, g.input("cos", 4)), -2)
    for node in (g.op(aten.squeeze.dim, unsqueezed, -2), g.op(aten.squeeze.dims, unsqueezed, [-2]),
                 g.op(aten.squeeze.default, unsqueezed)):
        check(g.value(node), (2, 4), 1, XCOS)
    # nothing of size 1: the identity
    check(g.value(g.op(aten.squeeze.dim, x, 0)), (2, 4), 1, X)


def test_squeeze_of_a_leading_dim_is_unsupported(g):
    x1 = g.input("x1", 1, 2, 4)
    assert g.value(g.op(aten.squeeze.dim, x1, 0)) is None
    assert g.value(g.op(aten.squeeze.default, x1)) is None


@covers(aten.expand.default)
def test_expand(g):
    y, x = g.input("y", 2, 1), g.input("x", 4)
    repeated = g.op(aten.expand.default, y, [2, 4])
    leading = g.op(aten.expand.default, x, [3, 4])
    check(g.value(repeated), (2, 4), 1, lanes_of("y", [0, 0, 0, 0]))
    check(g.value(leading), (3, 4), 1, X)


@covers(aten.permute.default)
def test_permute_of_grid_dims(g):
    pairs = g.op(aten.view.default, g.input("x", 2, 4), [2, 2, 2])  # grid (2, 2)
    node = g.op(aten.permute.default, pairs, [0, 2, 1])
    check(g.value(node), (2, 2, 2), 2, lanes_of("x", [0, 2, 1, 3]))
    check(g.value(g.op(aten.permute.default, pairs, [0, 1, 2])), (2, 2, 2), 2, lanes_of("x", range(4)))


def test_permute_of_leading_dims_is_unsupported(g):
    node = g.op(aten.permute.default, g.input("x", 2, 3, 4), [1, 0, 2])
    assert g.value(node) is None


@covers(aten.transpose.int)
def test_transpose(g):
    pairs = g.op(aten.view.default, g.input("x", 2, 4), [2, 2, 2])
    node = g.op(aten.transpose.int, pairs, -1, -2)
    check(g.value(node), (2, 2, 2), 2, lanes_of("x", [0, 2, 1, 3]))


@covers(aten.slice.Tensor)
def test_slice(g):
    x = g.input("x", 2, 4)
    strided = g.op(aten.slice.Tensor, x, -1, 1, 4, 2)
    whole_leading = g.op(aten.slice.Tensor, x, 0, 0, 9223372036854775807)
    check(g.value(strided), (2, 2), 1, lanes_of("x", [1, 3]))
    check(g.value(whole_leading), (2, 4), 1, X)


def test_slice_of_a_pair_dim_pulls_it_into_the_grid(g):
    node = g.op(aten.slice.Tensor, g.input("x", 3, 2, 4), 1, 0, 1)
    check(g.value(node), (3, 1, 4), 2, lanes_of("x", range(4), k=2))


def test_slice_of_a_leading_dim_is_unsupported(g):
    node = g.op(aten.slice.Tensor, g.input("x", 2, 3, 4), 1, 0, 2)
    assert g.value(node) is None


def test_symbolic_slice_is_unsupported():
    def fn(x, n):
        return x[: n.shape[0]]

    graph = make_fx(fn, tracing_mode="symbolic")(torch.randn(6, 4), torch.randn(3)).graph
    (node,) = [n for n in graph.nodes if n.target is aten.slice.Tensor]
    assert isinstance(node.args[3], fx.Node)  # the bound is a sym_size node
    interp = LaneInterpreter(graph)
    interp.run()
    assert node not in interp.values


@covers(aten.select.int)
def test_select(g):
    x, pairs = g.input("x", 2, 4), g.input("p", 3, 2, 4)
    lane = g.op(aten.select.int, x, -1, 3)
    half = g.op(aten.select.int, pairs, -2, 1)
    check(g.value(lane), (2,), 0, lanes_of("x", [3]))
    check(g.value(half), (3, 4), 1, lanes_of("p", range(4, 8), k=2))


def test_select_of_a_leading_dim_is_unsupported(g):
    node = g.op(aten.select.int, g.input("x", 2, 3, 4), 1, 0)
    assert g.value(node) is None


def _check_list(values, shapes, k, entries) -> None:
    assert isinstance(values, list) and len(values) == len(shapes) == len(entries)
    for value, shape, want in zip(values, shapes, entries, strict=True):
        check(value, shape, k, want)


@covers(aten.split.Tensor)
def test_split(g):
    node = g.op(aten.split.Tensor, g.input("x", 2, 8), 3, -1)
    _check_list(g.value(node), [(2, 3), (2, 3), (2, 2)], 1,
                [lanes_of("x", [0, 1, 2]), lanes_of("x", [3, 4, 5]), lanes_of("x", [6, 7])])


@covers(aten.split_with_sizes.default)
def test_split_with_sizes(g):
    node = g.op(aten.split_with_sizes.default, g.input("x", 2, 4), [1, 3], -1)
    _check_list(g.value(node), [(2, 1), (2, 3)], 1, [lanes_of("x", [0]), lanes_of("x", [1, 2, 3])])


@covers(aten.unbind.int)
def test_unbind(g):
    pairs = g.op(aten.unbind.int, g.input("p", 3, 2, 4), -2)
    lanes_ = g.op(aten.unbind.int, g.input("x", 2, 4), -1)
    _check_list(g.value(pairs), [(3, 4), (3, 4)], 1,
                [lanes_of("p", range(4), k=2), lanes_of("p", range(4, 8), k=2)])
    _check_list(g.value(lanes_), [(2,)] * 4, 0, [lanes_of("x", [f]) for f in range(4)])


@covers(operator.getitem)
def test_getitem(g):
    x = g.input("x", 2, 4)
    second = g.op(operator.getitem, g.op(aten.split.Tensor, x, 2, -1), 1)
    # a split along a leading dim of size 3 has no value: neither have its items
    opaque = g.op(operator.getitem, g.op(aten.split.Tensor, g.input("x3", 2, 3, 4), 1, 1), 0)
    check(g.value(second), (2, 2), 1, lanes_of("x", [2, 3]))
    assert g.value(opaque) is None


@covers(aten.index.Tensor)
def test_index_by_a_constant_lane_permutation(g):
    """torch.roll(x, 2, -1) as the post-grad graph spells it: x indexed by fmod(iota(4) + 2, 4)."""
    x = g.input("x", 2, 4)
    iota = g.op(prims.iota.default, 4, start=0, step=1, dtype=torch.int64, device=torch.device("cpu"),
                requires_grad=False)
    picks = g.op(aten.fmod.Scalar, g.op(aten.add.Tensor, iota, 2), 4)
    check(g.value(g.op(aten.index.Tensor, x, [None, picks])), (2, 4), 1, lanes_of("x", [2, 3, 0, 1]))


def test_index_by_values_or_on_a_leading_dim_is_unsupported(g):
    x, positions = g.input("x", 2, 4), g.input("positions", 4, dtype=torch.int64)
    iota = g.op(prims.iota.default, 2, start=0, step=1, dtype=torch.int64, device=torch.device("cpu"),
                requires_grad=False)
    assert g.value(g.op(aten.index.Tensor, x, [None, positions])) is None  # a gather: its numbers are data
    assert g.value(g.op(aten.index.Tensor, x, [iota])) is None  # rows, not lanes


@covers(aten.roll.default)
def test_roll(g):
    x = g.input("x", 2, 4)
    check(g.value(g.op(aten.roll.default, x, [1], [-1])), (2, 4), 1, lanes_of("x", [3, 0, 1, 2]))
    assert g.value(g.op(aten.roll.default, x, [1])) is None  # the flattened tensor: rows mix


@covers(aten.cat.default)
def test_cat_rotate_half(g):
    x = g.input("x", 2, 4)
    first = g.op(aten.slice.Tensor, x, -1, 0, 2)
    second = g.op(aten.neg.default, g.op(aten.slice.Tensor, x, -1, 2, 4))
    node = g.op(aten.cat.default, [first, second], -1)
    check(g.value(node), (2, 4), 1, lanes_of("x", [0, 1]) + lanes_of("x", [2, 3], coef=-1.0))


def test_cat_along_a_new_pair_dim(g):
    # stack spelled as unsqueeze + cat: computed halves of [2, 1, 4] give a [2, 2, 4] value with grid (2, 4)
    x, cos = g.input("x", 2, 4), g.input("cos", 4)
    a = g.op(aten.unsqueeze.default, g.op(aten.mul.Tensor, x, cos), -2)
    b = g.op(aten.unsqueeze.default, g.op(aten.add.Tensor, x, cos), -2)
    node = g.op(aten.cat.default, [a, b], -2)
    check(g.value(node), (2, 2, 4), 2, XCOS + [{(atom("x", f),): 1.0, (atom("cos", f),): 1.0} for f in range(4)])


def test_complex_cat_is_unsupported(g):
    z = g.input("z", 2, dtype=torch.complex64)
    assert g.value(g.op(aten.cat.default, [z, z], -1)) is None


@covers(aten.slice_scatter.default)
def test_slice_scatter(g):
    base = g.op(aten.empty.memory_format, [2, 4], dtype=torch.float32, device="cpu")
    node = g.op(aten.slice_scatter.default, base, g.input("y", 2, 2), -1, 0, 4, 2)
    check(g.value(node), (2, 4), 1, [{(atom("y", 0),): 1.0}, None, {(atom("y", 1),): 1.0}, None])


def test_slice_scatter_on_a_leading_dim_is_unsupported(g):
    node = g.op(aten.slice_scatter.default, g.input("x", 2, 3, 4), g.input("y", 2, 1, 4), 1, 0, 1)
    assert g.value(node) is None


@covers(aten.select_scatter.default)
def test_select_scatter(g):
    base = g.op(aten.zeros.default, [3, 2, 4], dtype=torch.float32, device="cpu")
    node = g.op(aten.select_scatter.default, base, g.input("y", 3, 4), -2, 1)
    check(g.value(node), (3, 2, 4), 2, [{}] * 4 + lanes_of("y", range(4)))


# -- complex ---------------------------------------------------------------------------------------

@covers(aten.view_as_complex.default)
def test_view_as_complex(g):
    node = g.op(aten.view_as_complex.default, g.input("y", 3, 2))
    # the leading dim of y joins the grid: y's atoms now have k = 2
    check(g.value(node), (3, 2), 2, lanes_of("y", range(6), k=2), is_complex=True)


@covers(aten.view_as_real.default)
def test_view_as_real(g):
    node = g.op(aten.view_as_real.default, g.input("z", 2, dtype=torch.complex64))
    check(g.value(node), (2, 2), 2, lanes_of("z", range(4), k=2, as_real=True))


@covers(aten._conj.default, aten.conj.default, aten.conj_physical.default)
def test_conj(g):
    z = g.input("z", 2, dtype=torch.complex64)
    want = [{(atom("z", f, 2, True),): -1.0 if f % 2 else 1.0} for f in range(4)]
    for target in (aten._conj.default, aten.conj.default, aten.conj_physical.default):
        check(g.value(g.op(target, z)), (2, 2), 2, want, is_complex=True)


def test_conj_of_a_real_tensor_is_unsupported(g):
    assert g.value(g.op(aten.conj.default, g.input("x", 2, 4))) is None


def test_complex_view_ops_are_unsupported(g):
    z = g.input("z", 2, 3, dtype=torch.complex64)
    for node in (g.op(aten.slice.Tensor, z, -1, 0, 2), g.op(aten.unsqueeze.default, z, -1),
                 g.op(aten.permute.default, z, [1, 0]), g.op(aten.expand.default, z, [2, 2, 3]),
                 g.op(aten.rsub.Scalar, z, 1.0)):
        assert g.value(node) is None


# -- the interpreter -------------------------------------------------------------------------------

def test_raw_values_of_structurally_equal_nodes_are_one_source(g):
    cos = g.input("cos", 8)
    first = g.op(aten.slice.Tensor, g.op(aten.sin.default, cos), 0, 0, 4)
    again = g.op(aten.slice.Tensor, g.op(aten.sin.default, cos), 0, 0, 4)  # the same table, rebuilt
    # sin has no rule: both sin nodes are sources, and the second reads the first's atoms
    check(g.value(again), (4,), 1, g.value(first).entries)
    check(g.value(first), (4,), 1, lanes_of(first.args[0].name, range(4)))


def test_promote_and_demote(g):
    x, cos = g.input("x", 2, 3, 4), g.input("cos", 1, 3, 4)
    node = g.op(aten.mul.Tensor, x, cos)
    value = g.value(node)
    interp = g.interp
    promoted = interp.promote(value, 2)  # the dim of size 3 joins the grid
    check(promoted, (2, 3, 4), 2, [{(atom("cos", f, 2), atom("x", f, 2)): 1.0} for f in range(12)])
    check(lanes.demote(interp, promoted), (2, 3, 4), 1, value.entries)
    # a block that is not the first one shifted along the absorbed dim: no demotion
    shuffled = LaneValue(promoted.shape, 2, promoted.entries[4:8] + promoted.entries[:4] + promoted.entries[8:])
    assert lanes.demote(interp, shuffled) is None
    assert lanes.demote(interp, g.value(node)) is None  # k = 1: nothing to demote


def test_grid_helpers():
    assert lanes.row_major_strides((2, 3, 4)) == [12, 4, 1]
    assert lanes.row_major_strides(()) == []
    assert lanes.unravel(7, (2, 4)) == [1, 3]
    assert lanes.unravel(23, (2, 3, 4)) == [1, 2, 3]
    assert list(lanes.grid_indices((2, 2))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(lanes.grid_indices(())) == [()]
    for flat, index in enumerate(lanes.grid_indices((2, 3, 4))):
        assert lanes.unravel(flat, (2, 3, 4)) == list(index)
        assert sum(i * s for i, s in zip(index, lanes.row_major_strides((2, 3, 4)), strict=True)) == flat


def test_fx_node_and_size_helpers(g):
    x = g.input("x", 2, 4)
    assert fx_nodes.meta(x) is x.meta["val"]
    assert fx_nodes.meta(3) is None
    assert fx_sizes.as_int(5) == 5
    assert fx_sizes.same_dim(4, 4) and not fx_sizes.same_dim(4, 5)
    assert fx_sizes.concrete_ints((2, 4)) == [2, 4]
    assert fx_sizes.norm_dim(-1, 3) == 2 and fx_sizes.norm_dim(1, 3) == 1
    with pytest.raises(lanes.Unsupported):
        lanes.lane_dims([None])


def test_fx_sizes_symbolic():
    graph = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(6, 4)).graph
    s0, s1 = next(iter(graph.nodes)).meta["val"].shape
    assert fx_sizes.as_int(s0) is None
    assert fx_sizes.same_dim(s0, s0) and not fx_sizes.same_dim(s0, s1)
    with pytest.raises(fx_sizes.SymbolicSizeError):
        fx_sizes.concrete_ints((s0, 4))
    assert isinstance(fx_sizes.SymbolicSizeError("x"), ValueError)
    assert fx_sizes.as_int(s1, specialize=True) == 4  # fixed at its hint
