"""vllm-omni's rotary layer compiled with rope_fusion: two flash-attn kernel launches (q, k) become one fused op.

vllm-omni's shared RotaryEmbedding layer (vllm_omni/diffusion/layers/rope.py, `forward_cuda`) rotates q and k by two
calls of flash-attn's Triton `rotary_kernel`, through vLLM's copy `vllm.vllm_flash_attn` (`apply_rotary_emb(x, cos,
sin, interleaved=not is_neox_style)`, tables cos/sin of half width [S, D/2]), and vllm-omni compiles its transformer
blocks with torch.compile. This script writes such a block (q/k/v projections, the layer's two kernel calls,
interleaved, SDPA, output projection), calls `rope_fusion.install()` and compiles it: the pass replaces the two
launches by one `rope_fusion.rotary_qk`, and the report says so (sites, kernels, origin "flash_attn.rotary_kernel").

Needs, beyond `pip install -e ".[test]"`: flash-attn's Triton rotary kernel, e.g. `pip install --no-deps vllm==0.33.0`
(only the kernel file is read, so no GPU and none of vLLM's dependencies), and triton (in the test extra). Without them
it exits 1 with one line that says so.

    python examples/vllm_omni_block.py                        # on the CPU (see below), float32
    python examples/vllm_omni_block.py --device cuda          # on a GPU with vLLM or flash-attn, bfloat16
    python examples/vllm_omni_block.py --rotary-file PATH     # the kernel file itself, e.g. a copy of
                                                              # vllm/vllm_flash_attn/ops/triton/rotary.py

The kernel is `vllm.vllm_flash_attn.ops.triton.rotary.apply_rotary` (the function `apply_rotary_emb` wraps; called
directly, it needs no einops), or flash-attn's `flash_attn.ops.triton.rotary` (`--kernel flash_attn`; `auto` takes
vLLM's and falls back to flash-attn's). Without a CUDA build of vLLM the package `vllm.vllm_flash_attn` cannot be
imported; the kernel module is then loaded from its file under its real module name, which is what the pass checks.

On the CPU (a CPU torch with triton installed, no GPU) the script uses the tracing recipe of the tests
(tests/passes/test_kernel_sites.py): while compiling, `cpu_triton_tracing()` lets Dynamo trace the Triton launch as it
does on a GPU (triton reported available, the wrapper's CUDA device context a no-op, a driver reporting a CUDA target
for torch's analysis of which arguments the kernel writes). The compile is then real Inductor with CPU code generation,
which cannot generate code for a user Triton kernel: it succeeds only because the pass removed both launches. The
reference is the block run eagerly with the kernel executed by Triton's interpreter. On a GPU everything runs
plainly. The script prints the report and the largest difference to the reference, and exits non-zero when nothing
fused or the difference is more than a few roundings of the dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton 3.9 warns on every process that runs a kernel unless this is set; "1" is the default it would take.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rope_fusion  # noqa: E402

VLLM_ROTARY = "vllm.vllm_flash_attn.ops.triton.rotary"
FLASH_ATTN_ROTARY = "flash_attn.ops.triton.rotary"
KERNELS = {"vllm": (VLLM_ROTARY,), "flash_attn": (FLASH_ATTN_ROTARY,), "auto": (VLLM_ROTARY, FLASH_ATTN_ROTARY)}
# What the script needs beyond the README's install, said in one line when it is missing.
NEEDS = ("examples/vllm_omni_block.py needs flash-attn's Triton rotary kernel: pip install --no-deps vllm==0.33.0 "
         "(only its kernel file is read: no GPU, no vLLM dependencies), or flash-attn, or --rotary-file PATH")
NEEDS_TRITON = "examples/vllm_omni_block.py needs triton (pip install triton, or the checkout's .[test] extra)"


# -- the kernel module -------------------------------------------------------------------------------------------

def load_rotary(kernel: str = "auto", path: str | None = None, try_import: bool | None = None) -> types.ModuleType:
    """flash-attn's rotary kernel module under its real name: imported (`try_import`, default on GPUs, where the
    packages can load), else executed from its file (`path`, or the installed one, found without importing it)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: under it triton.jit builds no JITFunction that Dynamo can trace")
    names = KERNELS[kernel]
    if path:
        return module_from_file(path, names[0])
    if try_import is None:
        try_import = torch.cuda.is_available()
    tried = []
    for name in names:
        if name in sys.modules:
            return sys.modules[name]
        if try_import:
            try:
                return importlib.import_module(name)
            except Exception as e:  # e.g. vllm.vllm_flash_attn without its CUDA extensions
                tried.append(f"import {name}: {type(e).__name__}: {e}")
        file = installed_file(name)
        if file:
            return module_from_file(file, name)
        tried.append(f"{name}: no such file installed")
    raise SystemExit(f"{NEEDS} (tried: {'; '.join(t.replace(chr(10), ' ') for t in tried)})")


