"""compute-sanitizer: racecheck, synccheck, memcheck and initcheck over the versions'
kernels, one verdict per kernel and tool, and the planted missing-barrier variant."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from fusedattn.problem import Problem
from fusedattn_lab.profile.resources import ToolMissing
from fusedattn_lab.profile.target import _target_cmd

SANITIZER_TOOLS = ("racecheck", "synccheck", "memcheck", "initcheck")
GATING = {"simt": SANITIZER_TOOLS, "tiles": ("synccheck", "memcheck", "initcheck"),
          "peer": ("memcheck",)}
"""Which tools decide a version's verdict. Triton's racecheck output carries known false
positives (triton-lang/triton issues 7264, 4736): reported, advisory. Peers are library
kernels: racecheck/initcheck findings there are reported, not ours to gate on."""

def planted_label(name: str) -> str:
    """A planted variant's label in reports."""
    return f"{name}-planted"


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


def sanitizer_kernels(names: list[str]) -> dict[str, list[str]]:
    """Symbol -> the versions that launch it, for our own kernels (declared in the
    registry); a library's kernels (the peers') have none and are reported as `other`."""
    from fusedattn_lab.registry import kernel_symbols

    return kernel_symbols(names)


def run_sanitizer(tool: str, names: list[str], problem: Problem, planted: str | None = None
                  ) -> tuple[SanitizerReport, str]:
    """One sanitizer process running every version in `names`, or with `planted` (a
    version's name) that version's planted variant."""
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        raise ToolMissing("compute-sanitizer")
    env = dict(os.environ)
    if tool == "memcheck":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # so out-of-bounds hit unallocated memory
    cmd = [exe, "--tool", tool, "--target-processes", "all", "--report-api-errors", "no",
           *_target_cmd(planted or ",".join(names), problem, planted is not None)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    raw = proc.stdout + proc.stderr
    symbols = list(sanitizer_kernels([planted] if planted else names))
    return parse_sanitizer(tool, raw, symbols), raw


def kernel_verdicts(routes: dict[str, str], report: SanitizerReport,
                    planted: str | None = None) -> dict[str, str]:
    """One verdict per kernel for one tool: `clean`, `FOUND`, or `advisory: ...` when the
    tool does not gate that kernel's route (`routes`: symbol -> route). Findings that name
    none of our kernels (torch's own) are judged as the peer route, under `other`; a report
    with errors but no finding that can be attributed counts against every kernel, to be
    safe. For the planted variant only its planted kernel is judged: `caught` when racecheck
    reports a hazard in it."""
    total = (report.errors or 0) + (report.hazards or 0)
    attributed = sum(report.kernels.values()) + report.other
    if planted:
        from fusedattn_lab.registry import planted_symbol

        symbol = planted_symbol(planted)
        caught = total > 0 and report.kernels.get(symbol, 0) > 0
        return {symbol: "caught" if caught else "MISSED"}

    def word(found: bool, route: str) -> str:
        w = "FOUND" if found else "clean"
        return w if report.tool in GATING[route] else f"advisory: {w}"

    unattributed = total > 0 and attributed == 0
    out = {k: word(n > 0 or unattributed, routes[k]) for k, n in report.kernels.items()}
    if "peer" in routes.values() or report.other:
        out["other"] = word(report.other > 0 or unattributed, "peer")
    return out
