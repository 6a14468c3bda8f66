"""The `rope-fusion` console script.

    rope-fusion explain MODULE:CALLABLE [--backend B] [--no-qk] [--dynamic] [--plain] [--verbose]
        import MODULE (from the current directory too), call CALLABLE() -> (model, example_inputs),
        compile the model with a RopeFusionPass, run it once and print the report as tables (--verbose: as
        text, with every detail).
        example_inputs: a tuple/list of positional args, a dict of keyword args, or (args, kwargs).
        Exit 0 when it ran (whatever fused), 2 when the callable could not be loaded, 1 when it failed.
    rope-fusion bench [ARGS...]
        run benchmarks/kernels.py of a source checkout with ARGS when a GPU is present; a message and exit 2
        otherwise (`--help` works anywhere).
    rope-fusion coverage [ARGS...]
        run the model-zoo coverage table (tests/zoo/coverage.py of a source checkout; needs diffusers and
        transformers).
    rope-fusion calibrate [--tokens N] [--rows SUBSTRINGS] [--dry]
        time the kernel rows on this GPU and write its factor table (next to `auto`'s decision cache), which
        `auto`'s table fallback then reads; exit 2 without a GPU.
    rope-fusion --version
        the package's version and those of torch and Triton it runs with.

`--help` works for every subcommand anywhere: one that runs a file of a source checkout says so where there is
none. Importing this module loads no compiler (the package is lazy), so the help answers at once.

Subcommands are registered with `@command(name, help, configure)` on a function `(args) -> int`;
`configure(parser)` adds its arguments. A `passthrough` command gets the raw rest of the command line as
`args.args`. Adding a subcommand is one decorated function, nothing else.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[Any], int], bool]] = {}


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None,
            passthrough: bool = False):
    """Register `fn(args) -> exit code` as the subcommand `name`; `configure(parser)` adds its options."""
    def register(fn: Callable[[Any], int]) -> Callable[[Any], int]:
        _COMMANDS[name] = (help, configure or (lambda p: None), fn, passthrough)
        return fn
    return register


def version_text() -> str:
    """"rope-fusion 0.1.0 (torch 2.13.0, triton 3.9.0)": read from the installed distributions, so that it imports
    neither torch nor Triton."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"rope-fusion {__version__} (torch {installed('torch')}, triton {installed('triton')})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rope-fusion", description="RoPE fusion for torch.compile: tools.")
    ap.add_argument("--version", action="version", version=version_text())
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_, configure, _, _) in _COMMANDS.items():
        configure(sub.add_parser(name, help=help_, description=help_))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _COMMANDS and _COMMANDS[argv[0]][3]:  # passthrough: the rest, unparsed
        return _COMMANDS[argv[0]][2](argparse.Namespace(command=argv[0], args=argv[1:]))
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.command][2](args)


# -- explain ------------------------------------------------------------------------------------------

def load_callable(spec: str) -> Callable[[], Any]:
    """`package.module:attr` (attr may be dotted); the current directory is importable, like `python -m`."""
    if ":" not in spec:
        raise ValueError(f"expected MODULE:CALLABLE, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) from what the callable returned as example inputs."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list))
            and isinstance(inputs[1], dict)):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def run_explain(target: Callable[[], Any], backend: str = "auto", fuse_qk: bool = True,
                dynamic: bool | None = None):
    """Build, compile with a fresh pass (caches off, so the pass runs) and run once: (pass, output)."""
    import torch

    from .passes.rope_pass import RopeFusionPass

    made = target()
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ValueError("the callable must return (model, example_inputs)")
    model, inputs = made
    args, kwargs = split_inputs(inputs)
    p = RopeFusionPass(backend=backend, fuse_qk=fuse_qk)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
        compiled = torch.compile(model, dynamic=dynamic, options={"post_grad_custom_post_pass": p})
        out = compiled(*args, **kwargs)
    return p, out


def print_report(report: Any, title: str, plain: bool = False, file: Any = None, verbose: bool = False) -> None:
    """The report as rich tables (sites, kernels, near misses, errors), or report.table() as text: without rich,
    with --plain, and with --verbose (every detail, passes/report_text.py)."""
    file = file or sys.stdout
    try:
        if plain or verbose:
            raise ImportError
        from rich.console import Console
    except ImportError:
        print(title, file=file)
        print(report.table(verbose=verbose), file=file)
        return
    from rich.markup import escape

    from .passes import report_text

    console = Console(file=file, width=max(140, Console(file=file).width))
    head, *notes = report_text.header(report)
    console.print(f"[bold]{escape(title)}[/bold]: {escape(head.split(': ', 1)[1])}")
    for line in notes:
        console.print(escape(line))
    if report.sites or report.misses:
        console.print(escape(f"  {report_text.DETAILS_HINT.replace('table(verbose=True)', '--verbose')}"))
    for table in _report_tables(report):
        console.print(table)
    if report.host_tables:
        console.print("host tables copied to the device once (not per call): " + escape(", ".join(report.host_tables)))


