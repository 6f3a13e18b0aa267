"""Which FP8 calls the Hopper forward serves without a fault: each case in a fresh process
(a CUDA fault ends its context), forced onto the Hopper path, its output against the
float64 reference of the dequantised inputs. A diagnostic for the GPU, not a test.

    python3 scripts/hopper_fp8_probe.py [--only NAME,...] [--out F]"""

import argparse
import json
import subprocess
import sys

# name -> (kind, lengths_q, lengths_k, dim, causal, dtype)
CASES = {
    "varlen-ragged-d64": ("varlen", [5, 0, 1, 300, 1000, 64], [5, 3, 1, 500, 1000, 0], 64,
                          False, "fp8"),
    "varlen-ragged-d64-bf16": ("varlen", [5, 0, 1, 300, 1000, 64], [5, 3, 1, 500, 1000, 0],
                               64, False, "bf16"),
    "varlen-one-d64": ("varlen", [1000], [1000], 64, False, "fp8"),
    "varlen-two-d64": ("varlen", [300, 1000], [500, 1000], 64, False, "fp8"),
    "varlen-short-d64": ("varlen", [5, 1, 64, 100], [5, 3, 64, 100], 64, False, "fp8"),
    "varlen-ragged-d128": ("varlen", [5, 0, 1, 300, 1000, 64], [5, 3, 1, 500, 1000, 0], 128,
                           False, "fp8"),
    "dense-many-items-d64": ("dense", [1000] * 6, [1000] * 6, 64, False, "fp8"),
    "dense-sk-unaligned-d64": ("dense", [100] * 2, [1509] * 2, 64, False, "fp8"),
}


def run_case(name: str) -> dict:
    import torch

    from fusedattn import attention, attention_varlen
    from fusedattn.dispatch import use_backend
    from fusedattn.reference import attention_ref, dequantize, varlen_ref
    from fusedattn.varlen import offsets_of

    kind, lq, lk, dim, causal, dtype = CASES[name]
    g = torch.Generator().manual_seed(0)
    heads, heads_kv = 4, 2

    def make(n, h):
        x = torch.randn(n, h, dim, generator=g).cuda()
        return x.to(torch.float8_e4m3fn) if dtype == "fp8" else x.to(torch.bfloat16)

    if kind == "varlen":
        q, k, v = make(sum(lq), heads), make(sum(lk), heads_kv), make(sum(lk), heads_kv)
        cu_q, cu_k = (offsets_of(n, "cuda") for n in (lq, lk))
        with use_backend("hopper"):
            out = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), is_causal=causal)
        torch.cuda.synchronize()
        ref = varlen_ref(*(dequantize(t) for t in (q, k, v)), cu_q, cu_k, causal=causal)
    else:
        b = len(lq)
        q = make(b * lq[0], heads).reshape(b, lq[0], heads, dim).transpose(1, 2)
        k, v = (make(b * lk[0], heads_kv).reshape(b, lk[0], heads_kv, dim).transpose(1, 2)
                for _ in range(2))
        with use_backend("hopper"):
            out = attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.cuda.synchronize()
        ref = attention_ref(*(dequantize(t) for t in (q, k, v)), causal=causal,
                            device="cuda")
    err = (out.double() - ref.to(out.device)).abs().max().item()
    return dict(name=name, ok=True, max_abs_error=err, finite=bool(torch.isfinite(out).all()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the child's
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return 0
    rows = []
    for name in (args.only.split(",") if args.only else CASES):
        p = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                           text=True, timeout=300)
        last = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            row = json.loads(last)
        except json.JSONDecodeError:
            error = [ln for ln in p.stderr.splitlines() if "Error" in ln][-1:] or ["?"]
            row = dict(name=name, ok=False, error=error[0][:300])
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
