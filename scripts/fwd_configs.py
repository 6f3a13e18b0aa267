"""Time the forward's tile configs on the GPU, including configs outside the autotuner's
candidate sets (`configs.CONFIGS`): for each prefill row, the library's default config and
every listed one through `flash_forward(config=...)`, cuDNN beside them, each output checked
against cuDNN's before timing. Writes a CSV.

    python3 scripts/fwd_configs.py $OUT/fwd_configs.csv
"""

import argparse
import csv

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedattn.api import attention
from fusedattn.lab.timing import time_gpu
from fusedattn.tiles.flash import flash_forward, flops

# (B, H, S, D, causal): the prefill rows furthest from cuDNN
ROWS = [(2, 16, 4096, 256, False), (4, 32, 4096, 128, False), (4, 32, 4096, 128, True),
        (2, 16, 4096, 96, False), (1, 16, 16384, 80, False)]
CANDIDATES = {
    256: [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 1),
          (64, 128, 8, 2), (128, 32, 8, 3), (64, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 4),
          (64, 64, 4, 4), (128, 128, 16, 2), (128, 128, 8, 4)],
}


def _row(b, h, s, d, causal) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, device="cuda").to(torch.bfloat16)
               for _ in range(3))
    label = f"bf16 B{b} H{h} S{s} D{d}{' causal' if causal else ''}"
    f = flops(b, h, s, s, d, causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    ref = cudnn()
    calls = [("sdpa-cudnn", cudnn), ("flash (default)",
                                     lambda: attention(q, k, v, is_causal=causal))]
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), device="cuda")  # written, as `attention` writes it
    for c in CANDIDATES[max(128, triton.next_power_of_2(d))]:
        config = triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1]}, num_warps=c[2],
                               num_stages=c[3])
        calls.append((f"flash@{c[0]}x{c[1]}-w{c[2]}-s{c[3]}",
                      lambda config=config: flash_forward(
                          q, k, v, out=out, lse=lse, is_causal=causal, scale=d ** -0.5,
                          precision="ieee", config=config)[0]))
    rows = []
    for name, call in calls:
        try:
            err = float((call().float() - ref.float()).abs().max())
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or fit
            rows.append(dict(problem=label, provider=name, median_ms=None, tflops=None,
                             err=f"{type(exc).__name__}: {str(exc)[:120]}"))
            print(label, name, rows[-1]["err"], flush=True)
            continue
        t = time_gpu(call, warmup=3, repeat=20)
        ok = err < 2e-2
        rows.append(dict(problem=label, provider=name, median_ms=t.median_ms,
                         spread_ms=t.max_ms - t.min_ms,
                         tflops=f / t.median_ms / 1e9 if ok else None, err=err))
        print(label, name, f"{t.median_ms:.3f} ms", f"{f / t.median_ms / 1e9:.0f}",
              f"err {err:.2e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    args = parser.parse_args()
    rows = [r for row in ROWS for r in _row(*row)]
    fields = ["problem", "provider", "median_ms", "spread_ms", "tflops", "err"]
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
