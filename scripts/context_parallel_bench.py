"""Context parallel at 2, 4 and 8 GPUs (issue 35): the ring, Ulysses and USP on one
sequence, forward + backward, against one GPU on the whole sequence.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node P scripts/context_parallel_bench.py OUT.csv \\
        [--layouts ring,ulysses,ulysses:4,usp2] [--seqs 131072,262144] [--heads 32] [--dim 128]

`ulysses:C` is Ulysses with its all-to-alls overlapped with the attention in C head groups
(`ulysses_attention(chunks=C)`; against `ulysses`, how much of the exchange the overlap
hides; `usp<U>:C` likewise). `usp<U>` is USP with Ulysses degree U and ring degree P / U
(rank r: Ulysses rank r % U, ring rank r // U, as `tests/test_ulysses.py` groups them).
bf16, B=1, causal (zigzag shards on the ring). Per layout and S: the median of 5 timed calls
after 2 warm-ups (CUDA events, every rank at a barrier before each), one GPU's time on the
whole sequence (rank 0, once per S), the speedup over it and its ratio to P (the issue's
target: >= 0.9 x P at S >= 128k for the best layout), TFLOP/s per GPU by FlashAttention's
convention (3.5x the causal forward's 2*B*H*S^2*D, over P), and the peak memory per GPU.
Before timing, rank 0's output of each layout is checked against the one-GPU output on its
rows (bf16: within 2^-6 of it; the float64 tests are the suite's).

Without CUDA it runs on gloo in Triton's interpreter at a tiny default size
(`--seqs 64 --heads 4 --dim 16`), to check the script's logic: no time it prints means
anything there.
"""

import argparse
import csv
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fusedattn.api import attention
from fusedattn.distributed import (
    ring_attention,
    ulysses_attention,
    usp_attention,
    usp_shard,
    zigzag_shard,
)
from fusedattn.distributed.ring import contiguous_shard

CUDA = torch.cuda.is_available()


def time_ms(fn, reps=5, warm=2, together=True) -> float:
    """Median ms of `fn`; `together`: every rank starts each repetition at a barrier (CUDA
    events on a GPU, the host's clock without one). `ring_bench.py` times with it too."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if together:
            dist.barrier()
        if CUDA:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsedtime_ms(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _layout(name: str, rank: int, world: int):
    """(shard function of a full `[B, H, S, D]` tensor, the attention call) of a layout."""
    if name == "ring":
        return (lambda t: zigzag_shard(t, rank, world),
                lambda q, k, v: ring_attention(q, k, v, is_causal=True))
    if name == "ulysses" or name.startswith("ulysses:"):  # ulysses:C, C head groups
        chunks = int(name.partition(":")[2] or 1)
        return (lambda t: contiguous_shard(t, rank, world),
                lambda q, k, v: ulysses_attention(q, k, v, is_causal=True, chunks=chunks))
    if name.startswith("usp"):  # usp<U>, or usp<U>:C with C head groups overlapped
        degree, _, groups = name[3:].partition(":")
        ulysses, chunks = int(degree), int(groups or 1)
        ring = world // ulysses
        if ulysses < 2 or ring < 2 or ulysses * ring != world:
            raise SystemExit(f"{name}: Ulysses degree {ulysses} must be >= 2 and leave a ring "
                             f"of >= 2 of the {world} ranks")
        # every rank creates every group, in the same order (torch.distributed's rule)
        u_groups = [dist.new_group([r * ulysses + u for u in range(ulysses)])
                    for r in range(ring)]
        r_groups = [dist.new_group([r * ulysses + u for r in range(ring)])
                    for u in range(ulysses)]
        u_rank, r_rank = rank % ulysses, rank // ulysses
        return (lambda t: usp_shard(t, u_rank, ulysses, r_rank, ring),
                lambda q, k, v: usp_attention(q, k, v, ulysses_group=u_groups[r_rank],
                                              ring_group=r_groups[u_rank], is_causal=True,
                                              chunks=chunks))
    raise SystemExit(f"unknown layout {name!r}: ring, ulysses, ulysses:C, usp<U> or usp<U>:C")


def _one(layout: str, seq: int, heads: int, dim: int, rank: int, world: int, device,
         single: dict) -> dict:
    dtype = torch.bfloat16 if CUDA else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, heads, seq, dim, generator=gen, device=device, dtype=dtype)
            for _ in range(4)]
    shard, call = _layout(layout, rank, world)
    q, k, v, dout = (shard(t).contiguous() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if seq not in single:  # one GPU on the whole sequence: its output, and rank 0's time
        fq, fk, fv = (t.detach().requires_grad_() for t in full[:3])
        single[seq] = [attention(fq, fk, fv, is_causal=True).detach(), None]
        if rank == 0:
            single[seq][1] = time_ms(lambda: torch.autograd.grad(
                attention(fq, fk, fv, is_causal=True), (fq, fk, fv), full[3]),
                together=False)
        dist.barrier()
    out = call(q, k, v)
    err = float((out.detach().float() - shard(single[seq][0]).float()).abs().max())
    if err > 2.0 ** -6:
        raise SystemExit(f"{layout} S{seq} rank {rank}: output off by {err} from one GPU's")
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    ms = time_ms(lambda: torch.autograd.grad(call(q, k, v), (q, k, v), dout))
    row = dict(layout=layout, world=world, seq=seq, heads=heads, dim=dim, ms=ms,
               max_abs_vs_one_gpu=err,
               tflops_per_gpu=3.5 * 2 * heads * seq * seq * dim / world / ms / 1e9,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if CUDA else None)
    if rank == 0:
        one = single[seq][1]
        row.update(one_gpu_ms=one, speedup=one / ms, speedup_over_p=one / ms / world)
        print(row, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layouts", default="ring,ulysses")
    ap.add_argument("--seqs", default="131072,262144" if CUDA else "64")
    ap.add_argument("--heads", type=int, default=32 if CUDA else 4)
    ap.add_argument("--dim", type=int, default=128 if CUDA else 16)
    args = ap.parse_args(argv)
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(device)
    single: dict = {}
    rows = [_one(layout, int(s), args.heads, args.dim, rank, world, device, single)
            for s in args.seqs.split(",") for layout in args.layouts.split(",")]
    if rank == 0:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
