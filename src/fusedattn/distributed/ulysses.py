"""Ulysses (DeepSpeed-Ulysses) and USP (Ulysses x ring, yunchang's unified sequence
parallelism) on fusedattn's kernels, forward and backward.

Ulysses: each of P ranks holds a contiguous shard of the sequence, `[B, H, S/P, D]`. One
all-to-all trades it for every token of H/P heads, `[B, H/P, S, D]`; `fusedattn.attention`
runs there on the whole sequence (so every mask, window, softcap and sink it takes is
exact), and a second all-to-all trades the output back to the rank's sequence shard. The
all-to-alls are differentiable (their backward is the reverse all-to-all), so the
gradients are `attention`'s own. GQA: K/V heads split over the ranks with their query
heads; where P does not divide the K/V heads but they divide P, each K/V head is
replicated P / H_kv times first (its gradient is the replicas' sum).

USP: a 2-D arrangement of P = U x R ranks, the Ulysses groups (U ranks) inside the ring
groups' positions. Within a Ulysses group the all-to-all gathers the group's shards into
the ring shard of its ring position, for H/U heads; `ring_attention` runs over the ring
group on those; the reverse all-to-all returns each rank's own shard. `usp_shard` cuts a
full sequence so (zigzag over the ring, as the causal ring wants, then contiguous over the
Ulysses group). The caller gives both groups (or a 2-D DeviceMesh); nothing is chosen here.

Cost per call (forward): two all-to-alls of q, k, v and O, each moving (P - 1) / P of the
tensor; Ulysses' attention has no P2P steps. The degree is bounded by the heads: H and the
K/V heads (after replication) divide by P.

Overlap (`ulysses_attention(..., chunks=C)`): the rank's H/P heads go in C groups, each
exchanged by its own all-to-all issued ahead (`async_op`), so that group c+1's q, k, v (and
group c-1's output) travel while group c's attention runs; the backward does the same with
dO and the gradients (`_Pipelined`). On NCCL the collectives run on NCCL's stream beside the
kernels; gloo (the CPU tests) runs them on its own threads. C = 1 is the plain exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fusedattn.distributed.ring import _check_shards, contiguous_shard, zigzag_shard
from fusedattn.problem import ProblemError


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` along dim 0 (equal splits), differentiable: the gradient
    goes back by the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk i of `x` (dim 0) to rank i; chunk j of the result from rank j. Both buffers
    contiguous: the collective reads and writes them as flat memory (`empty_like` of a
    permuted view would keep its strides)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _group_parts(x: torch.Tensor, world: int, chunks: int, c: int) -> torch.Tensor:
    """Head group c of `[B, H, s, D]` for every rank, `[P, B, H/(P*C), s, D]` contiguous:
    rank p's part holds heads p*H/P + c*H/(P*C) ... (C = 1: `_seq_to_heads`' parts)."""
    b, h, s, d = x.shape
    return x.reshape(b, world, chunks, h // (world * chunks), s, d)[:, :, c] \
        .transpose(0, 1).contiguous()


def _start(parts: torch.Tensor, group):
    """An all-to-all of `parts` along dim 0 issued without waiting: (its output, its
    work, `parts`, held until the work is waited on)."""
    out = torch.empty(parts.shape, dtype=parts.dtype, device=parts.device)
    return out, dist.all_to_all_single(out, parts, group=group, async_op=True), parts


def _as_heads(got: torch.Tensor) -> torch.Tensor:
    """A received `[P, B, h, s, D]` (dim 0: the rank whose tokens) as `[B, h, P*s, D]`."""
    world, b, h, s, d = got.shape
    return got.permute(1, 2, 0, 3, 4).reshape(b, h, world * s, d)


def _back_parts(x: torch.Tensor, world: int) -> torch.Tensor:
    """`[B, h, P*s, D]` as the parts that return each rank its tokens, `[P, B, h, s, D]`."""
    b, h, seq, d = x.shape
    return x.reshape(b, h, world, seq // world, d).permute(2, 0, 1, 3, 4).contiguous()


def _place(full: torch.Tensor, got: torch.Tensor, chunks: int, c: int) -> None:
    """Head group c of every rank, received `[P, B, h, s, D]`, into this rank's
    `[B, H, s, D]` (`_group_parts`' inverse)."""
    world, b, h, s, d = got.shape
    full.view(b, world, chunks, h, s, d)[:, :, c] = got.transpose(0, 1)


def _seq_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """`[B, H, s, D]` sequence shards -> `[B, H/P, P*s, D]`: this rank's heads, every rank's
    tokens in rank order."""
    return _as_heads(_AllToAll.apply(_group_parts(x, world, 1, 0), group))


def _heads_to_seq(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: `[B, H/P, P*s, D]` -> `[B, H, s, D]`."""
    got = _AllToAll.apply(_back_parts(x, world), group)  # [P, B, H/P, s, D], dim 0: heads
    world, b, hp, s, d = got.shape
    return got.transpose(0, 1).reshape(b, world * hp, s, d)


class _Pipelined(torch.autograd.Function):
    """Ulysses with its all-to-alls overlapping the attention (the module docstring): the
    rank's heads in `chunks` groups, group c+1's exchange issued before group c's
    attention runs and group c's output sent back behind it. Each group's attention,
    `attend(q, k, v, sinks)` (`attention`, or USP's ring), runs on leaves of its own, its
    graph saved for the backward (freed with the node's saved tensors, kept by
    retain_graph), which pipelines dO's exchange ahead of each group's gradients and
    theirs behind."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, world: int, chunks: int, attend):
        grads = any(ctx.needs_input_grad[:4])
        hs = q.shape[1] // (world * chunks)  # a group's query heads (its sinks' count)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))

        def send(c):  # group c's q, k and v on their way (each group's parts made then)
            return [_start(_group_parts(t, world, chunks, c), group) for t in (q, k, v)]

        pending, returns, graphs = send(0), [], []
        for c in range(chunks):
            ahead = send(c + 1) if c + 1 < chunks else None
            for _, work, _ in pending:
                work.wait()
            leaves = [_as_heads(got).requires_grad_(grads) for got, _, _ in pending]
            if sinks is not None:
                leaves.append(sinks[c * hs:(c + 1) * hs].detach().requires_grad_(grads))
            with torch.set_grad_enabled(grads):
                o = attend(*leaves[:3], leaves[3] if sinks is not None else None)
            returns.append(_start(_back_parts(o.detach(), world), group))
            graphs.append((o, leaves))
            pending = ahead
        for c, (got, work, _) in enumerate(returns):
            work.wait()
            _place(out, got, chunks, c)
        if grads:  # each group's graph saved as autograd saves tensors: kept for a
            # retain_graph backward, freed with this node's saved tensors otherwise
            ctx.save_for_backward(*(t for o, leaves in graphs for t in (o, *leaves)))
        ctx.group, ctx.world, ctx.chunks = group, world, chunks
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        group, world, chunks = ctx.group, ctx.world, ctx.chunks
        dq, dk, dv = (dout.new_empty(shape) for shape in ctx.shapes)
        dsinks = []
        pending = _start(_group_parts(dout, world, chunks, 0), group)
        returns = []
        saved = ctx.saved_tensors
        per = len(saved) // chunks  # a group's output and its 3 or 4 leaves
        for c in range(chunks):
            o, *leaves = saved[c * per:(c + 1) * per]
            ahead = (_start(_group_parts(dout, world, chunks, c + 1), group)
                     if c + 1 < chunks else None)
            pending[1].wait()
            got = torch.autograd.grad(o, leaves, _as_heads(pending[0]), retain_graph=True)
            returns.append([_start(_back_parts(g, world), group) for g in got[:3]])
            dsinks += got[3:]
            pending = ahead
        for c, sent in enumerate(returns):
            for full, (got, work, _) in zip((dq, dk, dv), sent, strict=True):
                work.wait()
                _place(full, got, chunks, c)
        return dq, dk, dv, torch.cat(dsinks) if dsinks else None, None, None, None, None


def _group_size(group, name: str) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise ProblemError(name, group, "a process group of an initialised torch.distributed "
                           "(torch.distributed.init_process_group first)")
    return dist.get_world_size(group)


def _checked(q, k, v, group, world: int, is_causal, scale, precision, chunks: int = 1,
             refused: ProblemError | None = None, also=None, **options) -> int:
    """Every rank's inputs valid and alike (`ring._check_shards`: one all_gather, so every
    rank raises the same error instead of waiting in an all-to-all), then `_heads`; the
    head groups of the overlap (`_chunks`) alike too. `refused`: a caller's own verdict
    against its arguments (`sdpa`'s modes'), told to every rank the same way. `also`:
    USP's ring group, which shares the Ulysses groups' verdicts (`_check_shards`)."""
    from fusedattn.api import _validate

    error = refused
    try:
        if error is not None:
            raise error
        _validate(q, k, v, is_causal, scale, True, precision, **options)
        replicas = _heads(q, k, world)
        _chunks(chunks, q.shape[1] // world, k.shape[1] * replicas // world)
    except ProblemError as err:
        error = err
    # (no zigzag here: Ulysses gathers whole rows, so an odd shard is fine; USP's ring
    # checks its own shards)
    _check_shards(q, k, group, is_causal, scale, precision, world, error,
                  extra=(("chunks", chunks if error is None else 0),), zigzag=False,
                  also=also)
    return replicas


def check_chunks(chunks) -> None:
    """`chunks` (the overlap's head groups) an int >= 1, wherever it is given (the entry
    points, Hugging Face's `sequence_parallel`)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ProblemError("chunks", chunks, "an int >= 1 (1: no overlap)")


def _chunks(chunks, heads: int, heads_kv: int) -> None:
    """`chunks` (`check_chunks`) dividing a rank's H/P query heads and its K/V heads (after
    replication): a group's query heads keep their K/V heads."""
    check_chunks(chunks)
    if heads % chunks or heads_kv % chunks:
        raise ProblemError("chunks", chunks, f"a divisor of a rank's {heads} query and "
                           f"{heads_kv} K/V heads (H / P and H_kv / P after replication)")


def _chunks_alone(chunks, q, k, ndim: int) -> None:
    """`_chunks` where one rank holds the whole sequence (a group of one): nothing to
    overlap, but the refusals a larger group would make, for q of the entry point's own
    rank `ndim` (`[B, H, S, D]`, or packed `[rows, H, D]`: the heads dim 1 in both); other
    shapes are left to the attention's own checks."""
    if q.dim() == ndim:
        _chunks(chunks, q.shape[1], k.shape[1])


def _heads(q, k, world: int) -> int:
    """Heads for a Ulysses degree `world`: q's divide by it; K/V heads too, or divide it
    (then replicated). Returns the replication of each K/V head (1: none)."""
    if q.dim() != 4:
        raise ProblemError("q.shape", tuple(q.shape), "[B, H, S/P, D] shards")
    heads, heads_kv = q.shape[1], k.shape[1]
    if heads % world:
        raise ProblemError("heads", heads, f"a multiple of the Ulysses degree {world} (each "
                           "rank takes H / P query heads)")
    if heads_kv % world == 0:
        return 1
    if world % heads_kv == 0:
        return world // heads_kv
    raise ProblemError("heads_kv", heads_kv, "a multiple or a divisor of the Ulysses degree "
                       f"{world} (divisors are replicated)")


def _replicated(k, v, sinks, group, world: int, replicas: int):
    """k and v with each K/V head replicated `replicas` times, and the sinks of this
    rank's heads (None stays None)."""
    if replicas > 1:
        k, v = (t.repeat_interleave(replicas, dim=1) for t in (k, v))
    if sinks is not None:
        sinks = sinks.chunk(world)[dist.get_rank(group)]
    return k, v, sinks


def _over_heads(q, k, v, sinks, group, world: int, replicas: int, chunks: int, attend):
    """Checked `[B, H, s, D]` sequence shards (`_checked`): `attend(qh, kh, vh, sinks)` on
    this rank's head shards of the whole sequence (K/V heads replicated first, the sinks
    its heads'), and its output back to the sequence shards; the exchanges overlapped with
    `attend` in `chunks` head groups (`_Pipelined`) where chunks > 1."""
    k, v, sinks = _replicated(k, v, sinks, group, world, replicas)
    if chunks > 1:
        return _Pipelined.apply(q, k, v, sinks, group, world, chunks, attend)
    return _heads_to_seq(attend(*(_seq_to_heads(t, group, world) for t in (q, k, v)), sinks),
                         group, world)


def _as_bhsd(t):
    """Packed `[rows, H, D]` as `[1, H, rows, D]` (a view); anything else as it is."""
    return t.permute(1, 0, 2)[None] if isinstance(t, torch.Tensor) and t.dim() == 3 else t


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`_as_bhsd`'s inverse: `[1, H, rows, D]` as `[rows, H, D]` (a view)."""
    return t[0].permute(1, 0, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                      is_causal: bool = False, scale: float | None = None,
                      precision: str | None = None,
                      window: tuple[int | None, int | None] | None = None,
                      softcap: float | None = None,
                      sinks: torch.Tensor | None = None, chunks: int = 1) -> torch.Tensor:
    """Attention over a sequence sharded contiguously across the ranks of `group` (default:
    the world), by Ulysses' all-to-alls (the module docstring).

    `q: [B, H, S/P, D]`, `k, v: [B, H_kv, S/P, D(v)]`, the same shapes on every rank, rank
    r holding tokens r*S/P .. (r+1)*S/P - 1 (`contiguous_shard`); H divides by P, and H_kv
    divides by P or divides P. Returns this rank's `[B, H, S/P, Dv]`, differentiable. The
    options are `fusedattn.attention`'s (top-left causal on the whole sequence, windows,
    softcap, `sinks: [H]` for all heads). A rank's bad inputs, or shapes that differ across
    the ranks, raise `ProblemError` on every rank (one all_gather compares them first, as
    `ring_attention` does). `chunks` > 1 overlaps the all-to-alls with the attention: the
    rank's H/P query heads (and its K/V heads) in that many groups, each exchanged while
    another's attention runs, forward and backward (built for eager mode: not tried under
    `torch.compile`); it divides both head counts."""
    return checked_ulysses(q, k, v, group, is_causal, scale, precision, window, softcap,
                           sinks, chunks)


def checked_ulysses(q, k, v, group, is_causal, scale, precision, window, softcap, sinks,
                    chunks: int, refused: ProblemError | None = None):
    """`ulysses_attention`'s body. `refused`: a caller's own verdict against its arguments
    (`sdpa.ulysses_sdpa`'s), told to every rank as the checks' own are."""
    from fusedattn.api import attention

    world = _group_size(group, "group")
    if world == 1:
        if refused is not None:
            raise refused
        _chunks_alone(chunks, q, k, 4)
        return attention(q, k, v, is_causal=is_causal, scale=scale, precision=precision,
                         enable_gqa=k.shape[1] != q.shape[1], window=window, softcap=softcap,
                         sinks=sinks)
    replicas = _checked(q, k, v, group, world, is_causal, scale, precision, chunks, refused,
                        window=window, softcap=softcap, sinks=sinks)

    def attend(qh, kh, vh, sinks):
        return attention(qh, kh, vh, is_causal=is_causal, scale=scale, precision=precision,
                         enable_gqa=kh.shape[1] != qh.shape[1], window=window, softcap=softcap,
                         sinks=sinks)

    return _over_heads(q, k, v, sinks, group, world, replicas, chunks, attend)


def ulysses_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, *, group=None,
                             is_causal: bool = False, scale: float | None = None,
                             precision: str | None = None,
                             window: tuple[int | None, int | None] | None = None,
                             softcap: float | None = None,
                             sinks: torch.Tensor | None = None,
                             chunks: int = 1) -> torch.Tensor:
    """Packed documents under Ulysses: `q: [total_q/P, H, D]`, `k, v: [total_k/P, H_kv, D]`,
    rank r holding rows r*total/P .. of the packed batch (`contiguous_shard(x, r, P,
    dim=0)`; pad the batch to a multiple of P, as a document of its own), and the whole
    batch's `cu_seqlens_q/k` and max lengths, the same on every rank. One all-to-all gives
    each rank every row of H/P heads, `attention_varlen` runs there (documents whole:
    causal per document, bottom-right; every rank the same work), and the output's rows go
    back. Returns this rank's `[total_q/P, H, Dv]`, differentiable. `chunks`: as
    `ulysses_attention`'s."""
    from fusedattn.varlen import attention_varlen

    options = dict(is_causal=is_causal, scale=scale, precision=precision, window=window,
                   softcap=softcap)
    world = _group_size(group, "group")
    if world == 1:
        _chunks_alone(chunks, q, k, 3)
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, sinks=sinks, **options)
    q, k, v = map(_as_bhsd, (q, k, v))
    replicas = _checked(q, k, v, group, world, is_causal, scale, precision, chunks,
                        window=window, softcap=softcap, sinks=sinks)

    def attend(qh, kh, vh, sinks):
        return _as_bhsd(attention_varlen(_as_rows(qh), _as_rows(kh), _as_rows(vh),
                                         cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, sinks=sinks, **options))

    return _as_rows(_over_heads(q, k, v, sinks, group, world, replicas, chunks, attend))


def usp_shard(x: torch.Tensor, ulysses_rank: int, ulysses: int, ring_rank: int, ring: int,
              dim: int = -2) -> torch.Tensor:
    """A rank's part of the full sequence `x` for `usp_attention`: its ring position's
    zigzag shard (`zigzag_shard` over the ring degree), cut contiguously over the Ulysses
    group (its Ulysses rank's piece). The length along `dim` must divide by 2 * ring *
    ulysses."""
    if x.shape[dim] % (2 * ring * ulysses):
        raise ProblemError("seq", x.shape[dim], f"a multiple of 2 * ring * ulysses = "
                           f"{2 * ring * ulysses} for USP shards")
    return contiguous_shard(zigzag_shard(x, ring_rank, ring, dim), ulysses_rank, ulysses, dim)


def _usp_groups(mesh, ulysses_group, ring_group):
    """(Ulysses group, ring group, Ulysses degree) from a 2-D mesh or the two groups."""
    if mesh is not None:
        if ulysses_group is not None or ring_group is not None:
            raise ProblemError("mesh", mesh, "a mesh or the two groups, not both")
        if getattr(mesh, "ndim", None) != 2:
            raise ProblemError("mesh", mesh, "a 2-D DeviceMesh: dim 0 Ulysses, dim 1 the ring")
        ulysses_group, ring_group = mesh.get_group(0), mesh.get_group(1)
    elif ulysses_group is None or ring_group is None:
        raise ProblemError("ulysses_group/ring_group", (ulysses_group, ring_group),
                           "both groups (or mesh=): USP chooses no split of its own")
    world = _group_size(ulysses_group, "ulysses_group")
    _group_size(ring_group, "ring_group")
    return ulysses_group, ring_group, world


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ulysses_group=None,
                  ring_group=None, mesh=None, is_causal: bool = False,
                  scale: float | None = None, precision: str | None = None,
                  sinks: torch.Tensor | None = None, chunks: int = 1) -> torch.Tensor:
    """USP: Ulysses over `ulysses_group` inside a ring over `ring_group` (the module
    docstring), or over a 2-D `DeviceMesh` `mesh` whose dim 0 is Ulysses and dim 1 the ring.
    `chunks` > 1 overlaps the Ulysses all-to-alls with the rings as `ulysses_attention`'s
    does (a ring a head group).

    `q: [B, H, S/P, D]`, `k, v: [B, H_kv, S/P, D]` shards cut by `usp_shard` (P = U x R);
    H divides by U, and H_kv divides by U or divides it. Returns this rank's
    `[B, H, S/P, D]`, differentiable. Causal masks run on the ring's zigzag shards; windows
    and softcap are not taken (the ring has neither); `sinks: [H]` are (each rank's ring
    takes its heads' sinks)."""
    ulysses_group, ring_group, world = _usp_groups(mesh, ulysses_group, ring_group)
    return checked_usp(q, k, v, ulysses_group, ring_group, world, is_causal, scale,
                       precision, sinks, chunks)


