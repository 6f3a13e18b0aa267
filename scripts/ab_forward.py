"""A/B of the library's forward under an environment switch, in one process on the same
inputs: each problem of a bench suite (and a few ragged and windowed ones) runs with the
switch off and on, alternately, each verified against the float64 reference before and after
timing, with its first call's time (the compile) beside the kernel's.

    python3 scripts/ab_forward.py --switch FUSEDATTN_ONE_LOOP [--suite prefill] --out DIR

(The one-key-loop A/B, evidence/nvidia-h200/20261130T1536Z-ab-one-loop, ran at 0a4b83b,
where the forward read FUSEDATTN_ONE_LOOP; `configs.single_key_loop` has chosen since.)
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch

from fusedattn.api import attention
from fusedattn.lab.evidence import environment, write_json
from fusedattn.lab.suites import BenchProblem, _inputs, suites
from fusedattn.lab.timing import time_gpu
from fusedattn.lab.verify import check
from fusedattn.reference import attention_ref

EXTRA = [BenchProblem(2, 8, 1000, 128, "bf16", False), BenchProblem(2, 8, 1000, 128, "bf16", True),
         BenchProblem(2, 8, 3000, 64, "fp16", True), BenchProblem(1, 4, 700, 96, "fp32", False)]


def _verified(out, q, k, v, p, window) -> bool:
    """Head 0 of batch 0 against the float64 reference, within the tolerance table's bound
    (which scales with SDPA's error on the same slice, in the inputs' dtype)."""
    q1, k1, v1 = (t[0, :1].detach() for t in (q, k, v))
    ref = attention_ref(q1, k1, v1, causal=p.causal, window=window, device=q1.device)
    mask = None
    if window is not None:
        i = torch.arange(q1.shape[-2], device=q1.device)[:, None]
        j = torch.arange(k1.shape[-2], device=q1.device)[None, :]
        mask = (j >= i - window[0]) & (j <= i + window[1])
    peer = torch.nn.functional.scaled_dot_product_attention(
        q1, k1, v1, attn_mask=mask, is_causal=p.causal and window is None)
    peer_error = float((peer.double() - ref.to(peer.device)).abs().max())
    return check(out[0, :1], ref, precision=p.precision, peer_error=peer_error).ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", required=True)
    parser.add_argument("--suite", default="prefill")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    cases = [(p, None) for p in suites()[args.suite] + EXTRA]
    cases += [(BenchProblem(2, 16, 4096, 128, "bf16", True), (1000, 0))]
    for p, window in cases:
        q, k, v = _inputs(p, 0)
        hk = p.heads_kv or p.heads
        kw = {"is_causal": p.causal and window is None, "precision": p.precision,
              "enable_gqa": hk != p.heads}
        if window is not None:
            kw["window"] = window
        result = {"problem": p.label() + (f" window {window}" if window else "")}

        def call(q=q, k=k, v=v, kw=kw):  # the switch, read at each call, picks the kernel
            return attention(q, k, v, **kw)

        for value in ("0", "1"):
            os.environ[args.switch] = value
            t0 = time.perf_counter()
            out = call()
            torch.cuda.synchronize()
            result[f"first_call_s_{value}"] = round(time.perf_counter() - t0, 3)
            result[f"verified_{value}"] = _verified(out, q, k, v, p, window)
        times = {"0": [], "1": []}
        for _ in range(4):  # alternate, so that drift of clocks or heat hits both
            for value in ("0", "1"):
                os.environ[args.switch] = value
                times[value] += time_gpu(call, warmup=3, repeat=args.repeat // 4).times_ms
        for value in ("0", "1"):
            os.environ[args.switch] = value
            result[f"verified_{value}"] &= _verified(call(), q, k, v, p, window)
            result[f"median_ms_{value}"] = statistics.median(times[value])
            result[f"spread_ms_{value}"] = max(times[value]) - min(times[value])
        result["speedup_1_over_0"] = result["median_ms_0"] / result["median_ms_1"]
        rows.append(result)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in result.items()), flush=True)
    with open(args.out / "ab_forward.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_json(args.out / "ab_forward.json", {
        "environment": environment(), "switch": args.switch, "rows": rows,
        "command": f"python3 scripts/ab_forward.py --switch {args.switch} --suite {args.suite}"})


if __name__ == "__main__":
    main()
