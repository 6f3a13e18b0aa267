"""`fusedattn.distributed.ring_sdpa` and `ulysses_sdpa`: SDPA calls on sequence shards run
by fusedattn's ring or Ulysses, alone and under torch's `context_parallel` (whose head-tail
sharding must be the ring's zigzag, and whose sharding without load balancing Ulysses'
contiguous layout), against the float64 reference, forward and gradients; and their
refusals, on every rank alike. 2 processes: gloo on CPUs in emulation, NCCL on 2 GPUs."""

import pytest
import torch

import fusedattn  # noqa: F401  (fix the mode before the workers are spawned)
from ranks import need_gpus, refusal, spawn

# (B, H, H_kv, S, D): GQA, S divisible by 2P for P = 2
SHAPE = (1, 4, 2, 16, 16)


def _full():
    b, h, hk, s, d = SHAPE
    g = torch.Generator().manual_seed(7)
    return [torch.randn(b, n, s, d, generator=g) for n in (h, hk, hk, h)]


def _compare(label, rank, world, shard, full, causal, out, grads) -> list[str]:
    """Lines "<label> <name> <ok> <max_abs> <reasons>" of out and its gradients against the
    float64 reference's rows that this rank holds (`shard` of the full results)."""
    from fusedattn.reference import attention_ref, attention_ref_grads
    from fusedattn_lab.verify import check

    ref = attention_ref(*full[:3], causal=causal)
    refs = attention_ref_grads(*full[:3], full[3], causal=causal)
    lines = []
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *refs),
                               strict=True):
        result = check(got.detach().cpu(), shard(want, rank, world))
        lines.append(f"{label} {name} {result.ok} {result.max_abs:.3e} "
                     f"{'; '.join(result.reasons)}")
    return lines


def _body(rank: int, world: int, device, results: str) -> list[str]:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    from fusedattn.distributed import contiguous_shard, ring_sdpa, zigzag_shard

    def shard_of(t, rank, world):  # torch's head-tail, reproduced by zigzag_shard
        return zigzag_shard(t, rank, world, dim=2)

    lines = []
    full = _full()
    # 1. local shards under ring_sdpa: zigzag for causal, contiguous otherwise
    for causal, shard in ((True, zigzag_shard), (False, contiguous_shard)):
        q, k, v, dout = (shard(t, rank, world).contiguous().to(device) for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with ring_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        lines += _compare(f"local-{causal}", rank, world, shard, full, causal, out, grads)
    # 2. torch's context_parallel shards the buffers (in place) and hands SDPA DTensors;
    #    ring_sdpa runs them on the ring. The reference rows are zigzag_shard's: equal
    #    results prove torch's layout is the ring's.
    mesh = init_device_mesh(device.type, (world,))
    bufs = [t.clone().to(device) for t in full]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
        q, k, v = (t.detach().clone().requires_grad_() for t in bufs[:3])
        with ring_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), bufs[3])
        lines.append(f"cp-type {type(out).__name__} {tuple(out.shape)}")
        lines += _compare("cp", rank, world, shard_of, full, True, out, grads)
        # torch's load balancing off: contiguous shards, so a causal call is refused
        _cp_options.enable_load_balance = False
        try:
            with ring_sdpa():
                lines.append(refusal("cp-balance", lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True)))
        finally:
            _cp_options.enable_load_balance = True
    # 2b. Ulysses: contiguous shards, alone and under torch's context_parallel with its
    #     load balancing off (torch's contiguous split); with it on, a causal call refused
    from fusedattn.distributed import ulysses_sdpa

    for causal in (True, False):
        q, k, v, dout = (contiguous_shard(t, rank, world).contiguous().to(device)
                         for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with ulysses_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        lines += _compare(f"ulysses-{causal}", rank, world, contiguous_shard, full, causal,
                          out, grads)
    _cp_options.enable_load_balance = False
    try:
        bufs = [t.clone().to(device) for t in full]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
            q, k, v = (t.detach().clone().requires_grad_() for t in bufs[:3])
            with ulysses_sdpa():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     enable_gqa=True)
            grads = torch.autograd.grad(out, (q, k, v), bufs[3])
            lines += _compare("cp-ulysses", rank, world, lambda t, r, w: contiguous_shard(
                t, r, w, dim=2), full, True, out, grads)
    finally:
        _cp_options.enable_load_balance = True
    bufs = [t.clone().to(device) for t in full]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
        q, k, v = bufs[:3]
        with ulysses_sdpa():
            lines.append(refusal("cp-ulysses-balance", lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True)))
    # 3. bad calls, refused on every rank: a mask on rank 0 only, dropout, GQA unasked
    q, k, v = (zigzag_shard(t, rank, world).contiguous().to(device) for t in full[:3])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=device)
    with ring_sdpa():
        lines.append(refusal("mask", lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if rank == 0 else None, enable_gqa=True)))
        lines.append(refusal("dropout", lambda: F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.1, enable_gqa=True)))
        lines.append(refusal("gqa", lambda: F.scaled_dot_product_attention(q, k, v)))
    # 4. outside the context SDPA is SDPA again: this rank's shard alone
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    alone = F.scaled_dot_product_attention(q, kk, vv).cpu().double()
    from fusedattn.reference import attention_ref

    lines.append(f"after {torch.allclose(alone, attention_ref(q, kk, vv), atol=1e-4)}")
    return lines


