"""The host cost `fusedattn.distributed.sdpa`'s TorchFunctionMode adds to every torch call
inside its context: a loop of 2000 small adds and multiplies, timed outside and inside the
mode (the CPU build of torch, no process group needed to enter the mode object itself).

    python evidence/cpu/20261204T2310Z-sdpa-mode-host-cost/measure.py
"""
import time

import torch

from fusedattn.distributed.sdpa import _SDPAMode

x = torch.randn(64, 64)


def work():
    y = x
    for _ in range(1000):
        y = torch.add(y, 1.0) * 0.5
    return y


def per_op(rounds=5):
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        work()
        times.append((time.perf_counter() - t) * 1e6 / 2000)
    return sorted(times)[rounds // 2]


for _ in range(3):
    work()
plain = per_op()
with _SDPAMode("ring", None, None, 1):
    work()
    moded = per_op()
print(f"{plain:.2f} us an op outside the mode, {moded:.2f} inside: +{moded - plain:.2f}")
