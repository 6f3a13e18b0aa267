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
    interpreter's unread overflow checks (`_unchecked_overflow`) and with its builtins found
    by name (`_language_patched_by_name`). On the GPU: nothing."""
    return _interpreted() if EMULATION else contextlib.nullcontext()


@contextlib.contextmanager
def _interpreted():
    with _INTERPRETER, _unchecked_overflow(), _language_patched_by_name():
        yield


_BUILTIN_NAMES: dict = {}  # triton.language's objects -> their builtins' names (unpatched)


@contextlib.contextmanager
def _language_patched_by_name():
    """Triton's interpreter, for the launch, finding the language's builtins by a list of
    their names made once, not by `inspect.getmembers` on every call. It patches
    `triton.language` (its module, `core`, `tensor`, `math`, the tensor descriptors) on
    each kernel call and again on every call of a `@triton.jit` helper from a kernel, where
    they are patched already and nothing changes; walking the members each time was 42% of
    a warmup of the portable forward under cProfile (after `_unchecked_overflow`), and
    without it the warmup took 12.4-12.6 s against 18.1-19.0 (the same evidence). The
    same members are patched the same way (`_patch_attr`, the builtins among the named
    members), so nothing else changes. The names are read at the first launch, before any
    kernel runs, when nothing is patched. Put back after the launch."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or patch_attr is None or is_builtin is None \
            or getattr(original, "by_name", False):
        yield
        return
    if not _BUILTIN_NAMES:
        import inspect

        for pkg in (tl, tl.core, tl.tensor, tl.math,
                    getattr(tl.core, "tensor_descriptor_base", None)):
            if pkg is not None:
                _BUILTIN_NAMES[pkg] = tuple(name for name, member in inspect.getmembers(pkg)
                                            if is_builtin(member))

    def patch_builtin(pkg, builder, scope):
        names = _BUILTIN_NAMES.get(pkg)
        if names is None:  # (another object: Triton's own walk)
            return original(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):  # (not patched yet in this kernel call)
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.by_name = True
    interpreter._patch_builtin = patch_builtin
    try:
        yield
    finally:
        interpreter._patch_builtin = original


@contextlib.contextmanager
def _unchecked_overflow():
    """Triton's interpreter with `sanitize_overflow` off for the launch, where its `debug`
    is off (the default), as the GPU compiler has it: there every integer +, - and * of a
    kernel is done again in int64, compared with the type's bounds, and the result handed
    to `device_assert`, which without `debug` checks nothing. That work was 43% of a warmup
    of the portable forward under cProfile, and without it the warmup took 13-20 s against
    24-34 (Triton 3.9 on the development CPU: evidence/cpu/
    20261207T1830Z-interpreter-overflow-checks); the numbers are the same, since nothing
    read it. Put back after the launch, so that other kernels in the process, and
    a `debug` run's checks, are untouched."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # (a Triton without the interpreter module: nothing to change)
        yield
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    before = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(before) or getattr(before, "debug", True) \
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
