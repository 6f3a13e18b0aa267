"""`fusedattn.distributed.ring_attention` in 2 and 3 processes (gloo on CPUs in emulation;
NCCL, one GPU per rank, on a machine with enough GPUs) against the float64 reference,
forward and gradients, causal (zigzag shards) and not, with GQA, and with sinks."""

import pytest
import torch

import fusedattn  # noqa: F401  (fix the mode before the workers are spawned)
from ranks import need_gpus, refusal, spawn_each

# (B, H, H_kv, S, D): S divisible by 2*P for P = 2 and 3
SHAPE = (1, 2, 1, 24, 16)


def _ring_body(rank: int, world: int, device, results: str) -> list[str]:
    """One rank: the ring against the float64 reference, then two refused inputs."""
    from fusedattn.distributed import contiguous_shard, ring_attention, zigzag_shard
    from fusedattn.reference import attention_ref, attention_ref_grads
    from fusedattn_lab.verify import check

    lines = []
    b, h, hk, s, d = SHAPE
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(b, n, s, d, generator=g) for n in (h, hk, hk, h)]
    for causal in (False, True):
        shard = zigzag_shard if causal else contiguous_shard
        q, k, v, dout = (shard(t, rank, world).contiguous().to(device) for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = shard(attention_ref(*full[:3], causal=causal), rank, world)
        refs = [shard(r, rank, world) for r in
                attention_ref_grads(*full[:3], full[3], causal=causal)]
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                   (ref, *refs), strict=True):
            result = check(got.detach(), want)
            lines.append(f"{causal} {name} {result.ok} {result.max_abs:.3e} "
                         f"{'; '.join(result.reasons)}")
    # attention sinks, causal: added after the ring's merge; d sinks summed over the ranks
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(4)) * 2
    q, k, v, dout = (zigzag_shard(t, rank, world).contiguous().to(device) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks_in = sinks.to(device).requires_grad_()
    out = ring_attention(q, k, v, is_causal=True, sinks=sinks_in)
    grads = list(torch.autograd.grad(out, (q, k, v, sinks_in), dout))
    torch.distributed.all_reduce(grads[3])
    ref = zigzag_shard(attention_ref(*full[:3], causal=True, sinks=sinks), rank, world)
    refs = attention_ref_grads(*full[:3], full[3], causal=True, sinks=sinks)
    refs = [zigzag_shard(r, rank, world) for r in refs[:3]] + [refs[3]]
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads),
                               (ref, *refs), strict=True):
        result = check(got.detach(), want)
        lines.append(f"sinks {name} {result.ok} {result.max_abs:.3e} "
                     f"{'; '.join(result.reasons)}")
    # past a grid's rows (`api.GRID_ROWS`, 2 here): the ring made in batches of the batch
    from fusedattn import api
    from fusedattn.distributed import ring

    x3 = [torch.randn(3, n, s, d, generator=g) for n in (h, hk, hk)]
    q3, k3, v3 = (zigzag_shard(t, rank, world).contiguous().to(device) for t in x3)
    whole = ring_attention(q3, k3, v3, is_causal=True)
    split, real = [], ring.batches
    api.GRID_ROWS, ring.batches = 2, lambda *a: split.append(real(*a)) or split[-1]
    try:
        parts = ring_attention(q3, k3, v3, is_causal=True)
    finally:
        api.GRID_ROWS, ring.batches = 65535, real
    lines.append(f"batches {torch.allclose(whole, parts, atol=1e-6)} {len(split[-1])}")
    # bad input: shards of unequal length across ranks, refused on every rank
    q, k, v = (t[..., : 4 + 2 * rank, :].contiguous().to(device) for t in full[:3])
    lines.append(refusal("unequal", lambda: ring_attention(q, k, v)))
    # bad input: S not divisible by 2P under zigzag (an odd shard), refused everywhere
    q5, k5, v5 = (t[..., :5, :].contiguous().to(device) for t in full[:3])
    lines.append(refusal("odd", lambda: ring_attention(q5, k5, v5, is_causal=True)))
    # a V head dim of its own on one rank only: refused on every rank
    qd, kd = (t.contiguous().to(device) for t in full[:2])
    vd = full[2][..., : d // 2 if rank == 0 else d].contiguous().to(device)
    lines.append(refusal("dv", lambda: ring_attention(qd, kd, vd)))
    return lines


# documents of lengths divisible by 2P for P = 2 and 3, one of them empty
DOCS = [12, 0, 24]


def _ring_varlen_body(rank: int, world: int, device, results: str) -> list[str]:
    """One rank: packed documents through the ring against the float64 reference (causal
    and not, GQA, sinks), then refused inputs."""
    from fusedattn.distributed import ring_attention_varlen, varlen_shard
    from fusedattn.reference import varlen_ref, varlen_ref_grads
    from fusedattn_lab.verify import check

    lines = []
    h, hk, d = 2, 1, 16
    bounds = [0]
    for n in DOCS:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    total = bounds[-1]
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(total, n, d, generator=g) for n in (h, hk, hk, h)]
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(4)) * 2
    for causal, with_sinks in ((False, False), (True, False), (True, True)):
        q, k, v, dout = (varlen_shard(t, cu, rank, world, causal=causal).contiguous()
                         .to(device) for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        sinks_in = sinks.to(device).requires_grad_() if with_sinks else None
        out = ring_attention_varlen(q, k, v, cu.to(device), max(DOCS), is_causal=causal,
                                    sinks=sinks_in)
        leaves = (q, k, v, sinks_in) if with_sinks else (q, k, v)
        grads = list(torch.autograd.grad(out, leaves, dout))
        extra = dict(sinks=sinks) if with_sinks else {}
        ref = varlen_shard(varlen_ref(*full[:3], cu, cu, causal=causal, **extra), cu, rank,
                           world, causal=causal)
        refs = varlen_ref_grads(*full[:3], full[3], cu, cu, causal=causal, **extra)
        refs = [varlen_shard(r, cu, rank, world, causal=causal) for r in refs[:3]] + list(
            refs[3:])
        if with_sinks:
            torch.distributed.all_reduce(grads[3])  # each rank's rows' part
        for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads),
                                   (ref, *refs), strict=False):
            result = check(got.detach(), want)
            lines.append(f"{causal}{'+sinks' if with_sinks else ''} {name} {result.ok} "
                         f"{result.max_abs:.3e} {'; '.join(result.reasons)}")
    def refused(label, cu, rows, longest):  # what a bad batch gets on this rank
        q = torch.randn(rows, h, d).to(device)
        return refusal(label, lambda: ring_attention_varlen(
            q, q[:, :1], q[:, :1], cu.to(device), longest, is_causal=True))

    # a document whose length is no multiple of 2P (8 rows a rank), refused on every rank
    lines.append(refused("odd", torch.tensor([0, 2 * world + 2, 8 * world],
                                             dtype=torch.int32), 8, 8 * world))
    # ranks that disagree on the documents
    lines.append(refused("docs", torch.tensor([0, 12 * (1 + rank), 12 * world * 2],
                                              dtype=torch.int32), 24, 24 * world))
    return lines


