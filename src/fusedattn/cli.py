"""Command line: `fusedattn run ...` (also `python -m fusedattn run ...`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusedattn import mode
from fusedattn.problem import Problem, ProblemError

OUT_DEFAULT = "(default evidence/ on a GPU, a temporary folder in emulation)"
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


def _int_list(text: str) -> list[int]:
    return [_int(t) for t in text.split(",") if t.strip()]


def _shapes(text: str) -> list[tuple[int, int]]:
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


def _common(p: argparse.ArgumentParser, warmup: int, repeat: int) -> None:
    from fusedattn.lab.inputs import PROTOCOLS
    from fusedattn.lab.registry import VERSIONS
    from fusedattn.lab.timing import MODES

    p.add_argument("--version", default="all",
                   help="all, or a comma-separated list of: " + ", ".join(VERSIONS))
    p.add_argument("--dim", type=_int, help="D, columns of Q/K/V (GPU default 64)")
    p.add_argument("--block", type=_int,
                   help="threads per block, thread-level versions (GPU default 256)")
    p.add_argument("--warmup", type=_int, default=warmup)
    p.add_argument("--repeat", type=_int, default=repeat)
    p.add_argument("--seed", type=_int, default=0)
    p.add_argument("--inputs", default="uniform", help="|".join(PROTOCOLS))
    p.add_argument("--timing", default="events", help="|".join(MODES))
    p.add_argument("--causal", action="store_true", help="mask key j > i (exercise 5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the registry: every version, its route, launches, limits")
    run = sub.add_parser("run", help="verify and time versions on one problem")
    _common(run, warmup=5, repeat=20)
    run.add_argument("--seq", type=_int, help="S, rows of Q/K/V (GPU default 128)")
    run.add_argument("--json", type=Path, help="write every record (and the environment) here")

    ra = sub.add_parser("run-all", help="the chapter's full protocol, with evidence files")
    _common(ra, warmup=10, repeat=50)  # the chapter's historical group
    ra.add_argument("--seq", type=_int_list,
                    help="main S, or a comma-separated sweep, e.g. 128,1024,16384 (default 128)")
    ra.add_argument("--processes", type=_int, default=3, help="independent processes")
    ra.add_argument("--boundary", type=_shapes, default="1x1,7x13,33x31,65x33",
                    help="boundary shapes SxD, verified before and after timing; none to skip")
    ra.add_argument("--out", type=Path, default=None,
                    help="base folder; the run goes to OUT/<gpu>/<timestamp>/ " + OUT_DEFAULT)
    ra.add_argument("--resume", type=Path, help="a run folder to complete (same options)")

    pr = sub.add_parser("profile", help="resource fields of every kernel; --ncu for counters")
    pr.add_argument("--version", default="all")
    pr.add_argument("--seq", type=_int, help="S (GPU default 128)")
    pr.add_argument("--dim", type=_int, help="D (GPU default 64)")
    pr.add_argument("--block", type=_int, help="threads per block (GPU default 256)")
    pr.add_argument("--ncu", action="store_true",
                    help="also run each version under Nsight Compute (--clock-control none)")
    pr.add_argument("--out", type=Path, default=None,
                    help="base folder; CSVs go to OUT/<gpu>/<timestamp>-profile/ " + OUT_DEFAULT)

    cr = sub.add_parser("check-races", help="compute-sanitizer racecheck/synccheck/memcheck/"
                        "initcheck on every kernel, and the planted barrier bug")
    cr.add_argument("--version", default="all")
    cr.add_argument("--seq", type=_int, default=65, help="S (default 65: a partial tile)")
    cr.add_argument("--dim", type=_int, default=33, help="D (default 33: past one warp)")
    cr.add_argument("--block", type=_int, default=64, help="threads per block (two warps)")
    cr.add_argument("--tools", default=",".join(("racecheck", "synccheck", "memcheck",
                                                 "initcheck")))
    cr.add_argument("--no-planted", action="store_true",
                    help="skip the planted missing-barrier variant")
    cr.add_argument("--out", type=Path, default=None,
                    help="base folder; CSV and raw reports go to OUT/<gpu>/<timestamp>-races/ "
                    + OUT_DEFAULT)

    wk = sub.add_parser("walkthrough", help="the online recurrence on one row, key by key")
    wk.add_argument("--scores", default="2,1,4", help="one query row's scores (default: the "
                    "chapter's 2,1,4)")
    wk.add_argument("--values", default="1,0;0,2;3,1",
                    help="V rows, ';' between rows (default: the chapter's 1,0;0,2;3,1)")
    wk.add_argument("--order", help="exercise 2: the same scores in another order, e.g. 4,2,1")
    wk.add_argument("--forget-rescale", action="store_true",
                    help="exercise 1: do not rescale the old accumulator")
    wk.add_argument("--figure", type=Path, help="small multiples of the steps (.png or .svg)")

    mk = sub.add_parser("masks", help="exercise 3: the per-iteration key masks of a row kernel")
    mk.add_argument("--seq", type=_int, default=33)
    mk.add_argument("--block-k", type=_int, default=16)
    mk.add_argument("--figure", type=Path, help="the masks as a picture (.png or .svg)")

    sw = sub.add_parser("sweep", help="exercise 4: one row version at several BLOCK_K")
    _common(sw, warmup=10, repeat=50)
    sw.add_argument("--seq", type=_int, help="S (GPU default 128)")
    sw.add_argument("--block-k", type=_int_list, default=[16, 32, 64, 128])
    sw.set_defaults(version=None)  # the first registry version with a BLOCK_K
    sw.add_argument("--out", type=Path, default=None,
                    help="base folder; CSV and plot go to OUT/<gpu>/<timestamp>-sweep/ "
                    + OUT_DEFAULT)

    bn = sub.add_parser("bench", help="the flash kernel against PyTorch's attention backends")
    bn.add_argument("--suite", default="bf16",
                    help="bf16|fp16|fp32|memory|tiny|train-bf16|train-fp16|train-fp32|"
                    "tiny-train|all")
    bn.add_argument("--providers", default="all",
                    help="all, or a comma-separated list of versions with a batched form")
    bn.add_argument("--match", default="",
                    help="only problems whose label contains one of these comma-separated "
                    "texts, e.g. 'S8192 D64 causal'")
    bn.add_argument("--configs", action="store_true",
                    help="also time each flash config the autotuner picks from, one by one")
    bn.add_argument("--warmup", type=_int, default=5)
    bn.add_argument("--repeat", type=_int, default=20)
    bn.add_argument("--seed", type=_int, default=0)
    bn.add_argument("--out", type=Path, default=None,
                    help="base folder; CSV and plots go to OUT/<gpu>/<timestamp>-bench-SUITE/ "
                    + OUT_DEFAULT)

    pl = sub.add_parser("plot", help="redraw the figures of a run folder from its summary.csv")
    pl.add_argument("run_dir", type=Path)
    return parser


def _problem(args: argparse.Namespace, console: Console, seq: int | None = None) -> Problem:
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


def _check_counts(args: argparse.Namespace) -> None:
    from fusedattn.lab.inputs import PROTOCOLS
    from fusedattn.lab.timing import MODES

    if args.warmup < 0:
        raise ProblemError("warmup", args.warmup, "an integer >= 0")
    if args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "an integer >= 1")
    if args.timing not in MODES:
        raise ProblemError("timing", args.timing, "one of " + ", ".join(MODES))
    if args.inputs not in PROTOCOLS:
        raise ProblemError("inputs", args.inputs, "one of " + ", ".join(PROTOCOLS))
    if args.seed < 0:
        raise ProblemError("seed", args.seed, "an integer >= 0")
    if getattr(args, "json", None) is not None:
        from fusedattn.lab.outputs import writable_file

        writable_file("json", args.json)


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.evidence import environment, write_json
    from fusedattn.lab.inputs import make_inputs
    from fusedattn.lab.protocol import Settings, check_resources, measure
    from fusedattn.lab.registry import VERSIONS, select
    from fusedattn.reference import attention_ref

    versions = select(args.version)
    problem = _problem(args, console)
    _check_counts(args)
    settings = Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing)
    for v in versions:  # every limit before anything runs
        v.limits.check(v.name, problem)
    check_resources(problem, versions, lambda text: console.print(f"[yellow]{text}[/]"))
    inputs = make_inputs(problem, settings.inputs, settings.seed, mode.DEVICE)
    ref = attention_ref(*inputs, causal=problem.causal)

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


def cmd_run_all(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fusedattn.lab.evidence import environment
    from fusedattn.lab.outputs import new_run_dir
    from fusedattn.lab.plots import draw
    from fusedattn.lab.protocol import Settings, check_resources
    from fusedattn.lab.registry import select
    from fusedattn.lab.runall import Plan, execute

    versions = select(args.version)
    seqs = args.seq or [GPU_DEFAULT["seq"]]
    if mode.EMULATION and args.block is None:
        args.block = EMU_DEFAULT["block"]
    problems = [_problem(args, console, seq) for seq in seqs]
    boundary = [Problem(s, d, problems[0].block) for s, d in args.boundary]
    _check_counts(args)
    if args.processes < 1:
        raise ProblemError("processes", args.processes, "an integer >= 1")
    for v in versions:
        for p in problems + boundary:
            v.limits.check(v.name, p)
    for p in boundary + ([] if mode.EMULATION else problems):  # what this machine runs
        check_resources(p, versions, lambda text: console.print(f"[yellow]{text}[/]"))
    plan = Plan(tuple(v.name for v in versions), tuple(seqs), problems[0].dim,
                problems[0].block, args.processes,
                Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing).__dict__,
                tuple(tuple(b) for b in args.boundary), args.causal)
    if not plan.units():
        raise ProblemError("boundary", "none", "at least one shape: in emulation run-all runs "
                           "the boundary suite only, so an empty one leaves nothing to run")
    if args.resume is not None:
        if not (args.resume / "plan.json").is_file():
            raise ProblemError("resume", str(args.resume), "a run folder holding plan.json")
        run_dir = args.resume
    else:
        run_dir = new_run_dir(_out_base(args), environment())
    if mode.EMULATION:
        console.print("[yellow]emulation: boundary suite only, verified, no times and no "
                      "memory peaks; the main shape needs a GPU[/]")
    console.print(f"run folder: {run_dir}")

    def progress():
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console)

    try:
        _, rows = execute(plan, run_dir, console, progress)
    except ValueError as err:
        raise ProblemError("resume", str(run_dir), str(err)) from None
    figures = draw(run_dir / "summary.csv")

    table = Table(title=f"run-all — {mode.describe()}")
    for col in ("suite", "shape", "version", "verdict", "max abs err", "GPU ms median",
                "range", "peak MiB"):
        table.add_column(col, no_wrap=True)
    by_key = {}
    for r in rows:
        by_key.setdefault((r.suite, r.seq, r.dim, r.version), {})[r.metric] = r
    for (suite, seq, dim, name), metrics in by_key.items():
        base = metrics["max_abs_error"]
        t = metrics.get("gpu_ms")
        peak = metrics.get("peak_bytes")
        table.add_row(suite, f"{seq}x{dim}", name, base.verdict,
                      _fmt(base.max_abs_error, ".2e"), _fmt(t and t.median, ".4f"),
                      f"{t.range_low:.4f}–{t.range_high:.4f}" if t else "—",
                      _fmt(peak and peak.median / 2**20, ".3f"))
    console.print(table)
    for f in figures:
        console.print(f"figure: {f}")
    console.print(f"evidence: {run_dir}/records.jsonl, summary.csv, environment.json")
    return 0 if all(r.verdict == "PASS" for r in rows) else 1


def cmd_plot(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.outputs import writable_dir
    from fusedattn.lab.plots import draw, draw_bench

    summary, bench = args.run_dir / "summary.csv", args.run_dir / "bench.csv"
    if not summary.is_file() and not bench.is_file():
        raise ProblemError("run_dir", str(args.run_dir),
                           "a run folder holding summary.csv (run-all) or bench.csv (bench)")
    writable_dir("run_dir", args.run_dir)  # the figures are written beside the CSV
    csv_path, drawer = (summary, draw) if summary.is_file() else (bench, draw_bench)
    try:
        figures = drawer(csv_path)
    except (KeyError, ValueError, TypeError, IndexError) as err:
        raise ProblemError(csv_path.name, str(csv_path), "a CSV as fusedattn writes it "
                           f"(reading it failed: {type(err).__name__}: {err})") from None
    for f in figures:
        console.print(f"figure: {f}")
    if not figures:
        console.print("no timed rows in this summary (emulation?): nothing to draw")
    return 0


def _out_base(args: argparse.Namespace) -> Path:
    """The checked base folder of a command's evidence (before any work)."""
    from fusedattn.lab.outputs import default_base, writable_dir

    return writable_dir("out", default_base(args.out))


