"""`fusedattn run`: verify and time versions on one problem."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import ProblemError
from fusedattn_lab.cli.shared import (
    check_counts,
    common_options,
    fmt,
    int_arg,
    problem_from,
    render_table,
)


def add(sub) -> None:
    p = sub.add_parser("run", help="verify and time versions on one problem")
    common_options(p, warmup=5, repeat=20)
    p.add_argument("--seq", type=int_arg, help="S, rows of Q/K/V (GPU default 128)")
    p.add_argument("--json", type=Path, help="write every record (and the environment) here")


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab.evidence import environment, write_json
    from fusedattn_lab.protocol import Settings, case_for, check_resources, measure
    from fusedattn_lab.registry import VERSIONS, select

    versions = select(args.version)
    problem = problem_from(args, console)
    check_counts(args)
    settings = Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing)
    for v in versions:  # every limit before anything runs
        v.limits.check(v.name, problem)
    check_resources(problem, versions, lambda text: console.print(f"[yellow]{text}[/]"))
    case = case_for(problem, settings)

    records, failures = [], {}
    with console.status("running…") as status:
        for v in versions:
            status.update(f"{v.name}: verify" + ("" if mode.EMULATION else " + time"))
            try:
                records.append(measure(v, problem, settings, case))
            except ProblemError:
                raise
            except Exception as exc:  # a kernel that fails to compile or launch: one row
                failures[v.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    errors = [SimpleNamespace(version=n, route=VERSIONS[n].route, why=why)
              for n, why in failures.items()]

    def timing(key, spec):
        return lambda r: "—" if not hasattr(r, "timing") else fmt((r.timing or {}).get(key),
                                                                 spec)

    render_table(console, f"attention forward {problem.label()} float32, block "
                 f"{problem.block}, inputs {settings.inputs} seed {settings.seed} — "
                 f"{mode.describe()}", records + errors, [
                     ("version", lambda r: r.version), ("route", lambda r: r.route),
                     ("max abs err", lambda r: f"{r.max_abs:.2e}" if hasattr(r, "max_abs")
                      else "—"),
                     ("verdict", lambda r: f"ERROR: {r.why}" if hasattr(r, "why") else
                      r.verdict if r.ok else "FAIL: " + "; ".join(r.reasons)),
                     ("median ms", timing("median_ms", ".4f")),
                     ("min ms", timing("min_ms", ".4f")), ("max ms", timing("max_ms", ".4f")),
                     ("host µs/call", timing("host_us_median", ".1f"))],
                 wrap=("verdict",))
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
