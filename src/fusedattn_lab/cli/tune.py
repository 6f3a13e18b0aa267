"""`fusedattn tune`: time the kernels' candidate configs on this GPU and write the tuned
table that every kernel reads before its rules (`configs.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn import mode
from fusedattn.problem import ProblemError
from fusedattn_lab.cli.shared import fmt, int_arg, int_list_arg, render_table, write_rows_csv

CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}


def add(sub) -> None:
    p = sub.add_parser("tune", help="time candidate tile configs and write the tuned table")
    p.add_argument("--kernel", default="fwd", help="fwd|bwd|decode")
    p.add_argument("--dtype", default="bf16", help="bf16|fp16|fp32")
    p.add_argument("--precision", default=None, help="fp32 only: ieee|tf32|tf32x3")
    p.add_argument("--dim", type=int_list_arg, default=[64, 128], help="head dims, e.g. 64,128")
    p.add_argument("--seq", type=int_list_arg, default=[1024, 4096],
                    help="sequence lengths (decode: cache lengths)")
    p.add_argument("--causal", default="both", help="both|yes|no")
    p.add_argument("--batch", type=int_arg, default=None,
                   help="with --heads: the problem's B and H (default B4 H32 from S 1024 up, "
                   "else B64 H16; decode B32 H32/8)")
    p.add_argument("--heads", type=int_arg, default=None)
    p.add_argument("--warmup", type=int_arg, default=3)
    p.add_argument("--repeat", type=int_arg, default=10)
    p.add_argument("--table", type=Path, default=None,
                    help="the table to merge into (default: the package's "
                    "tuned/<gpu>.json, which the kernels read)")
    p.add_argument("--report", type=Path, default=None,
                    help="also write every candidate's row to this CSV")


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn import configs
    from fusedattn.precision import resolve
    from fusedattn_lab.evidence import environment, provenance
    from fusedattn_lab.outputs import writable_file
    from fusedattn_lab.suites import DTYPES
    from fusedattn_lab.tune import KERNELS, default_cases, run_case, write_table

    if args.kernel not in KERNELS:
        raise ProblemError("kernel", args.kernel, " or ".join(KERNELS))
    if args.dtype not in DTYPES:
        raise ProblemError("dtype", args.dtype, " or ".join(DTYPES))
    resolve(DTYPES[args.dtype], args.precision)
    if args.causal not in CAUSAL:
        raise ProblemError("causal", args.causal, " or ".join(CAUSAL))
    for field, values, low, high in (("dim", args.dim, 1, 256), ("seq", args.seq, 1, 131072)):
        if not values or any(not low <= x <= high for x in values):
            raise ProblemError(field, values, f"a comma-separated list of {low}..{high}")
    if (args.batch is None) != (args.heads is None) or any(
            x is not None and not 1 <= x <= 1024 for x in (args.batch, args.heads)):
        raise ProblemError("batch/heads", (args.batch, args.heads),
                           "both or neither, each 1..1024")
    if args.kernel == "decode" and args.batch is not None:
        raise ProblemError("batch/heads", (args.batch, args.heads),
                           "none for decode (its cases are B32 H32/8)")
    if args.warmup < 0 or args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "warmup >= 0 and repeat >= 1")
    if mode.EMULATION:
        raise ProblemError("tune", "emulation", "a GPU: the interpreter times nothing")
    table = writable_file("table", args.table or configs.TUNED_DIR /
                          f"{configs.gpu_family()}.json", (".json",))
    report_path = writable_file("report", args.report, (".csv",)) if args.report else None
    cases = default_cases(args.kernel, args.dtype, args.precision, args.dim, args.seq,
                          CAUSAL[args.causal],
                          (args.batch, args.heads) if args.batch is not None else None)
    entries, report = {}, []
    with console.status("tune") as status:
        for case in cases:
            status.update(case.label())
            best, rows = run_case(case, warmup=args.warmup, repeat=args.repeat)
            report += rows
            if best is not None:
                entries[case.key()] = best
    render_table(console, f"tune {args.kernel} — {mode.describe()}", report, [
        ("case", lambda r: r["case"]), ("config", lambda r: r["config"]),
        ("status", lambda r: r["status"] + (f" ({r['reason'][:50]})" if r["reason"] else "")),
        ("ms", lambda r: fmt(r["median_ms"], ".4f"))])
    if report_path:
        write_rows_csv(report_path, report)
    env = environment()
    write_table(table, entries, dict(provenance(env), command=env.get("command")))
    for key, config in entries.items():
        console.print(f"{key}: {config}")
    console.print(f"written: {table} ({len(entries)} of {len(cases)} cases tuned)")
    return 0 if len(entries) == len(cases) else 1
