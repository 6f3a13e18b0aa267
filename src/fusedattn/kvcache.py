"""`fusedattn.attention_with_kvcache`: attention of new queries over a KV cache (decode and
chunked prefill), with the new keys appended in place.

    attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                           block_table=None, is_causal=True, window=None, softcap=None,
                           scale=None, return_lse=False, precision=None, splits=None)

- `q: [B, H, Sq, D]`: the new queries.
- The cache is `[B, H_kv, S_max, D]`, or paged: `[num_blocks, H_kv, block_size, D]` with
  `block_table: [B, max_blocks] int32`, where row j of sequence b lives in block
  `block_table[b, j // block_size]`, row `j % block_size`.
- `cache_seqlens: [B] int32`: the keys already in the cache for each sequence.
- `k_new, v_new: [B, H_kv, S_new, D]` are written into the cache at rows
  `cache_seqlens[b] ..` (in place), and the attention then reads
  `cache_seqlens[b] + S_new` keys. `cache_seqlens` itself is not changed: the caller
  advances it (as with FlashAttention's `flash_attn_with_kvcache`).
- Queries are aligned bottom-right: query i of sequence b sits at position
  `cache_seqlens[b] + S_new - Sq + i`, so `is_causal=True` lets it see the cache and the new
  keys up to itself. `window=(left, right)` and `softcap` as in `attention`.
- Split-KV (flash-decoding): the keys of each sequence are split across `splits` programs
  (default: enough to give the SMs four programs each, `configs.decode_splits`), each
  writes a normalised partial O and its LSE, and a merge kernel combines them by LSE. One
  K/V tile serves every query head of its GQA group (the group's heads are rows of one
  program).

Every bad input raises `ProblemError` before anything is written, so a cache is never left
half-updated; checking the lengths and block table against the cache costs one
device-to-host copy of `cache_seqlens` (and of `block_table`). `check_lengths=False` skips
that copy (a decode loop whose lengths are known good, CUDA graphs): shapes, dtypes and
options are still checked, but lengths past the cache or block indices out of range are
then the caller's bug (they read or write outside the cache). Returns O `[B, H, Sq, D]`
(and the LSE `[B, H, Sq] float32`). Inference only: no autograd.
"""

from __future__ import annotations

import math

import torch
import triton

from fusedattn.api import DTYPES, check_options
from fusedattn.mode import DEVICE
from fusedattn.precision import resolve
from fusedattn.problem import ProblemError, check_index_tensor, check_qkv


def _check_index(name: str, t: object, shape: tuple[int, ...] | None, rank: int) -> None:
    check_index_tensor(name, t, DEVICE)
    if t.dim() != rank or (shape is not None and tuple(t.shape) != shape):
        raise ProblemError(name, tuple(t.shape),
                           f"a tensor of shape {shape}" if shape else f"a {rank}-D tensor")


