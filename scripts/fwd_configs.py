"""Time the forward's tile configs on the GPU, including configs outside the autotuner's
candidate sets (`configs.CONFIGS`): for each prefill row, the library's default config and
every listed one through `flash_forward(config=...)`, cuDNN beside them, each output checked
against cuDNN's before timing. Writes a CSV (and a JSON with the environment).

`--fp32`: the fp32 rows instead (exact "ieee" and the default tf32x3, at the cold-start
shape S700 D96 and the bench's S4096 D64), SDPA's efficient kernel as the peer and float64
as the reference, with each config's first call (its compile: every config is a new
specialisation) beside its time: the trade between the first call and the kernel.

`--short`: the short-sequence rows (S 256/512, many heads) against tiles past the
short-sequence rule's set (`configs.SHORT`): 128-row tiles, and key tiles of 128 and 256.

    python3 scripts/fwd_configs.py [--fp32 | --short] $OUT/fwd_configs.csv
"""

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedattn.api import attention
from fusedattn.tiles.flash import flash_forward, flops
from fusedattn_lab.evidence import environment, write_json
from fusedattn_lab.timing import time_gpu

# (B, H, S, D, causal): the prefill rows furthest from cuDNN
ROWS = [(2, 16, 4096, 256, False), (4, 32, 4096, 128, False), (4, 32, 4096, 128, True),
        (2, 16, 4096, 96, False), (1, 16, 16384, 80, False)]
CANDIDATES = {
    256: [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 1),
          (64, 128, 8, 2), (128, 32, 8, 3), (64, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 4),
          (64, 64, 4, 4), (128, 128, 16, 2), (128, 128, 8, 4)],
}
SHORT_ROWS = [(64, 16, 256, 64, False), (64, 16, 256, 64, True), (32, 16, 512, 64, False),
              (64, 16, 256, 128, True)]
SHORT_CANDIDATES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 3), (64, 128, 4, 2),
                    (64, 256, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                    (128, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (64, 64, 8, 3)]
# (B, H, S, D, precision): the cold-start shape and the bench's fp32 row
FP32_ROWS = [(1, 4, 700, 96, "ieee"), (1, 4, 700, 96, "tf32x3"), (1, 16, 4096, 64, "ieee"),
             (1, 16, 4096, 64, "tf32x3")]
FP32_CANDIDATES = {
    "ieee": [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2), (32, 32, 2, 2),
             (64, 64, 8, 2), (32, 32, 4, 1)],
    "tf32x3": [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2),
               (64, 64, 4, 1), (64, 32, 4, 3), (128, 64, 8, 1)],
}


def _row(b, h, s, d, causal, candidates=None) -> list[dict]:
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
    for c in candidates or CANDIDATES[max(128, triton.next_power_of_2(d))]:
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


def _fp32_row(b, h, s, d, precision) -> list[dict]:
    """One fp32 row: SDPA efficient, the library's default, and every candidate, each with
    its first call's seconds (compile + run) and its error against float64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, device="cuda") for _ in range(3))
    label = f"fp32-{precision} B{b} H{h} S{s} D{d}"
    f = flops(b, h, s, s, d, False)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), device="cuda")
    calls = [("sdpa-efficient", efficient),
             ("flash (default)", lambda: attention(q, k, v, precision=precision))]
    for c in FP32_CANDIDATES[precision]:
        config = triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1]}, num_warps=c[2],
                               num_stages=c[3])
        calls.append((f"flash@{c[0]}x{c[1]}-w{c[2]}-s{c[3]}",
                      lambda config=config: flash_forward(
                          q, k, v, out=out, lse=lse, is_causal=False, scale=d ** -0.5,
                          precision=precision, config=config)[0]))
    rows = []
    for name, call in calls:
        row = dict(problem=label, provider=name)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = call()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            err = float((got.double() - ref).abs().max())
        except Exception as exc:  # a config that does not compile or fit
            rows.append(row | dict(err=f"{type(exc).__name__}: {str(exc)[:120]}"))
            print(label, name, rows[-1]["err"], flush=True)
            continue
        t = time_gpu(call, warmup=3, repeat=20)
        err = max(err, float((call().double() - ref).abs().max()))
        ok = err < 2e-4  # fp32's bound (the tolerance table's fp32 rows)
        rows.append(row | dict(median_ms=t.median_ms, spread_ms=t.max_ms - t.min_ms,
                               tflops=f / t.median_ms / 1e9 if ok else None, err=err))
        print(label, name, f"first {row['first_call_s']:.2f} s", f"{t.median_ms:.3f} ms",
              f"{f / t.median_ms / 1e9:.1f}", f"err {err:.2e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--fp32", action="store_true")
    kind.add_argument("--short", action="store_true")
    args = parser.parse_args()
    if args.short:
        rows = [r for row in SHORT_ROWS for r in _row(*row, candidates=SHORT_CANDIDATES)]
    elif args.fp32:
        rows = [r for row in FP32_ROWS for r in _fp32_row(*row)]
    else:
        rows = [r for row in ROWS for r in _row(*row)]
    fields = ["problem", "provider", "first_call_s", "median_ms", "spread_ms", "tflops", "err"]
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    write_json(args.out.with_suffix(".json"), {"environment": environment(), "rows": rows,
                                               "command": " ".join(["python3", *sys.argv])})


if __name__ == "__main__":
    main()
