"""Profiling and barrier proofs: resource rows, Nsight Compute metrics, compute-sanitizer.

- `resource_rows`: one row per kernel of a version: grid, block, registers, shared memory
  (static and dynamic), local memory, an occupancy estimate, the buffers it reads and
  writes, and the block-level barriers it executes (from the registry).
- `run_ncu`: the version under `ncu --clock-control none` with a small fixed metric set.
- `run_sanitizer`: the version under compute-sanitizer (racecheck, synccheck, memcheck,
  initcheck), with one verdict per kernel and tool.
- `python -m fusedattn.lab.profile target ...`: the process that both tools wrap: inputs,
  one prepare + call, verify. `--planted` swaps in the row softmax without the
  read-the-max barrier (the chapter's historical bug), which racecheck must catch.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from fusedattn.problem import Problem, ProblemError

NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    # share of active warp-cycles in which a warp waits at a barrier (bar.sync)
    "smsp__warp_issue_stalled_barrier_per_warp_active.pct": "barrier_stall_pct",
}
SANITIZER_TOOLS = ("racecheck", "synccheck", "memcheck", "initcheck")
GATING = {"simt": SANITIZER_TOOLS, "tiles": ("synccheck", "memcheck", "initcheck"),
          "peer": ("memcheck",)}
"""Which tools decide a version's verdict. Triton's racecheck output carries known false
positives (triton-lang/triton issues 7264, 4736): reported, advisory. Peers are library
kernels: racecheck/initcheck findings there are reported, not ours to gate on."""

PLANTED = "materialized-planted"  # the test-only variant's label in reports


class ToolMissing(ProblemError):
    def __init__(self, tool: str):
        super().__init__(tool, "not found on PATH",
                         f"install it (it ships with the CUDA toolkit / Nsight Compute) or "
                         f"run where it exists; {tool} needs a GPU")


# --- resources -----------------------------------------------------------------------------

def _device_limits() -> dict | None:
    from fusedattn.mode import EMULATION

    if EMULATION:
        return None
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "threads_per_sm": p.max_threads_per_multi_processor,
        "regs_per_sm": getattr(p, "regs_per_multiprocessor", 65536),
        "shared_per_sm": getattr(p, "shared_memory_per_multiprocessor", 233472),
        "blocks_per_sm": 32,  # sm_80..sm_90
        "sms": p.multi_processor_count,
    }


def occupancy(threads: int, regs: int | None, shared: int | None, limits: dict | None
              ) -> float | None:
    """Theoretical occupancy: resident warps / max warps per SM, from threads, registers and
    shared memory per block (registers allocated per warp in units of 256)."""
    if limits is None or regs is None or shared is None or threads is None:
        return None
    warps = math.ceil(threads / 32)
    regs_per_block = warps * math.ceil(max(regs, 1) * 32 / 256) * 256
    by_threads = limits["threads_per_sm"] // (warps * 32)
    by_regs = limits["regs_per_sm"] // regs_per_block
    by_shared = limits["shared_per_sm"] // shared if shared else limits["blocks_per_sm"]
    blocks = min(by_threads, by_regs, by_shared, limits["blocks_per_sm"])
    return blocks * warps * 32 / limits["threads_per_sm"]


def resource_rows(name: str, problem: Problem, seed: int = 0) -> list[dict]:
    """Run the version once on `problem` and describe each of its kernels."""
    from fusedattn.lab.inputs import make_inputs
    from fusedattn.lab.registry import VERSIONS
    from fusedattn.mode import DEVICE, EMULATION

    version = VERSIONS[name]
    q, k, v = make_inputs(problem, "uniform", seed, DEVICE)
    prepared = version.prepare(q, k, v, problem)
    prepared.call()
    if not EMULATION:
        import torch

        torch.cuda.synchronize()
    measured = {r["kernel"]: r for r in prepared.resources()}
    limits = _device_limits()
    rows = []
    for kern in version.launches:
        r = measured.get(kern.name, {})
        block = (r.get("block") or [None])[0]
        shared = None
        if r.get("static_shared_bytes") is not None:
            shared = r["static_shared_bytes"] + r.get("dynamic_shared_bytes", 0)
        rows.append({
            "version": name, "kernel": kern.name,
            "grid": (r.get("grid") or [None])[0], "block": block,
            "regs_per_thread": r.get("regs_per_thread"),
            "static_shared_bytes": r.get("static_shared_bytes"),
            "dynamic_shared_bytes": r.get("dynamic_shared_bytes"),
            "local_bytes_per_thread": r.get("local_bytes_per_thread"),
            "spills": r.get("spills"), "num_warps": r.get("num_warps"),
            "num_stages": r.get("num_stages"),
            "occupancy": occupancy(block, r.get("regs_per_thread"), shared, limits),
            "reads": "+".join(kern.reads), "writes": "+".join(kern.writes),
            "barriers_per_block": None if kern.barriers is None else kern.barriers(problem),
            "barriers_note": kern.barriers_note,
            "measured": bool(r),
        })
    return rows


# --- the wrapped process -------------------------------------------------------------------

def target_main(argv: list[str]) -> int:
    """`python -m fusedattn.lab.profile target --version X --seq S --dim D --block B [--planted]`"""
    from fusedattn.lab.inputs import make_inputs
    from fusedattn.lab.registry import VERSIONS
    from fusedattn.lab.verify import check, poison
    from fusedattn.mode import DEVICE, EMULATION
    from fusedattn.reference import attention_ref

    ap = argparse.ArgumentParser(prog="fusedattn.lab.profile target")
    ap.add_argument("--version", required=True, help="one name or a comma-separated list")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--planted", action="store_true")
    ap.add_argument("--no-poison", action="store_true",
                    help="skip the NaN fill, so a profiler sees only the version's kernels")
    args = ap.parse_args(argv)
    problem = Problem(args.seq, args.dim, args.block)
    q, k, v = make_inputs(problem, "uniform", 0, DEVICE)
    ref = attention_ref(q, k, v)
    for name in args.version.split(","):
        if args.planted:
            from fusedattn.simt import materialized

            bufs = materialized.allocate(q)
            out = bufs["out"]
            if not args.no_poison:
                poison(out)
            materialized.materialized_attention(
                q, k, v, bufs, block=problem.block,
                softmax_kernel=materialized.planted_softmax_kernel())
        else:
            prepared = VERSIONS[name].prepare(q, k, v, problem)
            out = prepared.out
            if not args.no_poison:
                poison(out)
            prepared.call()
        if not EMULATION:
            import torch

            torch.cuda.synchronize()
        result = check(out, ref)
        print(f"TARGET {name}{' (planted)' if args.planted else ''}: {result.verdict} "
              f"max_abs={result.max_abs:.3e}")
    return 0


def _target_cmd(name: str, problem: Problem, planted: bool = False) -> list[str]:
    """`name`: a version or a comma-separated list, run one after another in one process."""
    cmd = [sys.executable, "-m", "fusedattn.lab.profile", "target", "--version",
           "materialized" if planted else name, "--seq", str(problem.seq), "--dim",
           str(problem.dim), "--block", str(problem.block)]
    return cmd + (["--planted"] if planted else [])


# --- Nsight Compute ------------------------------------------------------------------------

def parse_ncu_csv(text: str) -> list[dict]:
    """Rows of `ncu --csv --page raw`: the header, a units row, then one row per kernel.
    Lines ncu or the target print around the CSV are skipped."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = rows[0], rows[1:]
    if body and body[0] and body[0][0] == "":  # the units row
        units, body = body[0], body[1:]
    else:
        units = [""] * len(header)
    out = []
    for row in body:
        rec = dict(zip(header, row, strict=False))
        item = {"kernel": rec.get("Kernel Name", ""), "id": rec.get("ID", "")}
        for metric, short in NCU_METRICS.items():
            if metric in rec:
                item[short] = _number(rec[metric])
                item[short + "_unit"] = units[header.index(metric)]
        out.append(item)
    return out


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def run_ncu(name: str, problem: Problem, metrics: dict = NCU_METRICS) -> tuple[list[dict], str]:
    """Profile every kernel launch of one call of `name`; returns (rows, raw output)."""
    exe = shutil.which("ncu")
    if exe is None:
        raise ToolMissing("ncu")
    names = list(metrics)
    for _ in range(2):
        cmd = [exe, "--clock-control", "none", "--csv", "--page", "raw",
               "--target-processes", "all", "--metrics", ",".join(names),
               *_target_cmd(name, problem), "--no-poison"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        raw = proc.stdout + proc.stderr
        missing = re.findall(r"Failed to find metric (\S+)", raw)
        if not missing:
            break
        names = [m for m in names if m not in {x.strip("'\".,") for x in missing}]
    return parse_ncu_csv(proc.stdout), raw


# --- compute-sanitizer ---------------------------------------------------------------------

@dataclass(frozen=True)
class SanitizerReport:
    tool: str
    errors: int | None          # "ERROR SUMMARY: N errors", host API errors excluded
    hazards: int | None         # racecheck: "RACECHECK SUMMARY: N hazards displayed"
    kernels: dict[str, int]     # kernel short name -> findings mentioning it
    other: int                  # findings that name none of the expected kernels
    api_errors: int = 0         # "Program hit CUDA_ERROR_... on CUDA API call": host side


def parse_sanitizer(tool: str, text: str, kernel_names: list[str]) -> SanitizerReport:
    """Parse a compute-sanitizer report; attribute each finding to the kernels it names."""
    errors = hazards = None
    m = re.search(r"ERROR SUMMARY:\s*(\d+)\s+error", text)
    if m:
        errors = int(m.group(1))
    m = re.search(r"RACECHECK SUMMARY:\s*(\d+)\s+hazard", text)
    if m:
        hazards = int(m.group(1))
    # Host API errors (torch and numba probe the driver with cuGetProcAddress and friends)
    # are counted in the summary but are not findings in any kernel.
    api_errors = len(re.findall(r"^=+ Program hit \S+ .* on CUDA API call", text, re.M))
    if errors is not None:
        errors = max(0, errors - api_errors)
    blocks, current = [], None
    for line in text.splitlines():
        body = line.removeprefix("=========").strip()
        finding = re.match(r"(Error|Warning|Invalid|Uninitialized|Race|Barrier)", body)
        if finding and line.startswith("="):
            current = [body]
            blocks.append(current)
        elif current is not None and line.startswith("=========     "):
            current.append(body)
        else:
            current = None
    kernels = {k: 0 for k in kernel_names}
    other = 0
    for block in blocks:
        joined = " ".join(block)
        hit = [k for k in kernel_names if k in joined]
        for k in hit:
            kernels[k] += 1
        other += not hit
    return SanitizerReport(tool, errors, hazards, kernels, other, api_errors)


SYMBOLS = {"scores": "_scores_kernel", "softmax_rows": "_softmax_rows_kernel",
           "pv": "_pv_kernel", "online_rows": "_online_rows_kernel",
           "rows_fwd": "_rows_fwd_kernel"}
"""Registry kernel name -> the name inside the symbol that reports print (numba keeps the
Python function name inside the mangled symbol, Triton the jit function's name)."""


def sanitizer_kernels(names: list[str]) -> dict[str, list[str]]:
    """Symbol -> the versions that launch it, for our own kernels; a library's kernels
    (torch-eager's) have no symbol of ours and are reported as `other`."""
    from fusedattn.lab.registry import VERSIONS

    out: dict[str, list[str]] = {}
    for name in names:
        for k in VERSIONS[name].launches:
            if k.name in SYMBOLS:
                out.setdefault(SYMBOLS[k.name], []).append(name)
    return out


def run_sanitizer(tool: str, names: list[str], problem: Problem, planted: bool = False
                  ) -> tuple[SanitizerReport, str]:
    """One sanitizer process running every version in `names` (or the planted variant)."""
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        raise ToolMissing("compute-sanitizer")
    env = dict(os.environ)
    if tool == "memcheck":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # so out-of-bounds hit unallocated memory
    cmd = [exe, "--tool", tool, "--target-processes", "all", "--report-api-errors", "no",
           *_target_cmd(",".join(names), problem, planted)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    raw = proc.stdout + proc.stderr
    symbols = list(sanitizer_kernels(["materialized"] if planted else names))
    return parse_sanitizer(tool, raw, symbols), raw


def kernel_verdicts(routes: dict[str, str], report: SanitizerReport, planted: bool = False
                    ) -> dict[str, str]:
    """One verdict per kernel for one tool: `clean`, `FOUND`, or `advisory: ...` when the
    tool does not gate that kernel's route (`routes`: symbol -> route). Findings that name
    none of our kernels (torch's own) are judged as the peer route, under `other`; a report
    with errors but no finding that can be attributed counts against every kernel, to be
    safe. For the planted variant only the row softmax is judged: `caught` when racecheck
    reports a hazard in it."""
    total = (report.errors or 0) + (report.hazards or 0)
    attributed = sum(report.kernels.values()) + report.other
    if planted:
        caught = total > 0 and report.kernels.get("_softmax_rows_kernel", 0) > 0
        return {"_softmax_rows_kernel": "caught" if caught else "MISSED"}

    def word(found: bool, route: str) -> str:
        w = "FOUND" if found else "clean"
        return w if report.tool in GATING[route] else f"advisory: {w}"

    unattributed = total > 0 and attributed == 0
    out = {k: word(n > 0 or unattributed, routes[k]) for k, n in report.kernels.items()}
    if "peer" in routes.values() or report.other:
        out["other"] = word(report.other > 0 or unattributed, "peer")
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "target":
        import fusedattn  # noqa: F401  (fix the mode first)

        raise SystemExit(target_main(sys.argv[2:]))
    print("usage: python -m fusedattn.lab.profile target --version X --seq S --dim D --block B",
          file=sys.stderr)
    raise SystemExit(2)
