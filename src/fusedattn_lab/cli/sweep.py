"""`fusedattn sweep`: exercise 4, one row version at several BLOCK_K."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import ProblemError
from fusedattn_lab.cli.shared import (
    OUT_DEFAULT,
    check_counts,
    common_options,
    fmt,
    int_arg,
    int_list_arg,
    out_base,
    problem_from,
    render_table,
    stamp_dir,
    write_environment,
    write_rows_csv,
)


def add(sub) -> None:
    p = sub.add_parser("sweep", help="exercise 4: one row version at several BLOCK_K")
    common_options(p, warmup=10, repeat=50)
    p.add_argument("--seq", type=int_arg, help="S (GPU default 128)")
    p.add_argument("--block-k", type=int_list_arg, default=[16, 32, 64, 128])
    p.set_defaults(version=None)  # the first registry version with a BLOCK_K
    p.add_argument("--out", type=Path, default=None,
                    help="base folder; CSV and plot go to OUT/<gpu>/<timestamp>-sweep/ "
                    + OUT_DEFAULT)


def run(args: argparse.Namespace, console: Console) -> int:
    import math

    from fusedattn_lab.evidence import environment, provenance, sha256_file
    from fusedattn_lab.protocol import Settings, case_for, check_resources, measure
    from fusedattn_lab.registry import VERSIONS, select

    if args.version is None:
        args.version = next(n for n, v in VERSIONS.items() if v.retune is not None)
    versions = select(args.version)
    problem = problem_from(args, console)
    check_counts(args)
    if not args.block_k:
        raise ProblemError("block_k", "", "a comma-separated list of powers of two, "
                           "e.g. 16,32,64,128")
    out_base(args)  # before any work
    tuned = [v.with_block_k(bk) for v in versions for bk in args.block_k]
    for v in tuned:
        v.limits.check(v.name, problem)
    check_resources(problem, tuned, lambda text: console.print(f"[yellow]{text}[/]"))
    settings = Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing)
    case = case_for(problem, settings)
    env = environment()
    rows = []
    with console.status("sweep") as status:
        for v in tuned:
            status.update(v.name)
            r = measure(v, problem, settings, case)
            t = r.timing or {}
            res = (r.resources or [{}])[0]
            rows.append({
                "version": v.name, "block_k": v.block_k, "seq": problem.seq,
                "dim": problem.dim, "causal": problem.causal,
                "iterations": math.ceil(problem.seq / v.block_k),
                "median_ms": t.get("median_ms"), "min_ms": t.get("min_ms"),
                "max_ms": t.get("max_ms"), "regs_per_thread": res.get("regs_per_thread"),
                "spills": res.get("spills"), "shared_bytes": res.get("static_shared_bytes"),
                "max_abs_error": r.max_abs, "verdict": r.verdict, "inputs": settings.inputs,
                "seed": settings.seed, "warmup": settings.warmup, "repeat": settings.repeat,
                "timing_mode": settings.timing, **provenance(env),
                "source_sha256": sha256_file(v.source_file())})
    render_table(console, f"BLOCK_K sweep at {problem.label()} — {mode.describe()}", rows, [
        ("version", lambda r: r["version"]), ("BLOCK_K", lambda r: str(r["block_k"])),
        ("iterations", lambda r: str(r["iterations"])),
        ("median ms", lambda r: fmt(r["median_ms"], ".4f")),
        ("range ms", lambda r: f"{r['min_ms']:.4f}–{r['max_ms']:.4f}" if r["min_ms"] else "—"),
        ("regs", lambda r: fmt(r["regs_per_thread"], "d")),
        ("spills", lambda r: fmt(r["spills"], "d")),
        ("shared B", lambda r: fmt(r["shared_bytes"], "d")),
        ("max abs err", lambda r: f"{r['max_abs_error']:.2e}"),
        ("verdict", lambda r: r["verdict"])])
    out_dir = stamp_dir(args, "-sweep", env)
    write_rows_csv(out_dir / "sweep.csv", rows)
    write_environment(out_dir, env, problem=problem.__dict__)
    if not mode.EMULATION:
        from fusedattn_lab.plots import draw_sweep

        for f in draw_sweep(out_dir / "sweep.csv"):
            console.print(f"figure: {f}")
    console.print(f"written: {out_dir}  (every BLOCK_K is kept, the slower ones too)")
    return 0 if all(r["verdict"] == "PASS" for r in rows) else 1
