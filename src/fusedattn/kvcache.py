"""`fusedattn.attention_with_kvcache`: attention of new queries over a KV cache (decode and
chunked prefill), with the new keys appended in place.

    attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                           block_table=None, is_causal=True, window=None, softcap=None,
                           scale=None, return_lse=False, precision=None, splits=None,
                           check_lengths=True, sinks=None, descale_q=None,
                           descale_k=None, descale_v=None)

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
  keys up to itself. `window=(left, right)`, `softcap` and `sinks` as in `attention` (with
  split-KV, the merge adds the sinks).
- Split-KV (flash-decoding): the keys of each sequence are split across `splits` programs
  (default: a power of two that fills one wave of the SMs, and 1, one launch and no
  merge, where the batch's programs fill it alone: `configs.decode_splits`), each
  writes a normalised partial O and its LSE, and a merge kernel combines them by LSE. One
  K/V tile serves every query head of its GQA group (the group's heads are rows of one
  program).

Every bad input raises `ProblemError` before anything is written, so a cache is never left
half-updated. The checks that need the values of `cache_seqlens` and `block_table` cost one
device-to-host copy of each (`check_lengths=True`, the default):
- every length in `0..capacity - S_new`;
- every block a sequence uses (after the append) in `0..num_blocks - 1`;
- no block that this call's append writes is mapped anywhere else among the blocks in
  use: not by another sequence, not twice by the same one. Reading a shared block is
  fine (prefix caching: several sequences map one prompt's blocks), appending into one
  is refused, since the other sequences would then read the new rows.
Only those copies are repeated each call: the checks and decisions that read shapes,
dtypes, strides and options are kept per call key, as `check_lengths=False`'s are, and the
launches replayed. Index tensors of any strides are taken (copied contiguous first, so what
is checked is what the kernels read). The caches must not overlap each other or themselves (an
expanded, stride-0 cache is refused); caches made under `torch.inference_mode()` are
written like any other.

`check_lengths=False` skips the copies (a decode loop whose lengths are known good, CUDA
graphs): shapes, dtypes and options are still checked. Bad lengths or block indices are
then the caller's bug, with exactly these effects:
- a sequence whose append does not fit (a negative length, a length past
  `capacity - S_new`, a written block index out of range) is not appended at all; the
  others are, and no write lands outside the cache or in another sequence's rows;
- duplicate blocks are not detected: of two appends into one block, either may win;
- the attention reads `clamp(cache_seqlens + S_new, 0, capacity)` keys per sequence, and
  a block index out of range as the nearest real block (0 or num_blocks - 1): the output
  is then meaningless, but nothing is read outside the cache.
FP8 (e4m3) caches, as FlashAttention-3's `flash_attn_with_kvcache` takes them: q, the caches
and `k_new`/`v_new` all `float8_e4m3fn`, standing for q * descale_q, k * descale_k and
v * descale_v (`descale_q` None, one element or `[H]`; `descale_k`/`descale_v` None, one
element or `[H_kv]`, float32, as `attention` takes them). The append copies the e4m3 bytes;
O comes back in bfloat16. Head dims 64, 128 and 256. As in bf16 decode, one program serves
a whole GQA group (its query heads are rows of one tile, each row scaled by its own head's q
factor), so a K/V tile is read once a group. The kernel is the portable one's FP8 products
(P in e4m3, as `attention`'s FP8 forward); with `FUSEDATTN_FP8_DECODE=1` (opt-in until the
H200 has timed it), up to 32 query rows a K/V head (Sq x H / H_kv: decode, a few
speculative tokens) run `tiles.fp8_decode`'s instead: the products transposed, keys as
their M (K Q^T in e4m3; V^T P^T with V widened to fp16 in registers, P in fp16).

Returns O `[B, H, Sq, D]` (and the LSE `[B, H, Sq] float32`). Inference only: no autograd.
"""

from __future__ import annotations

import math

import torch
import triton

from fusedattn import dispatch
from fusedattn.api import (
    DTYPES,
    as_sinks,
    batches,
    call_key,
    check_options,
    elsewhere,
    fp8_descale,
    joined,
    new_outputs,
)
from fusedattn.launch import KeptPlan, Plans
from fusedattn.mode import DEVICE
from fusedattn.precision import resolve
from fusedattn.problem import (
    FP8,
    ProblemError,
    check_flag,
    check_fp8,
    check_index_tensor,
    check_qkv,
    check_resolved,
    check_sinks,
    clamp_window,
    is_int,
)
from fusedattn.tiles.append import append_to_cache
from fusedattn.tiles.common import KVCache, Mask