def _stamp_dir(args: argparse.Namespace, suffix: str, env: dict) -> Path:
    from fusedattn.lab.outputs import new_run_dir

    return new_run_dir(_out_base(args), env, suffix)


def _write_environment(out_dir: Path, env: dict, **extra) -> None:
    """`environment.json` of a result folder: the machine, the command line, and `extra`."""
    from fusedattn.lab.evidence import write_json

    write_json(out_dir / "environment.json",
               env | {"command": "fusedattn " + " ".join(sys.argv[1:]), **extra})


def _write_rows_csv(path: Path, rows: list[dict]) -> None:
    import csv
    import io

    from fusedattn.lab.evidence import write_atomic

    buf = io.StringIO()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buf.getvalue())


def cmd_profile(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.evidence import environment, write_atomic
    from fusedattn.lab.profile import resource_rows, run_ncu
    from fusedattn.lab.registry import select

    versions = select(args.version)
    problem = _problem(args, console)
    for v in versions:
        v.limits.check(v.name, problem)
    _out_base(args)  # before any work
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
            r["version"], r["kernel"], _fmt(r["grid"], "d"), _fmt(r["block"], "d"),
            gpu_only if r["regs_per_thread"] is None and mode.EMULATION
            else _fmt(r["regs_per_thread"], "d"),
            smem, _fmt(r["local_bytes_per_thread"], "d"),
            f"{r['num_warps']}/{r['num_stages']}" if r["num_warps"] else "—",
            gpu_only if mode.EMULATION else _fmt(r["occupancy"], ".0%"),
            f"{r['reads']} → {r['writes']}",
            "—" if r["barriers_per_block"] is None else str(r["barriers_per_block"]))
    console.print(table)
    if mode.EMULATION:
        console.print("emulation knows grids, blocks, dynamic shared memory, buffers and "
                      "barrier counts; registers, static shared memory, spills and occupancy "
                      "need a GPU (the compiled kernel)")
    env = environment()
    out_dir = _stamp_dir(args, "-profile", env)
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
                       f"{_fmt(r.get('duration'), '.0f')} {r.get('duration_unit', '')}",
                       f"{_fmt(r.get('dram_read'), '.0f')} {r.get('dram_read_unit', '')}",
                       f"{_fmt(r.get('dram_write'), '.0f')} {r.get('dram_write_unit', '')}",
                       _fmt(r.get("achieved_occupancy_pct"), ".1f"),
                       _fmt(r.get("sm_throughput_pct"), ".1f"),
                       _fmt(r.get("barrier_stall_pct"), ".1f"))
        console.print(t2)
    _write_rows_csv(out_dir / "resources.csv", rows)
    if ncu_rows:
        _write_rows_csv(out_dir / "ncu.csv", ncu_rows)
    _write_environment(out_dir, env, problem=problem.__dict__)
    console.print(f"written: {out_dir}")
    return 0


