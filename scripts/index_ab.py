"""What 64-bit offsets cost: the flash forward and backward with 32-bit offsets (the default
wherever they suffice) and forced 64-bit ones (FUSEDATTN_INDEX64=1, read at each call), in
one process on the same inputs, alternating A, B, A, B so drift hits both; cuDNN beside
them. Every output is checked against cuDNN's before timing. NOT YET RUN.

    python3 scripts/index_ab.py OUT.csv
"""

import csv
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedattn.api import attention
from fusedattn.lab.timing import time_gpu


def _problem(dim: int, causal: bool) -> list[dict]:
    b, h, s = 4, 32, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, dim, generator=gen, device="cuda")
                     .to(torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd():
        return attention(q, k, v, is_causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = fwd()

    def grads():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    label = f"bf16 B{b} H{h} S{s} D{dim}{' causal' if causal else ''}"
    times: dict[str, list[float]] = {}
    for _ in range(3):  # A, B alternating
        for bits in ("32", "64"):
            os.environ["FUSEDATTN_INDEX64"] = "1" if bits == "64" else "0"
            err = float((fwd().float() - ref.float()).abs().max())
            assert err < 0.05, (label, bits, err)
            times.setdefault(f"fwd-{bits}", []).append(time_gpu(fwd, warmup=3,
                                                                repeat=10).median_ms)
            times.setdefault(f"bwd-{bits}", []).append(time_gpu(grads, warmup=3,
                                                                repeat=10).median_ms)
        times.setdefault("fwd-cudnn", []).append(time_gpu(cudnn, warmup=3,
                                                          repeat=10).median_ms)
    os.environ.pop("FUSEDATTN_INDEX64")
    return [dict(problem=label, what=w, median_ms=statistics.median(t), min_ms=min(t),
                 max_ms=max(t)) for w, t in times.items()]


def main(path: str) -> None:
    rows = [r for d in (64, 128) for c in (False, True) for r in _problem(d, c)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main(sys.argv[1])
