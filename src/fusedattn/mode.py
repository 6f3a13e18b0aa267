"""Where the kernels run: the GPU, or Triton's interpreter on CPU tensors (emulation).

Read once, when fusedattn is imported, from the environment the user (or the lab's CLI, or
the tests' conftest) set before; importing fusedattn sets nothing itself, so no other
package or child process sees a change:
- `TRITON_INTERPRET=1` (Triton's own switch, which it reads when a kernel is decorated):
  emulation. The kernels then take CPU tensors, slowly, to prove logic, never speed.
- otherwise the GPU: the kernels take CUDA tensors, and a CPU tensor is refused with a
  `ProblemError` that says how to run it.

The lab's CLI (`fusedattn_lab.cli`) chooses emulation on a machine without a GPU, or with
`FUSEDATTN_EMULATE=1`, by setting `TRITON_INTERPRET` and `NUMBA_ENABLE_CUDASIM` in its own
process before it imports fusedattn (`fusedattn_lab.choose_mode`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import torch

EMULATION: bool = os.environ.get("TRITON_INTERPRET", "") == "1"
"""True when kernels run in Triton's interpreter (on the CPU)."""

DEVICE: torch.device = torch.device("cpu" if EMULATION else "cuda")
"""Where the kernels' tensors live: CPU tensors in emulation, CUDA tensors otherwise."""

HOW_TO_EMULATE = ("without a GPU, set TRITON_INTERPRET=1 before importing fusedattn to run "
                  "the kernels on CPU tensors in Triton's interpreter (slow: for tests)")

_INTERPRETER = threading.RLock()


def kernel_launches():
    """The context every fusedattn kernel launch runs in. In emulation, one process-wide
    (re-entrant) lock: Triton's interpreter is not thread-safe (four threads launching a
    plain Triton kernel at once raised InterpreterError or returned wrong numbers, an
    upstream fault), so fusedattn's launches there run one at a time, each without the
    interpreter's unread overflow checks (`_unchecked_overflow`). On the GPU: nothing."""
    return _interpreted() if EMULATION else contextlib.nullcontext()


@contextlib.contextmanager
def _interpreted():
    with _INTERPRETER, _unchecked_overflow():
        yield


@contextlib.contextmanager
def _unchecked_overflow():
    """Triton's interpreter with `sanitize_overflow` off for the launch, where its `debug`
    is off (the default), as the GPU compiler has it: there every integer +, - and * of a
    kernel is done again in int64, compared with the type's bounds, and the result handed
    to `device_assert`, which without `debug` checks nothing. That work was 43% of a warmup
    of the portable forward under cProfile, and without it the calls ran 2.1x faster
    (29.0 -> 13.5 s, Triton 3.9 on the development CPU); the numbers are the same, since
    nothing read it. Put back after the launch, so that other kernels in the process, and
    a `debug` run's checks, are untouched."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # (a Triton without the interpreter module: nothing to change)
        yield
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    before = getattr(builder, "options", None)
    if before is None or getattr(before, "debug", True) \
            or not getattr(before, "sanitize_overflow", False):
        yield
        return
    builder.options = dataclasses.replace(before, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = before


def describe() -> str:
    """One line for tables and records."""
    if EMULATION:
        return "emulation (Triton interpreter + numba CUDA simulator on CPU): logic only, no times"
    return f"GPU: {torch.cuda.get_device_name()}"
