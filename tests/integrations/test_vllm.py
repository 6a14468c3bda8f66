"""`rope_fusion.vllm_pass` against the real vLLM 0.33 classes (installed with `pip install --no-deps vllm`).

What vLLM does with a post-grad pass, and what is checked here:
- `CompilationConfig.__post_init__` resolves `inductor_passes={"post_grad_custom_post_pass": "rope_fusion.vllm_pass"}`
  as `__import__("rope_fusion").__dict__["vllm_pass"]` and keeps it only if it `isinstance(InductorPass)`
  (else it wraps it in a CallableInductorPass). The CLI form `-cc.inductor_passes.post_grad_custom_post_pass=...`
  reaches the same code through vLLM's FlexibleArgumentParser and pydantic.
- `VllmBackend.configure_post_pass` asserts `isinstance(p, InductorPass)` for the Python dict form and adds
  it to its `PostGradPassManager`, whose `uuid()` JSON-encodes the uuids of its passes.
- The config is deep-copied, pickled and hashed (`normalize_value` calls `uuid()`).
- The pass fuses vLLM's native RoPE (`RotaryEmbedding.forward_native`), written below from its description.

Tests that need more of vLLM than its `inductor_pass` module (vllm.config needs cbor2, psutil, pyzmq,
aiohttp, openai-harmony, ...) skip when those are missing.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import rope_fusion
from benchmarks.spellings import vllm_apply_rotary  # vLLM's native rotation, one copy
from rope_fusion.integrations import vllm as integ
from rope_fusion.ops.reference import rotary_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def InductorPass():
    mod = pytest.importorskip("vllm.compilation.passes.inductor_pass")
    return mod.InductorPass


def _import_or_skip(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception as e:  # missing pure-Python deps of vLLM: ImportError, or anything a partial install raises
        pytest.skip(f"{name} is not importable here: {type(e).__name__}: {e}")


# -- the class and its identity ----------------------------------------------------------------------------

def test_vllm_pass_is_a_vllm_inductor_pass(InductorPass):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    p = rope_fusion.vllm_pass
    assert integ.vllm_inductor_pass() is InductorPass
    assert isinstance(p, InductorPass) and isinstance(p, rope_fusion.RopeFusionPass)
    assert isinstance(p, CustomGraphPass)
    assert rope_fusion.__dict__["vllm_pass"] is p  # what vLLM's resolver reads
    assert p.is_applicable_for_range(None) is True
    # vLLM's helpers still work on it (PostGradPassManager.uuid uses hash_dict over the pass uuids)
    assert isinstance(p.uuid(), str)
    assert len(InductorPass.hash_dict({"passes": [p.uuid()]})) == 64
    assert p.hash_source("x") == InductorPass.hash_source("x")


def test_string_resolution_as_vllm_does_it(InductorPass):
    # vllm/config/compilation.py, CompilationConfig.__post_init__, for a str value of inductor_passes:
    v = "rope_fusion.vllm_pass"
    names = v.split(".")
    module = ".".join(names[:-1])
    func_name = names[-1]
    func = __import__(module).__dict__[func_name]
    assert func is rope_fusion.vllm_pass
    assert isinstance(func, InductorPass)  # so vLLM keeps it as is (no CallableInductorPass wrapper)


def test_compilation_config_resolves_the_string(InductorPass):
    cfg = _import_or_skip("vllm.config")
    cc = cfg.CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "rope_fusion.vllm_pass"})
    assert cc.inductor_compile_config["post_grad_custom_post_pass"] is rope_fusion.vllm_pass


def test_cli_string_builds_a_compilation_config(InductorPass):
    """`-cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass`, parsed as `vllm serve` does."""
    cfg = _import_or_skip("vllm.config")
    argparse_utils = _import_or_skip("vllm.utils.argparse_utils")
    from pydantic import TypeAdapter

    argv = ["-cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass"]
    try:  # the whole EngineArgs parser when vLLM's serving deps are installed
        from vllm.engine.arg_utils import EngineArgs
        parser = EngineArgs.add_cli_args(argparse_utils.FlexibleArgumentParser())
        argv = ["--model", "m"] + argv
    except Exception:  # else the same -cc argument as EngineArgs declares it (arg_utils.parse_dataclass)
        parser = argparse_utils.FlexibleArgumentParser()
        parser.add_argument("--compilation-config", "-cc", default=None,
                            type=lambda val: TypeAdapter(cfg.CompilationConfig).validate_json(val))
    args = parser.parse_args(argv)
    cc = args.compilation_config
    assert isinstance(cc, cfg.CompilationConfig)
    assert cc.inductor_passes == {"post_grad_custom_post_pass": "rope_fusion.vllm_pass"}
    assert cc.inductor_compile_config["post_grad_custom_post_pass"] is rope_fusion.vllm_pass


def test_python_dict_form_hashes_copies_and_reaches_the_pass_manager(InductorPass):
    cfg = _import_or_skip("vllm.config")
    p = rope_fusion.vllm_pass
    cc = cfg.CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": p})
    other = cfg.CompilationConfig(
        inductor_compile_config={"post_grad_custom_post_pass": integ.pass_class(InductorPass)(fuse_qk=False)})
    assert cc.compute_hash() != other.compute_hash()  # the hash sees the pass's uuid (options included)
    again = cfg.CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": copy.deepcopy(p)})
    assert cc.compute_hash() == again.compute_hash()
    cc2 = copy.deepcopy(cc)
    p2 = cc2.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(p2, InductorPass) and p2.uuid() == p.uuid()
    try:
        from vllm.compilation.passes.pass_manager import PostGradPassManager
    except Exception as e:
        pytest.skip(f"vllm's pass manager is not importable here: {type(e).__name__}: {e}")
    pm = PostGradPassManager()
    pm.add(p)  # asserts isinstance(pass_, InductorPass)
    assert pm.passes == [p]


def _in_subprocess(code: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED="123")
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_uuid_deterministic_across_processes(InductorPass):
    theirs = _in_subprocess(
        "import json, rope_fusion; from rope_fusion.integrations.vllm import VllmRopeFusionPass as V; "
        "print(json.dumps([rope_fusion.vllm_pass.uuid(), V(backend='inductor').uuid(), V(fuse_qk=False).uuid()]))")
    V = integ.VllmRopeFusionPass
    ours = [rope_fusion.vllm_pass.uuid(), V(backend="inductor").uuid(), V(fuse_qk=False).uuid()]
    assert theirs == ours
    assert len(set(ours)) == 3  # the options are covered


def test_import_has_no_side_effects():
    """`import rope_fusion` imports neither vLLM nor depyf and leaves Inductor's settings alone."""
    got = _in_subprocess(
        "import json, os, sys, rope_fusion, torch._inductor.config as c; "
        "print(json.dumps([sorted(m for m in ('vllm', 'depyf') if m in sys.modules), "
        "os.environ.get('TORCHINDUCTOR_COMPILE_THREADS'), c.post_grad_custom_post_pass is None]))")
    assert got == [[], None, True]


