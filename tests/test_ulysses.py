"""`fusedattn.distributed.ulysses_attention` (its all-to-alls overlapped with the attention
too) and its varlen form on 2 processes, and `usp_attention` on 4 (2 Ulysses x 2 ring,
overlapped too; gloo on CPUs in emulation, NCCL with a GPU per rank where there are enough)
against the float64 reference on the whole sequence: outputs and gradients, causal and not,
GQA and MQA (K/V heads replicated), windows and sinks through Ulysses, packed documents, and
the refusals every rank agrees on."""

import pytest
import torch

import fusedattn  # noqa: F401  (fix the mode before the workers are spawned)
from ranks import need_gpus, refusal, spawn, spawn_each


def _verdicts(name, got, want) -> list[str]:
    from fusedattn_lab.verify import check

    lines = []
    for part, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
        result = check(g.detach(), w)
        lines.append(f"{name} {part} {result.ok} {result.max_abs:.2e} "
                     f"{'; '.join(result.reasons)}")
    return lines


def _full(b, h, hk, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g) for n in (h, hk, hk, h)]


def _varlen_lines(name, rank: int, world: int, device, heads: int, heads_kv: int, seed: int,
                  **options) -> list[str]:
    """`ulysses_attention_varlen` on packed documents (one empty), causal per document,
    the rows split over the ranks: outputs and gradients against the float64 reference."""
    from fusedattn.distributed import contiguous_shard, ulysses_attention_varlen
    from fusedattn.reference import varlen_ref, varlen_ref_grads
    from fusedattn.varlen import offsets_of

    lengths = [5, 17, 0, 1, 7]
    cu = offsets_of(lengths)
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(sum(lengths), n, 16, generator=g)
            for n in (heads, heads_kv, heads_kv, heads)]
    q, k, v, dout = (contiguous_shard(t, rank, world, dim=0).contiguous().to(device)
                     .requires_grad_() for t in full)
    out = ulysses_attention_varlen(q, k, v, cu.to(device), cu.to(device), max(lengths),
                                   max(lengths), is_causal=True, **options)
    grads = torch.autograd.grad(out, (q, k, v), dout.detach())
    refs = (varlen_ref(*full[:3], cu, cu, causal=True),
            *varlen_ref_grads(*full[:3], full[3], cu, cu, causal=True))
    return _verdicts(name, (out, *grads),
                     [contiguous_shard(r, rank, world, dim=0) for r in refs])


def _ulysses_body(rank: int, world: int, device, results: str) -> list[str]:
    from fusedattn.distributed import contiguous_shard, ulysses_attention
    from fusedattn.reference import attention_ref, attention_ref_grads

    lines = []
    cases = [("gqa", 4, 2, dict(is_causal=False)), ("causal", 4, 2, dict(is_causal=True)),
             ("mqa-window-sinks", 4, 1, dict(is_causal=True, window=(5, None)))]
    for name, h, hk, opts in cases:
        full = _full(1, h, hk, 16, 16)
        sinks = torch.randn(h, generator=torch.Generator().manual_seed(7)) * 2 \
            if "sinks" in name else None
        q, k, v, dout = (contiguous_shard(t, rank, world).contiguous().to(device)
                         .requires_grad_() for t in full)
        leaves = (q, k, v)
        if sinks is not None:
            sinks_in = sinks.to(device).requires_grad_()
            leaves += (sinks_in,)
        out = ulysses_attention(q, k, v, sinks=sinks_in if sinks is not None else None,
                                **opts)
        grads = torch.autograd.grad(out, leaves, dout.detach())
        ref_opts = dict(causal=opts["is_causal"], window=opts.get("window"), sinks=sinks)
        ref = attention_ref(*full[:3], **ref_opts)
        refs = attention_ref_grads(*full[:3], full[3], **ref_opts)
        want = [contiguous_shard(r, rank, world) for r in (ref, *refs[:3])] + list(refs[3:])
        if sinks is not None:  # each rank has dsinks of its own heads: summed, all of them
            got_sinks = grads[3].detach().clone()
            torch.distributed.all_reduce(got_sinks)
            grads = (*grads[:3], got_sinks)
        lines += _verdicts(name, (out, *grads), want)
    # packed documents (an empty one too), causal per document, rows split over the ranks
    # (30 rows: 15 a rank, odd: no zigzag in Ulysses)
    lines += _varlen_lines("varlen", rank, world, device, 4, 2, seed=3)
    q = torch.zeros(1, 3, 8, 16, device=device)  # 3 heads: not divisible by 2
    lines.append(refusal("heads", lambda: ulysses_attention(q, q, q)))
    return lines


