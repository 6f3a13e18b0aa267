"""Command line: `fusedattn COMMAND ...` (also `python -m fusedattn COMMAND ...`).

One module per command, each with `add(sub)` (its arguments) and `run(args, console)`;
`shared` holds what they share. Every bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from fusedattn.cli import (
    bench,
    check_races,
    list_,
    masks,
    plot,
    profile,
    run,
    run_all,
    sweep,
    tune,
    walkthrough,
)
from fusedattn.problem import ProblemError

COMMANDS = {"list": list_, "run": run, "run-all": run_all, "profile": profile,
            "check-races": check_races, "walkthrough": walkthrough, "masks": masks,
            "sweep": sweep, "bench": bench, "tune": tune, "plot": plot}
"""Command name -> its module, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Piped output (CI logs, the device tool) gets a wide table rather than 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args, console)
    except ProblemError as err:
        print(f"fusedattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusedattn: interrupted", file=sys.stderr)
        return 130
