"""Training (issue 13): the pass on the forward AND the backward graph that AOTAutograd produces.

Real tiny models from the zoo (tests/zoo/entries.py, no downloads) in train mode, compiled with real Inductor
(C++ code generation), once plainly and once with the pass, each run forward + backward on a sum-of-squares
loss against a random target, then two SGD steps. Checked per model:
- fused sites in both graphs, counted from the model source: q and k of every attention layer in the forward,
  the gradients of q and k (the conjugate rotation) in the backward, each pair in one `rotary_qk`; the report
  says which graph, and an independent probe after the pass sees the fused nodes in the graph that Inductor
  compiled while `loss.backward()` ran (AOTAutograd compiles the backward lazily);
- parameter gradients against an fp64 eager run of the same weights: the numerics contract, error with the
  pass <= plain torch.compile's error + eps(dtype), and no further from eager (same dtype) than plain compile;
- two optimizer steps: the update agrees with plain compile's and meets the same contract;
- bytes saved for backward (saved_tensors_hooks around the compiled forward) are not more than plain compile's.
Plus a module whose RoPE tables come from a learned nn.Parameter: its table gradient is checked the same way.

Every model compiles once per variant (functools.cache over its tests): about 100 s on 2 cores with a warm
Inductor code cache, about twice that with a cold one (C++ compilation).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import rope_fusion
from tests.helpers.numerics import rel_err
from tests.zoo.entries import by_name
from tests.zoo.harness import InOrder

QK = "rope_fusion.rotary_qk.default"
# the pass's name for a training forward graph: torch that tells a post-grad pass whether a graph is for
# inference names it "forward"; torch 2.11 does not tell, and the report then says "forward or inference"
FORWARD = "forward" if hasattr(torch._inductor.custom_graph_pass, "CustomInferenceAwareGraphPass") \
    else "forward or inference"


@dataclasses.dataclass(frozen=True)
class Case:
    entry: str  # tests/zoo/entries.py name (its sites/kernels/qk are counted from the model source)
    dtype: str
    style: str  # "neox" or "interleaved"
    rotary_dim: int
    head_dim: int

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.dtype}"


CASES = [
    # transformers NeoX, GQA (4 q heads, 2 kv heads), 2 layers (about 19 s on 2 cores: with -m slow)
    pytest.param(Case("llama", "float32", "neox", 16, 16), marks=pytest.mark.slow),
    # bf16 runs for Wan below; Llama in bf16 too with ROPE_TRAINING_ALL=1 (it adds 10-25 s to this file)
    pytest.param(Case("llama", "bfloat16", "neox", 16, 16), marks=pytest.mark.skipif(
        os.environ.get("ROPE_TRAINING_ALL") != "1", reason="set ROPE_TRAINING_ALL=1")),
    Case("gptj", "float32", "interleaved", 8, 16),  # rotate_every_two on k_rot/q_rot, R = 8 of 16
    # the longest training cases (36-71 s for the first test on 2 cores) run with -m slow, as CI runs them after the
    # default run; GPT-J's partial interleaved rotary stays in it
    pytest.param(Case("gpt_neox", "float32", "neox", 4, 16), marks=pytest.mark.slow),  # partial: R = 4 of 16, cat
    # diffusers apply_rotary_emb use_real, 1 double + 1 single block
    pytest.param(Case("flux", "float32", "interleaved", 16, 16), marks=pytest.mark.slow),
    # a rotation of the image rows only (`query[:, :, text:] = rope(...)`): its backward pads the rotation's gradient
    # with zero rows; 2 blocks, and a time embedding of 2 features whose linear layers are no 2x2 pair matrices
    # (about 95 s on 2 cores: with -m slow)
    pytest.param(Case("cogvideox", "float32", "interleaved", 16, 16), marks=pytest.mark.slow),
    pytest.param(Case("wan", "bfloat16", "interleaved", 12, 12), marks=pytest.mark.slow),  # strided slices, 2 blocks
]


def _id(case) -> str:
    return case.id


class Probe(CustomGraphPass):
    """Runs after the pass on every post-grad graph: the phase in which Inductor compiled it ("forward" while the
    compiled model runs, "backward" while `loss.backward()` runs) and the rope_fusion nodes left in it."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.graphs: list[tuple[str, collections.Counter]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        ops = collections.Counter(str(n.target) for n in graph.nodes
                                  if n.op == "call_function" and str(n.target).startswith("rope_fusion."))
        self.graphs.append((self.phase, ops))

    def uuid(self):
        return None