@pytest.mark.parametrize("order", ["rope_fusion first", "vllm first"])
def test_vllm_pass_is_vllms_type_whichever_is_imported_first(InductorPass, order):
    """vLLM's string form reads `__import__("rope_fusion").__dict__["vllm_pass"]` once vLLM is imported."""
    imports = ["import rope_fusion", "import vllm.compilation.passes.inductor_pass as ip"]
    if order == "vllm first":
        imports.reverse()
    got = _in_subprocess(
        "; ".join(imports) + "; import json; p = __import__('rope_fusion').__dict__['vllm_pass']; "
        "print(json.dumps([isinstance(p, ip.InductorPass), isinstance(p, rope_fusion.RopeFusionPass), "
        "p is rope_fusion.vllm_pass, p.uuid() == rope_fusion.RopeFusionPass().uuid()]))")
    assert got == [True, True, True, True]


def test_deepcopy_and_pickle(InductorPass):
    cls = integ.pass_class(InductorPass)
    p = cls(backend="inductor", fuse_qk=False)
    p.report.graphs = 3
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p)), copy.copy(p)):
        assert type(q) is cls and isinstance(q, InductorPass)
        assert (q.backend, q.fuse_qk, q.uuid()) == ("inductor", False, p.uuid())
        assert q.report is not p.report and q.report.graphs == 0
    q = pickle.loads(pickle.dumps(rope_fusion.vllm_pass))
    assert q.uuid() == rope_fusion.vllm_pass.uuid() and isinstance(q, InductorPass)


