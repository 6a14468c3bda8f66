"""RoPE fusion inside tensor-parallel and sequence-parallel ranks: one real attention block, sharded.

    torchrun --nproc-per-node 2 examples/distributed_attention.py --mode tp
    torchrun --nproc-per-node 2 examples/distributed_attention.py --mode ulysses --model flux --offset symbolic
    torchrun --nproc-per-node 2 examples/distributed_attention.py --mode ring --device cuda --dtype bfloat16

Every rank compiles its share of the block with `rope_fusion.RopeFusionPass()` and prints what fused; rank 0
gathers the output and checks it against one process running the whole block (eager in the same dtype, and
fp64). The process exits non-zero when a rank fused nothing, a pass error occurred, or the check failed.

Models (random weights from a tiny config, nothing downloaded):
  llama  transformers `LlamaAttention` (GQA, causal), RoPE by `modeling_llama.apply_rotary_pos_emb` (NeoX
         rotate_half), tables from the real `LlamaRotaryEmbedding`.
  flux   diffusers `FluxAttention` (per-head RMSNorm, bidirectional), RoPE by diffusers'
         `embeddings.apply_rotary_emb` (interleaved pairs, stack+flatten), tables from the real `FluxPosEmbed`.

Modes (collectives from `torch.distributed._functional_collectives`, so they are nodes of the compiled graph):
  tp       heads sharded: the model's own forward on a rank-local module whose q/k/v projections are row
           slices and whose output projection is a column slice of the whole block's weights; all_reduce.
  ulysses  tokens sharded; each rank slices the RoPE tables at its offset, rotates its tokens, all_to_all to
           head-sharded, attention over all tokens, all_to_all back, output projection.
  ring     tokens sharded; k/v travel around the ring (one all_to_all_single per step that sends this rank's
           block to rank+1 and receives rank-1's: a send/recv pair, which has no functional collective),
           blockwise attention by the aten ops that return the log-sum-exp (as torch's context parallelism
           calls them), merged by log-sum-exp; for llama, blocks from later ranks are skipped (causal).

Table offsets (--offset; they matter to ulysses and ring): `static` bakes rank * S_local into the graph;
`symbolic` compiles with dynamic=True, so the start of the table slice is a SymInt expression (rank * s0);
`unbacked` reads the start from a tensor (`.item()`), a data-dependent start. `symbolic` makes tp dynamic too.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import rope_fusion

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when transformers / diffusers are imported (lazily, below)

MODELS = ("llama", "flux")
LIBRARIES = {"llama": "transformers", "flux": "diffusers"}  # where each model's block comes from
MODES = ("tp", "ulysses", "ring")
OFFSETS = ("static", "symbolic", "unbacked")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Block geometry: batch, total tokens, hidden size, q heads, kv heads (llama GQA), head dim."""

    batch: int = 1
    tokens: int = 16
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: which block, how it is split, how the table offset reaches the graph, in which dtype."""

    model: str = "llama"
    mode: str = "tp"
    offset: str = "static"
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"{self.model}:{self.mode}:{self.offset}:{self.dtype}"

    @classmethod
    def parse(cls, text: str, dtype: str = "float32") -> Case:
        """`model:mode[:offset[:dtype]]`, the form --case takes; `dtype` when the text has none."""
        parts = text.split(":")
        case = cls(*parts) if len(parts) == 4 else cls(*parts, dtype=dtype)
        if case.model not in MODELS or case.mode not in MODES or case.offset not in OFFSETS:
            raise ValueError(f"bad case {text!r}: model in {MODELS}, mode in {MODES}, offset in {OFFSETS}")
        if not isinstance(getattr(torch, case.dtype, None), torch.dtype):
            raise ValueError(f"bad case {text!r}: {case.dtype} is not a torch dtype")
        return case


# ---------------------------------------------------------------------------------------------------------
# collectives: functional, so that dynamo puts them (and their waits) into the graph the pass sees


def _group() -> Any:
    return dist.group.WORLD


def seq_to_head(x: torch.Tensor) -> torch.Tensor:
    """Ulysses all_to_all: [B, H, S/N, D] token-sharded -> [B, H/N, S, D] head-sharded.

    Head group j goes to rank j; what comes back from rank j is its block of tokens for this rank's heads."""
    n = dist.get_world_size()
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    got = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, _group()))
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def head_to_seq(x: torch.Tensor) -> torch.Tensor:
    """The inverse all_to_all: [B, H/N, S, D] head-sharded -> [B, H, S/N, D] token-sharded."""
    n = dist.get_world_size()
    b, h, s, d = x.shape
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, _group()))
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * h, s // n, d)


