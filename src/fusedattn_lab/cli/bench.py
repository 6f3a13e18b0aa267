"""`fusedattn bench`: the flash kernel against PyTorch's backends, suite by suite."""

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
    render_table,
    stamp_dir,
    write_environment,
    write_rows_csv,
)


def add(sub) -> None:
    p = sub.add_parser("bench", help="the flash kernel against PyTorch's attention backends")
    p.add_argument("--suite", default="bf16",
                    help="bf16|fp16|fp32|memory|tiny|train-bf16|train-fp16|train-fp32|"
                    "tiny-train|prefill|all, the serving suites decode|varlen|window|sinks|mla|"
                    "fp8|tiny-serving, "
                    "coldstart (first calls in fresh processes), host (host µs a call), or the "
                    "Hugging Face suites hf-generate|hf-train|tiny-hf")
    p.add_argument("--providers", default="all",
                    help="all, or a comma-separated list of versions with a batched form")
    p.add_argument("--match", default="",
                    help="only problems whose label contains one of these comma-separated "
                    "texts, e.g. 'S8192 D64 causal'")
    p.add_argument("--configs", action="store_true",
                    help="also time each flash config the autotuner picks from, one by one")
    p.add_argument("--ab", default=None, metavar="FIELD=A,B",
                    help="an A/B of one override (one_loop, split_d, index64: 0 or 1 each) "
                    "on the suite's problems, alternately in this process; suites ab-train, "
                    "ab-split, ab-overlap besides the others")
    p.add_argument("--warmup", type=int_arg, default=5)
    p.add_argument("--repeat", type=int_arg, default=20)
    p.add_argument("--seed", type=int_arg, default=0)
    p.add_argument("--out", type=Path, default=None,
                    help="base folder; CSV and plots go to OUT/<gpu>/<timestamp>-bench-SUITE/ "
                    + OUT_DEFAULT)


COMMON_COLUMNS = [
    ("problem", lambda r: r["problem"]), ("provider", lambda r: r["provider"]),
    ("status", lambda r: r["status"] + (f" ({r['reason'][:50]})" if r["reason"] else "")),
    ("max err", lambda r: fmt(r["max_abs_error"], ".2e")),
    ("tol", lambda r: fmt(r["tolerance"], ".1e")),
    ("ms", lambda r: fmt(r["median_ms"], ".4f"))]