def _report_tables(report: Any) -> list:
    """The rich tables of a report: one row per site, kernel note, near miss and error, at a glance."""
    from rich.markup import escape
    from rich.table import Table

    from .passes.report_text import kernel_label, norm_glance, short_dtype, short_path

    def table(title: str, rows: list, columns: tuple) -> Table:
        t = Table(title=title)
        for col in columns:
            t.add_column(col, overflow="fold")
        for cells in rows:  # model names and reasons hold brackets: never markup
            t.add_row(*(escape(str(c)) for c in cells))
        return t

    def kernel_of(s: Any) -> Any:
        return report.kernels[s.kernel] if 0 <= s.kernel < len(report.kernels) else None

    def graph(g: int) -> str:  # which graphs a compile cache served: said once, in the header
        kind = [r.kind for r in report.graph_records if r.index == g]
        return f"{g}{' [backward]' if kind == ['backward'] else ''}"

    out = []
    if report.sites:
        out.append(table("fused sites", [
            (i, graph(s.graph), s.role, s.style_label(), f"{s.rotated_lanes()}/{s.head_dim}",
             s.table_form + (" angles" if s.angle_tables else ""),
             "/".join(short_dtype(d) for d in (s.x_dtype, s.table_dtype, s.out_dtype)),
             norm_glance(s.norm).removeprefix(", norm ") or "-", f"{s.kernel} {kernel_label(kernel_of(s))}",
             short_path(s.source)) for i, s in enumerate(report.sites)],
            ("#", "graph", "role", "style", "R/D", "tables", "dtypes x/tables/out", "norm", "kernel", "source")))
    if report.kernels:
        out.append(table("kernels", [(i, graph(k.graph), kernel_label(k), ", ".join(map(str, k.sites)),
                                      k.fallback or "-") for i, k in enumerate(report.kernels)],
                         ("#", "graph", "op[backend]", "sites", "fell back")))
    if report.misses:
        out.append(table("near misses (left unchanged)", [
            (graph(m.graph), m.tensor or "-", m.plain_reason(), short_path(m.source)) for m in report.misses],
            ("graph", "tensor", "reason", "source")))
    if report.errors:
        out.append(table("internal errors", [(graph(e.graph), e.error, e.outcome) for e in report.errors],
                         ("graph", "error", "what it left")))
    return out


def _explain_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODULE:CALLABLE",
                   help="a callable returning (model, example_inputs), e.g. examples.wan_demo:tiny_wan")
    from .ops.backends import BACKEND_NAMES

    p.add_argument("--backend", default="auto", choices=BACKEND_NAMES)
    p.add_argument("--no-qk", dest="fuse_qk", action="store_false", help="do not pair q and k")
    p.add_argument("--dynamic", action="store_true", default=None, help="torch.compile(dynamic=True)")
    p.add_argument("--plain", action="store_true", help="plain text instead of rich tables")
    p.add_argument("--verbose", action="store_true",
                   help="every detail: why a norm stayed, auto's choices, folds, FX nodes, full paths")


@command("explain", "compile MODULE:CALLABLE with the pass and print what fused, and what did not",
         _explain_options)
