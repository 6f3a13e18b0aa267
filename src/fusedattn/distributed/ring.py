"""Context-parallel attention over a ring of ranks (torch.distributed: NCCL on GPUs, gloo
on CPUs), forward and backward, on fusedattn's kernels. Only the glue is here: the P2P
transfers are torch.distributed's (`batch_isend_irecv`), the attention of each block is
`fusedattn.attention`'s custom ops, and the blocks are merged by their LSE.

Each of P ranks holds a shard of the sequence, `[B, H, S/P, D]` for q, k and v. At step s
rank r attends its queries to the K/V shard of rank (r - s) mod P, while that shard's
successor is already in flight to it; after P steps every query has seen every key. The
partial outputs merge exactly:

    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward recomputes each block from the final `out` and `lse` (so P of a block is the
final softmax's, and delta = rowsum(dO * O) is the final one) and sends each K/V shard's
dK and dV around the ring with it, back to its owner after a last hop.

Causal attention uses zigzag shards: the sequence is cut into 2P chunks and rank r holds
chunks r and 2P-1-r (`zigzag_shard`), so every rank has as much work as every other. Then
its own shard is causal (top-left within the shard is exact), a shard from an earlier rank
is seen by all queries but only in its first chunk, and a shard from a later rank is seen
by the second query chunk only, wholly: each step is half a shard's worth of blocks. A
non-causal ring takes any equal split (`contiguous_shard` or zigzag).

Packed documents (`ring_attention_varlen`, `attention_varlen`'s layout) shard the same way
document by document (`varlen_shard`): every rank holds the zigzag chunks r and 2P-1-r of
every document, so the work is balanced whatever the documents' lengths, and each step's
blocks are the dense ring's, per document, through the varlen kernels.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch
import torch.distributed as dist

from fusedattn.api import as_sinks, batches, kernel_options
from fusedattn.precision import resolve
from fusedattn.problem import ProblemError

_NO_WINDOW = kernel_options(None, None)  # the ops' window and softcap arguments: none


def contiguous_shard(x: torch.Tensor, rank: int, world: int, dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s part of `x` cut into `world` equal pieces along `dim` (a view)."""
    return x.chunk(world, dim=dim)[rank]


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s zigzag part of the full sequence `x`: chunks `rank` and
    `2*world-1-rank` of 2*world equal chunks along `dim`, concatenated (a copy). The length
    along `dim` must divide by 2*world."""
    if x.shape[dim] % (2 * world):
        raise ProblemError("seq", x.shape[dim], f"a multiple of 2*P = {2 * world} for zigzag "
                           "shards")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard (rank order), the inverse of
    `zigzag_shard`."""
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim=dim)


def _blocks(rank: int, src: int, seq: int, causal: bool):
    """(query slice, key slice, causal) blocks of rank `rank`'s queries against the zigzag
    K/V shard of rank `src` (the module docstring says why these)."""
    every, half = slice(0, seq), seq // 2
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]
    if src < rank:
        return [(every, slice(0, half), False)]
    return [(slice(half, seq), every, False)]


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_PRECISION_CODES = {None: 0, "ieee": 1, "tf32": 2, "tf32x3": 3}


