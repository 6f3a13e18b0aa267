"""`fusedattn profile`: resource rows of every kernel; `--ncu` for counters."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusedattn import mode
from fusedattn.cli.shared import (
    OUT_DEFAULT,
    fmt,
    int_arg,
    out_base,
    problem_from,
    stamp_dir,
    write_environment,
    write_rows_csv,
)
from fusedattn.problem import ProblemError


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
    from fusedattn.lab.evidence import environment, write_atomic
    from fusedattn.lab.profile import resource_rows, run_ncu
    from fusedattn.lab.registry import select

    versions = select(args.version)
    problem = problem_from(args, console)
    for v in versions:
        v.limits.check(v.name, problem)
    out_base(args)  # before any work
    if args.ncu and mode.EMULATION:
        raise ProblemError("ncu", "emulation", "a CUDA GPU: Nsight Compute reads hardware "
                           "counters of real kernels")
    rows = [r for v in versions for r in resource_rows(v.name, problem)]
    table = Table(title=f"kernels at {problem.label()}, block {problem.block} — "
                        f"{mode.describe()}")
    cols = ("version", "kernel", "grid", "block", "regs", "smem static+dyn", "local B",
            "warps/stages", "occupancy", "reads → writes", "barriers/block")
    for c in cols:
        table.add_column(c, no_wrap=True)
    gpu_only = "needs a GPU"
    for r in rows:
        static = r["static_shared_bytes"]
        smem = "—" if not r["measured"] else (
            f"{'?' if static is None else static}+{r['dynamic_shared_bytes'] or 0}")
        table.add_row(
            r["version"], r["kernel"], fmt(r["grid"], "d"), fmt(r["block"], "d"),
            gpu_only if r["regs_per_thread"] is None and mode.EMULATION
            else fmt(r["regs_per_thread"], "d"),
            smem, fmt(r["local_bytes_per_thread"], "d"),
            f"{r['num_warps']}/{r['num_stages']}" if r["num_warps"] else "—",
            gpu_only if mode.EMULATION else fmt(r["occupancy"], ".0%"),
            f"{r['reads']} → {r['writes']}",
            "—" if r["barriers_per_block"] is None else str(r["barriers_per_block"]))
    console.print(table)
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
        t2 = Table(title="Nsight Compute (--clock-control none)")
        for c in ("version", "kernel", "duration", "DRAM read", "DRAM write",
                  "achieved occ %", "SM thru %", "barrier stall %"):
            t2.add_column(c, no_wrap=True)
        for r in ncu_rows:
            t2.add_row(r["version"], r["kernel"][:40],
                       f"{fmt(r.get('duration'), '.0f')} {r.get('duration_unit', '')}",
                       f"{fmt(r.get('dram_read'), '.0f')} {r.get('dram_read_unit', '')}",
                       f"{fmt(r.get('dram_write'), '.0f')} {r.get('dram_write_unit', '')}",
                       fmt(r.get("achieved_occupancy_pct"), ".1f"),
                       fmt(r.get("sm_throughput_pct"), ".1f"),
                       fmt(r.get("barrier_stall_pct"), ".1f"))
        console.print(t2)
    write_rows_csv(out_dir / "resources.csv", rows)
    if ncu_rows:
        write_rows_csv(out_dir / "ncu.csv", ncu_rows)
    write_environment(out_dir, env, problem=problem.__dict__)
    console.print(f"written: {out_dir}")
    return 0