def installed_file(name: str) -> str | None:
    """The file of module `name` in the installed packages, found without executing any package's __init__."""
    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        file = os.path.join(root, *rest[:-1], rest[-1] + ".py")
        if os.path.isfile(file):
            return file
    return None


def module_from_file(path: str, name: str) -> types.ModuleType:
    """Execute the file as module `name`, registered in sys.modules (Dynamo looks the kernel's module up there).
    Parent packages that are not loaded yet are stood in for by empty packages (their real directories, so that
    their other modules stay importable): `vllm.vllm_flash_attn`'s own __init__ needs CUDA extensions."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in sys.modules:
            continue
        if i == 1:
            spec = importlib.machinery.PathFinder.find_spec(pkg)
            dirs = list(spec.submodule_search_locations or []) if spec else []
        else:
            parent = sys.modules[".".join(parts[: i - 1])]
            dirs = [os.path.join(d, parts[i - 1]) for d in parent.__path__]
            dirs = [d for d in dirs if os.path.isdir(d)]
        stub = types.ModuleType(pkg)
        stub.__path__ = dirs
        stub.__spec__ = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        stub.__spec__.submodule_search_locations = stub.__path__
        sys.modules[pkg] = stub
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    setattr(sys.modules[".".join(parts[:-1])], parts[-1], mod)
    return mod


# -- tracing and running the kernel on the CPU (tests/passes/test_kernel_sites.py explains each patch) -----------------

class _FakeCudaDriver:
    """Only what torch's TTIR analysis (which kernel arguments are written) asks of the active Triton driver."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def cpu_triton_tracing(ttir: bool = True):
    """Let Dynamo trace a Triton kernel launch on a machine without a GPU, as it does on one (`ttir=False`:
    with no active driver, so torch's TTIR analysis of written arguments is unavailable and it falls back)."""
    import torch.utils._triton as tu
    import triton
    from torch._dynamo.variables import ctx_manager

    drv = triton.runtime.driver
    # Dynamo's CUDADeviceVariable holds its own reference to the index function in newer torch; torch 2.11 calls
    # torch.cuda._get_device_index, which the patch below covers
    dyn = ctx_manager.CUDADeviceVariable
    saved = (tu.has_triton, torch.cuda._get_device_index, getattr(dyn, "_get_device_index_fn", None), drv._active)
    real_index = torch.cuda._get_device_index

    def device_index(device, optional=False, allow_cpu=False):
        i = real_index(device, optional=optional, allow_cpu=allow_cpu)
        return -1 if i is None else i

    tu.has_triton = lambda: True
    torch.cuda._get_device_index = device_index
    if saved[2] is not None:
        dyn._get_device_index_fn = staticmethod(device_index)
    if ttir:
        try:
            _ = drv.active
        except RuntimeError:  # no GPU driver
            drv.set_active(_FakeCudaDriver())
    else:
        drv._active = None
    try:
        yield
    finally:
        tu.has_triton, torch.cuda._get_device_index = saved[0], saved[1]
        if saved[2] is not None:
            dyn._get_device_index_fn = staticmethod(saved[2])
        drv._active = saved[3]


@contextlib.contextmanager
def interpreted(mod: types.ModuleType):
    """Eager calls of the module's wrapper run its kernel in Triton's interpreter (what TRITON_INTERPRET=1 builds)."""
    from triton.runtime.interpreter import InterpretedFunction

    jit = mod.rotary_kernel
    mod.rotary_kernel = InterpretedFunction(jit.fn)
    try:
        with cpu_triton_tracing():
            yield
    finally:
        mod.rotary_kernel = jit