def test_without_vllm_the_class_is_a_custom_graph_pass():
    """Before vLLM is imported: a torch CustomGraphPass with the same uuid and the same API."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    cls = integ.pass_class(None)
    p = cls()
    assert isinstance(p, CustomGraphPass) and isinstance(p, rope_fusion.RopeFusionPass)
    assert not any(k.__module__.startswith("vllm") for k in type(p).__mro__)
    assert p.is_applicable_for_range(None) is True
    assert p.uuid() == rope_fusion.vllm_pass.uuid()
    q = copy.deepcopy(p)  # rebuilt on vLLM's InductorPass when this process has imported vLLM
    assert isinstance(q, cls) and q.uuid() == p.uuid()


# -- the pass on vLLM's native RoPE ------------------------------------------------------------------------

class NativeRotaryEmbedding(torch.nn.Module):
    """vLLM's RotaryEmbedding.forward_native: positions index a [max_pos, R] cos|sin cache."""

    def __init__(self, head_size, rotary_dim, max_position, base, is_neox_style, dtype):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        freqs = torch.einsum("i,j->ij", torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key):
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)

        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim:]
        query_rot = vllm_apply_rotary(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)

        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim:]
        key_rot = vllm_apply_rotary(key_rot, cos, sin, self.is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        return query, key


@pytest.mark.parametrize("neox,rotary_dim", [(True, 64), (False, 64), (True, 32), (False, 48)],
                         ids=["neox", "gptj", "neox-partial", "gptj-partial"])
def test_fuses_vllm_native_rope(InductorPass, neox, rotary_dim):
    head, hq, hk, tokens = 64, 4, 2, 7
    torch.manual_seed(0)
    rope = NativeRotaryEmbedding(head, rotary_dim, 32, 10000.0, neox, torch.float32)
    positions = torch.randint(0, 32, (tokens,))
    q, k = torch.randn(tokens, hq * head), torch.randn(tokens, hk * head)
    p = copy.deepcopy(rope_fusion.vllm_pass)  # what vLLM runs is a copy of the configured pass
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(rope, fullgraph=True, options={"post_grad_custom_post_pass": p})
        qo, ko = compiled(positions, q, k)
    assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
    kern = p.report.kernels[0]
    assert kern.op == "rope_fusion.rotary_qk", p.report.table()
    for s in p.report.sites:
        assert s.style == ("neox" if neox else "interleaved") and s.rotary_dim == rotary_dim
        assert s.head_dim == head
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    kw = dict(interleaved=not neox, rotary_dim=rotary_dim, full_tables=False)
    for out, x, h in ((qo, q, hq), (ko, k, hk)):
        ref = rotary_reference(x.view(tokens, h, head), cos[:, None], sin[:, None], **kw).reshape(x.shape)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    eq, ek = rope(positions, q, k)
    torch.testing.assert_close(qo, eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, ek, rtol=1e-5, atol=1e-5)


# -- what a launch costs under vLLM ------------------------------------------------------------------------

def _decode_graph():
    """A NeoX q/k rotation at a decode size (16 tokens, 32/8 heads x 128) traced on fake CUDA tensors: no GPU
    is needed, the pass decides from shapes and dtypes. (vLLM's gathered cache is not traced here: fake
    CUDA tensors on a CPU-only torch cannot index.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def rotate(q, k, cos, sin):
        def rot(x):
            a, b = x.chunk(2, dim=-1)
            return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        return rot(q), rot(k)
    with FakeTensorMode():
        args = (torch.empty(16, 32, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(16, 8, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(16, 1, 64, dtype=torch.bfloat16, device="cuda"),
                torch.empty(16, 1, 64, dtype=torch.bfloat16, device="cuda"))
    return make_fx(rotate, tracing_mode="fake")(*args).graph


@pytest.mark.parametrize("mode,expected", [("FULL_AND_PIECEWISE", ["triton"]), ("PIECEWISE", ["triton"]),
                                           ("NONE", [])])
def test_vllm_cudagraph_mode_decides_what_a_launch_costs(InductorPass, mode, expected):
    """vLLM records compiled graphs in CUDA graphs itself, so its cudagraph mode, not Inductor's config, says
    whether a decode site's launch costs the GPU a microsecond (one launch for q and k wins: the kernel) or the
    host its launch time (plain compile's kernels are cheaper to launch: left, and reported so)."""
    cfg = _import_or_skip("vllm.config")
    from vllm.config.compilation import CUDAGraphMode

    vllm_config = cfg.VllmConfig(device_config=cfg.DeviceConfig(device="cpu"))
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    p = copy.deepcopy(rope_fusion.vllm_pass)
    graph = _decode_graph()
    with cfg.set_current_vllm_config(vllm_config):
        assert integ.vllm_cudagraph_mode() == mode
        p(graph)
    assert [k.backend for k in p.report.kernels] == expected, p.report.table()
    if not expected:
        assert len(p.report.misses) == 2 and all("host time (a host-bound graph" in m.reason
                                                 for m in p.report.misses), p.report.table()
    forced = integ.pass_class(InductorPass)(cuda_graphs=True)  # the option overrides vLLM's mode
    with cfg.set_current_vllm_config(vllm_config):
        forced(_decode_graph())
    assert [k.backend for k in forced.report.kernels] == ["triton"], forced.report.table()
