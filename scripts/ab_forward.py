"""A/B of the library's kernels under an environment switch, in one process on the same
inputs: each problem of a bench suite (and, for the forward's suites, a few ragged and
windowed ones) runs with the switch off and on, alternately, each verified against the
float64 reference before and after timing, with its first call's time (the compile) beside
the kernels'. A suite of training rows (`--suite train-bf16`, `--suite ab-train`) times the
backward ("bwd") or forward and backward ("fwd+bwd") and checks the gradients.

    python3 scripts/ab_forward.py --switch FUSEDATTN_ONE_LOOP [--suite prefill] --out DIR

FUSEDATTN_SPLIT_D=0 (`configs.head_dim_pieces`) pads every head dim to a power of two; "1"
is the rule (two pieces where they are narrower than padding): `--suite ab-split` times the
head dims it splits in two whole pieces, the prefill suite's D80 row among them, and
`--suite ab-overlap` those whose second piece overlaps the first (D72 = 64 + 16). `--suite
ab-split3` times the dims in three pieces (asked for by FUSEDATTN_SPLIT_D=3: `--values 0,3`;
its first run, at fe1f6b8, had the four whole ones under "1").

FUSEDATTN_ONE_LOOP (`configs.single_key_loop`) forces one loop (1) or two/three (0) in the
forward and the backward. The forward's A/B, evidence/nvidia-h200/20261130T1536Z-ab-one-loop,
ran at 0a4b83b, when the switch was the forward's alone.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from fusedattn.api import attention
from fusedattn.lab.evidence import environment, write_json
from fusedattn.lab.slices import GradCheck
from fusedattn.lab.suites import BenchProblem, _grad_call, _inputs, suites
from fusedattn.lab.timing import time_gpu
from fusedattn.lab.verify import check
from fusedattn.reference import attention_ref, visible

EXTRA = [BenchProblem(2, 8, 1000, 128, "bf16", False), BenchProblem(2, 8, 1000, 128, "bf16", True),
         BenchProblem(2, 8, 3000, 64, "fp16", True), BenchProblem(1, 4, 700, 96, "fp32", False)]
# the backward's one loop against three: short and long, causal or not, the cold-start row,
# fp32 (which takes one loop at any length)
AB_TRAIN = [BenchProblem(4, 32, s, d, "bf16", c, mode="bwd") for s in (1024, 2048, 4096)
            for d in (64, 128) for c in (False, True)] + [
    BenchProblem(64, 16, 256, 64, "bf16", False, mode="bwd"),
    BenchProblem(64, 16, 256, 64, "bf16", True, mode="bwd"),
    BenchProblem(2, 8, 1000, 128, "bf16", True, mode="fwd+bwd"),
    BenchProblem(1, 16, 4096, 64, "fp32", False, mode="bwd")]

# the forward's head dims in two pieces against one padded piece: each dim that splits
# (32+16, 64+16, 64+32, 128+16, 128+32, 128+64), causal or not at D80/D96, prefill's D80
AB_SPLIT = [BenchProblem(2, 16, 4096, d, "bf16", False) for d in (48, 80, 96, 144, 160, 192)] + [
    BenchProblem(2, 16, 4096, 80, "bf16", True), BenchProblem(2, 16, 4096, 96, "bf16", True),
    BenchProblem(1, 16, 16384, 80, "bf16", False), BenchProblem(1, 4, 700, 96, "fp32", False)]

# several (batch, head)s per forward program ($FUSEDATTN_HEADS) against one: short
# sequences with many heads, where each program is one or a few query tiles
AB_HEADS = [BenchProblem(64, 16, 256, 64, "bf16", c) for c in (False, True)] + [
    BenchProblem(64, 16, 128, 64, "bf16", False), BenchProblem(32, 16, 512, 64, "bf16", False),
    BenchProblem(64, 16, 256, 128, "bf16", True), BenchProblem(16, 16, 1024, 64, "bf16", False)]

# two pieces, the second overlapping the first (72 = 64 + 16 over columns 0..63 and
# 56..71; 88, 136, 168, 176), against one padded piece
AB_OVERLAP = [BenchProblem(2, 16, 4096, d, "bf16", False) for d in (72, 88, 136, 168, 176)] + [
    BenchProblem(2, 16, 4096, 72, "bf16", True), BenchProblem(1, 16, 16384, 72, "bf16", False)]

# three pieces (64+32+16, 128+64+16, 128+64+32; 100 and 200 with the third overlapping)
# against one padded piece
AB_SPLIT3 = [BenchProblem(2, 16, 4096, d, "bf16", False) for d in (100, 112, 200, 208, 224)
             ] + [BenchProblem(2, 16, 4096, 112, "bf16", True)]


def _verified(out, q, k, v, p, window) -> bool:
    """The first and the last (batch, head) against the float64 reference, within the
    tolerance table's bound (which scales with SDPA's error on the same slice, in the
    inputs' dtype). GQA: the last query head reads the last K/V head."""
    mask = None
    if window is not None:
        mask = visible(q.shape[-2], k.shape[-2], window=window, device=q.device)
    ok = True
    for b, h, hk in ((0, 0, 0), (-1, q.shape[1] - 1, k.shape[1] - 1)):
        q1, k1, v1 = q[b, h:h + 1].detach(), k[b, hk:hk + 1].detach(), v[b, hk:hk + 1].detach()
        ref = attention_ref(q1, k1, v1, causal=p.causal, window=window, device=q1.device)
        peer = torch.nn.functional.scaled_dot_product_attention(
            q1, k1, v1, attn_mask=mask, is_causal=p.causal and window is None)
        peer_error = float((peer.double() - ref.to(peer.device)).abs().max())
        ok &= check(out[b, h:h + 1], ref, precision=p.precision, peer_error=peer_error).ok
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", required=True)
    parser.add_argument("--suite", default="prefill")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--values", default="0,1",
                        help="the switch's two values, A,B (speedup: A's time over B's)")
    args = parser.parse_args()
    values = tuple(args.values.split(","))
    if len(values) != 2 or values[0] == values[1]:
        parser.error(f"--values {args.values}: two different values, A,B")
    off, on = values
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    problems = {**suites(), "ab-train": AB_TRAIN, "ab-split": AB_SPLIT,
                "ab-overlap": AB_OVERLAP, "ab-split3": AB_SPLIT3, "ab-heads": AB_HEADS}
    if args.suite not in problems:
        parser.error(f"--suite {args.suite}: one of {', '.join(problems)}")
    cases = [(p, None) for p in problems[args.suite]]
    if all(p.mode == "fwd" for p, _ in cases) and not args.suite.startswith("ab-"):
        cases += [(p, None) for p in EXTRA]
        cases += [(BenchProblem(2, 16, 4096, 128, "bf16", True), (1000, 0))]
    for p, window in cases:
        inputs = _inputs(p, 0)
        q, k, v = inputs[:3]
        hk = p.heads_kv or p.heads
        kw = {"is_causal": p.causal and window is None, "precision": p.precision,
              "enable_gqa": hk != p.heads}
        if window is not None:
            kw["window"] = window
        result = {"problem": p.label() + (f" window {window}" if window else "")}

        def forward(q=q, k=k, v=v, kw=kw):  # the switch, read at each call, picks the loops
            return attention(q, k, v, **kw)

        if p.mode == "fwd":
            calls = {value: forward for value in values}

            def verified(out, p=p, window=window, q=q, k=k, v=v):
                return _verified(out, q, k, v, p, window)
        else:  # "bwd" times the backward of one kept forward (run under its own switch)
            calls = {}
            for value in values:
                os.environ[args.switch] = value
                calls[value] = _grad_call(forward, *inputs, p.mode)
            grad_check = GradCheck(*inputs, p)

            def verified(grads, grad_check=grad_check):
                return grad_check(grads)[0]
        for value in values:
            os.environ[args.switch] = value
            t0 = time.perf_counter()
            out = calls[value]()
            torch.cuda.synchronize()
            result[f"first_call_s_{value}"] = round(time.perf_counter() - t0, 3)
            result[f"verified_{value}"] = verified(out)
            del out
        times = {value: [] for value in values}
        for _ in range(4):  # alternate, so that drift of clocks or heat hits both
            for value in values:
                os.environ[args.switch] = value
                times[value] += time_gpu(calls[value], warmup=3,
                                         repeat=args.repeat // 4).times_ms
        for value in values:
            os.environ[args.switch] = value
            result[f"verified_{value}"] &= verified(calls[value]())
            result[f"median_ms_{value}"] = statistics.median(times[value])
            result[f"spread_ms_{value}"] = max(times[value]) - min(times[value])
        result[f"speedup_{on}_over_{off}"] = result[f"median_ms_{off}"] / result[f"median_ms_{on}"]
        rows.append(result)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in result.items()), flush=True)
    with open(args.out / "ab_forward.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_json(args.out / "ab_forward.json", {
        "environment": environment(), "switch": args.switch, "rows": rows,
        "command": " ".join(["python3", *sys.argv])})


if __name__ == "__main__":
    main()
