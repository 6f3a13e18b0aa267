"""Ring attention on several GPUs against one GPU (issue: context parallel); run on 2xH200
(evidence/nvidia-h200-x2/20261130T1253Z-ring).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 scripts/ring_bench.py OUT.csv

bf16, B=1, H=32, D=128, causal (zigzag shards), S from 32k to 256k; forward + backward.
Per S: the ring's time (median of 5 after 2 warm-ups, CUDA events, every rank synchronised),
one GPU's time on the whole sequence (rank 0), the ring's compute alone (the same blocks
with no transfer: `world` local blocks of the right shapes) and the transfers alone, so
hidden share = (compute + transfers - ring) / transfers; peak memory per GPU. TFLOP/s by
FlashAttention's convention (3.5x the causal forward's 2*B*H*S^2*D).
"""

import csv
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fusedattn.api import attention
from fusedattn.distributed import ring_attention, zigzag_shard
from fusedattn.distributed.ring import _exchange, _wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_parallel_bench import time_ms  # noqa: E402

B, H, D = 1, 32, 128


def _one_seq(seq: int, rank: int, world: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(B, H, seq, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(4)]
    q, k, v, dout = (zigzag_shard(t, rank, world).contiguous() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ring():
        torch.autograd.grad(ring_attention(q, k, v, is_causal=True), (q, k, v), dout)

    def transfers():  # what the ring sends: K, V forward; K, V, dK, dV backward
        for _ in range((2 * (world - 1) + 4 * world) // 2):
            reqs, _ = _exchange([k.detach(), v.detach()], None, rank, world)
            _wait(reqs)

    torch.cuda.reset_peak_memory_stats()
    t_ring = time_ms(ring)
    peak = torch.cuda.max_memory_allocated()
    t_comm = time_ms(transfers)
    half = seq // world // 2
    qc, kc = q.detach()[..., :half, :].requires_grad_(), k.detach()[..., :2 * half, :]

    def compute():  # world blocks of half a shard's queries against a shard's keys
        for _ in range(world):
            o = attention(qc, kc, kc, is_causal=False)
            torch.autograd.grad(o, qc, o)

    t_compute = time_ms(compute)
    flops = 3.5 * 2 * B * H * seq * seq * D
    row = dict(seq=seq, world=world, ring_ms=t_ring, compute_ms=t_compute,
               transfer_ms=t_comm, hidden_share=(t_compute + t_comm - t_ring) / t_comm,
               ring_tflops=flops / t_ring / 1e9, peak_gib=peak / 2**30)
    if rank == 0:
        fq, fk, fv = (t.detach().requires_grad_() for t in full[:3])

        def single():
            torch.autograd.grad(attention(fq, fk, fv, is_causal=True), (fq, fk, fv), full[3])

        row["one_gpu_ms"] = t_one = time_ms(single, together=False)  # rank 0 alone
        row["speedup_over_one_gpu"] = t_one / t_ring
        print(row, flush=True)
    dist.barrier()  # the other ranks wait while rank 0 times one GPU
    return row


def main(path: str) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    rows = [_one_seq(seq, rank, world) for seq in (32768, 65536, 131072, 262144)]
    if rank == 0:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
