"""Tests run wherever they are started: in emulation on a CPU (CI), on the GPU otherwise
(the GPU tier: the same suite on the H200, README "The GPU tier").

The mode is chosen here, explicitly, before fusedattn is imported: emulation (Triton's
interpreter, numba's simulator) where no GPU is visible, by the lab's rule
(`fusedattn_lab.choose_mode`). A test that makes sense on one side only says so with a
marker and a reason, and is skipped on the other:

    @pytest.mark.emulation_only("why")   # CPU emulation only
    @pytest.mark.gpu_only("why")         # the GPU only

A test that needs most of the GPU's memory says so with `@pytest.mark.big_memory("why")`:
the GPU tier's workers (pytest-xdist, one a core) then run such tests one at a time, and
each hands its memory back to the driver when it ends, so that the next one (in another
worker) finds it free. Without this, the caching allocator of the worker that ran the
first kept its ~42 GB, and the second ran out of memory on an 80 GB H100 (153452Z).
"""

import fcntl
import gc
import tempfile
from pathlib import Path

import pytest
import torch

from fusedattn_lab import choose_mode

choose_mode()  # before fusedattn is imported

import fusedattn  # noqa: E402, F401
from fusedattn.mode import DEVICE, EMULATION  # noqa: E402
from fusedattn.problem import Problem  # noqa: E402
from fusedattn_lab.inputs import make_inputs  # noqa: E402

SIDES = {"emulation_only": True, "gpu_only": False}  # marker -> runs when EMULATION is


def pytest_configure(config):
    config.addinivalue_line("markers", "emulation_only(reason): runs in CPU emulation only")
    config.addinivalue_line("markers", "gpu_only(reason): runs on a GPU only")
    config.addinivalue_line("markers", "big_memory(reason): one at a time across workers")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, side in SIDES.items():
            marker = item.get_closest_marker(name)
            if marker is None:
                continue
            if not marker.args or not str(marker.args[0]).strip():
                raise pytest.UsageError(f"{item.nodeid}: @{name} needs a reason")
            if EMULATION != side:
                item.add_marker(pytest.mark.skip(reason=f"{name}: {marker.args[0]}"))


@pytest.fixture(autouse=True)
def _big_memory_one_at_a_time(request):
    """A `big_memory` test holds a lock every worker of this machine shares, and empties
    torch's caching allocator before and after (its own memory back to the driver)."""
    marker = request.node.get_closest_marker("big_memory")
    if marker is None or EMULATION:
        yield
        return
    if not marker.args or not str(marker.args[0]).strip():
        raise pytest.UsageError(f"{request.node.nodeid}: @big_memory needs a reason")
    with open(Path(tempfile.gettempdir()) / "fusedattn-big-memory.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            gc.collect()
            torch.cuda.empty_cache()
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def qkv():
    """`qkv(S, D, inputs="uniform", seed=0)` -> q, k, v on the mode's device."""

    def make(seq: int, dim: int, inputs: str = "uniform", seed: int = 0):
        return make_inputs(Problem(seq, dim, 32), inputs, seed, DEVICE)

    return make


def assert_passes(out: torch.Tensor, ref: torch.Tensor) -> None:
    from fusedattn_lab.verify import check

    result = check(out, ref)
    assert result.ok, result.reasons
