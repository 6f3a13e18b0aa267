"""Command line: `fusedattn run ...` (also `python -m fusedattn run ...`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusedattn import mode
from fusedattn.problem import Problem, ProblemError

GPU_DEFAULT = {"seq": 128, "dim": 64, "block": 256}  # the chapter's main problem
EMU_DEFAULT = {"seq": 16, "dim": 8, "block": 32}
"""Emulation default: numba's simulator runs every CUDA thread as an OS thread, so the
chapter's 128x64 with 256 threads would take hours on a CPU; 16x8 with 32 threads takes
seconds and still exercises a partial tile (S < BLOCK_K for t1) and a block larger than D."""


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _int_list(text: str) -> list[int]:
    return [_int(t) for t in text.split(",") if t.strip()]


def _shapes(text: str) -> list[tuple[int, int]]:
    if text.strip().lower() in ("", "none"):
        return []
    try:
        return [tuple(int(x) for x in t.lower().split("x")) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SxD[,SxD...], e.g. 1x1,7x13"
                                         ) from None


def _common(p: argparse.ArgumentParser, warmup: int, repeat: int) -> None:
    from fusedattn.inputs import PROTOCOLS
    from fusedattn.timing import MODES
    from fusedattn.versions import VERSIONS

    p.add_argument("--version", default="all",
                   help="all, or a comma-separated list of: " + ", ".join(VERSIONS))
    p.add_argument("--dim", type=_int, help="D, columns of Q/K/V (GPU default 64)")
    p.add_argument("--block", type=_int,
                   help="threads per block, thread-level versions (GPU default 256)")
    p.add_argument("--warmup", type=_int, default=warmup)
    p.add_argument("--repeat", type=_int, default=repeat)
    p.add_argument("--seed", type=_int, default=0)
    p.add_argument("--inputs", default="uniform", help="|".join(PROTOCOLS))
    p.add_argument("--timing", default="events", help="|".join(MODES))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="verify and time versions on one problem")
    _common(run, warmup=5, repeat=20)
    run.add_argument("--seq", type=_int, help="S, rows of Q/K/V (GPU default 128)")
    run.add_argument("--json", type=Path, help="write every record (and the environment) here")

    ra = sub.add_parser("run-all", help="the chapter's full protocol, with evidence files")
    _common(ra, warmup=10, repeat=50)  # the chapter's historical group
    ra.add_argument("--seq", type=_int_list,
                    help="main S, or a comma-separated sweep, e.g. 128,1024,16384 (default 128)")
    ra.add_argument("--processes", type=_int, default=3, help="independent processes")
    ra.add_argument("--boundary", type=_shapes, default="1x1,7x13,33x31,65x33",
                    help="boundary shapes SxD, verified before and after timing; none to skip")
    ra.add_argument("--out", type=Path, default=Path("evidence"),
                    help="base folder; the run goes to OUT/<gpu>/<timestamp>/")
    ra.add_argument("--resume", type=Path, help="a run folder to complete (same options)")

    pl = sub.add_parser("plot", help="redraw the figures of a run folder from its summary.csv")
    pl.add_argument("run_dir", type=Path)
    return parser


def _problem(args: argparse.Namespace, console: Console, seq: int | None = None) -> Problem:
    defaults = EMU_DEFAULT if mode.EMULATION else GPU_DEFAULT
    chosen = {key: getattr(args, key) for key in defaults}
    if seq is not None or isinstance(chosen["seq"], list):
        chosen["seq"] = seq
    if mode.EMULATION and all(v is None for v in chosen.values()):
        console.print(f"[yellow]emulation (no GPU): using the small default "
                      f"{defaults['seq']}x{defaults['dim']}, block {defaults['block']}; "
                      f"the chapter's problem is 128x64, block 256[/]")
    return Problem(**{key: defaults[key] if v is None else v for key, v in chosen.items()})


def _check_counts(args: argparse.Namespace) -> None:
    from fusedattn.inputs import PROTOCOLS
    from fusedattn.timing import MODES

    if args.warmup < 0:
        raise ProblemError("warmup", args.warmup, "an integer >= 0")
    if args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "an integer >= 1")
    if args.timing not in MODES:
        raise ProblemError("timing", args.timing, "one of " + ", ".join(MODES))
    if args.inputs not in PROTOCOLS:
        raise ProblemError("inputs", args.inputs, "one of " + ", ".join(PROTOCOLS))
    if args.seed < 0:
        raise ProblemError("seed", args.seed, "an integer >= 0")
    if getattr(args, "json", None) is not None and args.json.is_dir():
        raise ProblemError("json", str(args.json), "a file path, not a directory")


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.bench import Settings, measure
    from fusedattn.evidence import environment, write_json
    from fusedattn.inputs import make_inputs
    from fusedattn.reference import attention_ref
    from fusedattn.versions import VERSIONS, select

    versions = select(args.version)
    problem = _problem(args, console)
    _check_counts(args)
    settings = Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing)
    for v in versions:  # every limit before anything runs
        v.limits.check(v.name, problem)
    inputs = make_inputs(problem, settings.inputs, settings.seed, mode.DEVICE)
    ref = attention_ref(*inputs)

    records, failures = [], {}
    with console.status("running…") as status:
        for v in versions:
            status.update(f"{v.name}: verify" + ("" if mode.EMULATION else " + time"))
            try:
                records.append(measure(v, problem, settings, inputs, ref))
            except ProblemError:
                raise
            except Exception as exc:  # a kernel that fails to compile or launch: one row
                failures[v.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    table = Table(title=f"attention forward {problem.label()} float32, block {problem.block}, "
                        f"inputs {settings.inputs} seed {settings.seed} — {mode.describe()}")
    for col in ("version", "route", "max abs err", "verdict", "median ms", "min ms",
                "max ms", "host µs/call"):
        left = col in ("version", "route")
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    for r in records:
        t = r.timing or {}
        err = max(r.before.max_abs, r.after.max_abs if r.after else 0.0)
        verdict = "PASS" if r.ok else "FAIL: " + "; ".join(
            r.before.reasons + (r.after.reasons if r.after else ()))
        table.add_row(r.version, r.route, f"{err:.2e}", verdict,
                      _fmt(t.get("median_ms"), ".4f"), _fmt(t.get("min_ms"), ".4f"),
                      _fmt(t.get("max_ms"), ".4f"), _fmt(t.get("host_us_median"), ".1f"))
    for name, why in failures.items():
        table.add_row(name, VERSIONS[name].route, "—", f"ERROR: {why}", "—", "—", "—", "—")
    console.print(table)
    if mode.EMULATION:
        console.print("emulation: results verified, no times (emulation proves logic, not speed)")
    else:
        console.print(f"GPU times: CUDA events around exactly each version's launches "
                      f"({settings.timing} mode, GPU primed), warmup {settings.warmup}, "
                      f"repeat {settings.repeat}; host µs/call is the launch cost on the CPU")
    if args.json is not None:
        write_json(args.json, {"environment": environment(), "problem": problem.__dict__,
                               "records": [r.to_dict() for r in records],
                               "errors": failures})
        console.print(f"records written to {args.json}")
    return 0 if all(r.ok for r in records) and not failures else 1


def cmd_run_all(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fusedattn.bench import Settings
    from fusedattn.evidence import environment
    from fusedattn.plots import draw
    from fusedattn.runall import Plan, execute, run_dir_for
    from fusedattn.versions import select

    versions = select(args.version)
    seqs = args.seq or [GPU_DEFAULT["seq"]]
    if mode.EMULATION and args.block is None:
        args.block = EMU_DEFAULT["block"]
    problems = [_problem(args, console, seq) for seq in seqs]
    for s, d in args.boundary:
        Problem(s, d, problems[0].block)
    _check_counts(args)
    if args.processes < 1:
        raise ProblemError("processes", args.processes, "an integer >= 1")
    for v in versions:
        for p in problems + [Problem(s, d, problems[0].block) for s, d in args.boundary]:
            v.limits.check(v.name, p)
    plan = Plan(tuple(v.name for v in versions), tuple(seqs), problems[0].dim,
                problems[0].block, args.processes,
                Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing).__dict__,
                tuple(tuple(b) for b in args.boundary))
    if args.resume is not None:
        if not (args.resume / "plan.json").is_file():
            raise ProblemError("resume", str(args.resume), "a run folder holding plan.json")
        run_dir = args.resume
    else:
        run_dir = run_dir_for(args.out, environment())
    if mode.EMULATION:
        console.print("[yellow]emulation: boundary suite only, verified, no times and no "
                      "memory peaks; the main shape needs a GPU[/]")
    console.print(f"run folder: {run_dir}")

    def progress():
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console)

    try:
        _, rows = execute(plan, run_dir, console, progress)
    except ValueError as err:
        raise ProblemError("resume", str(run_dir), str(err)) from None
    figures = draw(run_dir / "summary.csv")

    table = Table(title=f"run-all — {mode.describe()}")
    for col in ("suite", "shape", "version", "verdict", "max abs err", "GPU ms median",
                "range", "peak MiB"):
        table.add_column(col, no_wrap=True)
    by_key = {}
    for r in rows:
        by_key.setdefault((r.suite, r.seq, r.dim, r.version), {})[r.metric] = r
    for (suite, seq, dim, name), metrics in by_key.items():
        base = metrics["max_abs_error"]
        t = metrics.get("gpu_ms")
        peak = metrics.get("peak_bytes")
        table.add_row(suite, f"{seq}x{dim}", name, base.verdict,
                      _fmt(base.max_abs_error, ".2e"), _fmt(t and t.median, ".4f"),
                      f"{t.range_low:.4f}–{t.range_high:.4f}" if t else "—",
                      _fmt(peak and peak.median / 2**20, ".3f"))
    console.print(table)
    for f in figures:
        console.print(f"figure: {f}")
    console.print(f"evidence: {run_dir}/records.jsonl, summary.csv, environment.json")
    return 0 if all(r.verdict == "PASS" for r in rows) else 1


def cmd_plot(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.plots import draw

    summary = args.run_dir / "summary.csv"
    if not summary.is_file():
        raise ProblemError("run_dir", str(args.run_dir), "a run folder holding summary.csv")
    figures = draw(summary)
    for f in figures:
        console.print(f"figure: {f}")
    if not figures:
        console.print("no timed rows in this summary (emulation?): nothing to draw")
    return 0


COMMANDS = {"run": cmd_run, "run-all": cmd_run_all, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> int:
    # Piped output (CI logs, the device tool) gets a wide table rather than 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, console)
    except ProblemError as err:
        print(f"fusedattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusedattn: interrupted", file=sys.stderr)
        return 130
