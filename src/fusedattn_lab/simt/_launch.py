"""The bridge between torch tensors and numba.cuda launches, GPU or simulator."""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
from numba import cuda

from fusedattn.mode import EMULATION, kernel_launches

F32 = np.float32

# One block per query row is the chapter's design, so small problems give small grids;
# numba's "grid size will likely result in under-utilization" says nothing new here.
warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-util")


def as_array(t: torch.Tensor):
    """A numba view of torch tensor `t`, sharing its memory (no copy)."""
    return t.numpy() if EMULATION else cuda.as_cuda_array(t)


def stream():
    """Torch's current stream as a numba stream (0 in the simulator, which has none)."""
    if EMULATION:
        return 0
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


@contextmanager
def simulated_threads():
    """Around a launch: in the simulator, switch Python threads often.

    The simulator runs every CUDA thread as an OS thread and a manager thread polls them
    for barriers; with the default 5 ms switch interval each block-level barrier costs
    about 20 ms for 32 threads. At 50 us the same 7x13 online launch ran 8x faster here.
    On a GPU this does nothing. The interval is process-wide, so simulated launches on
    different threads run one at a time (`mode.kernel_launches`): interleaved, the second
    would restore the first's interval.
    """
    if not EMULATION:
        yield
        return
    with kernel_launches():
        before = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)
        try:
            yield
        finally:
            sys.setswitchinterval(before)


@dataclass(frozen=True)
class Resources:
    """What the compiled kernel uses, per launch. None where emulation cannot know."""

    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    regs_per_thread: int | None
    static_shared_bytes: int | None
    dynamic_shared_bytes: int
    local_bytes_per_thread: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def resources(kernel, name: str, grid: int, block: int, dynamic_shared: int = 0) -> Resources:
    """Resource fields of the (already launched, hence compiled) numba `kernel`."""
    regs = shared = local = None
    if not EMULATION:
        compiled = list(kernel.overloads.values())[-1]  # the signature just launched
        regs = compiled.regs_per_thread
        shared = compiled.shared_mem_per_block
        local = compiled.local_mem_per_thread
    return Resources(name, (grid,), (block,), regs, shared, dynamic_shared, local)


def resource_fields(launches: list) -> list[dict]:
    """Resource fields of each `(kernel, name, grid, block, dynamic shared)` launch."""
    return [resources(*launch).to_dict() for launch in launches]
