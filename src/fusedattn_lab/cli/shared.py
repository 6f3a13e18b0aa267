"""What the commands share: argument types, the problem from the arguments, the checks
that run before any work, and the evidence folder helpers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import Problem, ProblemError

OUT_DEFAULT = "(default evidence/ on a GPU, a temporary folder in emulation)"
GPU_DEFAULT = {"seq": 128, "dim": 64, "block": 256}  # the chapter's main problem
EMU_DEFAULT = {"seq": 16, "dim": 8, "block": 32}
"""Emulation default: numba's simulator runs every CUDA thread as an OS thread, so the
chapter's 128x64 with 256 threads would take hours on a CPU; 16x8 with 32 threads takes
seconds and still exercises a partial tile (S < BLOCK_K for t1) and a block larger than D."""


def int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def int_list_arg(text: str) -> list[int]:
    return [int_arg(t) for t in text.split(",") if t.strip()]


def shapes_arg(text: str) -> list[tuple[int, int]]:
    if text.strip().lower() in ("", "none"):
        return []
    shapes = []
    for t in text.split(","):
        parts = t.strip().lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"{t.strip()!r} in {text!r}: expected SxD with "
                                             "S, D >= 1, comma-separated, e.g. 1x1,7x13; or "
                                             "none")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def common_options(p: argparse.ArgumentParser, warmup: int, repeat: int,
                   several_inputs: bool = False) -> None:
    from fusedattn_lab.inputs import PROTOCOLS
    from fusedattn_lab.registry import VERSIONS
    from fusedattn_lab.timing import MODES

    p.add_argument("--version", default="all",
                   help="all, or a comma-separated list of: " + ", ".join(VERSIONS))
    p.add_argument("--dim", type=int_arg, help="D, columns of Q/K/V (GPU default 64)")
    p.add_argument("--block", type=int_arg,
                   help="threads per block, thread-level versions (GPU default 256)")
    p.add_argument("--warmup", type=int_arg, default=warmup)
    p.add_argument("--repeat", type=int_arg, default=repeat)
    p.add_argument("--seed", type=int_arg, default=0)
    p.add_argument("--inputs", default="uniform", help="|".join(PROTOCOLS) + (
        ", or several comma-separated (uniform,normal: the chapter's two drivers)"
        if several_inputs else ""))
    p.add_argument("--timing", default="events", help="|".join(MODES))
    p.add_argument("--causal", action="store_true", help="mask key j > i (exercise 5)")


def problem_from(args: argparse.Namespace, console: Console, seq: int | None = None) -> Problem:
    defaults = EMU_DEFAULT if mode.EMULATION else GPU_DEFAULT
    chosen = {key: getattr(args, key) for key in defaults}
    if seq is not None or isinstance(chosen["seq"], list):
        chosen["seq"] = seq
    if mode.EMULATION and all(v is None for v in chosen.values()):
        console.print(f"[yellow]emulation (no GPU): using the small default "
                      f"{defaults['seq']}x{defaults['dim']}, block {defaults['block']}; "
                      f"the chapter's problem is 128x64, block 256[/]")
    return Problem(**{key: defaults[key] if v is None else v for key, v in chosen.items()},
                   causal=getattr(args, "causal", False))


def check_counts(args: argparse.Namespace, several_inputs: bool = False) -> None:
    """Counts, timing mode, input protocol(s), seed and --json of a timing command."""
    from fusedattn_lab.inputs import PROTOCOLS
    from fusedattn_lab.timing import MODES

    if args.warmup < 0:
        raise ProblemError("warmup", args.warmup, "an integer >= 0")
    if args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "an integer >= 1")
    if args.timing not in MODES:
        raise ProblemError("timing", args.timing, "one of " + ", ".join(MODES))
    protocols = args.inputs.split(",") if several_inputs else [args.inputs]
    if any(p not in PROTOCOLS for p in protocols) or len(set(protocols)) < len(protocols):
        raise ProblemError("inputs", args.inputs, ("a comma-separated subset" if several_inputs
                                                   else "one") + " of " + ", ".join(PROTOCOLS))
    if args.seed < 0:
        raise ProblemError("seed", args.seed, "an integer >= 0")
    if getattr(args, "json", None) is not None:
        from fusedattn_lab.outputs import writable_file

        writable_file("json", args.json)


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def out_base(args: argparse.Namespace) -> Path:
    """The checked base folder of a command's evidence (before any work)."""
    from fusedattn_lab.outputs import default_base, writable_dir

    return writable_dir("out", default_base(args.out))


def stamp_dir(args: argparse.Namespace, suffix: str, env: dict) -> Path:
    from fusedattn_lab.outputs import new_run_dir

    return new_run_dir(out_base(args), env, suffix)


def write_environment(out_dir: Path, env: dict, **extra) -> None:
    """`environment.json` of a result folder: the machine, the command line, and `extra`."""
    from fusedattn_lab.evidence import write_json

    write_json(out_dir / "environment.json",
               env | {"command": "fusedattn " + " ".join(sys.argv[1:]), **extra})


def write_rows_csv(path: Path, rows: list[dict]) -> None:
    import csv
    import io

    from fusedattn_lab.evidence import write_atomic

    buf = io.StringIO()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buf.getvalue())


Column = tuple[str, Callable[[object], str]]  # (header, row -> cell text)


def render_table(console: Console, title: str, rows, columns: list[Column],
                 wrap: tuple[str, ...] = ()) -> None:
    """The one table renderer: `columns` is data, (header, row -> cell text), applied to
    each row (a record, a dataclass or a dict) in order; the headers in `wrap` may wrap
    (long texts), the others keep one line."""
    from rich.table import Table

    table = Table(title=title)
    for header, _ in columns:
        table.add_column(header, no_wrap=header not in wrap)
    for row in rows:
        table.add_row(*(cell(row) for _, cell in columns))
    console.print(table)