def test_sdpa_modes_match_the_reference_alone_and_under_torch_context_parallel(tmp_path):
    need_gpus(2)
    for rank, lines in enumerate(spawn(_body, 2, tmp_path)):
        checks = [line.split() for line in lines
                  if line.startswith(("local", "cp ", "ulysses", "cp-ulysses "))]
        assert len(checks) == 12 + 12 and all(c[2] == "True" for c in checks), (rank, lines)
        starts = [" ".join(line.split()[:3]) for line in lines]
        # torch's wrapper hands the local shard back; the same bits as the local call's
        # show that fusedattn's ring, not torch's, computed it
        assert "cp-type Tensor (1, 4, 8, 16)" in lines, lines
        local = {c[1]: c[3] for c in checks if c[0] == "local-True"}
        assert {c[1]: c[3] for c in checks if c[0] == "cp"} == local, lines
        local = {c[1]: c[3] for c in checks if c[0] == "ulysses-True"}
        assert {c[1]: c[3] for c in checks if c[0] == "cp-ulysses"} == local, lines
        assert "cp-balance refused torch's" in starts, lines
        assert "cp-ulysses-balance refused torch's" in starts, lines
        assert ("mask refused attn_mask" if rank == 0 else "mask refused shards") in starts
        assert "dropout refused dropout_p" in starts and "gqa refused enable_gqa" in starts
        assert "after True" in lines, lines


class _TinyModel(torch.nn.Module):
    """A causal language model that calls SDPA, as torchtitan's do: embedding, one
    attention layer (no positional encoding: the causal mask carries the order), logits."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2):
        super().__init__()
        torch.manual_seed(3)
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        import torch.nn.functional as F

        b, s = tokens.shape
        x = self.embed(tokens)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(x + y.transpose(1, 2).reshape(b, s, -1))


def _loss(model, tokens, labels):
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(),
                                             reduction="sum")


def _train_body(rank: int, world: int, device, results: str) -> list[str]:
    """One training step of `_TinyModel` under torch's context_parallel and ring_sdpa: the
    ranks' summed loss and gradients against one process's on the whole sequence."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from fusedattn.distributed import ring_sdpa

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 32, (2, 24), generator=g)
    labels = torch.randint(0, 32, (2, 24), generator=g)
    whole = _TinyModel().double()  # the reference: one process, SDPA itself, float64
    _loss(whole, tokens, labels).backward()
    model = _TinyModel().to(device)
    mesh = init_device_mesh(device.type, (world,))
    tok, lab = tokens.clone().to(device), labels.clone().to(device)
    with context_parallel(mesh, buffers=[tok, lab], buffer_seq_dims=[1, 1]), ring_sdpa():
        shard_shape = tuple(tok.shape)
        loss = _loss(model, tok, lab)
        loss.backward()
    restored = torch.equal(tok.cpu(), tokens)  # torch puts the buffers back after
    dist.all_reduce(loss.detach())
    lines = [f"shard {shard_shape}", f"restored {restored}"]
    got = loss.detach().cpu().double()
    want = _loss(whole, tokens, labels).detach()
    lines.append(f"loss sum {torch.allclose(got, want, rtol=1e-4)} {got.item():.6f} "
                 f"{want.item():.6f}")
    for (name, p), (_, w) in zip(model.named_parameters(), whole.named_parameters(),
                                 strict=True):
        grad = p.grad.detach().clone()
        dist.all_reduce(grad)  # the ranks' parts of each parameter's gradient
        err = (grad.cpu().double() - w.grad).abs().max().item()
        lines.append(f"grad {name} {err < 1e-4} {err:.2e}")
    return lines


def test_a_training_step_under_torch_context_parallel_matches_one_process(tmp_path):
    need_gpus(2)
    for rank, lines in enumerate(spawn(_train_body, 2, tmp_path)):
        assert lines[0] == "shard (2, 12)" and lines[1] == "restored True", lines
        checks = [line.split() for line in lines[2:]]
        assert len(checks) == 1 + 5 and all(c[2] == "True" for c in checks), (rank, lines)


def test_sdpa_modes_need_a_process_group_and_ulysses_a_chunk_count():
    from fusedattn.distributed import ring_sdpa, ulysses_sdpa
    from fusedattn.problem import ProblemError

    for mode in (ring_sdpa, ulysses_sdpa):
        with pytest.raises(ProblemError, match="init_process_group"), mode():
            pass
    with pytest.raises(ProblemError, match="chunks"):
        ulysses_sdpa(chunks=0)
