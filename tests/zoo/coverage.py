"""The zoo coverage table: every entry of tests/zoo compiled with the pass, one row per model and dtype.

`python -m tests.zoo.coverage` from the checkout root (or `rope-fusion coverage`, which runs this file of
the checkout it was installed from) prints it; `--markdown` writes the form that COVERAGE.md holds. It lives
beside the zoo because it is the zoo: a plain install of the package has neither. Needs diffusers and
transformers.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time


def _zoo():
    from . import entries, harness

    return entries, harness


def status_of(entry, res) -> str:
    if res.failure:
        return "expected failure" if entry.expect_failure else "compile failed"
    if res.errors:
        return "pass error"
    if res.err_pass > res.tol:
        return "WRONG NUMERICS"
    if entry.category == "should":
        if res.sites == 0:
            return "left alone (should)"
        return "fused (should)" if res.sites == entry.compiled_sites else "partial (should)"
    if (res.sites == entry.compiled_sites and res.kernels == entry.compiled_kernels
            and res.qk_kernels == entry.compiled_qk and not res.products_after):
        bad = [s for s in res.sources if not any(f in s for f in entry.source_file.split("|"))]
        return "ok" if not bad else "ok (source?)"
    if res.sites == 0:
        return "not fused"
    if res.sites == entry.compiled_sites:
        return "not grouped" if res.products_after == [] else "left arithmetic"
    return "partial"


def coverage_rows(names=None, dtypes=None, full: bool = False, progress=None) -> list[dict]:
    """Run every zoo entry (graph level; `full` adds the full-compile entries) and return table rows."""
    import torch

    from tests.helpers.triton_cpu import triton_on_cpu

    entries, harness = _zoo()
    rows = []
    ref64: dict = {}
    for e in entries.ENTRIES:
        if names and e.name not in names:
            continue
        modes = [False] + ([True] if full and e.full_compile else []) + (["triton"] if e.triton_row else [])
        for mode in modes:
            for dt in (("float32",) if mode else e.dtypes):
                if dtypes and dt not in dtypes:
                    continue
                if mode == "triton":
                    with triton_on_cpu(serves=("slice_write", "cat")):  # what only the Triton backend folds
                        res = harness.run_entry(e, getattr(torch, dt), backend="triton", ref64_cache=ref64)
                else:
                    res = harness.run_entry(e, getattr(torch, dt), full=mode, ref64_cache=ref64)
                kind = {False: "graph", True: "inductor", "triton": "graph triton"}[mode]
                row = {
                    "model": e.name, "category": e.category, "variant": f"{dt} {kind}",
                    "expected": e.sites, "compiled": e.compiled_sites, "fused": res.sites,
                    "kernels": res.kernels, "expected_kernels": e.compiled_kernels,
                    "qk": res.qk_kernels, "graphs": res.graphs, "err": res.err_pass, "err_eager": res.err_eager,
                    "tol": res.tol, "status": status_of(e, res), "seconds": res.seconds,
                    "pass_seconds": res.pass_seconds,
                    "left": len(res.products_after), "misses": res.misses, "failure": res.failure,
                    "errors": res.errors, "note": e.compile_note or e.expect_failure,
                    "products_after": res.products_after, "norm": _norms(res.report), "folds": _folds(res.report),
                }
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def _folds(report) -> str:
    """The folds column: the data movement the fused ops took in, by kind (a kernel's `fold` text up to its colon),
    or the first reason one was not taken."""
    texts = [k.fold for k in (report.kernels if report is not None else []) if k.fold]
    taken = collections.Counter(t.split(":")[0] for t in texts if "not folded" not in t.split(":")[0])
    if taken:
        return ", ".join(f"{n} {kind}" for kind, n in taken.items())
    return texts[0] if texts else "-"


def _norms(report) -> str:
    """The QK-norm column: how many sites took their norm into the op, or why a norm stayed."""
    notes = [s.norm for s in (report.sites if report is not None else [])]
    folded = sum(1 for n in notes if n.endswith("folded"))
    kept = [n for n in notes if n.startswith("left in the graph")]
    if folded:
        return f"{folded} folded" + (f", {len(kept)} kept" if kept else "")
    if kept:
        return "kept: " + kept[0].removeprefix("left in the graph: ")
    return "-"


# What each column of the table means, in the order of the table (COVERAGE.md prints this as its legend).
COLUMNS = (
    ("model", "the zoo entry (tests/zoo/entries.py): one unmodified diffusers or transformers model class, a tiny "
              "random-init config, on the CPU"),
    ("cat", "*must*: every site has to fuse, or the row fails; *should*: a form the pass may leave alone, with a "
            "near miss that says why"),
    ("variant", "the dtype, then *graph* (Inductor's front half and post-grad passes, where the pass runs; the "
                "graph then runs eagerly), *inductor* (a full torch.compile with C++ code generation) or *graph "
                "triton* (graph, with the Triton backend asked for, its kernel interpreted)"),
    ("sites", "RoPE sites per forward, counted from the model's source (in parentheses: those in the compiled "
              "graphs, where Dynamo reuses one graph for several layers after a graph break)"),
    ("fused", "sites in `report.sites`"),
    ("kernels (qk)", "fused op nodes / the number expected; in parentheses, how many of them are `rotary_qk` or "
                     "`rotary_qkv` (one launch for several tensors)"),
    ("graphs", "Dynamo graphs the forward compiled into"),
    ("QK-norm", "sites whose RMSNorm before the rotation is folded into the fused op, or why a norm stayed in the "
                "graph (*-*: the model has no QK-norm there)"),
    ("folds", "data movement a fused op took in, per kernel: a slice write (the rotation written into the rows "
              "of a larger tensor in place), a joint cat (text and image pieces read where they are), a joined "
              "write (a rotation written into its rows of the cat that joins it after the rotation); only the "
              "Triton backend folds them, so they show on the *graph triton* rows (its kernel interpreted on the "
              "CPU), or why one was not taken (*-*: nothing to fold)"),
    ("max err", "relative error of the compiled output against an fp64 evaluation of the uncompiled model"),
    ("eager err", "the uncompiled model's own relative error in that dtype, against the same fp64 evaluation"),
    ("status", "*ok*: every expected site fused in the expected kernels and no table x activation product is "
               "left (*ok (source?)*: the same, but a site's source line is not in the model's file); "
               "*left alone / fused / partial (should)*: what the pass did with a *should* row; *not fused*, "
               "*partial*, *not grouped*, *left arithmetic*, *pass error*, *compile failed*, *WRONG NUMERICS*: "
               "a *must* row that failed. A row that did not fuse gives its first near miss's reason, whole"),
)


def markdown_header(torch_version: str) -> str:
    """COVERAGE.md's title, how it was made, and the legend of its columns."""
    legend = "\n".join(f"- **{name}**: {meaning}." for name, meaning in COLUMNS)
    return ("# RoPE fusion coverage on the model zoo\n\n"
            f"Generated by `python -m tests.zoo.coverage --full --markdown` (tests/zoo; torch {torch_version}). "
            "Each row compiles one model with the pass and checks the report against the sites its source has. "
            "`python -m tests.zoo.coverage NAME ...` runs only the named entries.\n\n"
            f"Columns:\n\n{legend}\n")


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.1e}"