def _out(o) -> torch.Tensor:
    if isinstance(o, torch.Tensor):
        return o
    if hasattr(o, "last_hidden_state"):
        return o.last_hidden_state
    if hasattr(o, "sample"):
        return o.sample
    return o[0]


def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _flat(model: nn.Module, grads: bool) -> torch.Tensor:
    ts = [(p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach() for p in model.parameters()]
    return torch.cat([t.double().flatten() for t in ts])


def _step(fn, model, inputs, target, probe=None, saved=None) -> None:
    """zero_grad, forward, sum-of-squares loss (fp64), backward. `saved` collects {storage ptr: bytes} of the
    tensors that autograd saves for backward during the forward."""
    model.zero_grad(set_to_none=True)
    if saved is None:
        out = _out(fn(**inputs))
    else:
        def pack(t):
            s = t.untyped_storage()
            saved[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _out(fn(**inputs))
    loss = ((out.double() - target) ** 2).sum()
    if probe is not None:
        probe.phase = "backward"
    loss.backward()
    if probe is not None:
        probe.phase = "forward"


@dataclasses.dataclass
class Run:
    grad: torch.Tensor  # all parameter gradients, flattened, fp64
    delta: torch.Tensor  # parameters after two SGD steps minus before
    params: torch.Tensor  # parameters after two SGD steps
    saved_bytes: int = 0
    no_grad: tuple = ()  # names of parameters without a gradient
    report: object = None
    probe: Probe | None = None


def train(base: nn.Module, inputs: dict, target: torch.Tensor, dtype: torch.dtype, variant: str, lr: float | None):
    """One variant ("fp64", "eager", "plain", "pass") of the same weights: gradients of the first step, bytes
    saved for backward, and the update of two SGD steps (momentum 0.9; lr None: chosen from this run's grads)."""
    model = copy.deepcopy(base).to(dtype).train()
    x = _cast(inputs, dtype)
    fn, p, probe = model, None, None
    if variant == "plain":
        fn = torch.compile(model)
    elif variant == "pass":
        p, probe = rope_fusion.RopeFusionPass(), Probe()
        fn = torch.compile(model, options={"post_grad_custom_post_pass": InOrder([p, probe])})
    p0 = _flat(model, grads=False)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _step(fn, model, x, target, probe)
        grad = _flat(model, grads=True)
        no_grad = tuple(n for n, q in model.named_parameters() if q.grad is None)
        lr = lr or 1e-2 * p0.norm().item() / grad.norm().item()  # a first update of ~1% of the weights
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        saved: dict = {}
        _step(fn, model, x, target, saved=saved)  # the same weights again: the same gradients, now measured
        opt.step()
        _step(fn, model, x, target)
        opt.step()
    params = _flat(model, grads=False)
    return Run(grad, params - p0, params, sum(saved.values()), no_grad, p and p.report, probe), lr


@functools.cache
def run_case(case: Case) -> dict:
    """Every variant of one model, computed once for all the tests of that case."""
    dtype = getattr(torch, case.dtype)
    torch.manual_seed(0)
    base, inputs = by_name(case.entry).build()
    base = base.to(dtype)  # the fp64 reference starts from the same (rounded) weights and inputs
    inputs = _cast(inputs, dtype)
    with torch.no_grad():
        shape = _out(base.eval()(**inputs)).shape
    target = torch.randn(shape, dtype=torch.float64)
    runs: dict = {}
    runs["fp64"], lr = train(base, inputs, target, torch.float64, "fp64", None)
    for variant in ("eager", "plain", "pass"):
        runs[variant], _ = train(base, inputs, target, dtype, variant, lr)
    return runs


def _errs(runs: dict, field: str) -> dict:
    ref = getattr(runs["fp64"], field)
    return {v: rel_err(getattr(runs[v], field), ref) for v in ("eager", "plain", "pass")}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fuses_forward_and_backward(case):
    entry = by_name(case.entry)
    rep = run_case(case)["pass"].report
    assert not rep.errors and not rep.misses, rep.table()
    assert [(g.kind, g.outcome, g.sites, g.kernels) for g in rep.graph_records] == [
        (FORWARD, "fused", entry.sites, entry.kernels), ("backward", "fused", entry.sites, entry.kernels)
    ], rep.table()
    for kind, conjugate in ((FORWARD, False), ("backward", True)):
        sites = [s for s in rep.sites if s.graph_kind == kind]
        assert len(sites) == entry.sites, rep.table()
        for s in sites:
            assert (s.style, s.rotary_dim, s.head_dim, s.conjugate) == (
                case.style, case.rotary_dim, case.head_dim, conjugate), rep.table()
            # x may be the fp32 value that the model casts to its dtype before rotating (Wan's RMSNorm output)
            assert s.out_dtype == case.dtype and s.x_dtype in (case.dtype, "float32"), rep.table()
        kernels = [k for k in rep.kernels if rep.graph_records[k.graph].kind == kind]
        assert len(kernels) == entry.kernels and sum(k.op == "rope_fusion.rotary_qk" for k in kernels) == entry.qk
        for k in kernels:  # q and k (forward), dq and dk (backward) of one layer in one launch
            assert len(k.sites) == 2 and all(rep.sites[i].graph_kind == kind for i in k.sites), rep.table()
            a, b = (rep.sites[i] for i in k.sites)
            assert {a.role, b.role} in ({"q", "k"}, {"x"}), rep.table()
            assert len(a.shape) == len(b.shape) and int(a.shape[-1]) == int(b.shape[-1]) == case.head_dim
    # independently of the report: the graphs Inductor compiled during forward and during loss.backward()
    probe = run_case(case)["pass"].probe
    assert [ops for _, ops in probe.graphs] == [collections.Counter({QK: entry.qk})] * 2
    if FORWARD == "forward":  # torch 2.11 may compile the backward graph during the forward call already
        assert [phase for phase, _ in probe.graphs] == ["forward", "backward"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gradients_meet_the_numerics_contract(case):
    runs = run_case(case)
    eps = torch.finfo(getattr(torch, case.dtype)).eps
    err = _errs(runs, "grad")
    assert runs["pass"].no_grad == runs["plain"].no_grad == runs["fp64"].no_grad
    assert runs["fp64"].grad.norm() > 0
    assert err["pass"] <= err["plain"] + eps, err
    # against eager in the same dtype: the pass moves the gradients no further from eager than compile does
    to_eager = {v: rel_err(runs[v].grad, runs["eager"].grad) for v in ("plain", "pass")}
    assert to_eager["pass"] <= to_eager["plain"] + eps, (err, to_eager)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_two_optimizer_steps_agree_with_plain_compile(case):
    runs = run_case(case)
    eps = torch.finfo(getattr(torch, case.dtype)).eps
    err = _errs(runs, "delta")
    assert err["pass"] <= err["plain"] + eps, err
    # the weights after two steps: within one rounding of the dtype of plain compile's
    assert rel_err(runs["pass"].params, runs["plain"].params) <= eps


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_saved_for_backward_not_more_than_plain_compile(case):
    runs = run_case(case)
    assert 0 < runs["pass"].saved_bytes <= runs["plain"].saved_bytes, (runs["pass"].saved_bytes,
                                                                       runs["plain"].saved_bytes)


# ------------------------------------------------------------------------------------------ learned frequencies
def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class LearnedRope(nn.Module):
    """Causal self-attention whose RoPE frequencies are an nn.Parameter: tables cos/sin(pos * inv_freq)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.inv_freq = nn.Parameter(1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        pos = torch.arange(s, device=x.device, dtype=self.inv_freq.dtype)
        freqs = pos[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


def _runs_against_fp64(base: nn.Module, x: dict, target: torch.Tensor) -> dict:
    """fp64 reference, then eager, plain compile and the pass in fp32, one training run each."""
    runs = {}
    runs["fp64"], lr = train(base, x, target, torch.float64, "fp64", None)
    for variant in ("eager", "plain", "pass"):
        runs[variant], _ = train(base, x, target, torch.float32, variant, lr)
    return runs


def _fused_both_ways(runs: dict):
    """The pass's report of the training runs: no errors, and q and k in one launch in the forward and in the
    backward graph."""
    rep = runs["pass"].report
    assert not rep.errors, rep.table()
    assert [(g.kind, g.sites, g.kernels) for g in rep.graph_records] == [(FORWARD, 2, 1), ("backward", 2, 1)], \
        rep.table()
    return rep


def _as_accurate_as_plain(runs: dict) -> None:
    """Gradients and the optimizer steps of the pass within one fp32 eps of plain compile's errors."""
    eps = torch.finfo(torch.float32).eps
    for field in ("grad", "delta"):
        err = _errs(runs, field)
        assert err["pass"] <= err["plain"] + eps, (field, err)


def test_learned_frequencies():
    """The rotations of q, k and of their gradients fuse; the gradient of the tables (and so of inv_freq) stays
    with Inductor (the fused op only rotates), and is as accurate as plain compile's. (The backward graph also
    lists one near miss: the chain rule through cos/sin, d(emb) = dS*cos - dC*sin, whose halves are added (the
    backward of cat(freqs, freqs)) and multiplied by the positions, looks like a NeoX pairing but is no rotation;
    leaving it alone is right, and whether it is listed is not asserted.)"""
    torch.manual_seed(0)
    base, x = LearnedRope(), {"x": torch.randn(2, 32, 64)}
    target = torch.randn(2, 32, 64, dtype=torch.float64)
    runs = _runs_against_fp64(base, x, target)
    rep = _fused_both_ways(runs)
    assert [(k.op, rep.graph_records[k.graph].kind) for k in rep.kernels] == [
        ("rope_fusion.rotary_qk", FORWARD), ("rope_fusion.rotary_qk", "backward")]
    assert [s.conjugate for s in rep.sites] == [False, False, True, True]
    eps = torch.finfo(torch.float32).eps
    names = [name for name, _ in base.named_parameters()]
    sizes = [q.numel() for q in base.parameters()]
    lo = sum(sizes[:names.index("inv_freq")])
    table_grad = {v: r.grad[lo:lo + base.inv_freq.numel()] for v, r in runs.items()}
    assert table_grad["fp64"].abs().min() > 0
    err = {v: rel_err(table_grad[v], table_grad["fp64"]) for v in ("eager", "plain", "pass")}
    assert err["pass"] <= err["plain"] + eps, err
    _as_accurate_as_plain(runs)


class AxisBlocksRope(nn.Module):
    """Attention whose head dim is rotated per position axis (Gemma 4 vision, Allegro: split into blocks,
    rotate_half each with its own tables, cat): one `rotary_blocks` op per tensor in both graphs."""

    def __init__(self, dim: int = 64, heads: int = 2, blocks: int = 2) -> None:
        super().__init__()
        self.heads, self.head_dim, self.blocks = heads, dim // heads, blocks
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        w = self.head_dim // self.blocks
        pos = torch.arange(s, device=x.device, dtype=x.dtype)

        def rope(t):
            out = []
            for i, part in enumerate(t.split(w, -1)):  # block i rotates by position * (i + 1)
                freqs = (pos * (i + 1))[:, None] / 10000 ** (torch.arange(0, w, 2, device=x.device) / w)
                emb = torch.cat((freqs, freqs), -1)
                out.append(part * emb.cos() + rotate_half(part) * emb.sin())
            return torch.cat(out, -1)
        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


def test_head_dim_in_axis_blocks_fuses_both_ways():
    """The backward of a rotation within blocks reads the partner lanes' sin within each block (the table
    pieces swapped block by block): q and k in one `rotary_blocks` launch in the forward and in the backward
    graph, gradients and two optimizer steps as accurate as plain compile's."""
    torch.manual_seed(1)
    base, x = AxisBlocksRope(), {"x": torch.randn(2, 16, 64)}
    target = torch.randn(2, 16, 64, dtype=torch.float64)
    runs = _runs_against_fp64(base, x, target)
    rep = _fused_both_ways(runs)
    assert {s.rotary_blocks for s in rep.sites} == {2}, rep.table()
    _as_accurate_as_plain(runs)
