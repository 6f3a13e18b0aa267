"""Nsight Compute of fusedattn's forward and backward against a peer's (SDPA cuDNN by
default; SDPA efficient for fp32, the only SDPA backend with an fp32 backward) on one
training-bench row, in one process: each warmed up and checked against the peer's output,
then one launch of each between cudaProfilerStart/Stop, so that `ncu --profile-from-start
off` profiles exactly those kernels (NVTX ranges name them).

    ncu --profile-from-start off --clock-control none --nvtx --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \\
        --csv --page details python3 scripts/ncu_vs_cudnn.py --dim 128 [--causal] > OUT.csv
    ... scripts/ncu_vs_cudnn.py --dtype fp32 --precision tf32x3 --batch 1 --heads 16 --dim 64
    ... scripts/ncu_vs_cudnn.py --peer fa4 --fwd-only --dim 64    # FA4 (staged) as the peer
    ... scripts/ncu_vs_cudnn.py --dtype fp8 --dim 128   # FP8 forward; cuDNN in bf16 on the
                                                      # same values (SDPA takes no FP8)
    ... scripts/ncu_vs_cudnn.py --bwd-only --dim 128    # the backwards alone: no --nvtx
                                                      # filter (below)

`--bwd-only` profiles the backwards alone, each one `autograd.grad` between the profiler's
start and stop. Autograd runs a CUDA backward on a thread of its own, outside the main
thread's NVTX ranges, so ncu's `--nvtx-include` finds none of its kernels: run it without
one and tell the kernels apart by name.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from fusedattn.api import attention
from fusedattn.dispatch import use_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=None, help="K/V heads (GQA)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"))
    parser.add_argument("--precision", default=None, choices=("ieee", "tf32", "tf32x3"))
    parser.add_argument("--peer", default="sdpa", choices=("sdpa", "fa4"),
                        help="SDPA (cuDNN; efficient for fp32) or FA4 (forward only)")
    parser.add_argument("--fwd-only", action="store_true", help="profile forwards only")
    parser.add_argument("--bwd-only", action="store_true", help="profile backwards only")
    parser.add_argument("--backend", default="auto", choices=("auto", "hopper", "portable"),
                        help="fusedattn's path (`use_backend`)")
    parser.add_argument("--varlen", action="store_true",
                        help="the varlen suite's packed batch (24 documents, 32k tokens, "
                             "causal) at --heads and --dim, against FA4")
    parser.add_argument("--knob", action="append", default=[],
                        help="NAME=VALUE: set one of `hopper.forward`'s A/B switches "
                             "(a Python literal) before the first call; backward.NAME=VALUE "
                             "one of `hopper.backward`'s")
    args = parser.parse_args()
    for knob in args.knob:
        import ast

        from fusedattn.hopper import backward, forward

        name, value = knob.split("=", 1)
        module = forward
        if name.startswith("backward."):
            module, name = backward, name.removeprefix("backward.")
        assert hasattr(module, name), f"{module.__name__} has no {name}"
        setattr(module, name, ast.literal_eval(value))
    if args.varlen:
        return _varlen(args)
    if args.dtype == "fp8":
        return _fp8(args)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    peer, backend = (("efficient", SDPBackend.EFFICIENT_ATTENTION) if dtype == torch.float32
                     else ("cudnn", SDPBackend.CUDNN_ATTENTION))
    if args.peer == "fa4":
        peer, args.fwd_only = "fa4", True
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads_kv = args.heads_kv or args.heads
    q, k, v, dout = (torch.randn(args.batch, h, args.seq, args.dim, generator=gen,
                                 device="cuda").to(dtype)
                     for h in (args.heads, heads_kv, heads_kv, args.heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    gqa = heads_kv != args.heads

    def ours():
        with use_backend(args.backend):
            return attention(q, k, v, is_causal=args.causal, precision=args.precision,
                             enable_gqa=gqa)

    def theirs():
        if peer == "fa4":  # [B, S, H, D] views of the same tensors (strided: TMA takes them)
            from flash_attn.cute import flash_attn_func

            out = flash_attn_func(*(t.detach().transpose(1, 2) for t in (q, k, v)),
                                  causal=args.causal)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=args.causal, enable_gqa=gqa)

    outs = {}
    for name, fwd in (("fusedattn", ours), (peer, theirs)):
        for _ in range(3):  # compile, pick configs, warm caches
            out = fwd()
            grads = () if args.fwd_only else torch.autograd.grad(out, (q, k, v), dout)
        outs[name] = (out, grads)
    for mine, its in zip((outs["fusedattn"][0], *outs["fusedattn"][1]),
                         (outs[peer][0], *outs[peer][1]), strict=True):
        err = float((mine.float() - its.float()).abs().max())
        print(f"max |fusedattn - {peer}| = {err:.3g}", flush=True)
        assert err < 0.1 * max(1.0, float(its.float().abs().max())), \
            f"fusedattn differs from {peer} by {err}"
    if args.fwd_only:
        return _profiled({"fusedattn": ours, peer: theirs})
    if args.bwd_only:
        return _profiled_backwards({"fusedattn": ours, peer: theirs}, (q, k, v), dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fwd in (("fusedattn", ours), (peer, theirs)):
        with torch.cuda.nvtx.range(f"{name}-fwd"):
            out = fwd()
        with torch.cuda.nvtx.range(f"{name}-bwd"):
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _profiled(calls: dict) -> None:
    """One launch of each call between cudaProfilerStart/Stop, in an NVTX range `NAME-fwd`."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fwd in calls.items():
        with torch.cuda.nvtx.range(f"{name}-fwd"):
            fwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _profiled_backwards(calls: dict, inputs: tuple, dout) -> None:
    """The calls' forwards first, unprofiled (their graphs kept), then each one's backward
    (`autograd.grad` of its output, a tuple's first) alone between cudaProfilerStart/Stop:
    autograd's thread runs outside NVTX ranges, so the kernels' names tell them apart."""
    outs = [fwd() for fwd in calls.values()]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for out in outs:
        torch.autograd.grad(out[0] if isinstance(out, tuple) else out, inputs, dout)
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _fp8(args) -> None:
    """The FP8 forward (e4m3 q, k, v with per-head factors, as `bench --suite fp8` makes
    them) against cuDNN in bf16 on the dequantised values; the NVTX range `fusedattn-fwd`
    holds V's transpose and the attention kernel."""
    from fusedattn.reference import dequantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads_kv = args.heads_kv or args.heads
    x = [torch.randn(args.batch, h, args.seq, args.dim, generator=gen, device="cuda")
         for h in (args.heads, heads_kv, heads_kv)]
    factors = [t.abs().amax(dim=(0, 2, 3)) / 256 for t in x]
    q8, k8, v8 = ((t / f.reshape(-1, 1, 1)).to(torch.float8_e4m3fn)
                  for t, f in zip(x, factors, strict=True))
    q, k, v = (dequantize(t, f).to(torch.bfloat16) for t, f in zip((q8, k8, v8), factors,
                                                                   strict=True))
    gqa = heads_kv != args.heads
    calls = {"fusedattn": lambda: attention(q8, k8, v8, is_causal=args.causal, enable_gqa=gqa,
                                            descale_q=factors[0], descale_k=factors[1],
                                            descale_v=factors[2])}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=args.causal, enable_gqa=gqa)
    calls["cudnn"] = cudnn
    outs = {}
    for name, fwd in calls.items():
        for _ in range(3):
            outs[name] = fwd()
    err = float((outs["fusedattn"].float() - outs["cudnn"].float()).abs().max())
    print(f"max |fusedattn - cudnn| = {err:.3g}", flush=True)
    assert err < 0.1, f"fusedattn differs from cudnn by {err}"
    _profiled(calls)


