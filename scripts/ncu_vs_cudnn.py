"""Nsight Compute of fusedattn's forward and backward against cuDNN's (SDPA) on one
training-bench row, in one process: each warmed up and checked against cuDNN's output, then
one launch of each between cudaProfilerStart/Stop, so that `ncu --profile-from-start off`
profiles exactly those kernels (NVTX ranges name them). NOT YET RUN.

    ncu --profile-from-start off --clock-control none --nvtx --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \\
        --csv --page details python3 scripts/ncu_vs_cudnn.py --dim 128 [--causal] > OUT.csv
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from fusedattn.api import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(4, 32, args.seq, args.dim, generator=gen, device="cuda")
                     .to(dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ours():
        return attention(q, k, v, is_causal=args.causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=args.causal)

    outs = {}
    for name, fwd in (("fusedattn", ours), ("cudnn", cudnn)):
        for _ in range(3):  # compile, pick configs, warm caches
            out = fwd()
            grads = torch.autograd.grad(out, (q, k, v), dout)
        outs[name] = (out, grads)
    err = float((outs["fusedattn"][0].float() - outs["cudnn"][0].float()).abs().max())
    assert err < 0.05, f"forward differs from cuDNN's by {err}"
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fwd in (("fusedattn", ours), ("cudnn", cudnn)):
        with torch.cuda.nvtx.range(f"{name}-fwd"):
            out = fwd()
        with torch.cuda.nvtx.range(f"{name}-bwd"):
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
