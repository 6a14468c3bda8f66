"""The report read at a glance: one line per site under 160 characters, details on request, near misses by the
model's source line and tensor, paths a person recognises, and what the counts count.

Real compiles: OLMo2 from transformers (its QK-norm across heads stays in the graph, with a long reason that once
made every q and k line 600 characters), spellings with a near miss written in this file, and a diffusers model
whose source lives in site-packages.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from rope_fusion.ops.schema import RotaryParams
from rope_fusion.passes import report_text
from rope_fusion.passes.report import GraphRecord, Kernel, Miss, Report, Site, plain_params
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

FX_NAME = re.compile(r"\b(?:add|mul|sub|view|cat|arg\d+|clone|permute|neg|unsqueeze)_\d+\b")


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def one_good_one_near_miss(q, k, cos, sin):
    q_rot = q * cos + _rotate_half(q) * sin
    k_same_table = k * cos + _rotate_half(k) * cos  # the near miss: cos for both tables
    return q_rot, k_same_table


def _lines(text: str, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def _tables(s: int, d: int):
    ang = torch.rand(s, 1, d // 2, dtype=torch.float64) * 6
    ang = torch.cat((ang, ang), -1)
    return ang.cos().float(), ang.sin().float()


def test_a_near_miss_reads_by_source_line_and_tensor():
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    cos, sin = _tables(6, 16)
    out, p = compile_with_pass(one_good_one_near_miss, q, k, cos, sin)
    r = p.report
    assert len(r.sites) == 1 and len(r.misses) == 1 and not r.errors, r.table(verbose=True)
    check_numerics(one_good_one_near_miss, (q, k, cos, sin), out, context=r.table())
    line = next(i for i, ln in enumerate(open(__file__), 1) if "# the near miss" in ln)
    glance, verbose = r.table(), r.table(verbose=True)
    (miss,) = _lines(glance, "  near miss ")
    assert miss.startswith(f"  near miss k_same_table at tests/passes/test_report_glance.py:{line}: "), glance
    assert r.misses[0].tensor == "k_same_table" and not FX_NAME.search(glance), glance
    assert f"node {r.misses[0].node}" in verbose and FX_NAME.search(r.misses[0].node)
    (site,) = _lines(glance, "  site ")
    assert "site 0 q neox R=16 D=16 fp32->fp32, tables per-lane fp32: rotary[" in site, site


@pytest.mark.slow  # a real transformers model's compile: about 20 s on 2 cores
def test_every_glance_line_fits_and_the_details_come_on_request():
    """OLMo2's norm across heads stays in the graph for q and k (its heads sit in dim -3): the glance says so in
    two words per site; verbose says why, once per kernel."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.Olmo2Model(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))

    def forward(input_ids):
        return model(input_ids=input_ids, use_cache=False).last_hidden_state

    with torch.no_grad():
        out, p = compile_with_pass(forward, ids)
        ref = forward(ids)
        ref64 = model.double()(input_ids=ids, use_cache=False).last_hidden_state
    model.float()
    err = ((out.double() - ref64).norm() / ref64.norm()).item()
    assert err <= ((ref.double() - ref64).norm() / ref64.norm()).item() + torch.finfo(torch.float32).eps
    r = p.report
    glance, verbose = r.table(), r.table(verbose=True)
    assert len(r.sites) == 4 and len(r.kernels) == 2 and not r.misses and not r.errors, verbose
    assert all(not s.norm.endswith("folded") and "dim -3" in s.norm for s in r.sites), verbose
    sites = _lines(glance, "  site ")
    assert len(sites) == 4 and all(len(ln) < report_text.LINE_LIMIT for ln in glance.splitlines()), glance
    assert all(ln.endswith(f"modeling_olmo2.py:{s.source.rsplit(':', 1)[1]}") and ", norm stays:" in ln
               for ln, s in zip(sites, r.sites)), glance
    assert "site-packages" not in glance and "dim -3" not in glance and report_text.DETAILS_HINT in glance
    assert "site-packages" in verbose or not any("site-packages" in s.source for s in r.sites)
    reasons = [ln for ln in verbose.splitlines() if ln.startswith("      norm: ")]
    assert [("dim -3" in ln, ln.endswith(("as site 0", "as site 2"))) for ln in reasons] == \
        [(True, False), (False, True), (True, False), (False, True)], verbose