def test_varlen_shards_put_back_together():
    from fusedattn.distributed import varlen_shard, varlen_unshard
    from fusedattn.problem import ProblemError

    cu = torch.tensor([0, 8, 8, 12], dtype=torch.int32)  # documents of 8, 0 and 4 rows
    x = torch.arange(12.0)[:, None]
    shards = [varlen_shard(x, cu, r, 2) for r in range(2)]
    # rank 0: chunks 0 and 3 of each document (2 rows each of the 8, 1 each of the 4)
    assert shards[0].flatten().tolist() == [0, 1, 6, 7, 8, 11]
    assert shards[1].flatten().tolist() == [2, 3, 4, 5, 9, 10]
    assert torch.equal(varlen_unshard(shards, cu), x)
    plain = [varlen_shard(x, cu, r, 2, causal=False) for r in range(2)]
    assert plain[1].flatten().tolist() == [4, 5, 6, 7, 10, 11]
    assert torch.equal(varlen_unshard(plain, cu, causal=False), x)
    with pytest.raises(ProblemError, match="multiple of 4"):
        varlen_shard(x, torch.tensor([0, 6, 12], dtype=torch.int32), 0, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_and_ring_varlen_match_the_reference_forward_and_gradients(world, tmp_path):
    # both bodies on the ranks of one spawn
    need_gpus(world)
    ranks = spawn_each({"ring": _ring_body, "varlen": _ring_varlen_body}, world, tmp_path)
    for rank, lines in enumerate(ranks["ring"]):
        checks = [line.split() for line in lines
                  if not line.startswith(("unequal", "odd", "dv", "batches"))]
        assert len(checks) == 8 + 5 and all(c[2] == "True" for c in checks), (rank, lines)
        assert "batches True 3" in lines, lines  # (3 entries x 2 heads, 2 rows a part)
        starts = [" ".join(line.split()[:3]) for line in lines]
        assert "unequal refused shards" in starts and "odd refused seq" in starts, lines
        assert ("dv refused v.shape" if rank == 0 else "dv refused shards") in starts, lines
    for rank, lines in enumerate(ranks["varlen"]):
        checks = [line.split() for line in lines if not line.startswith(("odd", "docs"))]
        assert len(checks) == 4 + 4 + 5 and all(c[2] == "True" for c in checks), (rank, lines)
        assert any(line.startswith("odd refused cu_seqlens") and "multiple of" in line
                   for line in lines), lines
        assert any(line.startswith("docs refused shards") and "checksum" in line
                   for line in lines), lines


def test_a_group_of_one_is_plain_attention(tmp_path):
    import torch.distributed as dist

    from fusedattn.api import attention
    from fusedattn.distributed import ring_attention
    from fusedattn.mode import DEVICE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/one", rank=0,
                            world_size=1)
    try:
        q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(s))
                   .to(DEVICE) for s in range(3))
        assert torch.equal(ring_attention(q, k, v, is_causal=True),
                           attention(q, k, v, is_causal=True))
    finally:
        dist.destroy_process_group()


def test_zigzag_shards_put_back_together():
    from fusedattn.distributed import zigzag_shard, zigzag_unshard
    from fusedattn.problem import ProblemError

    x = torch.arange(12.0).reshape(1, 1, 12, 1)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0].flatten().tolist() == [0, 1, 10, 11]   # chunks 0 and 5
    assert shards[2].flatten().tolist() == [4, 5, 6, 7]     # chunks 2 and 3
    assert torch.equal(zigzag_unshard(shards), x)
    with pytest.raises(ProblemError, match="multiple of 2"):
        zigzag_shard(torch.zeros(1, 1, 10, 1), 0, 3)