def checked_usp(q, k, v, ulysses_group, ring_group, world: int, is_causal, scale, precision,
                sinks, chunks: int, refused: ProblemError | None = None):
    """`usp_attention`'s body on its groups (`_usp_groups`). The Ulysses groups' checks
    share their verdicts over the ring group, so a refusal anywhere in the mesh is raised
    on every rank. `refused`: a caller's own verdict (`sdpa.usp_sdpa`'s)."""
    from fusedattn.distributed.ring import checked_ring, ring_attention

    if world == 1:
        if refused is None:
            _chunks_alone(chunks, q, k, 4)
        return checked_ring(q, k, v, ring_group, is_causal, scale, precision, sinks, refused)
    replicas = _checked(q, k, v, ulysses_group, world, is_causal, scale, precision, chunks,
                        refused, also=ring_group, sinks=sinks)

    def attend(qh, kh, vh, sinks):
        return ring_attention(qh, kh, vh, group=ring_group, is_causal=is_causal, scale=scale,
                              precision=precision, sinks=sinks)

    return _over_heads(q, k, v, sinks, ulysses_group, world, replicas, chunks, attend)


def usp_varlen_shard(x: torch.Tensor, cu_seqlens, ulysses_rank: int, ulysses: int,
                     ring_rank: int, ring: int, *, causal: bool = True) -> torch.Tensor:
    """A rank's rows of the packed batch `x` (`[total, ...]`) for `usp_attention_varlen`:
    its ring position's `varlen_shard` (each document in 2 * ring zigzag chunks, or ring
    chunks), cut contiguously over the Ulysses group (total / ring rows must divide by
    `ulysses`)."""
    from fusedattn.distributed.ring import varlen_shard

    rows = varlen_shard(x, cu_seqlens, ring_rank, ring, causal=causal)
    if rows.shape[0] % ulysses:
        raise ProblemError("cu_seqlens", f"{rows.shape[0]} rows a ring shard",
                           f"a multiple of ulysses = {ulysses} (pad the batch)")
    return contiguous_shard(rows, ulysses_rank, ulysses, dim=0)