def _validate(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
              check_lengths: bool) -> tuple:
    """Check everything (the lengths and block table only with `check_lengths`); returns
    (capacity per sequence, S_new)."""
    check_qkv(q, k_cache, v_cache, device=DEVICE, ranks={4: "[B, H, S, D]"}, dtypes=DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ProblemError("k_cache/v_cache shapes",
                           (tuple(k_cache.shape), tuple(v_cache.shape)), "k and v alike")
    batch, heads, seq_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    if 0 in q.shape or 0 in k_cache.shape:
        raise ProblemError("shapes", (tuple(q.shape), tuple(k_cache.shape)),
                           "no zero-sized dimension")
    if heads % heads_kv:
        raise ProblemError("heads", (heads, heads_kv), "k/v heads dividing q heads")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ProblemError("k_cache.shape", tuple(k_cache.shape),
                               f"[B={batch}, H_kv, S_max, D] (or paged, with block_table)")
        capacity = k_cache.shape[2]
    else:
        _check_index("block_table", block_table, None, 2)
        if block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ProblemError("block_table.shape", tuple(block_table.shape),
                               f"[B={batch}, max_blocks >= 1]")
        capacity = block_table.shape[1] * k_cache.shape[2]
    _check_index("cache_seqlens", cache_seqlens, (batch,), 1)
    s_new = 0
    if (k_new is None) != (v_new is None):
        raise ProblemError("k_new/v_new", (k_new is None, v_new is None), "both or neither")
    if k_new is not None:
        want = (batch, heads_kv, k_new.shape[2] if k_new.dim() == 4 else -1, dim)
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != want \
                    or want[2] < 1:
                raise ProblemError(f"{name}.shape", tuple(getattr(t, "shape", ())),
                                   f"[B={batch}, H_kv={heads_kv}, S_new >= 1, D={dim}], "
                                   "both alike")
            if t.dtype != q.dtype or t.device != q.device:
                raise ProblemError(f"{name}.dtype", f"{t.dtype} on {t.device}",
                                   f"{q.dtype} on {q.device}, as q")
        s_new = want[2]
    if not check_lengths:
        return capacity, s_new
    lengths = cache_seqlens.tolist()
    if min(lengths) < 0 or max(lengths) + s_new > capacity:
        raise ProblemError("cache_seqlens", lengths if batch <= 16 else f"max {max(lengths)}",
                           f"0..{capacity - s_new} (the cache holds {capacity} rows per "
                           f"sequence{f', and {s_new} new ones are appended' if s_new else ''})")
    if block_table is not None:
        # the blocks each sequence uses after the append: ceil((n + S_new) / block_size)
        used = torch.div(cache_seqlens + s_new + k_cache.shape[2] - 1, k_cache.shape[2],
                         rounding_mode="floor")
        in_use = torch.arange(block_table.shape[1], device=block_table.device) < used[:, None]
        pages = block_table[in_use]
        bad = pages[(pages < 0) | (pages >= k_cache.shape[0])].tolist()
        if bad:
            raise ProblemError("block_table", f"entries {bad[:8]}",
                               f"block indices in 0..{k_cache.shape[0] - 1} for every block "
                               "a sequence uses")
    return capacity, s_new


def _append(caches: tuple[torch.Tensor, ...], news: tuple[torch.Tensor, ...],
            seqlens: torch.Tensor, block_table: torch.Tensor | None) -> None:
    """Write each `new [B, H_kv, S_new, D]` at rows seqlens[b].. of each sequence of its
    cache, in place (the indices computed once for K and V)."""
    batch, _, s_new, _ = news[0].shape
    rows = seqlens.long()[:, None] + torch.arange(s_new, device=seqlens.device)[None, :]
    if block_table is None:
        index = (torch.arange(batch, device=rows.device)[:, None].expand_as(rows), rows)
    else:
        block = caches[0].shape[2]
        index = (torch.gather(block_table.long(), 1, rows // block), rows % block)
    for cache, new in zip(caches, news, strict=True):
        cache[index[0], :, index[1]] = new.permute(0, 2, 1, 3)  # [B, S_new, H_kv, D]


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens: torch.Tensor, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None,
                           block_table: torch.Tensor | None = None, is_causal: bool = True,
                           window: tuple[int | None, int | None] | None = None,
                           softcap: float | None = None, scale: float | None = None,
                           return_lse: bool = False, precision: str | None = None,
                           splits: int | None = None, check_lengths: bool = True):
    """Attention of new queries over a KV cache; see the module docstring."""
    from fusedattn.configs import decode_splits
    from fusedattn.tiles.common import KVCache, Mask
    from fusedattn.tiles.flash import flash_forward

    window, softcap = check_options(q, k_cache, v_cache, is_causal, scale, precision, window,
                                    softcap)
    capacity, s_new = _validate(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                block_table, check_lengths)
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or not 1 <= splits <= 64):
        raise ProblemError("splits", splits, "None (chosen) or an int in 1..64")
    if s_new:
        _append((k_cache, v_cache), (k_new, v_new), cache_seqlens, block_table)
    batch, heads, seq_q, dim = q.shape
    group = heads // k_cache.shape[1]
    seqlens = (cache_seqlens + s_new).to(torch.int32)
    if splits is None:
        rows = seq_q * group
        splits = decode_splits(programs=batch * k_cache.shape[1] * triton.cdiv(rows, 64),
                               seq_k=capacity)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device) \
        if return_lse else None
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    flash_forward(q, k_cache, v_cache, out=out, lse=lse, is_causal=is_causal, scale=scale,
                  precision=resolve(q.dtype, precision).op,
                  mask=Mask(causal=is_causal, window=window, softcap=softcap,
                            bottom_right=True),
                  cache=KVCache(seqlens, block_table), splits=splits, pack_gqa=True)
    return (out, lse) if return_lse else out
