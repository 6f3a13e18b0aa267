"""Choose, once and before any kernel module is imported, between the GPU and emulation.

Triton reads `TRITON_INTERPRET` when a kernel is decorated and numba reads
`NUMBA_ENABLE_CUDASIM` when it is imported, so both must be set before
`fusedattn.tiles` / `fusedattn.simt` are imported. `fusedattn/__init__.py` imports this
module first; nothing else sets the flags.

Rules:
- no CUDA device visible to torch -> emulation (both flags set to 1);
- `FUSEDATTN_EMULATE=1` forces emulation on a GPU machine (to test the emulated path there);
- flags the user already set to 1 are honoured (emulation).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

_FLAGS = ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")


def _decide() -> bool:
    forced = os.environ.get("FUSEDATTN_EMULATE", "") == "1"
    preset = any(os.environ.get(f, "") == "1" for f in _FLAGS)
    emulate = forced or preset or not torch.cuda.is_available()
    if emulate:
        for flag in _FLAGS:
            os.environ[flag] = "1"
    return emulate


EMULATION: bool = _decide()
"""True when kernels run in Triton's interpreter and numba's CUDA simulator (on the CPU)."""

DEVICE: torch.device = torch.device("cpu" if EMULATION else "cuda")
"""Where the version buffers live: torch CPU tensors in emulation, CUDA tensors otherwise."""


_INTERPRETER = threading.RLock()


def kernel_launches():
    """The context every fusedattn kernel launch runs in. In emulation, one process-wide
    (re-entrant) lock: Triton's interpreter is not thread-safe (four threads launching a
    plain Triton kernel at once raised InterpreterError or returned wrong numbers, an
    upstream fault), so fusedattn's launches there run one at a time. On the GPU: nothing."""
    return _INTERPRETER if EMULATION else contextlib.nullcontext()


def describe() -> str:
    """One line for tables and records."""
    if EMULATION:
        return "emulation (Triton interpreter + numba CUDA simulator on CPU): logic only, no times"
    return f"GPU: {torch.cuda.get_device_name()}"
