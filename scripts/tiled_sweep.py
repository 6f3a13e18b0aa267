"""online-tiled's rows per block against materialized, on one GPU, one process, the same
inputs (fp32 S x D, uniform): picks the registry's variants. Every output is checked against
the float64 reference (S <= 4096) or materialized's output before and after timing.

    python3 scripts/tiled_sweep.py OUT.csv [--seq 128,512,2048,8192,16384] [--dim 64]
"""

import argparse
import csv
import sys

import torch

from fusedattn.lab.timing import time_gpu
from fusedattn.reference import attention_ref
from fusedattn.simt import materialized, online_tiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seq", default="128,512,2048,8192,16384")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", default="32,64,128,256")
    parser.add_argument("--block", default="256")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    blocks = [int(b) for b in args.block.split(",")]
    out_rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        for causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(seq)
            q, k, v = (torch.rand(seq, args.dim, generator=gen, device="cuda") * 2 - 1
                       for _ in range(3))
            mbufs = materialized.allocate(q)
            runs = {("materialized", 0, 256): lambda: materialized.materialized_attention(
                q, k, v, mbufs, block=256, causal=causal)}
            outs = {}
            for block in blocks:
                for rows in rows_list:
                    if block % rows:
                        continue
                    bufs = online_tiled.allocate(q)
                    outs[(rows, block)] = bufs["out"]
                    runs[("online-tiled", rows, block)] = (
                        lambda bufs=bufs, rows=rows, block=block:
                        online_tiled.online_tiled_attention(q, k, v, bufs, block=block,
                                                            rows=rows, causal=causal))
            if seq <= 4096:
                ref = attention_ref(q.double(), k.double(), v.double(), causal=causal).to(q.device)
            else:
                materialized.materialized_attention(q, k, v, mbufs, block=256, causal=causal)
                ref = mbufs["out"].double().clone()

            def err(key):
                out = mbufs["out"] if key[0] == "materialized" else outs[key[1:]]
                return float((out.double() - ref).abs().max())

            for key, fn in runs.items():
                fn()
                torch.cuda.synchronize()
                before = err(key)
                t = time_gpu(fn, warmup=3 if seq > 4096 else 10, repeat=10 if seq > 4096 else 30)
                after = err(key)
                ok = before < 1e-4 and after < 1e-4
                row = dict(seq=seq, dim=args.dim, causal=causal, version=key[0], rows=key[1],
                           block=key[2], median_ms=t.median_ms, min_ms=t.min_ms,
                           max_ms=t.max_ms, err_before=before, err_after=after, ok=ok)
                out_rows.append(row)
                print(row, flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out_rows[0]))
        w.writeheader()
        w.writerows(out_rows)
    return 0 if all(r["ok"] for r in out_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
