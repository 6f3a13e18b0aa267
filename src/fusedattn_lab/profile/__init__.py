"""Profiling and barrier proofs, split by tool:

- `resources`: one row per kernel of a version (grid, block, registers, shared and local
  memory, occupancy, buffers, block-level barriers from the registry);
- `ncu`: Nsight Compute's metrics (`--clock-control none`);
- `sanitizer`: compute-sanitizer's four tools, one verdict per kernel, and the planted
  missing-barrier variant that racecheck must catch;
- `target`: the process both tools wrap (`python -m fusedattn_lab.profile target ...`).

Kernel symbols, the planted variant and which kernels are ours all come from the registry.
"""

from fusedattn_lab.profile.ncu import NCU_METRICS, parse_ncu_csv, run_ncu
from fusedattn_lab.profile.resources import ToolMissing, occupancy, resource_rows
from fusedattn_lab.profile.sanitizer import (
    GATING,
    SANITIZER_TOOLS,
    SanitizerReport,
    kernel_verdicts,
    parse_sanitizer,
    planted_label,
    run_sanitizer,
    sanitizer_kernels,
)

__all__ = ["GATING", "NCU_METRICS", "SANITIZER_TOOLS", "SanitizerReport",
           "ToolMissing", "kernel_verdicts", "occupancy", "parse_ncu_csv", "parse_sanitizer",
           "planted_label", "resource_rows", "run_ncu", "run_sanitizer",
           "sanitizer_kernels"]
