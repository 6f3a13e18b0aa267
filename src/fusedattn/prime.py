"""What a process's first GPU call would import, done on a thread started as fusedattn is
imported (issue 31: a first call after `fusedattn.warmup` at most 0.1 s).

After warmup nothing compiles, yet the D128 forward's first call took 0.195 s under
cProfile on the H200: 0.097 s importing Triton's Gluon for the Hopper kernels and 0.073 s
in Triton's first launch (evidence/nvidia-h200/20261203T0528Z-first-call-empty-cache).
`import fusedattn` itself imports neither Triton nor the kernels. So `start` runs `prime` on
a thread of its own. It puts the package's prebuilt C modules into Triton's cache
(`fusedattn.prebuilt`; the kernels wait for the first launch, which knows the GPU),
imports the modules a forward and a backward import at their first calls (`MODULES`),
hashes the Hopper kernels' sources as Triton's first launch would (`KERNELS`,
`JITFunction.cache_key`), and computes Triton's key. A process that calls fusedattn later
than that finds the work done. One that calls it sooner waits for the thread (`settle`) at
its first path choice and its first launch, so nothing is done twice. It once waited on
Python's import locks alone, and those do not keep two threads apart that enter one package
by different modules at once: the path choice's import of Gluon's Hopper API
(`dispatch._gluon_hopper`) beside the thread's import of the forward kernel (Gluon by its
top) failed in a fresh process with `KeyError: 'triton.experimental.gluon.language.nvidia'`
(evidence/nvidia-h100/20261206T060400Z-gpu-tier, tests/test_coldstart.py). For the same
reason the thread enters Triton by its top, `import triton`, as the package's modules do.

The process pays the same CPU time as before, on another thread, usually while it loads its
model. It starts only where kernels could run on a GPU: not in emulation, nor under a torch
without CUDA. `FUSEDATTN_PRIME=0` turns it off; the variable is read once, at import.

A fork waits for the thread (`os.register_at_fork`, at most `FORK_WAIT` seconds), so a child
never inherits an import that is half done. The thread is not a daemon, so a process that
exits at once waits for it rather than tearing Triton down under it. It never raises: an
import that fails there fails again, with its own error, where the call makes it.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

MODULES = ("fusedattn.api", "fusedattn.dispatch", "fusedattn.tiles.flash",
           "fusedattn.hopper.forward", "fusedattn.hopper.forward_kernel",
           "fusedattn.tiles.flash_bwd", "fusedattn.hopper.backward",
           "fusedattn.hopper.backward_kernel")
"""The modules a process's first forward and backward import, in import order."""

KERNELS = (("fusedattn.hopper.forward_kernel", "_flash_fwd_sm90"),
           ("fusedattn.hopper.backward_kernel", "_flash_bwd_sm90"))
"""The kernels whose source hash (`cache_key`: the source and every function it calls,
parsed) Triton's first launch of them computes: 10-21 ms each on the development CPU
(evidence/cpu/20261203T0905Z-prime-right-after-import/cache_key.txt)."""

FORK_WAIT = 2.0
"""Seconds a fork waits for the thread, at most."""

_THREAD: threading.Thread | None = None
_START = threading.Lock()


def wanted() -> bool:
    """Whether this process primes: a CUDA build of torch outside emulation, and
    `FUSEDATTN_PRIME` not "0"."""
    import torch

    from fusedattn.mode import EMULATION

    return (not EMULATION and torch.version.cuda is not None
            and os.environ.get("FUSEDATTN_PRIME", "1") != "0")


def prime() -> list[str]:
    """Put the package's prebuilt C modules into Triton's cache (`prebuilt.ensure`: first,
    before anything makes Triton's driver, which builds its `cuda_utils` module unless the
    cache has it), compute Triton's key (`triton_key`, kept in the cache by
    `fusedattn.launch`: 0.43 s at an empty one, mostly hashlib over libtriton, which lets
    the main thread run meanwhile), import `MODULES` and hash `KERNELS`; what failed, by
    name (never raises)."""
    failed = []
    try:
        import triton  # noqa: F401 (Triton by its top first, as the main thread enters it)
    except Exception:  # noqa: BLE001
        failed.append("triton")
    try:
        from fusedattn import prebuilt

        prebuilt.ensure()  # (never raises; a build it must not install compiles as before)
    except Exception:  # noqa: BLE001
        failed.append("fusedattn.prebuilt")
    try:
        from triton.runtime import cache

        import fusedattn.launch  # noqa: F401 (puts the kept key in place of Triton's)

        cache.triton_key()  # (computed once: a first launch meanwhile waits for it)
    except Exception:  # noqa: BLE001
        failed.append("triton_key")
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (the call's own import raises it again)
            failed.append(name)
    for module, kernel in KERNELS:
        try:
            getattr(sys.modules[module], kernel).cache_key  # noqa: B018 (computed, kept)
        except Exception:  # noqa: BLE001
            failed.append(f"{module}.{kernel}")
    return failed


def start() -> bool:
    """`prime` on a thread, once a process, where `wanted`; whether it started now."""
    global _THREAD
    with _START:
        if _THREAD is not None or not wanted():
            return False
        _THREAD = threading.Thread(target=prime, name="fusedattn-prime")
        _THREAD.start()
    return True


def settle() -> None:
    """Wait for the thread's work, from any other thread, where it has not ended: before
    a first call imports Triton's Gluon or compiles (`dispatch._gluon_hopper`,
    `launch.build_launchers_ahead`), so that those imports come after the thread's, not
    beside them. Where it has ended, or never ran, a look at the thread."""
    thread = _THREAD
    if thread is not None and thread is not threading.current_thread() \
            and thread.is_alive():
        thread.join()


def join(timeout: float = FORK_WAIT) -> None:
    """Wait for the thread, at most `timeout` seconds (before a fork; any time)."""
    thread = _THREAD
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


if hasattr(os, "register_at_fork"):  # POSIX: where a process can fork
    os.register_at_fork(before=join)