def _check_shards(q, k, group, causal: bool, scale: float | None, precision: str | None,
                  world: int, error: ProblemError | None, extra: tuple = (),
                  zigzag: bool = True, also=None) -> None:
    """Every rank the same shapes, dtype, scale, precision and is_causal, and no rank that
    refused its own inputs (one all_gather of 11 integers, and `extra`'s (name, int)
    pairs, which must agree too): every rank reaches the same verdict, so none waits on a
    raised one or computes with a disagreeing one. `zigzag`: causal shards must split in
    two (the ring's). `also`: a second group (USP's ring, crossing the Ulysses groups)
    whose ranks share their verdicts by one all_reduce, so that a refusal in one Ulysses
    group is raised in every one, not only in its own while the others wait in the ring."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    mine = torch.zeros(11 + len(extra), dtype=torch.int64)
    if error is None:
        exact_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        mine[1:] = torch.tensor([
            *q.shape, k.shape[-3], k.shape[-2], int(causal), _DTYPE_CODES[q.dtype],
            _PRECISION_CODES[precision],
            struct.unpack("<q", struct.pack("<d", exact_scale))[0],  # the float's bits
            *(value for _, value in extra)], dtype=torch.int64)
    else:
        mine[0] = 1
    mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    verdict = error if error is not None else _shards_verdict(
        [tuple(t.tolist()) for t in every], q, k, causal, world, extra, zigzag)
    if also is not None:  # (every rank of `also` takes part, whatever its own verdict)
        flag = torch.tensor([int(verdict is not None)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=also)
        if verdict is None and flag.item():
            verdict = ProblemError("shards", "a rank of another Ulysses group refused its "
                                   "inputs or disagreed", "valid inputs alike on every rank "
                                   "of the mesh (the ranks of that group raised why)")
    if verdict is not None:
        raise verdict


def _shards_verdict(rows: list, q, k, causal: bool, world: int, extra: tuple,
                    zigzag: bool) -> ProblemError | None:
    """`_check_shards`' verdict on the ranks' gathered rows (None: all is well)."""
    refused = [r for r, row in enumerate(rows) if row[0]]
    if refused:
        return ProblemError("shards", f"rank(s) {refused} refused their inputs",
                            "valid inputs on every rank (each refusing rank raised why)")
    if len(set(rows)) > 1:
        names = ("B", "H", "S/P", "D", "H_kv", "S_kv/P", "is_causal", "dtype", "precision",
                 "scale bits", *(name for name, _ in extra))
        differ = [n for i, n in enumerate(names) if len({row[1 + i] for row in rows}) > 1]
        return ProblemError("shards", f"ranks disagree on {', '.join(differ)}",
                            "the same [B, H, S/P, D], K/V heads, dtype, precision, scale and "
                            "is_causal on every rank")
    if q.shape[-2] != k.shape[-2]:
        return ProblemError("shards", (q.shape[-2], k.shape[-2]),
                            "q and k/v shards of one length on every rank")
    if zigzag and causal and q.shape[-2] % 2:
        return ProblemError("seq", q.shape[-2] * world, f"a multiple of 2*P = {2 * world} "
                            "(zigzag: two equal chunks per rank)")
    return None


def _exchange(tensors: list[torch.Tensor], group, rank: int, world: int):
    """Post sends of `tensors` to the next rank and receives of as many from the previous
    one; returns (requests, receive buffers)."""
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group else (rank - 1) % world
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _merge(out, lse, part_out, part_lse, qs):
    """Fold one block's (out, lse) into the running ones, rows `qs`, in fp32."""
    cur = lse[..., qs]
    new = torch.logaddexp(cur, part_lse)
    out[..., qs, :] = (out[..., qs, :] * torch.exp(cur - new)[..., None]
                       + part_out.float() * torch.exp(part_lse - new)[..., None])
    lse[..., qs] = new


class _Dense:
    """The ring's blocks of `[B, H, S/P, D]` shards (`_blocks`) through the dense ops."""

    def __init__(self, seq: int, causal: bool):
        self.seq, self.causal = seq, causal

    def blocks(self, rank: int, src: int):
        return _blocks(rank, src, self.seq, self.causal)

    def forward(self, q, k, v, block, scale, precision):
        """(part O, part LSE, query rows) of one block, as `_merge` takes them."""
        qs, ks, c = block
        part, part_lse = torch.ops.fusedattn.flash_fwd(
            q[..., qs, :], k[..., ks, :], v[..., ks, :], None, c, scale, precision,
            *_NO_WINDOW)  # None: no sinks
        return part, part_lse, qs

    def backward(self, dout, q, k, v, out, lse, block, scale, precision):
        """(query rows, key rows, dQ, dK, dV) of one block."""
        qs, ks, c = block
        dq, dk, dv, _ = torch.ops.fusedattn.flash_bwd(
            dout[..., qs, :], q[..., qs, :], k[..., ks, :], v[..., ks, :], out[..., qs, :],
            lse[..., qs].contiguous(), None, None, c, scale, precision,
            *_NO_WINDOW)  # no dLSE, no sinks
        return qs, ks, dq, dk, dv


