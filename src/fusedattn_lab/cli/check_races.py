"""`fusedattn check-races`: compute-sanitizer over every kernel and the planted bug."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import Problem, ProblemError
from fusedattn_lab.cli.shared import (
    OUT_DEFAULT,
    fmt,
    int_arg,
    out_base,
    render_table,
    stamp_dir,
    write_environment,
    write_rows_csv,
)


def add(sub) -> None:
    p = sub.add_parser("check-races", help="compute-sanitizer racecheck/synccheck/memcheck/"
                        "initcheck on every kernel, and the planted barrier bug")
    p.add_argument("--version", default="all")
    p.add_argument("--seq", type=int_arg, default=65, help="S (default 65: a partial tile)")
    p.add_argument("--dim", type=int_arg, default=33, help="D (default 33: past one warp)")
    p.add_argument("--block", type=int_arg, default=64, help="threads per block (two warps)")
    p.add_argument("--tools", default=",".join(("racecheck", "synccheck", "memcheck",
                                                 "initcheck")))
    p.add_argument("--no-planted", action="store_true",
                    help="skip the planted missing-barrier variant")
    p.add_argument("--out", type=Path, default=None,
                    help="base folder; CSV and raw reports go to OUT/<gpu>/<timestamp>-races/ "
                    + OUT_DEFAULT)


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab.evidence import environment, write_atomic
    from fusedattn_lab.profile import (
        SANITIZER_TOOLS,
        kernel_verdicts,
        planted_label,
        run_sanitizer,
        sanitizer_kernels,
    )
    from fusedattn_lab.registry import VERSIONS, planted_versions, select

    versions = select(args.version)
    problem = Problem(args.seq, args.dim, args.block)
    out_base(args)  # before any work
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in SANITIZER_TOOLS]
    if bad or not tools:
        raise ProblemError("tools", args.tools, "a comma-separated subset of "
                           + ", ".join(SANITIZER_TOOLS))
    for v in versions:
        v.limits.check(v.name, problem)
    if mode.EMULATION:
        raise ProblemError("check-races", "emulation", "a CUDA GPU: compute-sanitizer checks "
                           "real kernels")
    # One sanitizer process per tool runs every version (kernels are told apart by name);
    # t0 and t1 share the Triton kernel `_rows_fwd_kernel`, so they share its rows.
    names = [v.name for v in versions]
    kernels = sanitizer_kernels(names)
    routes = {sym: VERSIONS[users[0]].route for sym, users in kernels.items()}
    routes |= {"other": "peer"} if any(v.route == "peer" for v in versions) else {}
    jobs = [(tool, None) for tool in tools]
    if not args.no_planted and "racecheck" in tools:  # every registry version with one
        jobs += [("racecheck", name) for name in planted_versions()]
    env = environment()
    out_dir = stamp_dir(args, "-races", env)
    rows = []
    for tool, planted in jobs:
        label = planted_label(planted) if planted else "all"
        with console.status(f"{tool}: {label}"):
            report, raw = run_sanitizer(tool, names, problem, planted)
        write_atomic(out_dir / f"{label}.{tool}.txt", raw)
        for kernel, word in kernel_verdicts(routes, report, planted).items():
            users = [label] if planted else kernels.get(kernel, [
                v.name for v in versions if v.route == "peer"])
            rows.append({"versions": "+".join(users), "kernel": kernel, "tool": tool,
                         "errors": report.errors, "hazards": report.hazards,
                         "findings_in_kernel": report.kernels.get(kernel, report.other
                                                                  if kernel == "other" else 0),
                         "verdict": word})
    render_table(console, f"compute-sanitizer at {problem.label()}, block {problem.block}",
                 rows, [
                     ("versions", lambda r: r["versions"]), ("kernel", lambda r: r["kernel"]),
                     ("tool", lambda r: r["tool"]),
                     ("errors (run)", lambda r: fmt(r["errors"], "d")),
                     ("hazards (run)", lambda r: fmt(r["hazards"], "d")),
                     ("findings here", lambda r: str(r["findings_in_kernel"])),
                     ("verdict", lambda r: r["verdict"])])
    write_rows_csv(out_dir / "races.csv", rows)
    write_environment(out_dir, env, problem=problem.__dict__)
    console.print(f"written: {out_dir}")
    ok = all(r["verdict"] in ("clean", "caught") or r["verdict"].startswith("advisory")
             for r in rows)
    return 0 if ok else 1