def ring_shift(x: torch.Tensor) -> torch.Tensor:
    """Send x to rank+1 and receive rank-1's x: a send/recv pair spelled as one all_to_all_single whose
    split sizes are zero except towards the neighbours (send/recv are not functional collectives)."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = x.reshape(-1)
    send_sizes = [flat.numel() if j == (r + 1) % n else 0 for j in range(n)]
    recv_sizes = [flat.numel() if j == (r - 1) % n else 0 for j in range(n)]
    got = funcol.wait_tensor(funcol.all_to_all_single(flat, recv_sizes, send_sizes, _group()))
    return got.reshape(x.shape)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", _group()))


# ---------------------------------------------------------------------------------------------------------
# the two real blocks


class LlamaBlock:
    """transformers `LlamaAttention` with random weights; tables from `LlamaRotaryEmbedding`."""

    causal = True

    def __init__(self, sizes: Sizes, dtype: torch.dtype, device: str) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

        self.sizes, self.dtype, self.device = sizes, dtype, device
        self.config = LlamaConfig(hidden_size=sizes.hidden, num_attention_heads=sizes.heads,
                                  num_key_value_heads=sizes.kv_heads, head_dim=sizes.head_dim,
                                  max_position_embeddings=max(2048, sizes.tokens), attn_implementation="sdpa")
        torch.manual_seed(0)
        self.attn = LlamaAttention(self.config, layer_idx=0).to(device=device, dtype=dtype).eval()
        self.rotary = LlamaRotaryEmbedding(self.config).to(device)

    def tables(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, S, D] for positions 0..S-1, in x's dtype (what LlamaModel passes to each layer)."""
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        return self.rotary(x, pos)

    @staticmethod
    def table_slice(t: torch.Tensor, start: Any, length: Any) -> torch.Tensor:
        return t.narrow(1, start, length)

    def whole(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The unsharded block: the model's own forward."""
        return self.attn(x, position_embeddings=(cos, sin), attention_mask=None)[0]

    def to(self, dtype: torch.dtype) -> LlamaBlock:
        other = copy.copy(self)
        other.attn, other.dtype = copy.deepcopy(self.attn).to(dtype), dtype
        return other

    def tp_shard(self, rank: int, world: int) -> Callable:
        """This rank's heads as a LlamaAttention of H/N q heads and KV/N kv heads, running its own forward."""
        from transformers.models.llama.modeling_llama import LlamaAttention

        s = self.sizes
        cfg = copy.deepcopy(self.config)
        cfg.num_attention_heads, cfg.num_key_value_heads = s.heads // world, s.kv_heads // world
        local = LlamaAttention(cfg, layer_idx=0).to(device=self.device, dtype=self.dtype).eval()
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(local, name).weight.copy_(_rows(getattr(self.attn, name).weight, rank, world))
            local.o_proj.weight.copy_(_cols(self.attn.o_proj.weight, rank, world))

        def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return all_reduce_sum(local(x, position_embeddings=(cos, sin), attention_mask=None)[0])

        return forward

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """q, k, v as [B, heads, S, D] with RoPE applied by transformers' apply_rotary_pos_emb."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*x.shape[:-1], -1, self.attn.head_dim)  # a module attribute, static under dynamic=True
        q = self.attn.q_proj(x).view(shape).transpose(1, 2)
        k = self.attn.k_proj(x).view(shape).transpose(1, 2)
        v = self.attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.attn.o_proj(o.transpose(1, 2).flatten(2))


class FluxBlock:
    """diffusers `FluxAttention` with random weights; tables from `FluxPosEmbed` over an image id grid."""

    causal = False

    def __init__(self, sizes: Sizes, dtype: torch.dtype, device: str) -> None:
        from diffusers.models.transformers.transformer_flux import FluxAttention

        self.sizes, self.dtype, self.device = sizes, dtype, device
        torch.manual_seed(0)
        self.attn = FluxAttention(query_dim=sizes.hidden, heads=sizes.heads, dim_head=sizes.head_dim,
                                  bias=True, out_bias=True, eps=1e-6).to(device=device, dtype=dtype).eval()

    def tables(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, D] (fp32, full interleaved form) for ids (0, row, col) of a 4-wide token grid."""
        from diffusers.models.transformers.transformer_flux import FluxPosEmbed

        d = self.sizes.head_dim
        axes = [d - 2 * (d // 8 * 3), d // 8 * 3, d // 8 * 3]
        pos = torch.arange(x.shape[1], device=x.device)
        ids = torch.stack([torch.zeros_like(pos), pos // 4, pos % 4], dim=-1)
        return FluxPosEmbed(theta=10000, axes_dim=axes)(ids)

    @staticmethod
    def table_slice(t: torch.Tensor, start: Any, length: Any) -> torch.Tensor:
        return t.narrow(0, start, length)

    def whole(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The model's own forward, then `to_out`: without an encoder stream FluxAttnProcessor returns the
        attention before the output projection (Flux's single-stream block projects it afterwards)."""
        return self.attn.to_out[0](self.attn(x, image_rotary_emb=(cos, sin)))

    def to(self, dtype: torch.dtype) -> FluxBlock:
        other = copy.copy(self)
        other.attn, other.dtype = copy.deepcopy(self.attn).to(dtype), dtype
        return other

    def tp_shard(self, rank: int, world: int) -> Callable:
        """This rank's heads as a FluxAttention of H/N heads (its processor is written TP-agnostic); the
        output projection's bias is added once, after the all_reduce."""
        from diffusers.models.transformers.transformer_flux import FluxAttention

        s, a = self.sizes, self.attn
        local = FluxAttention(query_dim=s.hidden, heads=s.heads // world, dim_head=s.head_dim, bias=True,
                              out_bias=True, eps=1e-6).to(device=self.device, dtype=self.dtype).eval()
        with torch.no_grad():
            for name in ("to_q", "to_k", "to_v"):
                getattr(local, name).weight.copy_(_rows(getattr(a, name).weight, rank, world))
                getattr(local, name).bias.copy_(_rows(getattr(a, name).bias, rank, world))
            local.norm_q.load_state_dict(a.norm_q.state_dict())
            local.norm_k.load_state_dict(a.norm_k.state_dict())
            local.to_out[0].weight.copy_(_cols(a.to_out[0].weight, rank, world))
            local.to_out[0].bias.zero_()
        bias = a.to_out[0].bias.detach()

        def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return all_reduce_sum(local.to_out[0](local(x, image_rotary_emb=(cos, sin)))) + bias

        return forward

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """q, k, v as [B, heads, S, D]: projections, per-head RMSNorm and diffusers' apply_rotary_emb, as
        FluxAttnProcessor does them."""
        from diffusers.models.embeddings import apply_rotary_emb

        a, d = self.attn, self.attn.head_dim
        q = a.norm_q(a.to_q(x).unflatten(-1, (-1, d)))
        k = a.norm_k(a.to_k(x).unflatten(-1, (-1, d)))
        v = a.to_v(x).unflatten(-1, (-1, d))
        q = apply_rotary_emb(q, (cos, sin), sequence_dim=1)
        k = apply_rotary_emb(k, (cos, sin), sequence_dim=1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.attn.to_out[0](o.transpose(1, 2).flatten(2))


def _rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Column-parallel shard: this rank's block of output features (weight rows, bias entries)."""
    return w.chunk(world, dim=0)[rank]


def _cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Row-parallel shard: this rank's block of input features (weight columns)."""
    return w.chunk(world, dim=1)[rank]


def make_block(model: str, sizes: Sizes, dtype: torch.dtype, device: str) -> LlamaBlock | FluxBlock:
    return {"llama": LlamaBlock, "flux": FluxBlock}[model](sizes, dtype, device)


# ---------------------------------------------------------------------------------------------------------
# the sequence-parallel forwards (written here; projections, norms and RoPE are the model's own)


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k.repeat_interleave(heads // k.shape[1], dim=1) if k.shape[1] != heads else k


def _local_tables(block: Any, cos: torch.Tensor, sin: torch.Tensor, start: Any, length: Any) -> tuple:
    return block.table_slice(cos, start, length), block.table_slice(sin, start, length)


def ulysses_forward(block: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: Any) -> torch.Tensor:
    """x: this rank's tokens [B, S/N, hidden]; cos/sin: the whole sequence's tables, sliced here at `start`."""
    cos_l, sin_l = _local_tables(block, cos, sin, start, x.shape[1])
    q, k, v = block.qkv(x, cos_l, sin_l)
    q, k, v = seq_to_head(q), seq_to_head(k), seq_to_head(v)
    o = F.scaled_dot_product_attention(q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]),
                                       is_causal=block.causal)
    return block.out(head_to_seq(o))


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple:
    """One q block against one k/v block: (output in fp32, log-sum-exp [B, H, S, 1] in fp32).

    The aten attention ops that return the log-sum-exp, as PyTorch's own context parallelism calls them:
    the flash kernel for CPUs, memory-efficient attention on GPUs (any dtype; its lse is padded to 32)."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return o.float(), lse[..., : q.shape[-2]].unsqueeze(-1).float()


def _merge(acc: tuple | None, part: tuple) -> tuple:
    """Combine two partial attentions over disjoint key sets by their log-sum-exps."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse), lse


def ring_forward(block: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: Any) -> torch.Tensor:
    """Ring attention: at step j this rank holds the k/v block of rank (r - j) mod N. With a causal block,
    later ranks' blocks are skipped (they are still passed on) and the own block is causal."""
    n, r = dist.get_world_size(), dist.get_rank()
    cos_l, sin_l = _local_tables(block, cos, sin, start, x.shape[1])
    q, k, v = block.qkv(x, cos_l, sin_l)
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    kv = torch.stack([k, v])
    acc = None
    for step in range(n):
        src = (r - step) % n
        if not (block.causal and src > r):
            acc = _merge(acc, _block_attention(q, kv[0], kv[1], block.causal and src == r))
        if step < n - 1:
            kv = ring_shift(kv)
    return block.out(acc[0].to(q.dtype))


# ---------------------------------------------------------------------------------------------------------
# one case on one rank


@dataclasses.dataclass
class Built:
    """What a rank compiles and calls, and what rank 0 checks against."""

    fn: Callable
    args: tuple
    dynamic: bool
    x: torch.Tensor  # the whole input
    cos: torch.Tensor
    sin: torch.Tensor
    block: Any


def make_inputs(case: Case, sizes: Sizes, device: str) -> tuple:
    """(block, x, cos, sin) of the whole block: the same on every rank and in any process (fixed seeds)."""
    dtype = getattr(torch, case.dtype)
    block = make_block(case.model, sizes, dtype, device)
    torch.manual_seed(1)
    x = torch.randn(sizes.batch, sizes.tokens, sizes.hidden, device=device, dtype=dtype)
    cos, sin = block.tables(x)
    return block, x, cos, sin


def build(case: Case, sizes: Sizes, device: str) -> Built:
    """The rank-local function of `case` and its arguments; inputs are identical on every rank (same seed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    block, x, cos, sin = make_inputs(case, sizes, device)
    dynamic = case.offset == "symbolic"
    if case.mode == "tp":
        return Built(block.tp_shard(rank, world), (x, cos, sin), dynamic, x, cos, sin, block)
    local = x.chunk(world, dim=1)[rank].contiguous()
    forward = ulysses_forward if case.mode == "ulysses" else ring_forward
    if case.offset == "unbacked":
        offset = torch.tensor(rank * local.shape[1])

        def fn(x_l: torch.Tensor, c: torch.Tensor, s: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
            start = off.item()
            torch._check(start >= 0)
            torch._check(start + x_l.shape[1] <= c.shape[-2])
            return forward(block, x_l, c, s, start)

        return Built(fn, (local, cos, sin, offset), dynamic, x, cos, sin, block)

    def fn(x_l: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return forward(block, x_l, c, s, rank * x_l.shape[1])

    return Built(fn, (local, cos, sin), dynamic, x, cos, sin, block)


def compile_and_run(built: Built, with_pass: bool = True) -> tuple[Callable, torch.Tensor, Any]:
    """Compile the rank's function (fullgraph: the collectives and the RoPE in one graph) with a fresh pass,
    or plainly, and make the first (compiling) call. Returns (compiled function, output, pass or None).

    The FX graph and AOTAutograd caches are off for the compile: a cache hit would skip the pass."""
    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass() if with_pass else None
    options = {"post_grad_custom_post_pass": p} if with_pass else {}
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(built.fn, dynamic=built.dynamic, fullgraph=True, options=options)
        out = compiled(*built.args)
    return compiled, out, p


def gather_output(case: Case, out: torch.Tensor) -> torch.Tensor:
    """The whole output on every rank: tp already has it; sequence parallel concatenates the token shards."""
    if case.mode == "tp":
        return out
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out.contiguous())
    return torch.cat(parts, dim=1)


def check(built: Built, out: torch.Tensor) -> dict:
    """The numerics contract against one process running the whole block: the error of the distributed
    compiled output against fp64 must not exceed that of single-process eager (same dtype) plus eps."""
    with torch.no_grad():
        eager = built.block.whole(built.x, built.cos, built.sin)
        b64 = built.block.to(torch.float64)
        ref = b64.whole(built.x.double(), built.cos.double(), built.sin.double())
    err_dist, err_eager = _rel(out, ref), _rel(eager, ref)
    eps = torch.finfo(out.dtype).eps
    return dict(max_diff=(out.double() - eager.double()).abs().max().item(), rel_vs_eager=_rel(out, eager),
                err_dist=err_dist, err_eager=err_eager, eps=eps, ok=bool(err_dist <= err_eager + eps))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def report_record(p: rope_fusion.RopeFusionPass) -> dict:
    """The parts of the pass's report that the checks (and the tests) read, as plain data."""
    r = p.report
    return dict(sites=len(r.sites), kernels=[k.op for k in r.kernels], backends=[k.backend for k in r.kernels],
                roles=[s.role for s in r.sites], styles=[s.style for s in r.sites],
                misses=[f"{m.node}: {m.reason}" for m in r.misses], errors=[e.error for e in r.errors],
                summary=r.summary(), table=r.table())


def run_case(case: Case, sizes: Sizes, device: str, save_dir: str | None = None) -> dict:
    """Build, compile and run `case` on this rank; rank 0 adds the check (and saves the gathered output to
    save_dir, for a caller that checks it independently). Returns this rank's record."""
    built = build(case, sizes, device)
    _, out, p = compile_and_run(built)
    whole = gather_output(case, out)
    record = dict(case=case.name, rank=dist.get_rank(), **report_record(p))
    if dist.get_rank() == 0:
        record["check"] = check(built, whole)
        if save_dir:
            record["output"] = os.path.join(save_dir, case.name.replace(":", "_") + ".pt")
            torch.save(whole.cpu(), record["output"])
    return record


# ---------------------------------------------------------------------------------------------------------
# command line


def print_ranked(text: str) -> None:
    """Print on each rank in rank order (barriers between), so that the reports do not interleave."""
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(text, flush=True)
        dist.barrier()


def verdict(records: list[dict]) -> list[str]:
    """Why a case failed, from every rank's record: nothing fused, a pass error, or a failed check."""
    problems = []
    for rec in records:
        where = f"{rec['case']} rank {rec['rank']}"
        if rec["sites"] == 0:
            problems.append(f"{where}: nothing fused")
        if rec["errors"]:
            problems.append(f"{where}: pass errors {rec['errors']}")
        if "check" in rec and not rec["check"]["ok"]:
            problems.append(f"{where}: numerics check failed {rec['check']}")
    return problems


def describe(rec: dict) -> str:
    lines = [f"[rank {rec['rank']}] {rec['case']}: {rec['table']}"]
    if "check" in rec:
        c = rec["check"]
        lines.append(f"[rank 0] vs one process running the whole block: max |diff| {c['max_diff']:.3g}, "
                     f"rel. error {c['rel_vs_eager']:.3g}; vs fp64: distributed {c['err_dist']:.3g}, "
                     f"single-process eager {c['err_eager']:.3g} (+eps {c['eps']:.3g}) -> "
                     f"{'ok' if c['ok'] else 'FAILED'}")
    return "\n".join(lines)


def init(device: str) -> str:
    """Join the torchrun group: gloo on the CPU, NCCL with one GPU per rank. Returns the rank's device."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("examples/distributed_attention.py runs under torchrun: "
                         "torchrun --nproc-per-node 2 examples/distributed_attention.py --mode tp")
    if device == "cuda" and torch.cuda.device_count() < int(os.environ["WORLD_SIZE"]):
        raise SystemExit(f"--device cuda needs one GPU per rank: {os.environ['WORLD_SIZE']} ranks, "
                         f"{torch.cuda.device_count()} GPUs here (leave --device out for the CPU and gloo)")
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return f"cuda:{local}"
    dist.init_process_group("gloo")
    return "cpu"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="tp")
    ap.add_argument("--model", choices=MODELS, default="llama")
    ap.add_argument("--offset", choices=OFFSETS, default="static",
                    help="how the RoPE table offset reaches the graph (ulysses, ring); symbolic makes tp dynamic")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="default: float32 on the CPU, bfloat16 on GPUs")
    ap.add_argument("--case", action="append", default=[], metavar="MODEL:MODE[:OFFSET[:DTYPE]]",
                    help="run these cases (repeatable) in one launch instead of --model/--mode/--offset")
    for f in dataclasses.fields(Sizes):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    ap.add_argument("--json", default=None, help="write every rank's records here (rank 0 writes)")
    ap.add_argument("--save", default=None, metavar="DIR", help="rank 0 saves each case's gathered output here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    cases = [Case.parse(c, dtype) for c in args.case] or [Case(args.model, args.mode, args.offset, dtype)]
    for lib in sorted({LIBRARIES[c.model] for c in cases}):
        if importlib.util.find_spec(lib) is None:
            raise SystemExit(f"examples/distributed_attention.py needs {lib} for its model: pip install {lib} "
                             "(or the checkout's .[test] extra)")
    device = init(args.device)
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)})
    records = []
    for case in cases:
        rec = run_case(case, sizes, device, args.save)
        print_ranked(describe(rec))
        records.append(rec)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    flat = [rec for recs in everyone for rec in recs]
    problems = verdict(flat)
    if dist.get_rank() == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(flat, f, indent=1)
        print("\n".join(problems) if problems else f"all {len(cases)} case(s) fused on every rank and match")
    dist.destroy_process_group()
    return 1 if problems else 0


def leave(code: int) -> None:
    """Exit without the interpreter's teardown. A graph with functional collectives keeps the gloo group alive
    past destroy_process_group (torch 2.13: its worker threads still run; a script without functional
    collectives has none left), and now and then tearing the interpreter down under those threads aborts
    the process ("terminate called without an active exception") after every check above has passed and the
    records are written. Nothing is left to flush but stdio."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