class _Ring(torch.autograd.Function):
    """The ring's forward and backward on `[B, H, S/P, D]` shards (packed documents as
    `[1, H, rows, D]` views), its blocks and their kernels the `plan`'s (`_Dense`,
    `_Packed`)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, scale: float, precision: str, plan):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for step in range(world):
            if step < world - 1:  # the next shard travels while this one is computed
                reqs, (k_next, v_next) = _exchange([k_cur, v_cur], group, rank, world)
            for block in plan.blocks(rank, (rank - step) % world):
                _merge(out, lse, *plan.forward(q, k_cur, v_cur, block, scale, precision))
            if step < world - 1:
                _wait(reqs)
                k_cur, v_cur = k_next, v_next
        if sinks is not None:  # one more term of every row's sum, carrying no value
            with_sink = torch.logaddexp(lse, sinks[None, :, None])
            out *= torch.exp(lse - with_sink)[..., None]
            lse = with_sink
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.options = (group, scale, precision, plan)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        group, scale, precision, plan = ctx.options
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        dk_cur = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_cur = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(world):
            if step < world - 1:  # K/V travel on while their gradients are computed
                kv_reqs, (k_next, v_next) = _exchange([k_cur, v_cur], group, rank, world)
            for block in plan.blocks(rank, (rank - step) % world):
                qs, ks, dq_i, dk_i, dv_i = plan.backward(dout, q, k_cur, v_cur, out, lse,
                                                         block, scale, precision)
                dq[..., qs, :] += dq_i
                dk_cur[..., ks, :] += dk_i
                dv_cur[..., ks, :] += dv_i
            # dK, dV of src's shard follow it; after the last step one more hop brings
            # every shard's gradients home
            d_reqs, (dk_next, dv_next) = _exchange([dk_cur, dv_cur], group, rank, world)
            if step < world - 1:
                _wait(kv_reqs)
                k_cur, v_cur = k_next, v_next
            _wait(d_reqs)
            dk_cur, dv_cur = dk_next, dv_next
        dsinks = None
        if sinks is not None:  # this rank's rows' part
            from fusedattn.tiles.flash_bwd import sink_gradient

            dsinks = sink_gradient(sinks, lse, (dout.float() * out.float()).sum(-1))
        return (dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype), dsinks,
                None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                   is_causal: bool = False, scale: float | None = None,
                   precision: str | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of `group` (default: the world).

    `q: [B, H, S/P, D]`, `k, v: [B, H_kv, S/P, D]` (GQA when H_kv divides H), the same
    shapes on every rank; returns this rank's `[B, H, S/P, D]` of the output, differentiable
    for q, k and v. `is_causal=True` expects zigzag shards (`zigzag_shard`; S divisible by
    2P); a non-causal ring takes any equal split. A group of one rank is plain `attention`.
    The shapes, dtype, scale, precision and is_causal are compared across the ranks (one
    small all_gather per call): disagreeing ranks, or a rank whose own inputs are refused,
    give every rank a ProblemError, not a hang or a wrong result. Without an initialised
    process group: a ProblemError. `sinks: [H]` as in `attention` (added to each row's
    merged sum after the ring; their gradient is this rank's rows' part, summed over the
    ranks as any replicated parameter's is).
    """
    return checked_ring(q, k, v, group, is_causal, scale, precision, sinks)


def checked_ring(q, k, v, group, is_causal: bool, scale: float | None,
                 precision: str | None, sinks, refused: ProblemError | None = None):
    """`ring_attention`'s body. `refused`: a caller's own verdict against its arguments
    (`sdpa.ring_sdpa`'s), told to every rank as the ring's own checks are."""
    from fusedattn.api import _validate

    if not (dist.is_available() and dist.is_initialized()):
        raise ProblemError("group", group, "a process group of an initialised "
                           "torch.distributed (torch.distributed.init_process_group first)")
    world = dist.get_world_size(group)
    error = refused
    try:  # a rank that refuses its inputs tells the others before it raises
        if error is not None:
            raise error
        _validate(q, k, v, is_causal, scale, True, precision, sinks=sinks)
        if q.dim() != 4:
            raise ProblemError("q.shape", tuple(q.shape), "[B, H, S/P, D] shards")
        if v.shape[-1] != q.shape[-1]:
            raise ProblemError("v.shape", tuple(v.shape), "v's head dim equal to q's in the "
                               "ring (a head dim of its own runs in attention, "
                               "attention_varlen and attention_with_kvcache)")
    except ProblemError as err:
        error = err
    if world == 1:
        if error is not None:
            raise error
        from fusedattn.api import attention

        return attention(q, k, v, is_causal=is_causal, scale=scale, precision=precision,
                         enable_gqa=k.shape[-3] != q.shape[-3], sinks=sinks)
    _check_shards(q, k, group, is_causal, scale, precision, world, error)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (as_sinks(sinks), group, scale, resolve(q.dtype, precision).op,
            _Dense(q.shape[-2], is_causal))
    # past a grid's rows, in batches (`api.batches`), each its own ring: every rank has
    # the same shapes (checked above), so all split alike
    parts = batches(q.shape[0], q.shape[1])
    if parts is None:
        return _Ring.apply(q, k, v, *args)
    return torch.cat([_Ring.apply(q[part], k[part], v[part], *args) for part in parts])