def _select(args: argparse.Namespace, problems: list, known: list[str], emulated: str):
    """The suite's problems that `--match` keeps and the `--providers` asked for (all of
    `known` by default), with the counts checked; in emulation only the `emulated` suites."""
    if args.match:
        wanted = [m.strip() for m in args.match.split(",") if m.strip()]
        kept = [p for p in problems if any(m in p.label() for m in wanted)]
        if not kept:
            raise ProblemError("match", args.match, "texts found in the suite's labels, e.g. "
                               + ", ".join(p.label() for p in problems[:2]))
        problems = kept
    names = known if args.providers == "all" else [
        n.strip() for n in args.providers.split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise ProblemError("providers", args.providers, "all, or a comma-separated list of: "
                           + ", ".join(known))
    if args.warmup < 0:
        raise ProblemError("warmup", args.warmup, "an integer >= 0")
    if args.repeat < 1:
        raise ProblemError("repeat", args.repeat, "an integer >= 1")
    if mode.EMULATION and not args.suite.startswith("tiny"):
        raise ProblemError("suite", args.suite,
                           f"{emulated} in emulation (the others are GPU-sized)")
    return problems, names


def _run_problems(args, console, problems, run_one, as_rows):
    """Run each problem (`run_one(p)` gives its rows) into a new run folder, writing
    bench.csv whole after each (`as_rows(rows)`: the rows as CSV dicts); returns
    (environment, folder, rows)."""
    from fusedattn_lab.evidence import environment

    env = environment()
    out_dir = stamp_dir(args, f"-bench-{args.suite}", env)
    rows = []
    with console.status("bench") as status:
        for p in problems:
            status.update(p.label())
            rows += run_one(p)
            write_rows_csv(out_dir / "bench.csv", as_rows(rows))
    return env, out_dir, rows


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab.serving import serving_suites

    if args.suite in serving_suites():
        return run_serving_suite(args, console)
    if args.suite == "coldstart":
        return run_coldstart(args, console)
    if args.suite == "host":
        return run_host(args, console)
    from fusedattn_lab.hf_bench import SUITES as HF_SUITES

    if args.suite in HF_SUITES:
        from fusedattn_lab.hf_bench import run_hf_suite

        return run_hf_suite(args, console)
    if args.ab is not None:
        return run_ab_suite(args, console)
    from fusedattn_lab.evidence import sha256_file
    from fusedattn_lab.registry import VERSIONS
    from fusedattn_lab.suites import check_suite, providers, run_problem, with_ratios

    problems, names = _select(args, check_suite(args.suite), providers(), "tiny or tiny-train")
    env, out_dir, rows = _run_problems(
        args, console, problems, lambda p: run_problem(
            p, names, warmup=args.warmup, repeat=args.repeat, seed=args.seed,
            configs=args.configs), with_ratios)
    render_table(console, f"bench {args.suite} — {mode.describe()}", with_ratios(rows), [
        *COMMON_COLUMNS,
        ("TFLOP/s", lambda r: fmt(r["tflops"], ".1f")),
        ("flash ×", lambda r: fmt(r["flash_over_this"], ".2f")),
        ("call MiB", lambda r: fmt(r["call_bytes"] and r["call_bytes"] / 2**20, ".1f"))])
    write_environment(out_dir, env, warmup=args.warmup, repeat=args.repeat, seed=args.seed,
                       source_sha256={n: sha256_file(VERSIONS[n].source_file())
                                      for n in names})
    if not mode.EMULATION:
        from fusedattn_lab.plots import draw_bench

        for f in draw_bench(out_dir / "bench.csv"):
            console.print(f"figure: {f}")
    console.print(f"written: {out_dir}")
    return 0 if all(r.status != "FAIL" for r in rows) else 1


def run_serving_suite(args: argparse.Namespace, console: Console) -> int:
    """decode / varlen / window / sinks / mla: the serving entry points against their
    peers."""
    from fusedattn_lab.evidence import sha256_file
    from fusedattn_lab.serving import BUILDERS, PROVIDERS, run_serving, serving_suites

    problems, names = _select(args, serving_suites()[args.suite], list(PROVIDERS),
                              "tiny-serving")
    env, out_dir, rows = _run_problems(
        args, console, problems, lambda p: run_serving(
            p, names, warmup=args.warmup, repeat=args.repeat, seed=args.seed), list)
    render_table(console, f"bench {args.suite} — {mode.describe()}", rows, [
        *COMMON_COLUMNS,
        ("useful TFLOP/s", lambda r: fmt(r["tflops"], ".1f")),
        ("K+V GB/s", lambda r: fmt(r["gbps"], ".0f")),
        ("fusedattn ×", lambda r: fmt(r["flash_over_this"], ".2f"))])
    from fusedattn import kvcache, varlen
    from fusedattn.tiles import flash

    write_environment(out_dir, env, warmup=args.warmup, repeat=args.repeat, seed=args.seed,
                      source_sha256={m.__name__: sha256_file(m.__file__)
                                     for m in (flash, kvcache, varlen)},
                      kinds=sorted(BUILDERS))
    console.print(f"written: {out_dir}")
    return 0 if all(r["status"] != "FAIL" for r in rows) else 1


def run_coldstart(args: argparse.Namespace, console: Console) -> int:
    """Each first-call case in a fresh process with an empty Triton cache."""
    from fusedattn_lab.coldstart import MODES, problems, run_fresh
    from fusedattn_lab.evidence import environment

    if mode.EMULATION:
        raise ProblemError("suite", "coldstart", "a GPU: in emulation nothing is compiled")
    env = environment()
    out_dir = stamp_dir(args, "-bench-coldstart", env)
    rows = []
    with console.status("coldstart") as status:
        for p in problems():
            for start in MODES:
                status.update(f"{p.label()} ({start})")
                rows.append(run_fresh(p, start))
                write_rows_csv(out_dir / "coldstart.csv", rows)
    write_environment(out_dir, env)
    render_coldstart(console, rows)
    console.print(f"written: {out_dir}")
    return 0 if all(r.get("verified") for r in rows) else 1


def run_host(args: argparse.Namespace, console: Console) -> int:
    """Host µs a call and graph GPU µs, fusedattn against SDPA (`fusedattn_lab.host`)."""
    from fusedattn_lab.evidence import environment
    from fusedattn_lab.host import CALLS, LOOPS, REPLAYS, TARGET, measure, problems

    if mode.EMULATION:
        raise ProblemError("suite", "host", "a GPU: in emulation the kernels run on the host")
    env = environment()
    out_dir = stamp_dir(args, "-bench-host", env)
    rows = []
    with console.status("host") as status:
        for p in problems():
            status.update(p.label())
            rows += measure(p, seed=args.seed)
            write_rows_csv(out_dir / "host.csv", rows)
    write_environment(out_dir, env, loops=LOOPS, calls=CALLS, replays=REPLAYS, target=TARGET)
    render_table(console, f"host cost a call — {mode.describe()}", rows, [
        ("problem", lambda r: r["problem"]), ("provider", lambda r: r["provider"]),
        ("status", lambda r: r["status"] + (f" ({r['reason'][:40]})" if r["reason"] else "")),
        ("host µs", lambda r: fmt(r.get("host_us"), ".1f")),
        ("spread", lambda r: "" if "host_us" not in r else
         f"{r['host_us_min']:.1f}-{r['host_us_max']:.1f}"),
        ("× SDPA", lambda r: fmt(r.get("over_sdpa"), ".2f")),
        ("graph GPU µs", lambda r: fmt(r["graph_gpu_us"], ".1f") if r.get("graph_gpu_us")
         is not None else r.get("graph_note", "—"))])
    console.print(f"written: {out_dir}")
    return 0 if all(r["status"] != "FAIL" for r in rows) else 1


def render_coldstart(console: Console, rows: list[dict]) -> None:
    """The cold-start rows as a table: a case that failed shows its error."""
    render_table(console, f"first calls, fresh processes — {mode.describe()}", rows, [
        ("problem", lambda r: r["problem"]),
        ("primer s", lambda r: fmt(r.get("primer_s"), ".2f")),
        ("first call s", lambda r: fmt(r.get("first_call_s"), ".2f")),
        ("its forward s", lambda r: fmt(r.get("first_forward_s"), ".2f")),
        ("torch's import s", lambda r: fmt(r.get("torch_backward_import_s"), ".2f")),
        ("compiles s (summed)", lambda r: fmt(r.get("compile_sum_s"), ".2f")),
        ("second call ms", lambda r: fmt(r.get("second_call_s") and
                                         r["second_call_s"] * 1e3, ".2f")),
        ("new shape s", lambda r: fmt(r.get("second_shape_s"), ".3f")),
        ("its compiles", lambda r: str(r.get("second_shape_compiles", "—"))),
        ("SDPA first s", lambda r: fmt(r.get("sdpa_first_call_s"), ".3f")),
        ("process s", lambda r: fmt(r.get("process_s"), ".1f")),
        ("verified", lambda r: str(r.get("verified", r.get("error", "")))[:60])])


def run_ab_suite(args: argparse.Namespace, console: Console) -> int:
    """`--ab FIELD=A,B`: the A/B runner (`fusedattn_lab.ab`) on the suite's problems."""
    from fusedattn_lab.ab import parse_ab, run_ab
    from fusedattn_lab.suites import AB_SUITES, check_suite

    field, values = parse_ab(args.ab)
    problems, _ = _select(args, check_suite(args.suite), ["flash"], "none")
    if mode.EMULATION:
        raise ProblemError("ab", args.ab, "a GPU: an A/B times kernels")
    from fusedattn_lab.evidence import environment

    env = environment()
    out_dir = stamp_dir(args, f"-ab-{field}-{args.suite}", env)
    with console.status("ab") as status:
        rows = run_ab(field, values, problems, extra=args.suite not in AB_SUITES,
                      repeat=args.repeat, progress=status.update)
    write_rows_csv(out_dir / "ab.csv", rows)
    write_environment(out_dir, env, warmup=3, repeat=args.repeat, seed=0, ab=args.ab)
    speed = next(k for k in rows[0] if k.startswith("speedup"))
    render_table(console, f"A/B {args.ab} — {mode.describe()}", rows, [
        ("problem", lambda r: r["problem"]),
        ("verified", lambda r: all(v for k, v in r.items() if k.startswith("verified"))),
        (speed, lambda r: fmt(r[speed], ".3f"))])
    console.print(f"written: {out_dir}/ab.csv")
    return 0 if all(all(v for k, v in r.items() if k.startswith("verified"))
                    for r in rows) else 1
