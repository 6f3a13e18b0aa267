"""Flash-decoding's merge: each split of a sequence's keys wrote a normalised partial O and
its LSE (`flash._flash_fwd` with SPLIT); one small kernel combines them by LSE."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedattn.launch import Recording, settle_keys


@triton.jit(do_not_specialize=["n_heads", "seq_q"])  # read only to find a row's sink
def _merge_splits(p_part, p_lse_part, p_o, p_lse, p_sinks, n_splits, rows, head_dim,
                  n_heads, seq_q, so_row, so_d, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr, SINKS: tl.constexpr):
    """Flash-decoding's merge of BLOCK_R rows and BLOCK_D columns of O: LSE = log sum_s
    exp(LSE_s) and O = sum_s exp(LSE_s - LSE) O_s, from the splits' normalised partials
    (fp32, rows contiguous: `[splits, rows, head_dim]` and `[splits, rows]`, rows in
    (batch, head, query) order). Every split's partial is loaded at once, a
    [SPLITS, BLOCK_R, BLOCK_D] block, and summed over the splits: no loop, so a merge of
    few rows (one long sequence: 32 rows of 64 splits) spreads over programs by columns
    instead of walking the splits one load at a time. SINKS: each row's head's sink joins
    the sum as one more term that carries no value. A row no split saw (and no sink) keeps
    O = 0, LSE = -inf. The LSE is written by the programs of the first columns."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SPLITS)
    mask_r = r < rows
    mask_s = offs_s < n_splits
    mask_d = offs_d < head_dim
    lse_s = tl.load(p_lse_part + offs_s[:, None].to(tl.int64) * rows + r[None, :],
                    mask=mask_s[:, None] & mask_r[None, :], other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    if SINKS:
        sink = tl.load(p_sinks + (r // seq_q) % n_heads, mask=mask_r, other=0.0)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe[None, :])                                   # [SPLITS, BLOCK_R]
    total = tl.sum(w, axis=0)
    if SINKS:
        total += tl.exp(sink - m_safe)
    rows_s = (offs_s[:, None] * rows + r[None, :]).to(tl.int64) * head_dim  # [SPLITS, BLOCK_R]
    part = tl.load(p_part + rows_s[:, :, None] + offs_d[None, None, :],
                   mask=(mask_s[:, None] & mask_r[None, :])[:, :, None]
                   & mask_d[None, None, :], other=0.0)          # [SPLITS, BLOCK_R, BLOCK_D]
    acc = tl.sum(part * w[:, :, None], axis=0)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(p_o + r[:, None].to(tl.int64) * so_row + offs_d[None, :] * so_d,
             out.to(p_o.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
    if WRITE_LSE:
        if tl.program_id(1) == 0:
            tl.store(p_lse + r, m_safe + tl.log(total), mask=mask_r)


MERGE_BLOCK = 2048  # a merge program's [SPLITS, BLOCK_R, BLOCK_D] block: 16 fp32 a thread


def merge_splits(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, launcher=None,
                 sinks: torch.Tensor | None = None) -> None:
    """Combine `part [splits, B, H, Sq, D] fp32` and `part_lse [splits, B, H, Sq]` into
    `out [B, H, Sq, D]` (rows contiguous) and `lse [B, H, Sq]` (or None), with `sinks`
    (`[H]` float32) where given. `launcher`: how to launch (`launch.Recording.launch`, the
    caller's plan), else Triton's own. A program takes up to 32 columns and as many rows
    (up to 16) as keep its block at `MERGE_BLOCK` elements."""
    launcher = launcher or Recording().launch
    splits, dim = part.shape[0], part.shape[-1]
    rows = part_lse[0].numel()
    block_d = min(32, max(16, triton.next_power_of_2(dim)))
    block_s = max(2, triton.next_power_of_2(splits))
    block_r = max(1, min(16, MERGE_BLOCK // (block_s * block_d)))
    launcher(
        _merge_splits, (triton.cdiv(rows, block_r), triton.cdiv(dim, block_d)), part,
        part_lse, out, lse if lse is not None else part_lse,
        sinks if sinks is not None else part_lse, splits, rows, dim, part_lse.shape[-2],
        part_lse.shape[-1], out.stride(-2), out.stride(-1), BLOCK_R=block_r, BLOCK_D=block_d,
        SPLITS=block_s, WRITE_LSE=lse is not None, SINKS=sinks is not None)


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
