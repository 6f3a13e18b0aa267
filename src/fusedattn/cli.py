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


def build_parser() -> argparse.ArgumentParser:
    from fusedattn.inputs import PROTOCOLS
    from fusedattn.timing import MODES
    from fusedattn.versions import VERSIONS

    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="verify and time versions on one problem")
    run.add_argument("--version", default="all",
                     help="all, or a comma-separated list of: " + ", ".join(VERSIONS))
    run.add_argument("--seq", type=_int, help="S, rows of Q/K/V (GPU default 128)")
    run.add_argument("--dim", type=_int, help="D, columns of Q/K/V (GPU default 64)")
    run.add_argument("--block", type=_int,
                     help="threads per block, thread-level versions (GPU default 256)")
    run.add_argument("--warmup", type=_int, default=5)
    run.add_argument("--repeat", type=_int, default=20)
    run.add_argument("--seed", type=_int, default=0)
    run.add_argument("--inputs", default="uniform", help="|".join(PROTOCOLS))
    run.add_argument("--timing", default="events", help="|".join(MODES))
    run.add_argument("--json", type=Path, help="write every record (and the environment) here")
    return parser


def _problem(args: argparse.Namespace, console: Console) -> Problem:
    defaults = EMU_DEFAULT if mode.EMULATION else GPU_DEFAULT
    chosen = {key: getattr(args, key) for key in defaults}
    if mode.EMULATION and all(v is None for v in chosen.values()):
        console.print(f"[yellow]emulation (no GPU): using the small default "
                      f"{defaults['seq']}x{defaults['dim']}, block {defaults['block']}; "
                      f"the chapter's problem is 128x64, block 256[/]")
    return Problem(**{key: defaults[key] if v is None else v for key, v in chosen.items()})


def _check_counts(args: argparse.Namespace) -> None:
    from fusedattn.timing import MODES

    if args.warmup < 0:
        raise ProblemError("warmup", args.warmup, "an integer >= 0")
    if args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "an integer >= 1")
    if args.timing not in MODES:
        raise ProblemError("timing", args.timing, "one of " + ", ".join(MODES))
    if args.json is not None and args.json.is_dir():
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


COMMANDS = {"run": cmd_run}


def main(argv: list[str] | None = None) -> int:
    console = Console()
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, console)
    except ProblemError as err:
        print(f"fusedattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusedattn: interrupted", file=sys.stderr)
        return 130