def _overlap_body(rank: int, world: int, device, results: str) -> list[str]:
    """`ulysses_attention(..., chunks=2)` (and its varlen form): outputs and gradients
    against the reference, its calls in the pipelined order, and the groups' refusals on
    every rank."""
    import fusedattn.api
    from fusedattn.distributed import contiguous_shard, ulysses, ulysses_attention
    from fusedattn.reference import attention_ref, attention_ref_grads

    lines = []
    # 8 heads over 2 ranks: 4 query and 2 K/V heads a rank, in 2 groups
    cases = [("overlap-gqa", dict(is_causal=False), False),
             ("overlap-causal-window-softcap-sinks",
              dict(is_causal=True, window=(6, None), softcap=3.0), True)]
    for name, opts, with_sinks in cases:
        full = _full(2, 8, 4, 16, 16, seed=4)
        sinks = torch.randn(8, generator=torch.Generator().manual_seed(8)) * 2 \
            if with_sinks else None
        q, k, v, dout = (contiguous_shard(t, rank, world).contiguous().to(device)
                         .requires_grad_() for t in full)
        leaves = (q, k, v)
        sinks_in = None
        if with_sinks:
            sinks_in = sinks.to(device).requires_grad_()
            leaves += (sinks_in,)
        out = ulysses_attention(q, k, v, sinks=sinks_in, chunks=2, **opts)
        grads = torch.autograd.grad(out, leaves, dout.detach())
        ref_opts = dict(causal=opts["is_causal"], window=opts.get("window"),
                        softcap=opts.get("softcap"), sinks=sinks)
        refs = attention_ref_grads(*full[:3], full[3], **ref_opts)
        want = [contiguous_shard(r, rank, world)
                for r in (attention_ref(*full[:3], **ref_opts), *refs[:3])] + list(refs[3:])
        if with_sinks:  # each rank has dsinks of its own heads: summed, all of them
            got_sinks = grads[3].detach().clone()
            torch.distributed.all_reduce(got_sinks)
            grads = (*grads[:3], got_sinks)
        lines += _verdicts(name, (out, *grads), want)
        with torch.no_grad():  # no graph kept: the same output
            again = ulysses_attention(q, k, v, sinks=sinks_in, chunks=2, **opts)
        lines.append(f"{name} no-grad-equal {torch.equal(again, out.detach())}")
    # packed documents (an empty one), causal per document, in two head groups
    lines += _varlen_lines("overlap-varlen", rank, world, device, 8, 4, seed=9, chunks=2)
    # the order the work is issued in: each exchange (s<heads>, its parts' heads a
    # group) ahead of the attention (a) it feeds, each result's sent behind it
    events, start, attend = [], ulysses._start, fusedattn.api.attention

    def logged_start(parts, group):
        events.append(f"s{parts.shape[2]}")
        return start(parts, group)

    def logged_attention(*args, **kwargs):
        events.append("a")
        return attend(*args, **kwargs)

    grad = torch.autograd.grad

    def logged_grad(*args, **kwargs):  # a group's backward (b)
        events.append("b")
        return grad(*args, **kwargs)

    ulysses._start, fusedattn.api.attention = logged_start, logged_attention
    torch.autograd.grad = logged_grad
    try:  # 4 query heads and 2 K/V heads a rank: 2 and 1 a group
        q = torch.randn(1, 8, 8, 16, device=device, requires_grad=True)
        kv = torch.randn(1, 4, 8, 16, device=device, requires_grad=True)
        out = ulysses_attention(q, kv, kv, chunks=2)
        lines.append("forward " + " ".join(events))
        events.clear()
        out.backward(torch.ones_like(out))
        lines.append("backward " + " ".join(events))
    finally:
        ulysses._start, fusedattn.api.attention = start, attend
        torch.autograd.grad = grad
    lines += _retained_lines(device, ulysses_attention)
    q = torch.zeros(1, 8, 8, 16, device=device)
    lines.append(refusal("three", lambda: ulysses_attention(q, q, q, chunks=3)))
    lines.append(refusal("kv", lambda: ulysses_attention(q, q[:, :2], q[:, :2], chunks=2)))
    lines.append(refusal("bool", lambda: ulysses_attention(q, q, q, chunks=True)))
    return lines


