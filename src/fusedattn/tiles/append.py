"""The KV-cache append: `k_new`, `v_new` `[B, H_kv, S_new, D]` (V's D may be its own)
written at rows `seqlens[b] ..` of each sequence of `k_cache`, `v_cache` (in place),
contiguous caches `[B, H_kv, S_max, D]` or paged ones `[num_blocks, H_kv, page, D]`
through a block table.

One launch writes K and V together, and a sequence is appended whole or not at all: its
programs first check that rows `seqlens[b] .. seqlens[b] + S_new - 1` lie inside the
sequence's capacity and, when paged, that every block they land in is in
`0..num_blocks - 1`. `attention_with_kvcache` refuses such inputs on the host before it
launches (the default, `check_lengths=True`); without that check (`check_lengths=False`) a
sequence that does not fit is skipped here, so a bad length or block index never writes
outside the cache, never wraps around into another sequence, and never leaves K written
and V not.

Traffic: read and write 2 * B * H_kv * S_new * D elements, plus one int per (row, block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedattn.launch import KeptPlan, Recording, settle_keys

BLOCK_S = 16  # new rows per program


@triton.jit
def _append_rows(p_kn, p_vn, p_kc, p_vc, p_lens, p_table,
                 skn_b, skn_h, skn_s, skn_d, svn_b, svn_h, svn_s, svn_d,
                 skc_b, skc_h, skc_s, skc_d, svc_b, svc_h, svc_s, svc_d, st_b,
                 n_heads_kv, s_new, capacity, n_blocks, page, head_dim, head_dim_v,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PAGED: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // n_heads_kv).to(tl.int64)
    h = (bh % n_heads_kv).to(tl.int64)
    start = tl.load(p_lens + b)
    # the sequence's append fits, or no program of it writes anything
    fits = ((start >= 0) & (start <= capacity - s_new)).to(tl.int32)  # 1: it does
    if PAGED:
        first = tl.where(fits != 0, start // page, 0)
        last = tl.where(fits != 0, (start + s_new - 1) // page + 1, 0)
        for j in range(first, last):  # every block the append writes is a real block
            blk = tl.load(p_table + b * st_b + j)
            fits = fits * ((blk >= 0) & (blk < n_blocks)).to(tl.int32)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)  # V's head dim may differ from K's
    mask_s = offs_s < s_new * fits  # none where it does not fit
    mask = mask_s[:, None] & (offs_d < head_dim)[None, :]
    mask_v = mask_s[:, None] & (offs_dv < head_dim_v)[None, :]
    rows = (start + offs_s).to(tl.int64)
    if PAGED:
        blk = tl.load(p_table + b * st_b + rows // page, mask=mask_s, other=0).to(tl.int64)
        k_rows = blk * skc_b + (rows % page) * skc_s
        v_rows = blk * svc_b + (rows % page) * svc_s
    else:
        k_rows = b * skc_b + rows * skc_s
        v_rows = b * svc_b + rows * svc_s
    offs_new = offs_s.to(tl.int64)
    k = tl.load(p_kn + b * skn_b + h * skn_h + offs_new[:, None] * skn_s
                + offs_d[None, :] * skn_d, mask=mask)
    v = tl.load(p_vn + b * svn_b + h * svn_h + offs_new[:, None] * svn_s
                + offs_dv[None, :] * svn_d, mask=mask_v)
    tl.store(p_kc + h * skc_h + k_rows[:, None] + offs_d[None, :] * skc_d, k, mask=mask)
    tl.store(p_vc + h * svc_h + v_rows[:, None] + offs_dv[None, :] * svc_d, v, mask=mask_v)


def append_to_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                    v_new: torch.Tensor, seqlens: torch.Tensor,
                    block_table: torch.Tensor | None, capacity: int,
                    kept: KeptPlan | None = None) -> None:
    """Write `k_new`, `v_new` into the caches at rows `seqlens[b] ..` (the module
    docstring); `seqlens [B]` and `block_table [B, max_blocks]` contiguous int32,
    `capacity` the rows each sequence has. `kept`: the plan a caller keeps for calls whose
    key settles every argument but the tensors' addresses (`attention_with_kvcache`'s
    `check_lengths=False` calls): replayed where it holds one (no pass through Triton's
    launch binding, issue 31), else recorded into it."""
    inputs = (k_new, v_new, k_cache, v_cache, seqlens, block_table)
    plan = kept.get(None) if kept is not None else None
    if plan is not None:
        plan(inputs)
        return
    batch, heads_kv, s_new, dim = k_new.shape
    table = block_table if block_table is not None else seqlens  # unused pointer
    recording = Recording(inputs)
    recording.launch(
        _append_rows, (batch * heads_kv, triton.cdiv(s_new, BLOCK_S)),
        k_new, v_new, k_cache, v_cache, seqlens, table,
        *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0) if block_table is not None else 0,
        heads_kv, s_new, capacity, k_cache.shape[0], k_cache.shape[2], dim,
        v_new.shape[3], BLOCK_S=BLOCK_S, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_DV=triton.next_power_of_2(v_new.shape[3]), PAGED=block_table is not None)
    if kept is not None:
        plan = recording.plan()
        kept.keep(None, [plan] if plan is not None else [])


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
