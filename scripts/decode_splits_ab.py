"""Decode's split count against its GPU time and host time, in one process (the GPU only).

`attention_with_kvcache` (bf16, `check_lengths=False`, every sequence's cache full) at the
split counts `kvcache.chosen_splits` picks ("rule") and others: 1 (no merge: one launch a
call), 2 and twice the rule's. Issue 31 measured decode at 2x SDPA's host time a call, the
split forward and its merge being two launches; this says what one launch would cost the
GPU where the rule splits. Each row's counts take turns (A B C ... A B C, `--rounds` times):
GPU µs a call replayed in a CUDA graph (`fusedattn_lab.timing.time_gpu`, the median of 30),
and host µs a call in a loop without synchronising (`bench --suite host`'s: its `CALLS`
calls; 300 in this script's first runs, 0222Z).
Every output is checked against the float64 reference on batch 0's first and last head
(`fusedattn_lab.verify.check`, SDPA cuDNN's error as the peer's).

    python3 scripts/decode_splits_ab.py [--rounds 3] [--out DIR] [--rows R] [--counts C]
    (DIR/decode_splits.json; R: rows 'batch,heads,heads_kv,seq_q,seq_k,dim' joined by ';';
    C: more split counts, comma-separated)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fusedattn.configs import SMS
from fusedattn.kvcache import attention_with_kvcache, chosen_splits, decode_programs
from fusedattn.mode import DEVICE
from fusedattn.reference import attention_ref
from fusedattn_lab.evidence import environment, write_json
from fusedattn_lab.host import _host_us  # (the host suite's loop of CALLS calls, no sync)
from fusedattn_lab.timing import time_gpu
from fusedattn_lab.verify import check

# (batch, heads, heads_kv, new queries, cache length, head dim): the decode suite's B32 rows
# and batches around the rule's turning points
ROWS = [(32, 32, 8, 1, 8192, 128), (32, 32, 8, 4, 8192, 128), (32, 32, 8, 16, 8192, 128),
        (32, 32, 8, 1, 8192, 64), (16, 32, 8, 1, 8192, 128), (64, 32, 8, 1, 4096, 128),
        (128, 32, 8, 1, 2048, 128), (8, 32, 8, 1, 32768, 128), (1, 32, 8, 1, 131072, 128)]


def _row(row, rounds: int, extra_counts=()) -> dict:
    b, h, hkv, sq, sk, d = row
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(b, h, sq, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hkv, sk, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    lens = torch.full((b,), sk, dtype=torch.int32, device=DEVICE)
    rule = chosen_splits(b, h, sq, hkv, sk)
    counts = list(dict.fromkeys([rule, 1, 2, min(64, 2 * rule), *extra_counts]))
    causal = sq > 1
    heads = [0, h - 1]
    kv = [x // (h // hkv) for x in heads]
    ref = attention_ref(q[0, heads], k[0, kv], v[0, kv], causal=causal, align="bottom-right",
                        device=q.device)
    extra = {}
    if causal:
        from torch.nn.attention.bias import causal_lower_right
        extra["attn_mask"] = causal_lower_right(sq, sk)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                                **extra)
    peer_error = float((peer[0, heads].double() - ref).abs().max())

    def call(n):
        return lambda: attention_with_kvcache(q, k, v, cache_seqlens=lens, splits=n,
                                              check_lengths=False)

    calls = {n: call(n) for n in counts}
    got = {n: {"gpu_us": [], "host_us": []} for n in counts}
    for n, fn in calls.items():  # checked before timing
        got[n]["check_before"] = check(fn()[0, heads], ref, peer_error=peer_error).ok
    for _ in range(rounds):
        for n, fn in calls.items():
            got[n]["gpu_us"].append(time_gpu(fn, warmup=3, repeat=30, mode="graph")
                                    .median_ms * 1e3)
            got[n]["host_us"].append(_host_us(fn))
    for n, fn in calls.items():  # and after
        got[n]["check_after"] = check(fn()[0, heads], ref, peer_error=peer_error).ok
        got[n]["gpu_median_us"] = statistics.median(got[n]["gpu_us"])
        got[n]["host_median_us"] = statistics.median(got[n]["host_us"])
    name = f"B{b} H{h}/{hkv} Sq{sq} Sk{sk} D{d}"
    programs = decode_programs(b, h, sq, hkv)
    print(f"{name} (programs {programs}, SMs {SMS}, rule {rule}):")
    for n in counts:
        g = got[n]
        print(f"  splits {n:2d}: GPU {g['gpu_median_us']:8.1f} us "
              f"({min(g['gpu_us']):.1f}-{max(g['gpu_us']):.1f}), host "
              f"{g['host_median_us']:5.1f} us, checks {g['check_before']}/{g['check_after']}")
    return {"row": name, "programs": programs, "rule": rule,
            "splits": {str(n): got[n] for n in counts}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default=None,
                    help="'batch,heads,heads_kv,seq_q,seq_k,dim' joined by ';' (default: ROWS)")
    ap.add_argument("--counts", default="",
                    help="split counts to time beside the rule's, 1, 2 and twice the rule's")
    args = ap.parse_args()
    rows = ROWS if args.rows is None else [tuple(map(int, r.split(",")))
                                           for r in args.rows.split(";")]
    extra = [int(c) for c in args.counts.split(",") if c]
    results = [_row(row, args.rounds, extra) for row in rows]
    if args.out:
        write_json(f"{args.out}/decode_splits.json",
                   {"environment": environment(), "rows": results})


if __name__ == "__main__":
    main()