def _retained_lines(device, ulysses_attention) -> list[str]:
    """Two head groups' graphs: a retain_graph backward leaves them for a second one (the
    gradients add up), a plain one frees them while the output lives, and a backward after
    that is torch's own error."""
    import gc
    import weakref

    import fusedattn.api

    attend, inner = fusedattn.api.attention, []

    def kept_attention(*args, **kwargs):  # each group's output, watched
        o = attend(*args, **kwargs)
        inner.append(weakref.ref(o))
        return o

    fusedattn.api.attention = kept_attention
    try:
        q = torch.randn(1, 8, 8, 16, device=device, requires_grad=True)
        out = ulysses_attention(q, q, q, chunks=2, is_causal=True)
    finally:
        fusedattn.api.attention = attend
    out.sum().backward(retain_graph=True)
    once = q.grad.clone()
    out.sum().backward()
    gc.collect()
    lines = [f"retained twice {torch.allclose(q.grad, 2 * once)}",
             f"retained freed {len(inner) == 2 and all(o() is None for o in inner)}"]
    try:
        out.sum().backward()
        lines.append("retained third-backward ran")
    except RuntimeError as err:
        lines.append(f"retained third {'a second time' in str(err)}")
    return lines


def _usp_body(rank: int, world: int, device, results: str) -> list[str]:
    import torch.distributed as dist

    from fusedattn.distributed import usp_attention, usp_shard
    from fusedattn.reference import attention_ref, attention_ref_grads

    ulysses, ring = 2, 2
    # Ulysses groups {0, 1}, {2, 3}; ring groups {0, 2}, {1, 3} (every rank makes every group)
    u_groups = [dist.new_group([r * ulysses + u for u in range(ulysses)]) for r in range(ring)]
    r_groups = [dist.new_group([r * ulysses + u for r in range(ring)]) for u in range(ulysses)]
    u_rank, r_rank = rank % ulysses, rank // ulysses
    lines = []
    # (overlapped: 8 query and 4 K/V heads, 2 and 1 a Ulysses rank's head group)
    for name, causal, chunks in (("full", False, 1), ("causal", True, 1),
                                 ("overlap-causal", True, 2)):
        full = _full(1, 8 if chunks > 1 else 4, 4 if chunks > 1 else 2, 24, 16, seed=1)
        q, k, v, dout = (usp_shard(t, u_rank, ulysses, r_rank, ring).contiguous().to(device)
                         .requires_grad_() for t in full)
        out = usp_attention(q, k, v, ulysses_group=u_groups[r_rank],
                            ring_group=r_groups[u_rank], is_causal=causal, chunks=chunks)
        grads = torch.autograd.grad(out, (q, k, v), dout.detach())
        ref = attention_ref(*full[:3], causal=causal)
        refs = attention_ref_grads(*full[:3], full[3], causal=causal)
        want = [usp_shard(r, u_rank, ulysses, r_rank, ring) for r in (ref, *refs)]
        lines += _verdicts(name, (out, *grads), want)
    # the same over a 2-D DeviceMesh: dim 0 Ulysses ({0, 2}, {1, 3}), dim 1 the ring
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (ulysses, ring))
    u_rank, r_rank = rank // ring, rank % ring
    full = _full(1, 4, 2, 24, 16, seed=2)
    q, k, v = (usp_shard(t, u_rank, ulysses, r_rank, ring).contiguous().to(device)
               for t in full[:3])
    want = usp_shard(attention_ref(*full[:3], causal=True), u_rank, ulysses, r_rank, ring)
    lines += _verdicts("mesh", (usp_attention(q, k, v, mesh=mesh, is_causal=True),), (want,))
    # model code's SDPA calls on USP's shards (`usp_sdpa`): the same rows
    import torch.nn.functional as F

    from fusedattn.distributed import usp_sdpa

    with usp_sdpa(mesh):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    lines += _verdicts("mesh-sdpa", (got,), (want,))
    # a refusal in one Ulysses group is raised in every one: before, the other Ulysses
    # group went on into the ring and waited there for the refusing ranks (a hang)
    lines.append(refusal("disagree", lambda: usp_attention(
        q, k, v, mesh=mesh, scale=0.5 if rank == 0 else None)))
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=device)
    with usp_sdpa(mesh):
        lines.append(refusal("sdpa-mask", lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if rank == 3 else None, enable_gqa=True)))
    # sinks through USP (each ring takes its Ulysses heads' sinks)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)) * 2
    want = usp_shard(attention_ref(*full[:3], causal=True, sinks=sinks), u_rank, ulysses,
                     r_rank, ring)
    got = usp_attention(q, k, v, mesh=mesh, is_causal=True, sinks=sinks.to(device))
    lines += _verdicts("mesh-sinks", (got,), (want,))
    # packed documents (one empty) through USP: lengths divisible by 2 * ring, each ring
    # shard's rows by the Ulysses degree
    from fusedattn.distributed import usp_attention_varlen, usp_varlen_shard
    from fusedattn.reference import varlen_ref, varlen_ref_grads

    cu = torch.tensor([0, 8, 8, 32, 44], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(44, n, 16, generator=g) for n in (4, 2, 2, 4)]
    q, k, v, dout = (usp_varlen_shard(t, cu, u_rank, ulysses, r_rank, ring).contiguous()
                     .to(device).requires_grad_() for t in full)
    out = usp_attention_varlen(q, k, v, cu.to(device), 24, mesh=mesh, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout.detach())
    refs = (varlen_ref(*full[:3], cu, cu, causal=True),
            *varlen_ref_grads(*full[:3], full[3], cu, cu, causal=True))
    lines += _verdicts("varlen", (out, *grads),
                       [usp_varlen_shard(r, cu, u_rank, ulysses, r_rank, ring) for r in refs])
    return lines


