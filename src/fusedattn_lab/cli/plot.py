"""`fusedattn plot DIR`: redraw the figures of a run or bench folder from its CSV."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn.problem import ProblemError


def add(sub) -> None:
    p = sub.add_parser("plot", help="redraw the figures of a run folder from its summary.csv")
    p.add_argument("run_dir", type=Path)


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab.outputs import writable_dir
    from fusedattn_lab.plots import draw, draw_bench

    summary, bench = args.run_dir / "summary.csv", args.run_dir / "bench.csv"
    if not summary.is_file() and not bench.is_file():
        raise ProblemError("run_dir", str(args.run_dir),
                           "a run folder holding summary.csv (run-all) or bench.csv (bench)")
    writable_dir("run_dir", args.run_dir)  # the figures are written beside the CSV
    csv_path, drawer = (summary, draw) if summary.is_file() else (bench, draw_bench)
    try:
        figures = drawer(csv_path)
    except (KeyError, ValueError, TypeError, IndexError) as err:
        raise ProblemError(csv_path.name, str(csv_path), "a CSV as fusedattn writes it "
                           f"(reading it failed: {type(err).__name__}: {err})") from None
    for f in figures:
        console.print(f"figure: {f}")
    if not figures:
        console.print("no timed rows in this summary (emulation?): nothing to draw")
    return 0
