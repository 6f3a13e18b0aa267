"""A/B of short sliding windows across the forward's paths, in one process
(`PYTHONPATH=src python3 scripts/window_sinks_ab.py --out F`): B1 S8192 causal with sinks
(the sinks suite's gpt-oss sliding layer is D64 H64/8, window 128), windows --windows, head
dims and heads --shapes; the portable kernel, the Hopper kernel at two (and at D64 three)
consumer warpgroups, and `auto`, each checked against the portable output. JSON lines to
--out. Timing: triton.testing.do_bench's median (ms): a quick A/B, not the bench protocol."""
import argparse
import json

import torch
import triton

import fusedattn
from fusedattn import dispatch
from fusedattn.hopper import forward as hf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", default="128,1024")
    ap.add_argument("--shapes", default="64,64,8",
                    help="dim,heads,heads_kv triples joined by ';'")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(";"):
        dim, heads, heads_kv = map(int, shape.split(","))
        rows += run_shape(dim, heads, heads_kv, args.windows)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def run_shape(dim, heads, heads_kv, windows):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, 8192, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, heads_kv, 8192, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, heads_kv, 8192, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    sinks = torch.randn(heads, device="cuda", dtype=torch.float32, generator=g)
    rows = []
    for w in map(int, windows.split(",")):
        def call(w=w):
            return fusedattn.attention(q, k, v, is_causal=True, window=(w, 0), sinks=sinks,
                                       enable_gqa=True)
        with dispatch.use_backend("portable"):
            ref = call()
        variants = [("portable", "portable", None)]
        variants += [(f"hopper-{n}wg", "hopper", n) for n in ((2, 3) if dim == 64 else (2,))]
        variants += [("auto", "auto", None)]
        for name, backend, wg in variants:
            saved = dict(hf.WARPGROUPS)
            if wg is not None:
                hf.WARPGROUPS[(dim, dim)] = wg
            try:
                with dispatch.use_backend(backend):
                    out = call()
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(call, warmup=50, rep=300)
            finally:
                hf.WARPGROUPS.clear()
                hf.WARPGROUPS.update(saved)
            useful = 4 * heads * 8192 * dim * min(w + 1, 8192)  # ~ pairs x 4D (upper bound)
            row = dict(dim=dim, heads=heads, heads_kv=heads_kv, window=w, variant=name, ms=ms,
                       err=err, tflops_upper=useful / ms / 1e9)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
