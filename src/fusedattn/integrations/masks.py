"""A boolean attention mask as fusedattn's packed sequences, or not at all: the plan that the
Hugging Face integration computes once per model call (transformers' mask hook) and every
layer then uses (`MaskPlan.attend`).

A mask `[B, Sq, Sk]` (True: query i sees key j) is representable when, after dropping the
query rows that see no key and the keys that no query sees (with Sq == Sk, the query rows of
those keys too: padding tokens, whose outputs are zeros), each batch row is one sequence
(or, when queries and keys are the same tokens, several: packed documents) in which
compacted query i sees exactly the compacted keys j with

    p - left <= j <= p,    p = Sk_s - Sq_s + i    (bottom-right causal, an optional window)

That covers left and right padding in training, prefill and decode, chunked prefill after
a cache, a static cache's unused tail, packed documents (`position_ids` that restart), and
sliding windows on any of them. `plan_from_mask` checks the whole mask against that form,
element by element, and returns None for anything else (an arbitrary mask: the caller
refuses it or falls back). Keys kept in order keep causality: compaction only removes keys
that nobody sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedattn.varlen import attention_varlen, offsets_of


@dataclass(frozen=True)
class MaskPlan:
    """Which rows of `[B, Sq]` queries and `[B, Sk]` keys form each packed sequence:
    `q_index`/`k_index` index the flattened rows, sequence by sequence; `cu_q`/`cu_k` the
    int32 offsets; `left` the window's left side (None: unbounded)."""

    batch: int
    seq_q: int
    seq_k: int
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    left: int | None

    def attend(self, q, k, v, *, scale=None, softcap=None, sinks=None) -> torch.Tensor:
        """`q: [B, H, Sq, D]`, `k, v: [B, H_kv, Sk, D]` -> `[B, Sq, H, D]` (transformers'
        layout), zeros at the query rows that see no key (padding); `sinks` as
        `attention_varlen` takes them. Differentiable."""
        def packed(t, index):  # [B, H, S, D] -> [total, H, D], the plan's rows
            return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).index_select(0, index)

        out = attention_varlen(packed(q, self.q_index), packed(k, self.k_index),
                               packed(v, self.k_index), self.cu_q, self.cu_k, self.max_q,
                               self.max_k, is_causal=True, scale=scale, softcap=softcap,
                               window=None if self.left is None else (self.left, None),
                               sinks=sinks)
        full = out.new_zeros(self.batch * self.seq_q, *out.shape[1:])
        full = full.index_copy(0, self.q_index, out)
        return full.reshape(self.batch, self.seq_q, *out.shape[1:])


