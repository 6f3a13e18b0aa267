"""Nsight Compute: the version under `ncu --clock-control none` (the card's clocks are never
changed) with a small fixed metric set, parsed from `--csv --page raw`."""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess

from fusedattn.problem import Problem
from fusedattn_lab.profile.resources import ToolMissing
from fusedattn_lab.profile.target import _target_cmd

NCU_METRICS = {
    "gpu__time_duration.sum": "duration",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    # share of active warp-cycles in which a warp waits at a barrier (bar.sync)
    "smsp__warp_issue_stalled_barrier_per_warp_active.pct": "barrier_stall_pct",
    # what the time model of the thread-level versions needs (evidence README)
    "lts__t_bytes.sum": "l2_bytes",
    "smsp__inst_executed.sum": "warp_instructions",
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": "ffma_thread_ops",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "shared_bank_conflicts",
    "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct": "shared_wait_stall_pct",
}


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