def test_the_header_says_what_the_counts_count():
    r = Report()
    assert report_text.RUNS_NOTE.split("\n")[0] not in r.table()  # no graph seen: nothing to count
    r.graph_records.append(GraphRecord(0, "inference", "fused", 1, 1, 0))
    r.graphs = 1
    text = r.table()
    assert text.splitlines()[0] == "rope_fusion: 1 compiled graph, fused 0 sites in 0 kernels, 0 near misses"
    assert "counted per compiled graph, not per run" in text and "torch.profiler" in text and "rotary" in text
    assert "compile cache" not in text
    for i in (1, 2, 3):  # graphs 1 and 3 served by a compile cache: said once, naming them
        r.graph_records.append(GraphRecord(i, "inference", "fused", from_cache=i % 2 == 1))
    r.graphs = 4
    cache = [ln for ln in r.table().splitlines() if "compile cache" in ln]
    assert len(cache) == 1 and cache[0].startswith("  2 of 4 graphs (1, 3) came from the compile cache: "), cache
    assert all(len(ln) <= report_text.LINE_LIMIT for ln in r.table().splitlines())


def test_long_paths_and_reasons_stay_within_the_line():
    """A site deep in a package and a near miss with a long reason: the glance lines keep the file name and line
    (the folders in between go), the reason is cut and marked; verbose keeps everything."""
    deep = os.sep.join(["", "opt", "env", "lib", "python3.11", "site-packages", "vendor_models", "a" * 40, "b" * 40,
                        "transformer_with_a_long_name.py:1234"])
    plain = plain_params(RotaryParams(interleaved=False, rotary_dim=128, full_tables=True, conjugate=False,
                                      out_dtype=torch.bfloat16))
    every = plain_params(RotaryParams(interleaved=False, rotary_dim=64, full_tables=True, conjugate=True,
                                      out_dtype=torch.bfloat16, norm="rms_across_heads", rotary_blocks=3,
                                      rotary_offset=64))
    r = Report()
    r.graph_records.append(GraphRecord(0, "backward", "fused", 2, 1, 1))
    r.graphs = 1
    r.kernels.append(Kernel(0, "rope_fusion.rotary_qkv_into_", "triton", [0, 1], choice="measured " + "x" * 300))
    shape = ("2", "8", "4096", "128")
    r.sites.append(Site(0, "add_5", 128, "bfloat16", "float32", shape, deep, plain, 0, "k"))
    r.sites.append(Site(0, "add_7", 128, "bfloat16", "float32", shape, deep.replace("transformer_with_a_long_name",
                        "rope"), every, 0, "q", norm="rms_across_heads folded"))
    r.misses.append(Miss(0, "add_9", "a reason " * 40, deep, "key_states"))
    glance = r.table()
    assert all(len(ln) <= report_text.LINE_LIMIT for ln in glance.splitlines()), glance
    short, full = _lines(glance, "  site ")
    assert short.endswith(f" at vendor_models{os.sep}…{os.sep}transformer_with_a_long_name.py:1234"), short
    assert full.endswith(f" at …{os.sep}rope.py:1234"), full
    assert "neox x3 blocks conjugate R=64:128 D=128 bf16->bf16" in full and "rotary_qkv_into_[triton]" in full
    (miss,) = _lines(glance, "  near miss ")
    assert miss.startswith("  near miss key_states at vendor_models") and miss.endswith("…"), miss
    verbose = r.table(verbose=True)
    assert deep in verbose and "a reason " * 40 in verbose and "x" * 300 in verbose and "node add_9" in verbose


def test_paths_read_relative_to_site_packages_the_project_or_the_checkout(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    sp = os.sep.join(["", "usr", "lib", "python3", "dist-packages", "diffusers", "models", "embeddings.py:997"])
    assert report_text.short_path(sp) == os.sep.join(["diffusers", "models", "embeddings.py:997"])
    assert report_text.short_path(str(tmp_path / "model.py") + ":6") == "model.py:6"
    here = os.path.abspath(__file__) + ":3"
    assert report_text.short_path(here) == os.path.join("tests", "passes", "test_report_glance.py") + ":3"
    assert report_text.short_path("<eval_with_key>.3:12") == "<eval_with_key>.3:12"