def _ranks(valid: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """For each valid element of `[B, S]`, its rank among the valid elements of its segment
    (segments are runs along S); -1 elsewhere."""
    flat = valid.reshape(-1).long()
    order = torch.cumsum(flat, 0) - flat  # valid elements before this one, all rows
    seg = segment.reshape(-1)
    first = torch.ones_like(flat, dtype=torch.bool)
    first[1:] = seg[1:] != seg[:-1]
    # each run's count at its start, carried on (counts never fall: cummax carries it)
    starts = torch.cummax(torch.where(first, order, 0), 0).values
    rank = order - starts
    return torch.where(valid.reshape(-1), rank, -1).reshape(valid.shape)


def plan_from_mask(mask: torch.Tensor) -> MaskPlan | None:
    """The plan of a boolean mask `[B, Sq, Sk]` or `[B, 1, Sq, Sk]`, or None when it is not
    of the form in the module docstring. One pass of tensor ops (the last, the check, on
    `[B, Sq, Sk]` booleans) and about ten scalar reads on the host, once per model call."""
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            return None
        mask = mask[:, 0]
    if mask.dim() != 3 or mask.dtype != torch.bool:
        return None
    batch, seq_q, seq_k = mask.shape
    q_valid, k_used = mask.any(-1), mask.any(-2)
    if not bool(q_valid.any()):
        return None  # no query sees any key: nothing to plan
    rows = torch.arange(batch, device=mask.device)[:, None]
    seg_q = rows.expand(batch, seq_q)
    seg_k = rows.expand(batch, seq_k)
    if seq_q == seq_k:
        # queries and keys the same tokens: a token that no query sees, not even its own,
        # is padding; its query row (transformers lets a right pad see the keys before it)
        # is dropped too, and gets zeros
        q_valid = q_valid & k_used
    shared = seq_q == seq_k and torch.equal(q_valid, k_used)
    if shared:
        # and packed documents: a new one wherever a token cannot see the valid token
        # before it (with a window of one key every token would be one; the check below
        # accepts that only where the mask says so)
        pos = torch.arange(seq_q, device=mask.device).expand(batch, seq_q)
        before = torch.full_like(pos, -1)  # the previous valid token's position, or -1
        before[:, 1:] = torch.cummax(torch.where(q_valid, pos, -1), 1).values[:, :-1]
        sees = torch.gather(mask, 2, before.clamp(min=0)[:, :, None])[:, :, 0] & (before >= 0)
        new_doc = q_valid & ~sees
        seg_q = seg_k = torch.cumsum(new_doc.reshape(-1).long(), 0).reshape(batch, seq_q)
    rank_q, rank_k = _ranks(q_valid, seg_q), _ranks(k_used, seg_k)
    flat_q, flat_k = q_valid.reshape(-1), k_used.reshape(-1)
    # per segment: how many queries and keys; segments in order of first appearance
    ids_q, len_q = torch.unique_consecutive(seg_q.reshape(-1)[flat_q], return_counts=True)
    ids_k, len_k = torch.unique_consecutive(seg_k.reshape(-1)[flat_k], return_counts=True)
    if not torch.equal(ids_q, ids_k):
        return None  # a segment with keys but no queries, or the reverse
    # each valid query's bottom-right position among its segment's keys
    seg_of_q = torch.repeat_interleave(torch.arange(len(ids_q), device=mask.device), len_q)
    shift = (len_k - len_q)[seg_of_q]
    pos_q = torch.full_like(rank_q, -1)
    pos_q.reshape(-1)[flat_q] = rank_q.reshape(-1)[flat_q] + shift
    if bool((pos_q.reshape(-1)[flat_q] < 0).any()):
        return None  # more queries than keys in a segment: not bottom-right causal
    # the window: the widest reach back that any query has (its first visible key)
    first_seen = torch.gather(rank_k, 1, mask.to(torch.uint8).argmax(-1))
    reach = torch.where(q_valid, pos_q - first_seen, 0)
    left = int(reach.max())
    if left >= int(pos_q.max()):
        left = None
    same = seg_q[:, :, None] == seg_k[:, None, :]
    implied = same & k_used[:, None, :] & q_valid[:, :, None] \
        & (rank_k[:, None, :] <= pos_q[:, :, None])
    if left is not None:
        implied &= rank_k[:, None, :] >= pos_q[:, :, None] - left
    if not torch.equal(implied, mask & q_valid[:, :, None]):  # dropped rows: padding
        return None
    index_q, cu_q, max_q = flat_q.nonzero()[:, 0], offsets_of(len_q), int(len_q.max())
    # the same tokens: one index and one offsets tensor for queries and keys (each layer's
    # call keys it once and `check_lengths` reads it once, not twice)
    index_k, cu_k, max_k = (index_q, cu_q, max_q) if shared else (
        flat_k.nonzero()[:, 0], offsets_of(len_k), int(len_k.max()))
    return MaskPlan(batch, seq_q, seq_k, index_q, index_k, cu_q, cu_k, max_q, max_k, left)


def plan_from_positions(position_ids: torch.Tensor, left: int | None) -> MaskPlan | None:
    """The plan of packed documents told by `position_ids [B, S]` that restart at 0 for
    each document (`DataCollatorWithFlattening`), causal within each, with a window's left
    side `left`; None where they never restart (one document a row: plain causal)."""
    if position_ids.dim() != 2:
        return None
    batch, seq = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True  # a row begins a document wherever its positions start
    if not bool(starts[:, 1:].any()):
        return None
    first = starts.reshape(-1).nonzero()[:, 0]
    lengths = torch.diff(first, append=first.new_tensor([batch * seq]))
    cu = offsets_of(lengths)
    index = torch.arange(batch * seq, device=position_ids.device)
    longest = int(lengths.max())
    return MaskPlan(batch, seq, seq, index, index, cu, cu, longest, longest, left)
