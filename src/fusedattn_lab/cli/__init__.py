"""Command line: `fusedattn COMMAND ...` (also `python -m fusedattn_lab COMMAND ...`).

One module per command, each with `add(sub)` (its arguments) and `run(args, console)`;
`shared` holds what they share. Every bad input is one line on stderr and exit status 2.
The lab's mode (GPU or emulation, `fusedattn_lab.choose_mode`) is chosen before any
command module, and so fusedattn, is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys

NAMES = {"list": "list_", "run": "run", "run-all": "run_all", "profile": "profile",
         "check-races": "check_races", "walkthrough": "walkthrough", "masks": "masks",
         "sweep": "sweep", "bench": "bench", "tune": "tune", "plot": "plot",
         "warmup": "warmup"}
"""Command name -> its module in `fusedattn_lab.cli`, in the order `--help` lists them."""


def commands() -> dict:
    """Command name -> its module, imported (after the mode is chosen)."""
    from fusedattn_lab import choose_mode

    choose_mode()
    return {name: importlib.import_module(f"fusedattn_lab.cli.{module}")
            for name, module in NAMES.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in commands().values():
        module.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        from rich.console import Console

        mods = commands()
    except ImportError as err:  # the library alone was installed
        print(f"fusedattn: error: the lab needs its extra ({err.name} is missing): "
              "pip install 'fusedattn[lab]'", file=sys.stderr)
        return 2
    from fusedattn.problem import ProblemError

    # Piped output (CI logs, the device tool) gets a wide table rather than 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    args = build_parser().parse_args(argv)
    try:
        return mods[args.command].run(args, console)
    except ProblemError as err:
        print(f"fusedattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusedattn: interrupted", file=sys.stderr)
        return 130
