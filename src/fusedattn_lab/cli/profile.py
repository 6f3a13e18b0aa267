"""`fusedattn profile`: resource rows of every kernel; `--ncu` for counters."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import ProblemError
from fusedattn_lab.cli.shared import (
    OUT_DEFAULT,
    fmt,
    int_arg,
    out_base,
    problem_from,
    render_table,
    stamp_dir,
    write_environment,
    write_rows_csv,
)


def add(sub) -> None:
    p = sub.add_parser("profile", help="resource fields of every kernel; --ncu for counters")
    p.add_argument("--version", default="all")
    p.add_argument("--seq", type=int_arg, help="S (GPU default 128)")
    p.add_argument("--dim", type=int_arg, help="D (GPU default 64)")
    p.add_argument("--block", type=int_arg, help="threads per block (GPU default 256)")
    p.add_argument("--ncu", action="store_true",
                    help="also run each version under Nsight Compute (--clock-control none)")
    p.add_argument("--out", type=Path, default=None,
                    help="base folder; CSVs go to OUT/<gpu>/<timestamp>-profile/ " + OUT_DEFAULT)


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab.evidence import environment, write_atomic
    from fusedattn_lab.profile import resource_rows, run_ncu
    from fusedattn_lab.registry import select

    versions = select(args.version)
    problem = problem_from(args, console)
    for v in versions:
        v.limits.check(v.name, problem)
    out_base(args)  # before any work
    if args.ncu and mode.EMULATION:
        raise ProblemError("ncu", "emulation", "a CUDA GPU: Nsight Compute reads hardware "
                           "counters of real kernels")
    rows = [r for v in versions for r in resource_rows(v.name, problem)]
    gpu_only = "needs a GPU"

    def smem(r):
        static = r["static_shared_bytes"]
        return "—" if not r["measured"] else (
            f"{'?' if static is None else static}+{r['dynamic_shared_bytes'] or 0}")

    render_table(console, f"kernels at {problem.label()}, block {problem.block} — "
                 f"{mode.describe()}", rows, [
                     ("version", lambda r: r["version"]), ("kernel", lambda r: r["kernel"]),
                     ("grid", lambda r: fmt(r["grid"], "d")),
                     ("block", lambda r: fmt(r["block"], "d")),
                     ("regs", lambda r: gpu_only if r["regs_per_thread"] is None
                      and mode.EMULATION else fmt(r["regs_per_thread"], "d")),
                     ("smem static+dyn", smem),
                     ("local B", lambda r: fmt(r["local_bytes_per_thread"], "d")),
                     ("warps/stages", lambda r: f"{r['num_warps']}/{r['num_stages']}"
                      if r["num_warps"] else "—"),
                     ("occupancy", lambda r: gpu_only if mode.EMULATION
                      else fmt(r["occupancy"], ".0%")),
                     ("reads → writes", lambda r: f"{r['reads']} → {r['writes']}"),
                     ("barriers/block", lambda r: "—" if r["barriers_per_block"] is None
                      else str(r["barriers_per_block"]))])
    if mode.EMULATION:
        console.print("emulation knows grids, blocks, dynamic shared memory, buffers and "
                      "barrier counts; registers, static shared memory, spills and occupancy "
                      "need a GPU (the compiled kernel)")
    env = environment()
    out_dir = stamp_dir(args, "-profile", env)
    ncu_rows = []
    if args.ncu:
        for v in versions:
            with console.status(f"ncu: {v.name}"):
                parsed, raw = run_ncu(v.name, problem)
            write_atomic(out_dir / f"ncu.{v.name}.raw.txt", raw)
            ncu_rows += [dict(version=v.name, **r) for r in parsed]
            if not parsed:
                console.print(f"[red]ncu gave no rows for {v.name}:[/] "
                              + " | ".join(raw.strip().splitlines()[-3:]))
        def unit(key):
            return lambda r: f"{fmt(r.get(key), '.0f')} {r.get(key + '_unit', '')}"

        render_table(console, "Nsight Compute (--clock-control none)", ncu_rows, [
            ("version", lambda r: r["version"]), ("kernel", lambda r: r["kernel"][:40]),
            ("duration", unit("duration")), ("DRAM read", unit("dram_read")),
            ("DRAM write", unit("dram_write")),
            ("achieved occ %", lambda r: fmt(r.get("achieved_occupancy_pct"), ".1f")),
            ("SM thru %", lambda r: fmt(r.get("sm_throughput_pct"), ".1f")),
            ("barrier stall %", lambda r: fmt(r.get("barrier_stall_pct"), ".1f"))])
    write_rows_csv(out_dir / "resources.csv", rows)
    if ncu_rows:
        write_rows_csv(out_dir / "ncu.csv", ncu_rows)
    write_environment(out_dir, env, problem=problem.__dict__)
    console.print(f"written: {out_dir}")
    return 0