def format_table(rows, markdown: bool = False) -> str:
    head = [name for name, _ in COLUMNS]
    body = []
    for r in rows:
        sites = str(r["expected"]) if r["compiled"] == r["expected"] else f"{r['expected']} ({r['compiled']} compiled)"
        status = r["status"]
        if status.startswith(("left alone", "partial", "not fused")) and r["misses"]:
            status += ": " + r["misses"][0][0]  # the reason, whole, in the table itself
        body.append([r["model"], r["category"], r["variant"], sites, str(r["fused"]),
                     f"{r['kernels']}/{r['expected_kernels']} ({r['qk']})", str(r["graphs"]), r.get("norm", "-"),
                     r.get("folds", "-"), _fmt(r["err"]), _fmt(r["err_eager"]), status])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in b) + " |" for b in body]
    else:
        w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w[i]) for i, h in enumerate(head))]
        lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(b)) for b in body]
    return "\n".join(lines)


def format_details(rows) -> str:
    out = []
    for r in rows:
        if r["status"] in ("ok", "left alone (should)", "fused (should)") and not r["note"]:
            continue
        out.append(f"- **{r['model']}** {r['variant']}: {r['status']}" + (f"; {r['note']}" if r["note"] else ""))
        if r["failure"]:
            out.append(f"  - failure: `{r['failure']}`")
        for e in r["errors"][:3]:
            out.append(f"  - pass error: `{e}`")
        for reason, src in r["misses"][:6]:
            out.append(f"  - miss at {src}: {reason}")
        if r["products_after"] and r["status"] not in ("ok",):
            srcs = sorted({s for _, s in r["products_after"]})
            out.append(f"  - {r['left']} table x activation products left at {', '.join(srcs[:6])}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rope-fusion coverage", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="entry names (default: all)")
    ap.add_argument("--dtype", action="append", help="float32 / bfloat16 (default: each entry's own)")
    ap.add_argument("--full", action="store_true", help="also compile full_compile entries through Inductor")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def progress(r):
        print(f"  {r['model']:24s} {r['variant']:18s} {r['status']:20s} {r['seconds']:.1f}s "
              f"(pass {r['pass_seconds']:.1f}s)", file=sys.stderr)

    rows = coverage_rows(args.models or None, args.dtype, args.full, progress)
    if args.markdown:
        import torch
        print(markdown_header(torch.__version__))
    print(format_table(rows, args.markdown))
    details = format_details(rows)
    if details:
        print("\n" + details)
    must = [r for r in rows if r["category"] == "must"]
    ok = sum(r["status"] == "ok" for r in must)
    sites = sum(r["compiled"] for r in must)
    fused = sum(min(r["fused"], r["compiled"]) for r in must)
    print(f"\nmust: {ok}/{len(must)} rows fully fused, {fused}/{sites} sites; wall {time.perf_counter() - t0:.0f}s")
    return 0 if ok == len(must) else 1


if __name__ == "__main__":
    sys.exit(main())
