"""Time the backward's tile configs one pass at a time on the GPU (how `configs.BACKWARD` was
chosen): for each problem, every dK/dV candidate with the default dQ config, then every dQ
candidate with the default dK/dV config, and SDPA's flash and cuDNN backward beside them.
Every gradient's max error against SDPA's is in each row. Writes a CSV.

    python3 scripts/bwd_configs.py $OUT/bwd_configs.csv                 # B4 H32, D 64 and 128
    python3 scripts/bwd_configs.py OUT.csv --dim 256 --batch 2 --heads 16   # the wide set
"""

import argparse
import csv

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedattn.api import attention
from fusedattn.configs import backward_configs
from fusedattn.tiles.flash import flops
from fusedattn.tiles.flash_bwd import flash_backward
from fusedattn_lab.timing import time_gpu

DKDV = [(32, 128, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3),
        (128, 128, 8, 2), (64, 128, 4, 2)]
DQ = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2),
      (128, 128, 8, 2)]
# head dims past 128: two [BLOCK_N, 256] fp32 accumulators are 256 registers a thread at
# BLOCK_N=64 and 4 warps (spilled: ncu 20261130T1454Z), so fewer keys or more warps
DKDV_WIDE = [(32, 64, 4, 1), (32, 64, 8, 1), (16, 64, 8, 1), (32, 32, 4, 1), (16, 32, 4, 1),
             (64, 64, 8, 1), (32, 64, 8, 2), (16, 32, 4, 2)]
DQ_WIDE = [(64, 32, 4, 1), (64, 32, 8, 1), (64, 64, 8, 1), (128, 32, 8, 1), (32, 32, 4, 1),
           (64, 32, 4, 2)]


def _problem(dim: int, causal: bool, b: int = 4, h: int = 32, s: int = 4096) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, dim, generator=gen, device="cuda")
                     .to(torch.bfloat16) for _ in range(4))
    out, lse = attention(q, k, v, is_causal=causal, return_lse=True)
    f = 2.5 * flops(b, h, s, s, dim, causal)
    label = f"bf16 B{b} H{h} S{s} D{dim}{' causal' if causal else ''}"
    # SDPA's gradients: what each config must agree with
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = None
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        grads = torch.autograd.grad(o, leaves, dout, retain_graph=True)
        ref = ref or grads
        t = time_gpu(lambda o=o: torch.autograd.grad(o, leaves, dout, retain_graph=True),
                     warmup=3, repeat=10)
        rows.append(dict(problem=label, provider=name, median_ms=t.median_ms,
                         tflops=f / t.median_ms / 1e9, err=0.0))
    default_kv, default_q = backward_configs(dim=dim, itemsize=2)
    dkdv, dq = (DKDV_WIDE, DQ_WIDE) if dim > 128 else (DKDV, DQ)
    tries = ([("dkdv", c, (c, default_q)) for c in dkdv]
             + [("dq", c, (default_kv, c)) for c in dq])
    for which, c, pair in tries:
        name = f"{which}@{c[0]}x{c[1]}-w{c[2]}-s{c[3]}"

        def call(pair=pair):
            return flash_backward(dout, q, k, v, out, lse, None, is_causal=causal,
                                  scale=dim ** -0.5, precision="ieee", configs=pair)
        try:
            got = call()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or fit
            rows.append(dict(problem=label, provider=name, median_ms=None, tflops=None,
                             err=f"{type(exc).__name__}"))
            continue
        err = max(float((g.float() - r.float()).abs().max())
                  for g, r in zip(got, ref, strict=True))
        t = time_gpu(call, warmup=3, repeat=10)
        rows.append(dict(problem=label, provider=name, median_ms=t.median_ms,
                         tflops=f / t.median_ms / 1e9, err=err))
        print(label, name, f"{t.median_ms:.3f} ms", f"{f / t.median_ms / 1e9:.0f}",
              f"err {err:.2e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dim", default="64,128")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args()
    rows = [r for dim in map(int, args.dim.split(",")) for causal in args.causal.split(",")
            for r in _problem(dim, causal == "1", args.batch, args.heads, args.seq)]
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
