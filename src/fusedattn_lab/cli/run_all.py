"""`fusedattn run-all`: the chapter's protocol in independent processes, with evidence."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import Problem, ProblemError
from fusedattn_lab.cli.shared import (
    EMU_DEFAULT,
    GPU_DEFAULT,
    OUT_DEFAULT,
    check_counts,
    common_options,
    fmt,
    int_arg,
    int_list_arg,
    out_base,
    problem_from,
    render_table,
    shapes_arg,
)


def add(sub) -> None:
    p = sub.add_parser("run-all", help="the chapter's full protocol, with evidence files")
    common_options(p, warmup=10, repeat=50, several_inputs=True)  # the chapter's historical group
    p.add_argument("--seq", type=int_list_arg,
                    help="main S, or a comma-separated sweep, e.g. 128,1024,16384 (default 128)")
    p.add_argument("--processes", type=int_arg, default=3, help="independent processes")
    p.add_argument("--boundary", type=shapes_arg, default="1x1,7x13,33x31,65x33",
                    help="boundary shapes SxD, verified before and after timing; none to skip")
    p.add_argument("--out", type=Path, default=None,
                    help="base folder; the run goes to OUT/<gpu>/<timestamp>/ " + OUT_DEFAULT)
    p.add_argument("--resume", type=Path, help="a run folder to complete (same options)")


def run(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fusedattn_lab.evidence import environment
    from fusedattn_lab.outputs import new_run_dir
    from fusedattn_lab.plots import draw
    from fusedattn_lab.protocol import Settings, check_resources
    from fusedattn_lab.registry import select
    from fusedattn_lab.runall import Plan, execute

    versions = select(args.version)
    seqs = args.seq or [GPU_DEFAULT["seq"]]
    if mode.EMULATION and args.block is None:
        args.block = EMU_DEFAULT["block"]
    problems = [problem_from(args, console, seq) for seq in seqs]
    boundary = [Problem(s, d, problems[0].block) for s, d in args.boundary]
    check_counts(args, several_inputs=True)
    if args.processes < 1:
        raise ProblemError("processes", args.processes, "an integer >= 1")
    for v in versions:
        for p in problems + boundary:
            v.limits.check(v.name, p)
    for p in boundary + ([] if mode.EMULATION else problems):  # what this machine runs
        check_resources(p, versions, lambda text: console.print(f"[yellow]{text}[/]"))
    plan = Plan(tuple(v.name for v in versions), tuple(seqs), problems[0].dim,
                problems[0].block, args.processes,
                Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing).__dict__,
                tuple(tuple(b) for b in args.boundary), args.causal)
    if not plan.units():
        raise ProblemError("boundary", "none", "at least one shape: in emulation run-all runs "
                           "the boundary suite only, so an empty one leaves nothing to run")
    if args.resume is not None:
        if not (args.resume / "plan.json").is_file():
            raise ProblemError("resume", str(args.resume), "a run folder holding plan.json")
        run_dir = args.resume
    else:
        run_dir = new_run_dir(out_base(args), environment())
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

    by_key: dict[tuple, dict] = {}  # the summary's metric rows, one dict per version/shape
    for r in rows:
        by_key.setdefault((r.inputs, r.suite, r.seq, r.dim, r.version), {})[r.metric] = r
    render_table(console, f"run-all — {mode.describe()}", by_key.values(), [
        ("inputs", lambda m: m["max_abs_error"].inputs),
        ("suite", lambda m: m["max_abs_error"].suite),
        ("shape", lambda m: f"{m['max_abs_error'].seq}x{m['max_abs_error'].dim}"),
        ("version", lambda m: m["max_abs_error"].version),
        ("verdict", lambda m: m["max_abs_error"].verdict),
        ("max abs err", lambda m: fmt(m["max_abs_error"].max_abs_error, ".2e")),
        ("GPU ms median", lambda m: fmt(m["gpu_ms"].median if "gpu_ms" in m else None, ".4f")),
        ("range", lambda m: f"{m['gpu_ms'].range_low:.4f}–{m['gpu_ms'].range_high:.4f}"
         if "gpu_ms" in m else "—"),
        ("peak MiB", lambda m: fmt(m["peak_bytes"].median / 2**20 if "peak_bytes" in m
                                   else None, ".3f"))])
    for f in figures:
        console.print(f"figure: {f}")
    console.print(f"evidence: {run_dir}/records.jsonl, summary.csv, environment.json")
    return 0 if all(r.verdict == "PASS" for r in rows) else 1