def explain(args: Any) -> int:
    try:
        target = load_callable(args.target)
    except Exception as e:
        print(f"rope-fusion explain: cannot load {args.target}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        p, _ = run_explain(target, backend=args.backend, fuse_qk=args.fuse_qk, dynamic=args.dynamic)
    except Exception as e:
        print(f"rope-fusion explain: {args.target} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print_report(p.report, f"rope_fusion explain {args.target}", plain=args.plain, verbose=args.verbose)
    return 0


# -- commands that run a file of the source checkout ------------------------------------------------------

def find_checkout_file(relpath: str) -> str | None:
    """`relpath` in the source tree this package comes from (an editable install), or in the current
    directory; None from a plain install (benchmarks and the zoo are not part of the package)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root in (here, os.getcwd()):
        path = os.path.join(root, relpath)
        if os.path.isfile(path):
            return path
    return None


def find_benchmark() -> str | None:
    return find_checkout_file(os.path.join("benchmarks", "kernels.py"))


def gpu_present() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def _rest_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed through")


def wants_help(rest: list[str]) -> bool:
    return "-h" in rest or "--help" in rest


def _run_checkout_module(relpath: str, rest: list[str], usage: str) -> int:
    """`python -m` the module at relpath with the checkout root as working directory. Outside a checkout,
    `--help` prints `usage` (what the command does and that it needs one) and anything else exits 2."""
    path = find_checkout_file(relpath)
    if path is None:
        if wants_help(rest):
            print(f"{usage}\n\n{relpath} is part of a source checkout of rope_fusion, not of the installed package: "
                  "run this from a checkout (or with one as the current directory).")
            return 0
        print(f"rope-fusion: {relpath} not found: run from a source checkout of rope_fusion", file=sys.stderr)
        return 2
    root = path[: -len(relpath)].rstrip(os.sep) or os.sep
    module = relpath[:-3].replace(os.sep, ".")
    return subprocess.call([sys.executable, "-m", module, *rest], cwd=root)


@command("bench", "run the kernel benchmark (benchmarks/kernels.py of a source checkout) on the GPU; "
         "arguments pass through", _rest_options, passthrough=True)
def bench(args: Any) -> int:
    rest = list(args.args)
    relpath, usage = os.path.join("benchmarks", "kernels.py"), BENCH_USAGE
    if not wants_help(rest) and not gpu_present():
        print("rope-fusion bench: no GPU here (torch.cuda.is_available() is False), and the kernel benchmark times "
              "CUDA/ROCm kernels. Its CPU smoke test (plumbing, not speed), from a checkout: "
              "python -m benchmarks.kernels --quick", file=sys.stderr)
        return 2
    return _run_checkout_module(relpath, rest, usage)


BENCH_USAGE = "usage: rope-fusion bench [ARGS...]: runs benchmarks/kernels.py of a source checkout with ARGS on a GPU"
COVERAGE_USAGE = ("usage: rope-fusion coverage [ARGS...]: runs tests/zoo/coverage.py of a source checkout with ARGS "
                  "(the model-zoo coverage table; needs diffusers and transformers)")


@command("coverage", "print the model-zoo coverage table (tests/zoo/coverage.py of a source checkout)",
         _rest_options, passthrough=True)
def coverage(args: Any) -> int:
    return _run_checkout_module(os.path.join("tests", "zoo", "coverage.py"), list(args.args), COVERAGE_USAGE)


# -- calibrate ----------------------------------------------------------------------------------------

def _calibrate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8192, help="tokens per row (default 8192)")
    p.add_argument("--rows", default="", help="comma-separated substrings of the row names to run (default all)")
    p.add_argument("--dry", action="store_true", help="print the table, do not write it")


@command("calibrate", "time the kernel rows on this GPU and write its factor table for auto's fallback",
         _calibrate_options)
def calibrate(args: Any) -> int:
    if not gpu_present():
        print("rope-fusion calibrate: no GPU here (torch.cuda.is_available() is False): the factor table is "
              "measured on the GPU it is for", file=sys.stderr)
        return 2
    import torch

    from .passes.auto import auto_decisions
    from .passes.auto.calibration import ROWS
    from .passes.auto.calibration import calibrate as run_rows

    wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
    rows = tuple(r for r in ROWS if not wanted or any(w in r.name for w in wanted))
    if not rows:
        print(f"rope-fusion calibrate: no row matches {args.rows!r}; rows: {[r.name for r in ROWS]}",
              file=sys.stderr)
        return 2
    device = f"cuda:{torch.cuda.current_device()}"
    factors, records = run_rows(device=device, tokens=args.tokens, rows=rows)
    print(f"{'row':32s} {'floor us':>9s} {'triton':>8s} {'inductor':>9s} {'left':>7s}  (x the floor)")
    for r in records:
        cells = [f"{r['factor'][v]:.2f}" if v in r["factor"] else "-" for v in ("triton", "inductor", "left")]
        print(f"{r['row']:32s} {r['us']['floor']:9.1f} {cells[0]:>8s} {cells[1]:>9s} {cells[2]:>7s}")
        for v, why in r["skipped"].items():
            print(f"    {v} not counted: {why}")
    if args.dry:
        return 0
    path = auto_decisions.write_factors(device, factors, {r["row"]: r for r in records})
    print(f"wrote {path} ({auto_decisions.device_name(device)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