def cmd_check_races(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.evidence import environment, write_atomic
    from fusedattn.lab.profile import (
        PLANTED,
        SANITIZER_TOOLS,
        kernel_verdicts,
        run_sanitizer,
        sanitizer_kernels,
    )
    from fusedattn.lab.registry import VERSIONS, select

    versions = select(args.version)
    problem = Problem(args.seq, args.dim, args.block)
    _out_base(args)  # before any work
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
    jobs = [(tool, False) for tool in tools]
    if not args.no_planted and "racecheck" in tools:
        jobs.append(("racecheck", True))
    env = environment()
    out_dir = _stamp_dir(args, "-races", env)
    rows = []
    for tool, planted in jobs:
        label = PLANTED if planted else "all"
        with console.status(f"{tool}: {label}"):
            report, raw = run_sanitizer(tool, names, problem, planted)
        write_atomic(out_dir / f"{label}.{tool}.txt", raw)
        for kernel, word in kernel_verdicts(routes, report, planted).items():
            users = [PLANTED] if planted else kernels.get(kernel, [
                v.name for v in versions if v.route == "peer"])
            rows.append({"versions": "+".join(users), "kernel": kernel, "tool": tool,
                         "errors": report.errors, "hazards": report.hazards,
                         "findings_in_kernel": report.kernels.get(kernel, report.other
                                                                  if kernel == "other" else 0),
                         "verdict": word})
    table = Table(title=f"compute-sanitizer at {problem.label()}, block {problem.block}")
    for c in ("versions", "kernel", "tool", "errors (run)", "hazards (run)", "findings here",
              "verdict"):
        table.add_column(c, no_wrap=True)
    for r in rows:
        table.add_row(r["versions"], r["kernel"], r["tool"], _fmt(r["errors"], "d"),
                      _fmt(r["hazards"], "d"), str(r["findings_in_kernel"]), r["verdict"])
    console.print(table)
    _write_rows_csv(out_dir / "races.csv", rows)
    _write_environment(out_dir, env, problem=problem.__dict__)
    console.print(f"written: {out_dir}")
    ok = all(r["verdict"] in ("clean", "caught") or r["verdict"].startswith("advisory")
             for r in rows)
    return 0 if ok else 1


def _floats(field: str, text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ProblemError(field, text, "comma-separated numbers") from None


def cmd_walkthrough(args: argparse.Namespace, console: Console) -> int:
    import torch

    from fusedattn.lab import walkthrough as wt

    if args.figure:
        wt.figure_path(args.figure)  # before any work
    scores = _floats("scores", args.scores)
    values = [_floats("values", row) for row in args.values.split(";")]
    if len({len(r) for r in values}) > 1:
        raise ProblemError("values", args.values, "rows of one length, ';' between rows")
    w = wt.walk(scores, values)
    steps = w.steps
    title = "online softmax, key by key (float64)"
    if args.forget_rescale:
        fr = wt.forget_rescale(scores, values)
        steps, title = fr["steps"], "WITHOUT rescaling the old accumulator (exercise 1)"
    table = Table(title=title)
    for c in ("key", "score", "m_i", "l_i", "α = exp(m_old − m_new)", "β = exp(s − m_new)",
              "acc"):
        table.add_column(c, justify="right", no_wrap=True)
    for st in steps:
        grew = st.key > 0 and st.alpha < 1.0
        table.add_row(str(st.key), f"{st.score:g}", f"{st.m_i:g}", f"{st.l_i:.4f}",
                      f"{st.alpha:.4f}" + (" ← max grew" if grew else ""), f"{st.beta:.4f}",
                      "[" + ", ".join(f"{a:.4f}" for a in st.acc) + "]")
    console.print(table)
    fmt = ", ".join
    console.print("probabilities softmax(s):   [" + fmt(f"{p:.4f}" for p in w.probabilities) + "]")
    console.print("acc / l_i (online):         [" + fmt(f"{x:.4f}" for x in w.online) + "]")
    console.print("softmax · V (materialized): [" + fmt(f"{x:.4f}" for x in w.materialized)
                  + "]")
    if args.forget_rescale:
        console.print("without rescaling:          [" + fmt(f"{x:.4f}" for x in fr["wrong"])
                      + "]  error [" + fmt(f"{x:+.4f}" for x in fr["error"]) + "]; worst: "
                      f"component {fr['worst_component']}. Every key read before the max "
                      "grew keeps its old, larger scale in acc, but not in l.")
    if args.order:
        order = wt.parse_order(args.order, len(scores))
        for dtype in (torch.float32, torch.float64):
            ex = wt.order_experiment(scores, values, order, dtype)
            console.print(f"order {args.order} ({ex['dtype']}): original ["
                          + fmt(f"{x!r}" for x in ex["original"].tolist()) + "], reordered ["
                          + fmt(f"{x!r}" for x in ex["reordered"].tolist()) + "], ULPs "
                          + str(ex["ulps"]) + (" — bit for bit equal" if ex["bitwise_equal"]
                                               else " — equal mathematically, not bit for bit"))
    if args.figure:
        console.print(f"figure: {wt.draw_steps(w, args.figure)}")
    return 0


def cmd_masks(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab import walkthrough as wt

    if args.figure:
        wt.figure_path(args.figure)  # before any work
    masks = wt.key_masks(args.seq, args.block_k)
    console.print(f"S={args.seq}, BLOCK_K={args.block_k}: {len(masks)} iterations "
                  f"(ceil(S/BLOCK_K)); '#' a key, '.' a masked slot (score set to -inf)")
    console.print(wt.mask_grid(masks), highlight=False)
    demo = wt.wrong_fill(args.seq, args.block_k)
    console.print(f"\nwhy -inf and not 0 (one random row, float64, the kernel's tile "
                  f"recurrence): {demo['masked_slots']} masked slots")
    console.print(f"  fill -inf: max abs error {demo['right_err']:.2e} against the reference")
    console.print(f"  fill 0   : max abs error {demo['wrong_err']:.2e}: each masked slot adds "
                  "exp(0 - m) to l_i (its V row is 0), so every output shrinks; and a 0 can "
                  "even become the running max when all real scores are negative")
    if args.figure:
        console.print(f"figure: {wt.draw_masks(masks, args.figure)}")
    return 0


def cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    import math

    from fusedattn.lab.evidence import environment, sha256_file
    from fusedattn.lab.inputs import make_inputs
    from fusedattn.lab.protocol import Settings, check_resources, measure
    from fusedattn.lab.registry import VERSIONS, select
    from fusedattn.reference import attention_ref

    if args.version is None:
        args.version = next(n for n, v in VERSIONS.items() if v.retune is not None)
    versions = select(args.version)
    problem = _problem(args, console)
    _check_counts(args)
    if not args.block_k:
        raise ProblemError("block_k", "", "a comma-separated list of powers of two, "
                           "e.g. 16,32,64,128")
    _out_base(args)  # before any work
    tuned = [v.with_block_k(bk) for v in versions for bk in args.block_k]
    for v in tuned:
        v.limits.check(v.name, problem)
    check_resources(problem, tuned, lambda text: console.print(f"[yellow]{text}[/]"))
    settings = Settings(args.inputs, args.seed, args.warmup, args.repeat, args.timing)
    inputs = make_inputs(problem, settings.inputs, settings.seed, mode.DEVICE)
    ref = attention_ref(*inputs, causal=problem.causal)
    env = environment()
    rows = []
    with console.status("sweep") as status:
        for v in tuned:
            status.update(v.name)
            r = measure(v, problem, settings, inputs, ref)
            t = r.timing or {}
            res = (r.resources or [{}])[0]
            rows.append({
                "version": v.name, "block_k": v.block_k, "seq": problem.seq,
                "dim": problem.dim, "causal": problem.causal,
                "iterations": math.ceil(problem.seq / v.block_k),
                "median_ms": t.get("median_ms"), "min_ms": t.get("min_ms"),
                "max_ms": t.get("max_ms"), "regs_per_thread": res.get("regs_per_thread"),
                "spills": res.get("spills"), "shared_bytes": res.get("static_shared_bytes"),
                "max_abs_error": max(r.before.max_abs, r.after.max_abs if r.after else 0.0),
                "verdict": "PASS" if r.ok else "FAIL", "inputs": settings.inputs,
                "seed": settings.seed, "warmup": settings.warmup, "repeat": settings.repeat,
                "timing_mode": settings.timing, "gpu": env["gpu"], "driver": env["driver"],
                "git_commit": env["git_commit"], "git_dirty": env["git_dirty"],
                "source_sha256": sha256_file(v.source_file()), "date": env["date"]})
    table = Table(title=f"BLOCK_K sweep at {problem.label()} — {mode.describe()}")
    for c in ("version", "BLOCK_K", "iterations", "median ms", "range ms", "regs", "spills",
              "shared B", "max abs err", "verdict"):
        table.add_column(c, no_wrap=True)
    for r in rows:
        table.add_row(r["version"], str(r["block_k"]), str(r["iterations"]),
                      _fmt(r["median_ms"], ".4f"),
                      f"{r['min_ms']:.4f}–{r['max_ms']:.4f}" if r["min_ms"] else "—",
                      _fmt(r["regs_per_thread"], "d"), _fmt(r["spills"], "d"),
                      _fmt(r["shared_bytes"], "d"), f"{r['max_abs_error']:.2e}", r["verdict"])
    console.print(table)
    out_dir = _stamp_dir(args, "-sweep", env)
    _write_rows_csv(out_dir / "sweep.csv", rows)
    _write_environment(out_dir, env, problem=problem.__dict__)
    if not mode.EMULATION:
        from fusedattn.lab.plots import draw_sweep

        for f in draw_sweep(out_dir / "sweep.csv"):
            console.print(f"figure: {f}")
    console.print(f"written: {out_dir}  (every BLOCK_K is kept, the slower ones too)")
    return 0 if all(r["verdict"] == "PASS" for r in rows) else 1


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.evidence import environment, sha256_file
    from fusedattn.lab.registry import VERSIONS
    from fusedattn.lab.suites import check_suite, providers, run_problem, with_ratios

    problems = check_suite(args.suite)
    if args.match:
        wanted = [m.strip() for m in args.match.split(",") if m.strip()]
        problems = [p for p in problems if any(m in p.label() for m in wanted)]
        if not problems:
            raise ProblemError("match", args.match, "texts found in the suite's labels, e.g. "
                               + ", ".join(p.label() for p in check_suite(args.suite)[:2]))
    known = providers()
    names = known if args.providers == "all" else [
        n.strip() for n in args.providers.split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise ProblemError("providers", args.providers, "all, or a comma-separated list of: "
                           + ", ".join(known))
    if args.warmup < 0 or args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "warmup >= 0 and repeat >= 1")
    if mode.EMULATION and not args.suite.startswith("tiny"):
        raise ProblemError("suite", args.suite,
                           "tiny or tiny-train in emulation (the others are GPU-sized)")
    env = environment()
    out_dir = _stamp_dir(args, f"-bench-{args.suite}", env)
    rows = []
    with console.status("bench") as status:
        for p in problems:
            status.update(p.label())
            rows += run_problem(p, names, warmup=args.warmup, repeat=args.repeat,
                                seed=args.seed, configs=args.configs)
            _write_rows_csv(out_dir / "bench.csv", with_ratios(rows))  # whole after each
    table = Table(title=f"bench {args.suite} — {mode.describe()}")
    for c in ("problem", "provider", "status", "max err", "tol", "ms", "TFLOP/s",
              "flash ×", "call MiB"):
        table.add_column(c, no_wrap=True)
    for r in with_ratios(rows):
        table.add_row(r["problem"], r["provider"], r["status"] + (
            f" ({r['reason'][:50]})" if r["reason"] else ""),
            _fmt(r["max_abs_error"], ".2e"), _fmt(r["tolerance"], ".1e"),
            _fmt(r["median_ms"], ".4f"), _fmt(r["tflops"], ".1f"),
            _fmt(r["flash_over_this"], ".2f"),
            _fmt(r["call_bytes"] and r["call_bytes"] / 2**20, ".1f"))
    console.print(table)
    _write_environment(out_dir, env, warmup=args.warmup, repeat=args.repeat, seed=args.seed,
                       source_sha256={n: sha256_file(VERSIONS[n].source_file())
                                      for n in names})
    if not mode.EMULATION:
        from fusedattn.lab.plots import draw_bench

        for f in draw_bench(out_dir / "bench.csv"):
            console.print(f"figure: {f}")
    console.print(f"written: {out_dir}")
    return 0 if all(r.status != "FAIL" for r in rows) else 1


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.registry import ROUTES, VERSIONS

    table = Table(title="versions (the registry, src/fusedattn/versions.py)")
    for c in ("version", "route", "timed launches", "limits", "in `all`", "description"):
        table.add_column(c)
    for v in VERSIONS.values():
        table.add_row(v.name, v.route, " → ".join(k.name for k in v.launches),
                      f"D ≤ {v.limits.max_dim}" if v.limits.max_dim else "—",
                      "yes" if v.in_all else "bench", v.description)
    console.print(table)
    for route, what in ROUTES.items():
        console.print(f"{route}: {what}")
    return 0


COMMANDS = {"list": cmd_list, "run": cmd_run, "run-all": cmd_run_all, "plot": cmd_plot,
            "bench": cmd_bench, "walkthrough": cmd_walkthrough, "masks": cmd_masks,
            "sweep": cmd_sweep, "profile": cmd_profile, "check-races": cmd_check_races}


def main(argv: list[str] | None = None) -> int:
    # Piped output (CI logs, the device tool) gets a wide table rather than 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, console)
    except ProblemError as err:
        print(f"fusedattn: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusedattn: interrupted", file=sys.stderr)
        return 130
