"""The Hopper forward on the GPU in one call: every case against the float64 reference
(beside the portable kernel's error on the same inputs), then the prefill rows timed
against the portable kernel, SDPA cuDNN, SDPA flash and FA4 where it imports.

    python3 scripts/hopper_check.py [--out DIR] [--quick]

Prints one line per case and per row; writes `hopper_check.json` under --out."""

import argparse
import json
import sys
import time

import torch
import triton

from fusedattn import attention, attention_varlen
from fusedattn.dispatch import use_backend
from fusedattn.reference import attention_ref, varlen_ref

CASES = [  # (B, H, Hkv, Sq, Sk, D, causal, window)
    (2, 4, 4, 1, 1, 128, False, None), (1, 3, 3, 127, 127, 64, True, None),
    (1, 2, 2, 129, 300, 128, True, None), (1, 2, 2, 300, 129, 128, True, None),
    (1, 2, 2, 4095, 4095, 128, True, None), (2, 48, 8, 257, 257, 128, True, None),
    (1, 2, 2, 1000, 1000, 96, False, None), (1, 2, 2, 513, 513, 192, True, None),
    (1, 2, 2, 700, 700, 256, False, None), (1, 2, 2, 2000, 2000, 128, True, (100, 0)),
    (1, 2, 2, 777, 777, 64, False, (0, 0)), (1, 2, 2, 777, 777, 64, False, (50, 3000)),
    (1, 2, 2, 4097, 4097, 64, False, None), (3, 5, 1, 333, 555, 128, False, None),
]


def _err(out, ref):
    return (out.double() - ref).abs().max().item()


def check_cases(dtype):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, h, hk, sq, sk, d, causal, window in CASES:
        q = torch.randn(b, h, sq, d, device="cuda", generator=g).to(dtype)
        k = torch.randn(b, hk, sk, d, device="cuda", generator=g).to(dtype)
        v = torch.randn(b, hk, sk, d, device="cuda", generator=g).to(dtype)
        ref, ref_lse = attention_ref(q, k, v, causal=causal, window=window, return_lse=True,
                                     device="cuda")
        errs = {}
        for backend in ("hopper", "portable"):
            with use_backend(backend):
                out, lse = attention(q, k, v, is_causal=causal, enable_gqa=hk != h,
                                     window=window, return_lse=True)
            finite = torch.isfinite(out).all().item()
            lse_err = (lse.double() - ref_lse).abs().nan_to_num(0.0, 0.0, 0.0).max().item()
            errs[backend] = (_err(out, ref), lse_err, finite)
        ok = errs["hopper"][2] and errs["hopper"][0] <= 2 * errs["portable"][0] + 2e-3 \
            and errs["hopper"][1] <= 1e-3
        rows.append(dict(case=[b, h, hk, sq, sk, d, causal, window], dtype=str(dtype),
                         hopper=errs["hopper"], portable=errs["portable"], ok=ok))
        print(f"{'ok  ' if ok else 'FAIL'} {dtype} B{b} H{h}/{hk} {sq}x{sk} D{d} causal={causal} "
              f"window={window}: hopper {errs['hopper'][0]:.2e} (lse {errs['hopper'][1]:.1e}) "
              f"portable {errs['portable'][0]:.2e}", flush=True)
    # varlen: ragged, with 0- and 1-token sequences, causal bottom-right per sequence
    lens_q = [5, 0, 1, 300, 129, 1000, 64]
    lens_k = [5, 3, 1, 300, 500, 1000, 0]
    for causal in (False, True):
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32,
                            device="cuda")
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32,
                            device="cuda")
        q = torch.randn(sum(lens_q), 4, 128, device="cuda", generator=g).to(dtype)
        k = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=g).to(dtype)
        v = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=g).to(dtype)
        ref = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, device="cuda")
        ref = ref[0] if isinstance(ref, tuple) else ref
        errs = {}
        for backend in ("hopper", "portable"):
            with use_backend(backend):
                out = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                       is_causal=causal)
            errs[backend] = (_err(out, ref), 0.0, torch.isfinite(out).all().item())
        ok = errs["hopper"][2] and errs["hopper"][0] <= 2 * errs["portable"][0] + 2e-3
        rows.append(dict(case=["varlen", lens_q, lens_k, causal], dtype=str(dtype),
                         hopper=errs["hopper"], portable=errs["portable"], ok=ok))
        print(f"{'ok  ' if ok else 'FAIL'} {dtype} varlen causal={causal}: hopper "
              f"{errs['hopper'][0]:.2e} portable {errs['portable'][0]:.2e}", flush=True)
    return rows


ROWS = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True),
        (1, 32, 32, 16384, 128, True), (2, 32, 32, 8192, 64, True),
        (1, 32, 8, 8192, 128, True), (2, 16, 16, 4096, 256, False),
        (4, 32, 32, 4096, 96, False), (4, 32, 32, 4096, 192, False),
        (4, 32, 32, 4096, 64, False), (64, 16, 16, 256, 64, False)]


def providers(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    calls = {}
    for backend in ("hopper", "portable"):
        def call(backend=backend):
            with use_backend(backend):
                return attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        calls[backend] = call
    def no_pingpong():  # the A/B of the consumers' explicit turns
        from fusedattn.hopper import forward

        forward.PINGPONG = False
        try:
            return calls["hopper"]()
        finally:
            forward.PINGPONG = True
    calls["hopper-nopp"] = no_pingpong
    for name, which in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def call(which=which):
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=gqa)
        calls[name] = call
    try:
        from flash_attn.cute import flash_attn_func

        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))

        def fa4():
            o = flash_attn_func(qs, ks, vs, causal=causal)
            return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)
        calls["fa4"] = fa4
    except ImportError:
        pass
    return calls


def bench(rows):
    results = []
    for b, h, hk, s, d, causal in rows:
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        ref = None
        line = {}
        for name, call in providers(q, k, v, causal).items():
            try:
                out = call()
                torch.cuda.synchronize()
            except Exception as e:  # a peer that refuses the row
                line[name] = f"refused: {type(e).__name__}: {str(e)[:80]}"
                continue
            if ref is None:
                ref = out.float()
            err = (out.float() - ref).abs().max().item()
            ms = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
            err2 = (call().float() - ref).abs().max().item()
            line[name] = dict(ms=ms, tflops=flops / ms / 1e9, err=max(err, err2))
        results.append(dict(row=[b, h, hk, s, d, causal], **line))
        cells = " ".join(f"{n}={v['tflops']:.0f}" if isinstance(v, dict) else f"{n}=-"
                         for n, v in line.items())
        print(f"B{b} H{h}/{hk} S{s} D{d} causal={causal}: {cells}", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="bf16 checks only")
    ap.add_argument("--bench-only", action="store_true", help="no checks")
    args = ap.parse_args()
    t0 = time.time()
    checks = [] if args.bench_only else check_cases(torch.bfloat16) + (
        [] if args.quick else check_cases(torch.float16))
    print(f"checks: {sum(r['ok'] for r in checks)}/{len(checks)} ok ({time.time() - t0:.0f}s)")
    results = bench(ROWS)
    with open(f"{args.out}/hopper_check.json", "w") as f:
        json.dump(dict(checks=checks, bench=results, gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__), f, indent=1)
    return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
