"""Which of the backward's products could run in FP8 (issue 34.3: "decide which products
run in FP8 by measured error"): the backward's formulas done by torch on FP8 inputs, each
product in fp32 or with its operands rounded to e4m3, against float64 autograd of the
dequantised inputs. An error measurement on the CPU (no GPU, no times):

    python3 scripts/fp8_backward_error.py [--out F]

The variants (each from "fp32" on adds its rounding to the one before it):
    FP8 O         every product in fp32, delta = rowsum(dO * O) from the FP8 forward's O
                  (P rounded to e4m3 in P.V, O in bf16), as FP8 backwards take it
    fp32          every product in fp32, delta from O in fp32 (`attention_fp8_backward`)
    dO e4m3       dO rounded to e4m3 (one factor per head) in dP = dO V^T and dV = P^T dO
    P e4m3        and P (times FP8_P_SCALE) in dV = P^T dO, as the forward's P.V product
    dS e4m3       and dS (one factor per head) in dK = dS^T Q and dQ = dS K
For each it prints the largest error of dQ, dK, dV over the bf16 storage floor of the
tolerance table (2^-8 at the gradient's magnitude): at 1 a gradient's error is what storing
it in bf16 costs already.

`--library` adds the library's own `attention_fp8_backward` at each precision ("fp32", the
default, and "bf16": the bf16 kernels on the dequantised values rounded to bfloat16), the
kernels in emulation on the CPU (set TRITON_INTERPRET=1), and "bf16 formula": the
formulas with every tensor in bfloat16 (`peers.fp8_backward_peer(dtype=torch.bfloat16)`,
the bf16 route's test peer)."""

import argparse
import json
import sys
from pathlib import Path

import torch

from fusedattn.problem import FP8
from fusedattn.reference import attention_ref_grads, dequantize, visible
from fusedattn.tiles.common import FP8_P_SCALE

SHAPES = [(4, 512, 64, False), (4, 512, 64, True), (2, 1024, 128, True)]  # (H, S, D, causal)
VARIANTS = ("FP8 O", "fp32", "dO e4m3", "P e4m3", "dS e4m3")


def e4m3(x: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """`x` rounded to e4m3 with one factor per head (its largest magnitude to 448)."""
    amax = x.abs().amax(dim=(-2, -1), keepdim=True) if per_head else x.abs().max()
    factor = amax.clamp_min(1e-30) / 448
    return (x / factor).to(FP8).to(x.dtype) * factor


def grads(q, k, v, do, o, causal, variant):
    """(dq, dk, dv): the backward's formulas in fp32, `variant`'s products rounded (`o`:
    the O that delta takes)."""
    level = VARIANTS.index(variant) - 1
    scale = q.shape[-1] ** -0.5
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~visible(q.shape[-2], k.shape[-2], causal=True), float("-inf"))
    p = torch.softmax(s, dim=-1)
    delta = (do * o).sum(-1, keepdim=True)
    do_mm = e4m3(do) if level >= 1 else do
    dp = do_mm @ v.transpose(-1, -2)
    p_mm = ((p * FP8_P_SCALE).to(FP8).to(p.dtype) / FP8_P_SCALE) if level >= 2 else p
    dv = p_mm.transpose(-1, -2) @ do_mm
    ds = p * (dp - delta)
    ds_mm = e4m3(ds) if level >= 3 else ds
    return ds_mm @ k * scale, ds_mm.transpose(-1, -2) @ q * scale, dv


def measure(shape, seed=0, library=False):
    heads, seq, dim, causal = shape
    g = torch.Generator().manual_seed(seed)
    q8, k8, v8 = ((torch.randn(heads, seq, dim, generator=g) * 2).to(FP8) for _ in range(3))
    q, k, v = (dequantize(t) for t in (q8, k8, v8))
    do = torch.randn(heads, seq, dim, generator=g, dtype=torch.float64)
    refs = attention_ref_grads(q, k, v, do, causal=causal)
    # O as an FP8 forward gives it (P in e4m3 for P.V, O in bf16), and exactly
    p = torch.softmax(((q @ k.transpose(-1, -2)) * dim ** -0.5).masked_fill(
        ~visible(seq, seq, causal=causal), float("-inf")), dim=-1)
    o_fp8 = ((p * FP8_P_SCALE).to(FP8).double() / FP8_P_SCALE @ v).to(torch.bfloat16)
    row = dict(heads=heads, seq=seq, dim=dim, causal=causal)
    for variant in VARIANTS:
        o = o_fp8 if variant == "FP8 O" else p @ v
        got = grads(*(t.to(torch.float32) for t in (q, k, v, do, o)), causal, variant)
        row[variant] = {name: float((x.double() - r).abs().max()
                                    / (2.0 ** -8 * max(1.0, float(r.abs().max()))))
                        for name, x, r in zip(("dq", "dk", "dv"), got, refs, strict=True)}
    if library:
        from fusedattn import attention_fp8_backward
        from fusedattn_lab.peers import fp8_backward_peer

        dout = do.to(torch.bfloat16)  # (the reference's dO is this one, rounded: re-taken)
        refs = attention_ref_grads(q, k, v, dout.double(), causal=causal)
        runs = {f"library {p}": attention_fp8_backward(dout, q8, k8, v8, is_causal=causal,
                                                       precision=p) for p in ("fp32", "bf16")}
        runs["bf16 formula"] = fp8_backward_peer(dout, q8, k8, v8, causal=causal,
                                                 dtype=torch.bfloat16)
        for variant, got in runs.items():
            row[variant] = {name: float((x.double() - r).abs().max()
                                        / (2.0 ** -8 * max(1.0, float(r.abs().max()))))
                            for name, x, r in zip(("dq", "dk", "dv"), got, refs, strict=True)}
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--library", action="store_true", help="also attention_fp8_backward at "
                    "each precision (TRITON_INTERPRET=1 on the CPU)")
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        row = measure(shape, library=args.library)
        rows.append(row)
        cells = "  ".join(f"{v}: " + "/".join(f"{row[v][n]:.2f}" for n in ("dq", "dk", "dv"))
                          for v in row if isinstance(row[v], dict))
        print(f"H{shape[0]} S{shape[1]} D{shape[2]} causal={shape[3]}  {cells}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            command=" ".join(sys.argv), torch=torch.__version__,
            unit="max abs error / (2^-8 * max(1, |reference|)), dq/dk/dv", rows=rows),
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
