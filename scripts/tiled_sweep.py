"""online-tiled's rows per block against materialized, on one GPU, one process, the same
inputs (fp32 S x D, uniform): picks the registry's variants. Every output is checked against
the float64 reference (S <= 4096) or materialized's output before and after timing.

    python3 scripts/tiled_sweep.py OUT.csv [--seq 128,512,2048,8192,16384] [--dim 64]
        [--rows 4,8,..] [--block 256] [--causal 0,1]

Writes OUT.csv and environment.json beside it (GPU, driver, versions, commit, command).
"""

import argparse
import csv
import functools
import sys
from pathlib import Path

import torch

from fusedattn.reference import attention_ref
from fusedattn_lab.evidence import environment, write_json
from fusedattn_lab.simt import materialized, online_tiled
from fusedattn_lab.simt.tiled_plan import Plan
from fusedattn_lab.timing import time_gpu


def _one(seq: int, dim: int, causal: bool, rows_list, blocks) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v = (torch.rand(seq, dim, generator=gen, device="cuda") * 2 - 1 for _ in range(3))
    outs = {("materialized", 0, 256): materialized.allocate(q)}
    runs = {("materialized", 0, 256): lambda: materialized.materialized_attention(
        q, k, v, outs[("materialized", 0, 256)], block=256, causal=causal)}
    for block in blocks:
        for rows in rows_list:
            if block % rows == 0 and Plan(rows, block, dim).fits():
                key = ("online-tiled", rows, block)
                outs[key] = online_tiled.allocate(q)
                runs[key] = functools.partial(online_tiled.online_tiled_attention, q, k, v,
                                              outs[key], block=block, rows=rows,
                                              causal=causal)
    if seq <= 4096:
        ref = attention_ref(q.double(), k.double(), v.double(), causal=causal).to(q.device)
    else:
        runs[("materialized", 0, 256)]()
        ref = outs[("materialized", 0, 256)]["out"].double().clone()
    rows_out = []
    for key, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        before = float((outs[key]["out"].double() - ref).abs().max())
        t = time_gpu(fn, warmup=3 if seq > 4096 else 10, repeat=10 if seq > 4096 else 30)
        after = float((outs[key]["out"].double() - ref).abs().max())
        row = dict(seq=seq, dim=dim, causal=causal, version=key[0], rows=key[1],
                   block=key[2], median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                   err_before=before, err_after=after, ok=before < 1e-4 and after < 1e-4)
        rows_out.append(row)
        print(row, flush=True)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seq", default="128,512,2048,8192,16384")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", default="32,64,128,256")
    parser.add_argument("--block", default="256")
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    blocks = [int(b) for b in args.block.split(",")]
    out_rows = [r for seq in (int(s) for s in args.seq.split(","))
                for causal in (c == "1" for c in args.causal.split(","))
                for r in _one(seq, args.dim, causal, rows_list, blocks)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out_rows[0]))
        w.writeheader()
        w.writerows(out_rows)
    write_json(Path(args.out).with_name("environment.json"),
               environment() | {"command": " ".join(sys.argv)})
    return 0 if all(r["ok"] for r in out_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