# --- packed documents (varlen) through the ring -------------------------------------------

def _doc_bounds(cu_seqlens, world: int, causal: bool) -> list[int]:
    """The documents' offsets, each document's length checked to be a multiple of 2P
    (causal: zigzag chunks) or P."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    parts = 2 * world if causal else world
    odd = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True) if (b - a) % parts]
    if odd:
        raise ProblemError("cu_seqlens", f"document lengths {odd[:6]}",
                           f"every document's length a multiple of {parts} ("
                           f"{'2*P: zigzag, two chunks' if causal else 'P: one chunk'} per "
                           "rank; pad a document, or add one of padding)")
    return bounds


def _pieces(bounds: list[int], rank: int, world: int, causal: bool) -> list[tuple[int, int]]:
    """Rank `rank`'s (start, stop) rows of the packed batch: of each document, chunks rank
    and 2P-1-rank of 2P (causal), else chunk rank of P; documents in order."""
    parts = 2 * world if causal else world
    chunks = (rank, parts - 1 - rank) if causal else (rank,)
    return [(a + c * ((b - a) // parts), a + (c + 1) * ((b - a) // parts))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True) for c in chunks]


def varlen_shard(x: torch.Tensor, cu_seqlens, rank: int, world: int, *,
                 causal: bool = True) -> torch.Tensor:
    """Rank `rank`'s rows of the packed `x` (`[total, ...]`, documents at `cu_seqlens`) for
    `ring_attention_varlen`: each document in 2P zigzag chunks (causal; chunks rank and
    2P-1-rank) or P chunks (chunk rank), so every rank holds total/P rows and the same share
    of every document."""
    bounds = _doc_bounds(cu_seqlens, world, causal)
    return torch.cat([x[a:b] for a, b in _pieces(bounds, rank, world, causal)])


def varlen_unshard(shards: list[torch.Tensor], cu_seqlens, *,
                   causal: bool = True) -> torch.Tensor:
    """The packed batch back from every rank's `varlen_shard` (rank order)."""
    world = len(shards)
    bounds = _doc_bounds(cu_seqlens, world, causal)
    out = shards[0].new_empty((bounds[-1], *shards[0].shape[1:]))
    for rank, shard in enumerate(shards):
        rows = [torch.arange(a, b) for a, b in _pieces(bounds, rank, world, causal)]
        out[torch.cat(rows).to(out.device)] = shard
    return out


class _Layout(NamedTuple):
    """A rank's shard of packed documents: its offsets (cu // P), the offsets of each
    document's half (causal), the rows of those halves, and the longest of each."""
    cu: torch.Tensor
    cu_half: torch.Tensor
    first: torch.Tensor
    second: torch.Tensor
    longest: int
    longest_half: int


