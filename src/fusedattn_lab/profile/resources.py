"""Resource rows: one per kernel of a version, from the compiled kernel (GPU) and the
registry: grid, block, registers, shared memory (static and dynamic), local memory, an
occupancy estimate, the buffers it reads and writes, and its block-level barriers."""

from __future__ import annotations

import math

from fusedattn.problem import Problem, ProblemError


class ToolMissing(ProblemError):
    def __init__(self, tool: str):
        super().__init__(tool, "not found on PATH",
                         f"install it (it ships with the CUDA toolkit / Nsight Compute) or "
                         f"run where it exists; {tool} needs a GPU")


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
    from fusedattn.mode import DEVICE, EMULATION
    from fusedattn_lab.inputs import make_inputs
    from fusedattn_lab.registry import VERSIONS

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
