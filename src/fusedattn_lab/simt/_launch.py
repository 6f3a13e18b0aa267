"""The bridge between torch tensors and numba.cuda launches, GPU or simulator."""

from __future__ import annotations

import sys
import threading
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


_SHARED_LOCK = threading.Lock()


def _shared_array(self, shape, dtype, alignment=None):
    """numba's simulator's `cuda.shared.array` (numba-cuda's `FakeCUDAShared.array`), with
    its lookup and its store made one step. The simulator names a launch's shared array by
    the line that asks for it: the first thread there makes it and stores it, the others
    find it. Its threads are OS threads, and it had no lock between the lookup and the
    store. `simulated_threads` switches them every 50 µs, so two threads could both find no
    array and each keep one of its own: one thread then read partial sums or a softmax state
    that no other thread wrote (most likely the lab's `online` version's one CI failure;
    numba's own method keeps four arrays where four threads store together: `test_simt`).
    Dynamic shared memory (`shape` 0) is one buffer with no lookup, so it goes to numba's
    own method."""
    if shape == 0 or alignment is not None:
        return _NUMBA_SHARED_ARRAY(self, shape, dtype, alignment)
    caller = sys._getframe(1)  # (the kernel's frame: its line names the array)
    where = (caller.f_code.co_filename, caller.f_lineno)
    with _SHARED_LOCK:
        found = self._allocations.get(where)
        if found is None:
            kind = _as_dtype(dtype) if isinstance(dtype, _NumbaType) else dtype
            found = self._allocations[where] = np.empty(shape, kind)
    return found


_NUMBA_SHARED_ARRAY = None
if EMULATION:
    from numba.core.types import Type as _NumbaType
    from numba.cuda.simulator import kernelapi
    from numba.np.numpy_support import as_dtype as _as_dtype

    _NUMBA_SHARED_ARRAY = kernelapi.FakeCUDAShared.array
    kernelapi.FakeCUDAShared.array = _shared_array


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