def _check_index(name: str, t: object, shape: tuple[int, ...] | None,
                 rank: int) -> torch.Tensor:
    t = check_index_tensor(name, t, DEVICE)
    if t.dim() != rank or (shape is not None and tuple(t.shape) != shape):
        raise ProblemError(name, tuple(t.shape),
                           f"a tensor of shape {shape}" if shape else f"a {rank}-D tensor")
    return t


def _self_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` may share memory: sorted by stride, each dimension
    (of size > 1) must step past everything the smaller ones reach (conservative: True
    where it cannot tell)."""
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True)
                               if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` may share an element (conservative: True where it cannot tell).
    Views of one storage with the same shape and strides, offset by `delta` elements, are
    apart when stacking them along a new dimension of stride `delta` leaves no overlap
    (`kv[:, 0]` and `kv[:, 1]` of one `[N, 2, H, page, D]` buffer)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size = a.element_size()
    spans = [(t.data_ptr(), t.data_ptr() + size * (1 + sum(
        (n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))) for t in (a, b)]
    if spans[0][1] <= spans[1][0] or spans[1][1] <= spans[0][0]:
        return False
    delta, rest = divmod(abs(a.data_ptr() - b.data_ptr()), size)
    if a.shape != b.shape or a.stride() != b.stride() or rest or delta == 0:
        return True
    return _self_overlaps(a.as_strided((2, *a.shape), (delta, *a.stride())))


def _validate(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
              check_lengths: bool, descales: tuple) -> tuple:
    """Check everything (the lengths and block table's values only with `check_lengths`;
    `descales`: FP8's factors, `problem.DESCALE_NAMES`); returns (capacity per sequence,
    S_new, cache_seqlens, block_table), the index tensors contiguous."""
    check_flag("check_lengths", check_lengths)
    check_qkv(q, k_cache, v_cache, device=DEVICE, ranks={4: "[B, H, S, D]"},
              dtypes=(*DTYPES, FP8))
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ProblemError("k_cache/v_cache shapes",
                           (tuple(k_cache.shape), tuple(v_cache.shape)),
                           "k and v alike but for the head dim")
    batch, heads, seq_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    if 0 in q.shape or 0 in k_cache.shape:
        raise ProblemError("shapes", (tuple(q.shape), tuple(k_cache.shape)),
                           "no zero-sized dimension")
    if heads % heads_kv:
        raise ProblemError("heads", (heads, heads_kv), "k/v heads dividing q heads")
    check_fp8(q, v_cache, descales, heads, heads_kv, False)
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ProblemError("k_cache.shape", tuple(k_cache.shape),
                               f"[B={batch}, H_kv, S_max, D] (or paged, with block_table)")
        capacity = k_cache.shape[2]
    else:
        block_table = _check_index("block_table", block_table, None, 2)
        if block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ProblemError("block_table.shape", tuple(block_table.shape),
                               f"[B={batch}, max_blocks >= 1]")
        capacity = block_table.shape[1] * k_cache.shape[2]
    cache_seqlens = _check_index("cache_seqlens", cache_seqlens, (batch,), 1)
    s_new = 0
    if (k_new is None) != (v_new is None):
        raise ProblemError("k_new/v_new", (k_new is None, v_new is None), "both or neither")
    if k_new is not None:
        rows = k_new.shape[2] if isinstance(k_new, torch.Tensor) and k_new.dim() == 4 else -1
        for name, t, d in (("k_new", k_new, dim), ("v_new", v_new, v_cache.shape[3])):
            want = (batch, heads_kv, rows, d)
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != want \
                    or rows < 1:
                raise ProblemError(f"{name}.shape", tuple(getattr(t, "shape", ())),
                                   f"[B={batch}, H_kv={heads_kv}, S_new >= 1, D={d}] (the "
                                   "cache's head dim), k_new and v_new of one S_new")
            if t.dtype != q.dtype or t.device != q.device:
                raise ProblemError(f"{name}.dtype", f"{t.dtype} on {t.device}",
                                   f"{q.dtype} on {q.device}, as q")
            check_resolved(name, t)
        s_new = rows
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _self_overlaps(t):
                raise ProblemError(f"{name}.stride", t.stride(), "a cache whose elements "
                                   "each have their own memory (not expanded, no stride 0)")
        if _share_memory(k_cache, v_cache):
            raise ProblemError("k_cache/v_cache", "tensors sharing memory",
                               "separate memory for K and V (the append writes both)")
    if check_lengths:
        _check_lengths(cache_seqlens, block_table, s_new, capacity, k_cache)
    return capacity, s_new, cache_seqlens, block_table


def _check_lengths(cache_seqlens, block_table, s_new: int, capacity: int, k_cache) -> None:
    """`check_lengths`' checks of the values (the lengths, the block table's entries): a
    device-to-host copy that waits for the GPU. Every call with `check_lengths` runs them,
    a call whose metadata's checks are kept (`_DECIDED`) too; `cache_seqlens` and
    `block_table` contiguous and checked for shape and dtype."""
    lengths = cache_seqlens.tolist()
    if min(lengths) < 0 or max(lengths) + s_new > capacity:
        raise ProblemError("cache_seqlens",
                           lengths if len(lengths) <= 16 else f"max {max(lengths)}",
                           f"0..{capacity - s_new} (the cache holds {capacity} rows per "
                           f"sequence{f', and {s_new} new ones are appended' if s_new else ''})")
    if block_table is not None:
        _check_blocks(block_table, cache_seqlens, s_new, k_cache.shape[0], k_cache.shape[2])


def _check_blocks(block_table, cache_seqlens, s_new: int, n_blocks: int, page: int) -> None:
    """Every block a sequence uses after the append in range, and no block this call's
    append writes mapped anywhere else among the blocks in use (the module docstring)."""
    # the blocks each sequence uses after the append: ceil((n + S_new) / page)
    used = torch.div(cache_seqlens + s_new + page - 1, page, rounding_mode="floor")
    slots = torch.arange(block_table.shape[1], device=block_table.device)
    pages = block_table[slots < used[:, None]]
    bad = pages[(pages < 0) | (pages >= n_blocks)].tolist()
    if bad:
        raise ProblemError("block_table", f"entries {bad[:8]}",
                           f"block indices in 0..{n_blocks - 1} for every block a sequence "
                           "uses")
    if not s_new:
        return
    first = torch.div(cache_seqlens, page, rounding_mode="floor")
    written = block_table[(slots >= first[:, None]) & (slots < used[:, None])]
    maps = torch.bincount(pages.long(), minlength=n_blocks)
    shared = torch.unique(written[maps[written.long()] > 1]).tolist()
    if shared:
        raise ProblemError("block_table", f"blocks {shared[:8]} appended to and mapped more "
                           "than once", "blocks that this call appends to mapped once among "
                           "the blocks in use (shared blocks may be read, not appended to)")


_DECIDED = Plans()  # `_decode_key` -> what the checks and decisions of a call gave


def decode_programs(batch: int, heads: int, seq_q: int, heads_kv: int) -> int:
    """A decode call's programs before its keys are split: a program's rows are a query tile
    (64 rows) of one GQA group's heads, packed."""
    return batch * heads_kv * triton.cdiv(seq_q * (heads // heads_kv), 64)


def chosen_splits(batch: int, heads: int, seq_q: int, heads_kv: int, capacity: int) -> int:
    """The split count a call with `splits=None` takes (`configs.decode_splits`)."""
    from fusedattn.configs import decode_splits

    return decode_splits(programs=decode_programs(batch, heads, seq_q, heads_kv),
                         seq_k=capacity)


def _decode_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, sinks,
                descales, options):
    """The metadata every check and decision of a call reads but `check_lengths`' checks of
    the values, which a call with it runs each time (`_check_lengths`): `api.call_key`'s,
    the caches' addresses too (the overlap checks read them); None for a call that takes
    the full path (a `check_lengths` that is not a bool among them: `_validate` says what
    is wrong)."""
    if type(options[-1]) is not bool or not (type(k_cache) is type(v_cache) is torch.Tensor):
        return None
    tensors = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, sinks,
               *descales)
    key = call_key(tensors, options[:1] + options[2:], options[1])
    # (the addresses after `call_key`, which has refused what has none: sparse tensors)
    return None if key is None else (key, k_cache.data_ptr(), v_cache.data_ptr())


def _in_batches(parts, q, k_cache, v_cache, seqlens, k_new, v_new, table, return_lse: bool,
                options: dict):
    """`attention_with_kvcache` over `parts` (`api.batches`) of the batch, joined, after
    the whole call's checks (with `check_lengths`, a block appended to in one part and
    read in another is refused): each part its sequences' rows of q, the lengths, the new
    keys and values, and of the cache (contiguous) or the block table (paged)."""
    got = []
    for part in parts:
        caches = (k_cache[part], v_cache[part]) if table is None else (k_cache, v_cache)
        got.append(attention_with_kvcache(
            q[part], *caches, cache_seqlens=seqlens[part],
            k_new=k_new[part] if k_new is not None else None,
            v_new=v_new[part] if v_new is not None else None,
            block_table=table[part] if table is not None else None, return_lse=return_lse,
            **options))
    return joined(got, return_lse)


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens: torch.Tensor, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None,
                           block_table: torch.Tensor | None = None, is_causal: bool = True,
                           window: tuple[int | None, int | None] | None = None,
                           softcap: float | None = None, scale: float | None = None,
                           return_lse: bool = False, precision: str | None = None,
                           splits: int | None = None, check_lengths: bool = True,
                           sinks: torch.Tensor | None = None,
                           descale_q: torch.Tensor | None = None,
                           descale_k: torch.Tensor | None = None,
                           descale_v: torch.Tensor | None = None):
    """Attention of new queries over a KV cache; see the module docstring."""
    if elsewhere(q):  # (`api.elsewhere`)
        with torch.cuda.device(q.device):
            return attention_with_kvcache(**locals())  # (only the parameters are local)
    descales = (descale_q, descale_k, descale_v)
    key = _decode_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, sinks,
                      descales, (is_causal, window, softcap, scale, return_lse, precision,
                                 splits, check_lengths))
    decided = _DECIDED.get(key) if key is not None else None
    if decided is None:
        from fusedattn.configs import tuned_table

        capacity, s_new, cache_seqlens, block_table = _validate(
            q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, check_lengths,
            descales)
        window, softcap = check_options(q, k_cache, v_cache, is_causal, scale, precision,
                                        window, softcap)
        check_flag("return_lse", return_lse)
        window = clamp_window(window, q.shape[2], capacity)
        check_sinks(sinks, q.shape[1], q.device)
        if splits is not None and (not is_int(splits) or not 1 <= splits <= 64):
            raise ProblemError("splits", splits, "None (chosen) or an int in 1..64")
        tuned_table()  # a malformed tuned table is refused here, before the cache is written
        if parts := batches(q.shape[0], k_cache.shape[1]):  # (the kernels pack the GQA group)
            return _in_batches(parts, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                               block_table, return_lse, dict(
                                   is_causal=is_causal, window=window, softcap=softcap,
                                   scale=scale, precision=precision, splits=splits,
                                   check_lengths=check_lengths, sinks=sinks,
                                   descale_q=descale_q, descale_k=descale_k,
                                   descale_v=descale_v))
        if splits is None:
            splits = chosen_splits(*q.shape[:3], k_cache.shape[1], capacity)
        # the last two: the plans of this key's calls (the attention's, below; the append's)
        decided = (capacity, s_new, window, softcap, splits, KeptPlan(), KeptPlan())
        if key is not None:
            _DECIDED.put(key, decided)
    else:  # checked before, on the same metadata: the values alone are left to check
        capacity, s_new, window, softcap, splits, *_ = decided
        cache_seqlens = cache_seqlens.contiguous()
        block_table = block_table.contiguous() if block_table is not None else None
        if check_lengths:
            _check_lengths(cache_seqlens, block_table, s_new, capacity, k_cache)
    kept_attention, kept_append = decided[-2:] if key is not None else (None, None)
    if s_new:
        append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity,
                        kept=kept_append)
    out, lse = new_outputs(q, v_cache, q.shape[:3] if return_lse else None)  # V's head dim
    descale = fp8_descale(q, descales, q.shape[1], k_cache.shape[1]) if q.dtype == FP8 \
        else None
    sinks = as_sinks(sinks)

    def launch(keep=None):
        # the kernel reads cache_seqlens + s_new keys, clamped to the capacity, through
        # block indices clamped to the cache (`tiles.common.KVCache`): unchecked lengths
        # and tables read inside the cache, and no torch op a call adds a launch
        dispatch.forward(
            q, k_cache, v_cache, out=out, lse=lse, is_causal=is_causal,
            scale=1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale),
            precision=resolve(q.dtype, precision).op,
            mask=Mask(causal=is_causal, window=window, softcap=softcap, bottom_right=True),
            cache=KVCache(cache_seqlens, block_table, added=s_new), splits=splits,
            pack_gqa=True, sinks=sinks, descale=descale, keep=keep)

    if key is None:  # (a call the full path takes each time: no plan kept)
        launch()
    else:  # the key settled the dispatch's plan key but for the context: the tensors made
        # here are fresh (O, the LSE, FP8's factors), the rest are the key's
        dispatch.kept_forward(kept_attention, dispatch.forward_inputs(
            q, k_cache, v_cache, out, lse, cache=(cache_seqlens, block_table), sinks=sinks,
            descale=descale), launch)
    return (out, lse) if return_lse else out
