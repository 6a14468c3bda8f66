"""The layout attention reads the fused op's result in (issue: "the consumer's layout"): the op writes its output
in x's logical shape, contiguous, and real models hand it to attention through views only, so no copy follows it
that plain compile avoids.

For each model the post-grad graph is read twice, after plain compile's own passes and after the pass, and two
things are counted: copies (`clone`, `copy`) anywhere in the graph, and the consumers each fused op's result
reaches through views (transpose, permute, expand, ...). The pass adds no copy (GPT-J's `stack`ed pairs lose 8:
they die with the rotation, and Llama's and Flux's counts are equal); the consumers are attention, or GQA's
`repeat_kv` (k expanded to q's heads and cloned), a copy that plain compile makes as well. Found so (tests/zoo,
every default "must" model; docs/design.md 4.3): no model that permutes or transposes the rotated q and k for
attention copies them; writing another layout would remove nothing.
"""

from __future__ import annotations

import collections
import operator

import pytest
import torch

import rope_fusion

aten = torch.ops.aten
VIEWS = {aten.view.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.expand.default,
         aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int,
         operator.getitem}
COPIES = {aten.clone.default, aten.copy.default}


def _is_fused(node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("rope_fusion.")


def _census(graph) -> tuple[int, collections.Counter, int]:
    """(copies in the graph, the consumers of the fused ops' results through views by target, fused ops)."""
    copies = sum(1 for n in graph.nodes if n.target in COPIES)
    consumers: collections.Counter = collections.Counter()
    fused = [n for n in graph.nodes if _is_fused(n)]
    for n in fused:
        stack = [n]
        while stack:
            for u in stack.pop().users:
                if u.target in VIEWS:
                    stack.append(u)
                else:
                    consumers[str(u.target)] += 1
    return copies, consumers, len(fused)


def _post_grad_census(model, kwargs, with_pass: bool) -> tuple[int, collections.Counter, int]:
    p = rope_fusion.RopeFusionPass(backend="inductor") if with_pass else None
    seen = []

    def post(graph):
        if p is not None:
            p(graph)
        seen.append(_census(graph))

    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=post, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
        torch.compile(lambda **kw: model(**kw), fullgraph=True)(**kwargs)
    assert len(seen) == 1, f"{len(seen)} graphs"
    return seen[0]


# model: (fused ops, the consumers through views: attention, and GQA's k clone where the model repeats k heads)
CASES = {
    "llama": (2, {"aten._scaled_dot_product_flash_attention_for_cpu.default": 2, "aten.clone.default": 2}),
    "gptj": (2, {"aten._scaled_dot_product_flash_attention_for_cpu.default": 4}),
    "flux": (2, {"aten._scaled_dot_product_flash_attention_for_cpu.default": 4}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_reads_the_fused_result_through_views(name):
    from tests.zoo.entries import ENTRIES

    entry = next(e for e in ENTRIES if e.name == name)
    model, kwargs = entry.build()
    model = model.eval()
    plain_copies, _, none = _post_grad_census(model, kwargs, with_pass=False)
    copies, consumers, fused = _post_grad_census(model, kwargs, with_pass=True)
    kernels, want = CASES[name]
    assert none == 0 and fused == kernels == entry.kernels, (none, fused, entry.kernels)
    # never a copy more than plain compile's graph has (GPT-J's stacked pairs are copies that die with the rotation)
    assert copies <= plain_copies, f"{copies} copies after the pass, {plain_copies} in plain compile's graph"
    assert dict(consumers) == want, dict(consumers)