# -- the block ------------------------------------------------------------------------------------------------

def rope_tables(seqlen: int, head_dim: int, device, dtype, theta: float = 10000.0) -> tuple:
    """cos, sin [S, D/2]: one angle per position and pair, as vllm-omni's models hand them to the layer."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.arange(seqlen, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RotaryEmbedding(torch.nn.Module):
    """vllm-omni's RotaryEmbedding.forward_cuda: flash-attn's kernel on x [B, S, H, D] with cos/sin [S, D/2]
    ([B, S, D/2] tables: the first batch's rows)."""

    def __init__(self, rotary, is_neox_style: bool = False):
        super().__init__()
        self.rotary, self.interleaved = rotary, not is_neox_style

    def forward(self, x, cos, sin):
        if cos.dim() == 3:
            cos, sin = cos[0], sin[0]
        return self.rotary.apply_rotary(x, cos, sin, interleaved=self.interleaved)


class Attention(torch.nn.Module):
    """A DiT self-attention block the way vllm-omni writes one: the rotary layer once for q, once for k."""

    def __init__(self, rotary, heads: int, head_dim: int):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v, self.to_out = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.rope = RotaryEmbedding(rotary, is_neox_style=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim) for p in (self.to_q, self.to_k, self.to_v))
        q = self.rope(q, cos, sin)
        k = self.rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.to_out(o.transpose(1, 2).reshape(b, s, -1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: float32 on the CPU, bfloat16 on a GPU")
    ap.add_argument("--kernel", choices=list(KERNELS), default="auto", help="whose copy of the kernel to call")
    ap.add_argument("--rotary-file", default=None, help="load the kernel from this file (under its real module name)")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit(NEEDS_TRITON) from None
    if not cpu and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here (run without --device for the CPU)")
    dtype = getattr(torch, args.dtype or ("float32" if cpu else "bfloat16"))
    rotary = load_rotary(args.kernel, args.rotary_file, try_import=not cpu)
    batch, seqlen, heads, head_dim = (2, 16, 4, 64) if cpu else (1, 4096, 24, 128)

    torch.manual_seed(0)
    block = Attention(rotary, heads, head_dim).to(args.device, dtype).eval()
    x = torch.randn(batch, seqlen, heads * head_dim, device=args.device, dtype=dtype)
    cos, sin = rope_tables(seqlen, head_dim, args.device, dtype)

    p = rope_fusion.install()
    tracing = cpu_triton_tracing() if cpu else contextlib.nullcontext()
    try:
        # a cache hit would skip the pass (and its report) on a second run of this script; the compile caches are
        # turned off one by one (`force_disable_caches` would also turn off Dynamo's profile-guided sizes, and say so)
        with torch.no_grad(), tracing, torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            torch._dynamo.reset()
            fused = torch.compile(block)(x, cos, sin)
        with torch.no_grad(), (interpreted(rotary) if cpu else contextlib.nullcontext()):
            eager = block(x, cos, sin)
    finally:
        rope_fusion.uninstall()

    print(f"vllm-omni style attention block, kernel {rotary.__name__} ({rotary.__file__}), {args.device}, {dtype}")
    print(p.report.table())
    rep = p.report
    print(f"sites: {len(rep.sites)}, origins: {sorted({s.origin for s in rep.sites})}; kernels: "
          + ", ".join(f"{k.op}[{k.backend}] for sites {k.sites}" for k in rep.kernels))
    diff = (fused.float() - eager.float()).abs().max().item()
    scale = eager.float().abs().max().item()
    print(f"max |compiled with the pass - eager (the kernel{' interpreted' if cpu else ''})| = {diff:.3g} "
          f"(max |eager| {scale:.3g})")
    if not any(s.origin == "flash_attn.rotary_kernel" for s in rep.sites):
        print("the flash-attn kernel calls were not fused", file=sys.stderr)
        return 1
    if diff > 8 * torch.finfo(dtype).eps * max(scale, 1.0):
        print("the difference is larger than a few roundings of the dtype", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