def _layout(bounds: list[int], world: int, causal: bool, device) -> _Layout:
    local = [b // world for b in bounds]
    halves, first, second = [b // 2 for b in local], [], []
    for a, b in zip(local[:-1], local[1:], strict=True):
        first.append(torch.arange(a, (a + b) // 2))
        second.append(torch.arange((a + b) // 2, b))
    lengths = [b - a for a, b in zip(local[:-1], local[1:], strict=True)]
    return _Layout(torch.tensor(local, dtype=torch.int32, device=device),
                   torch.tensor(halves, dtype=torch.int32, device=device),
                   torch.cat(first).to(device), torch.cat(second).to(device),
                   max(1, max(lengths)), max(1, max(lengths) // 2))


def _rows(t: torch.Tensor, rows) -> torch.Tensor:
    """Rows of a `[1, H, rows, D]` view as the varlen ops take them, `[n, H, D]`."""
    return t[0][:, rows].permute(1, 0, 2)


class _Packed:
    """The ring's blocks of packed documents (`_blocks` per document) through the varlen
    ops: (query rows, key rows, cu_q, cu_k, longest q, longest k, causal), rows a slice (all)
    or a half's rows (`_Layout`)."""

    def __init__(self, lay: _Layout, causal: bool):
        self.lay, self.causal = lay, causal

    def blocks(self, rank: int, src: int):
        lay, every = self.lay, slice(None)
        whole = (lay.cu, lay.cu, lay.longest, lay.longest)
        if not self.causal:
            return [(every, every, *whole, False)]
        if src == rank:
            return [(every, every, *whole, True)]
        if src < rank:  # every query of each document, the first chunk of src's
            return [(every, lay.first, lay.cu, lay.cu_half, lay.longest, lay.longest_half,
                     False)]
        return [(lay.second, every, lay.cu_half, lay.cu, lay.longest_half, lay.longest,
                 False)]

    def forward(self, q, k, v, block, scale, precision):
        qs, ks, cu_q, cu_k, max_q, max_k, c = block
        part, part_lse = torch.ops.fusedattn.varlen_fwd(
            _rows(q, qs), _rows(k, ks), _rows(v, ks), cu_q, cu_k, None, max_q, max_k, c,
            scale, precision, *_NO_WINDOW)
        return part.permute(1, 0, 2)[None], part_lse[None], qs

    def backward(self, dout, q, k, v, out, lse, block, scale, precision):
        qs, ks, cu_q, cu_k, max_q, max_k, c = block
        dq, dk, dv, _ = torch.ops.fusedattn.varlen_bwd(
            _rows(dout, qs), _rows(q, qs), _rows(k, ks), _rows(v, ks), _rows(out, qs),
            lse[0][:, qs].contiguous(), None, cu_q, cu_k, None, max_q, max_k, c, scale,
            precision, *_NO_WINDOW)
        return qs, ks, *(g.permute(1, 0, 2)[None] for g in (dq, dk, dv))


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: torch.Tensor, max_seqlen: int, *, group=None,
                          is_causal: bool = False, scale: float | None = None,
                          precision: str | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Packed documents (self-attention, `attention_varlen`'s layout) through the ring.

    `cu_seqlens` (int32, B + 1 offsets) and `max_seqlen` are the whole batch's, the same on
    every rank; each document's length a multiple of 2P (causal) or P. Rank r holds
    `varlen_shard(x, cu_seqlens, r, P, causal=is_causal)` of each of q `[total, H, D]`, k
    and v `[total, H_kv, D]`: of every document the zigzag chunks r and 2P-1-r (causal) or
    chunk r, so every rank has the same work whatever the documents' lengths. Each step
    attends this rank's rows to another's shard document by document (`attention_varlen`'s
    kernels, causal per document), merged by their LSE as `ring_attention` does. Returns this
    rank's rows of O `[total/P, H, D]`, differentiable for q, k, v (and `sinks: [H]`, this
    rank's rows' part). A group of one rank is `attention_varlen`."""
    from fusedattn.varlen import _checked, attention_varlen, check_cu_seqlens

    if not (dist.is_available() and dist.is_initialized()):
        raise ProblemError("group", group, "a process group of an initialised "
                           "torch.distributed (torch.distributed.init_process_group first)")
    world = dist.get_world_size(group)
    error, bounds = None, []
    try:  # a rank that refuses its inputs tells the others before it raises
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ProblemError("q.shape", tuple(getattr(q, "shape", ())),
                               "[total/P, H, D]: this rank's rows of the packed batch")
        cu_seqlens, max_seqlen = check_cu_seqlens("cu_seqlens", cu_seqlens,
                                                  q.shape[0] * world, None, max_seqlen)
        bounds = _doc_bounds(cu_seqlens, world, is_causal)
        local = torch.tensor([b // world for b in bounds], dtype=torch.int32,
                             device=cu_seqlens.device)
        _checked(q, k, v, local, local, max(1, max_seqlen // world),
                 max(1, max_seqlen // world), is_causal, None, None, scale, precision, True,
                 sinks)
        if v.shape[-1] != q.shape[-1]:
            raise ProblemError("v.shape", tuple(v.shape), "v's head dim equal to q's in the "
                               "ring")
    except ProblemError as err:
        error = err
    if world == 1:
        if error is not None:
            raise error
        return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                is_causal=is_causal, scale=scale, precision=precision,
                                sinks=sinks)
    # documents' offsets as (count, a checksum): every rank must hold the same batch
    digest = sum((i + 1) * b for i, b in enumerate(bounds)) % (1 << 61)
    as_4d = (lambda t: t.permute(1, 0, 2)[None]) if error is None else (lambda t: t)
    _check_shards(as_4d(q), as_4d(k), group, is_causal, scale, precision, world, error,
                  extra=(("cu_seqlens (count)", len(bounds)),
                         ("cu_seqlens (checksum)", digest)))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = _Ring.apply(*(t.permute(1, 0, 2)[None] for t in (q, k, v)), as_sinks(sinks), group,
                      scale, resolve(q.dtype, precision).op,
                      _Packed(_layout(bounds, world, is_causal, q.device), is_causal))
    return out[0].permute(1, 0, 2)