def usp_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: torch.Tensor, max_seqlen: int, *, ulysses_group=None,
                         ring_group=None, mesh=None, is_causal: bool = False,
                         scale: float | None = None, precision: str | None = None,
                         sinks: torch.Tensor | None = None, chunks: int = 1) -> torch.Tensor:
    """Packed documents under USP: `usp_attention`'s groups (or mesh), q `[rows, H, D]`,
    k, v `[rows, H_kv, D]` cut by `usp_varlen_shard`, and the whole batch's `cu_seqlens`
    and `max_seqlen` on every rank (documents as `ring_attention_varlen` takes them). The
    Ulysses all-to-all gives each rank its ring shard's rows for H/U heads, the ring runs
    `ring_attention_varlen` on them, and the output's rows go back. Returns this rank's
    `[rows, H, D]`, differentiable. `chunks`: as `usp_attention`'s."""
    from fusedattn.distributed.ring import ring_attention_varlen

    ulysses_group, ring_group, world = _usp_groups(mesh, ulysses_group, ring_group)
    options = dict(group=ring_group, is_causal=is_causal, scale=scale, precision=precision)
    if world == 1:
        _chunks_alone(chunks, q, k, 3)
        return ring_attention_varlen(q, k, v, cu_seqlens, max_seqlen, sinks=sinks, **options)
    q, k, v = map(_as_bhsd, (q, k, v))
    replicas = _checked(q, k, v, ulysses_group, world, is_causal, scale, precision, chunks,
                        also=ring_group, sinks=sinks)

    def attend(qh, kh, vh, sinks):
        return _as_bhsd(ring_attention_varlen(_as_rows(qh), _as_rows(kh), _as_rows(vh),
                                              cu_seqlens, max_seqlen, sinks=sinks, **options))

    return _as_rows(_over_heads(q, k, v, sinks, ulysses_group, world, replicas, chunks,
                                attend))