def _varlen(args) -> None:
    """The varlen suite's batch against FA4. `--bwd-only`: the backwards alone (ours on
    `--backend`), each one `autograd.grad` between the profiler's start and stop, told apart
    by kernel name (as the dense `--bwd-only`); FA4 sits out where it does not import."""
    from fusedattn.varlen import attention_varlen, offsets_of
    from fusedattn_lab.serving import _lengths

    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        if not args.bwd_only:
            raise
        flash_attn_varlen_func = None
    lengths = _lengths(24, 32768, 0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(sum(lengths), args.heads, args.dim, generator=gen,
                                 device="cuda").to(torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_(args.bwd_only) for t in (q, k, v))
    cu = offsets_of(lengths, "cuda")
    n = max(lengths)

    def ours():
        with use_backend(args.backend):
            return attention_varlen(q, k, v, cu, cu, n, n, is_causal=True)

    calls = {"fusedattn": ours}
    if flash_attn_varlen_func is not None:
        calls["fa4"] = lambda: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
            causal=True)
    outs = {}
    for name, fwd in calls.items():
        for _ in range(3):
            out = fwd()
            out = out[0] if isinstance(out, tuple) else out
            grads = torch.autograd.grad(out, (q, k, v), dout) if args.bwd_only else ()
        outs[name] = (out, *grads)
    if "fa4" in outs:
        for mine, its in zip(outs["fusedattn"], outs["fa4"], strict=True):
            err = float((mine.float() - its.float()).abs().max())
            print(f"max |fusedattn - fa4| = {err:.3g}", flush=True)
            assert err < 0.1, f"fusedattn differs from fa4 by {err}"
    if not args.bwd_only:
        return _profiled(calls)
    return _profiled_backwards(calls, (q, k, v), dout)


if __name__ == "__main__":
    main()
