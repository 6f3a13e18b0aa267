"""The lab: the chapter's experiments and the benchmarks, built on the library.

The registry of versions (`registry`, with the peers in `peers`), the input protocols, the
one verification (`verify`: poison, check, the tolerance table), the measurement protocol
(`protocol`, with `timing`), run-all and its worker processes, evidence and output folders,
the bench suites, profile (resources, Nsight Compute, compute-sanitizer), the walkthrough of
the online recurrence, and the figures. Imports run one way: the lab uses the library
(`fusedattn.api`, `reference`, `tiles`, `simt`), never the reverse.
"""

import os
import sys

_FLAGS = ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")


def choose_mode() -> bool:
    """The lab's choice of where kernels run, made in its own process before fusedattn is
    imported (Triton reads `TRITON_INTERPRET` when a kernel is decorated, numba
    `NUMBA_ENABLE_CUDASIM` when it is imported): emulation, with both flags set, when no
    GPU is visible, when `FUSEDATTN_EMULATE=1`, or when either flag is already 1. Once
    fusedattn is imported its mode stands, and this only reports it. Returns whether the
    process emulates."""
    if "fusedattn.mode" in sys.modules:
        return sys.modules["fusedattn.mode"].EMULATION
    import torch

    emulate = (os.environ.get("FUSEDATTN_EMULATE", "") == "1"
               or any(os.environ.get(f, "") == "1" for f in _FLAGS)
               or not torch.cuda.is_available())
    if emulate:
        for flag in _FLAGS:
            os.environ[flag] = "1"
    return emulate