def test_ulysses_and_its_overlapped_groups_match_the_reference(tmp_path):
    # both bodies on the ranks of one spawn: the plain all-to-alls, then the overlapped
    # head groups in the pipelined order
    need_gpus(2)
    ranks = spawn_each({"plain": _ulysses_body, "overlap": _overlap_body}, 2, tmp_path)
    for rank, lines in enumerate(ranks["plain"]):
        checks = [line.split() for line in lines if not line.startswith("heads")]
        assert len(checks) == 4 + 4 + 5 + 4 and all(c[2] == "True" for c in checks), \
            (rank, lines)
        assert any(line.startswith(("heads refused heads ", "heads refused shards "))
                   for line in lines), lines
    for rank, lines in enumerate(ranks["overlap"]):
        checks = [line.split() for line in lines if line.startswith("overlap")]
        assert len(checks) == 4 + 1 + 5 + 1 + 4 and all(c[2] == "True" for c in checks), \
            (rank, lines)
        # the forward: q, k, v of group 0 and of group 1 sent, group 0's attention, its
        # output sent, group 1's attention, its output sent; the backward: dO of both
        # groups sent, group 0's backward, its dq, dk, dv sent, group 1's backward, its
        # gradients sent
        assert "forward s2 s1 s1 s2 s1 s1 a s2 a s2" in lines, lines
        assert "backward s2 s2 b s2 s1 s1 b s2 s1 s1" in lines, lines
        # a retain_graph backward, a second one, the groups' graphs freed, then refused
        retained = [line.split() for line in lines if line.startswith("retained")]
        assert [r[1:] for r in retained] == [["twice", "True"], ["freed", "True"],
                                             ["third", "True"]], lines
        for label in ("three", "kv", "bool"):
            assert any(line.startswith(f"{label} refused chunks ") for line in lines), lines


def test_usp_on_two_by_two_matches_the_reference(tmp_path):
    need_gpus(4)
    for rank, lines in enumerate(spawn(_usp_body, 4, tmp_path)):
        checks = [line.split() for line in lines if not line.startswith(("disagree",
                                                                         "sdpa-mask"))]
        assert len(checks) == 19 and all(c[2] == "True" for c in checks), (rank, lines)
        starts = [" ".join(line.split()[:3]) for line in lines]
        assert "disagree refused shards" in starts, lines  # every rank, not rank 0 alone
        assert ("sdpa-mask refused attn_mask" if rank == 3
                else "sdpa-mask refused shards") in starts, lines


def test_usp_shards_and_its_refusals():
    from fusedattn.distributed import usp_attention, usp_shard, zigzag_shard
    from fusedattn.problem import ProblemError

    x = torch.arange(16.0).reshape(1, 1, 16, 1)
    # ring position 1 of 2 holds zigzag chunks 1 and 2 of 4; its Ulysses halves split them
    assert torch.equal(torch.cat([usp_shard(x, u, 2, 1, 2) for u in range(2)], -2),
                       zigzag_shard(x, 1, 2))
    with pytest.raises(ProblemError, match="seq"):
        usp_shard(x[..., :12, :], 0, 2, 0, 2)  # 12 does not divide by 2 * 2 * 2
    with pytest.raises(ProblemError, match="both groups"):
        usp_attention(x, x, x, ulysses_group=None, ring_group=None)
