"""FlashAttention-2-style forward in Triton: query tiles x key tiles, tensor cores.

Each program owns BLOCK_M query rows of one (batch, head) and loops over BLOCK_N key tiles:

    m_i = -inf; l_i = 0; acc = 0                        # per row: max, sum, numerator
    for each key tile K_j, V_j:
        s     = (Q_i @ K_j^T) * scale * log2(e)         # tl.dot: [BLOCK_M, BLOCK_N]
        s     = where(key valid and (not causal or j <= i), s, -inf)
        m_new = max(m_i, rowmax(s))
        alpha = exp2(m_i - m_new); p = exp2(s - m_new) # exp2: log2(e) folded into the scale
        l_i   = l_i * alpha + rowsum(p)
        acc   = acc * alpha + p @ V_j                   # tl.dot
        m_i   = m_new
    O_i = acc / l_i;  LSE_i = (m_i + log2(l_i)) * ln(2)

exp2 instead of exp: exp(x) = exp2(x * log2(e)), and multiplying the scores once by
scale * log2(e) (1.44269504 = 1/ln 2) saves a multiply per element in the loop.

Unlike the row kernels, each K/V tile loaded into shared memory serves BLOCK_M query rows
(reuse across rows), and both products run on tensor cores (fp16, bf16, tf32, tf32x3; fp32
"ieee" runs them as FMA on CUDA cores). Layout `[B, H, S, D]` with any strides; GQA/MQA:
query head h reads K/V head h // (H / H_kv). Causal is top-left aligned
like `scaled_dot_product_attention(is_causal=True)`: query i sees keys j <= i; key tiles
wholly past the diagonal are not visited, and those wholly before it run without any mask:
`_key_tiles` is instantiated twice (unmasked whole tiles, then the diagonal/ragged ones), or
once, masking a tile only when it is on an edge (ONE_LOOP: half the code and compile time,
faster on short loops and fp32; `configs.single_key_loop` chooses).
Head dims up to 256: a power of two >= 16, padded (masked), or for fp16/bf16 two (or three)
power-of-two pieces where they are narrower than padding (D=80 as 64 + 16: each product is
one dot per piece; D=72 as 64 + 16 overlapping by 8 columns; `configs.head_dim_pieces`).
fp32 inputs use `input_precision="ieee"` (exact FMA) unless "tf32" or "tf32x3" is asked for.

HBM traffic per (batch, head), the fewest bytes: read Q, K, V once, write O (and LSE):
(2*Sq + 2*Sk) * D * itemsize (+ 4*Sq). K and V are re-read once per query tile, i.e.
ceil(Sq / BLOCK_M) times, from L2 when it holds them. FLOPs: 4 * Sq * Sk * D (half causal).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from fusedattn.configs import (
    CONFIGS,
    autotune_requested,
    decode_config,
    forward_config,
    head_dim_pieces,
    heads_per_program,
    prune_configs,
    single_key_loop,
)
from fusedattn.mode import kernel_launches
from fusedattn.precision import resolve
from fusedattn.tiles.common import (
    KVCache,
    Mask,
    Varlen,
    _scores,
    _spans,
    _visible,
    emulation_operands,
    index_dtype,
    row_alignment,
    shape_jit,
)
from fusedattn.tiles.splitkv import merge_splits


@triton.jit
def _tile(ptrs, rows_ok, cols_ok, MASKED: tl.constexpr, MIXED: tl.constexpr,
          PAD: tl.constexpr):
    """One tile of K or V: bounded by `rows_ok & cols_ok` (broadcastable) in the masked
    loops (MASKED, MIXED), by `cols_ok` alone where the head dim is padded, else not."""
    if MASKED or MIXED:
        return tl.load(ptrs, mask=rows_ok & cols_ok, other=0.0)
    elif PAD:
        return tl.load(ptrs, mask=cols_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _key_tiles(acc, acc2, acc3, l_i, m_i, b_q, b_q2, b_q3, p_k_base, p_v_base, p_pages,
               sk_b, sk_s, sk_d, sv_b, sv_s, sv_d, page, pos, offs_n, offs_d, mask_d, offs_d2,
               offs_d3, seq_k, qk_scale, cap, left, right, lo, hi, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAD_D: tl.constexpr,
               BLOCK_D2: tl.constexpr, BLOCK_D3: tl.constexpr, PRECISION: tl.constexpr,
               INDEX: tl.constexpr, ulo=0, uhi=0, MIXED: tl.constexpr = False):
    """Key tiles [lo, hi) of one query tile: the online-softmax update. MASKED=False for
    tiles wholly inside the keys and wholly visible to every row of the tile (no compare, no
    select per element, no bounds on the loads); MASKED=True for the tiles on a mask's edge
    (causal diagonal, window edge) and the ragged last one. PAD_D: the head dim is padded up
    to BLOCK_D (masked columns). BLOCK_D2 > 0: the head dim is split in pieces, columns
    [0, BLOCK_D) (`b_q`, `acc`), then BLOCK_D2 columns `offs_d2` (`b_q2`, `acc2`) and,
    where BLOCK_D3 > 0, BLOCK_D3 more `offs_d3` (`b_q3`, `acc3`), none padded or masked
    (the last may overlap the one before: `_forward_tile`), each product one dot per piece
    (`configs.head_dim_pieces`). PAGED: key j lives in page
    `pages[j // page]` of the cache (`sk_b`/`sv_b` the page stride), row j % page.
    MIXED=True: all of [lo, hi) in one loop, tiles outside [ulo, uhi) masked (a branch per
    tile), the loads always bounded."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        mask_n = keys < seq_k
        if PAGED:
            blk = tl.load(p_pages + keys // page, mask=mask_n, other=0).to(INDEX)
            k_rows = blk * sk_b + (keys % page) * sk_s
            v_rows = blk * sv_b + (keys % page) * sv_s
        else:
            first = tl.cast(start_n, INDEX)  # the tile's first row (INDEX bits); inside, 32
            k_rows = first * sk_s + offs_n * sk_s
            v_rows = first * sv_s + offs_n * sv_s
        b_kt = _tile(p_k_base + k_rows[None, :] + offs_d[:, None] * sk_d,  # [BLOCK_D, BLOCK_N]
                     mask_n[None, :], mask_d[:, None], MASKED, MIXED, PAD_D)
        qk = tl.dot(b_q, b_kt, input_precision=PRECISION)
        if BLOCK_D2 > 0:  # whole pieces: bounded by the keys alone
            b_kt2 = _tile(p_k_base + k_rows[None, :] + offs_d2[:, None] * sk_d,
                          mask_n[None, :], mask_n[None, :], MASKED, MIXED, False)
            qk = tl.dot(b_q2, b_kt2, qk, input_precision=PRECISION)
        if BLOCK_D3 > 0:
            b_kt3 = _tile(p_k_base + k_rows[None, :] + offs_d3[:, None] * sk_d,
                          mask_n[None, :], mask_n[None, :], MASKED, MIXED, False)
            qk = tl.dot(b_q3, b_kt3, qk, input_precision=PRECISION)
        s = _scores(qk, qk_scale, cap, SOFTCAP)
        edge = MASKED  # MASKED: every tile; MIXED: a tile outside the whole ones [ulo, uhi)
        if MIXED:
            edge = (start_n < ulo) | (start_n >= uhi)
        if edge:
            valid = _visible(pos[:, None], keys[None, :], seq_k, left, right, HAS_LEFT,
                             HAS_RIGHT)
            s = tl.where(valid, s, float("-inf"))
        if MASKED or MIXED:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row that has seen no key yet keeps m = -inf; its exponents subtract 0
            # instead (alpha = p = 0, never -inf - -inf = NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        b_v = _tile(p_v_base + v_rows[:, None] + offs_d[None, :] * sv_d,  # [BLOCK_N, BLOCK_D]
                    mask_n[:, None], mask_d[None, :], MASKED, MIXED, PAD_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=PRECISION)
        if BLOCK_D2 > 0:
            b_v2 = _tile(p_v_base + v_rows[:, None] + offs_d2[None, :] * sv_d,
                         mask_n[:, None], mask_n[:, None], MASKED, MIXED, False)
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(b_v2.dtype), b_v2,
                                                  input_precision=PRECISION)
        if BLOCK_D3 > 0:
            b_v3 = _tile(p_v_base + v_rows[:, None] + offs_d3[None, :] * sv_d,
                         mask_n[:, None], mask_n[:, None], MASKED, MIXED, False)
            acc3 = acc3 * alpha[:, None] + tl.dot(p.to(b_v3.dtype), b_v3,
                                                  input_precision=PRECISION)
        m_i = m_new
    return acc, acc2, acc3, l_i, m_i


@triton.jit
def _forward_tile(
    bh, start_m, q_start, k_start, seq_q, seq_k,
    p_q, p_k, p_v, p_o, p_lse, p_table,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_s, so_d, so_split, sl_b, sl_h, sl_split, st_b,
    n_heads, group, head_dim, qk_scale, cap, left, right, page, split_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_D3: tl.constexpr, OVERLAP: tl.constexpr,
    HAS_RIGHT: tl.constexpr, WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr, PAD_D: tl.constexpr,
    INDEX: tl.constexpr, HAS_LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    PAGED: tl.constexpr, PACK_GQA: tl.constexpr, SPLIT: tl.constexpr,
    ONE_LOOP: tl.constexpr,
):
    """Query tile `start_m` of row set `bh` (a (batch, head), or with PACK_GQA a (batch,
    K/V head)), its sequences starting at rows `q_start`/`k_start`: `_flash_fwd`'s work."""
    if PACK_GQA:
        b = bh // (n_heads // group)
        h_kv = bh % (n_heads // group)
    else:
        b = bh // n_heads
        h = bh % n_heads
        h_kv = h // group  # GQA: `group` query heads share one K/V head
    rows_total = seq_q * group if PACK_GQA else seq_q
    diag = seq_k - seq_q if BOTTOM_RIGHT else 0

    offs_r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if PACK_GQA:
        offs_m = offs_r // group
        heads = h_kv * group + offs_r % group
        first_pos = start_m * BLOCK_M // group
    else:
        offs_m = offs_r
        heads = offs_r * 0 + h
        first_pos = start_m * BLOCK_M
    mask_m = offs_r < rows_total
    mask_d = offs_d < head_dim
    pos = offs_m + diag
    last_pos = tl.minimum((start_m * BLOCK_M + BLOCK_M - 1) // (group if PACK_GQA else 1),
                          seq_q - 1) + diag

    row_q = (q_start + offs_m).to(INDEX)
    p_q_rows = p_q + b * sq_b + heads[:, None].to(INDEX) * sq_h + row_q[:, None] * sq_s
    b_q = tl.load(p_q_rows + offs_d[None, :] * sq_d, mask=mask_m[:, None] & mask_d[None, :],
                  other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # the head dim's further pieces: columns BLOCK_D .. + BLOCK_D2 .. + BLOCK_D3, the last
    # OVERLAP columns earlier where it is wider than what is left (its loads stay inside the
    # row, unmasked); Q's overlapped columns are zeros there, so they count once. A piece
    # that is not there passes the first's tensors, never read
    offs_d2, b_q2, acc2, offs_d3, b_q3, acc3 = offs_d, b_q, acc, offs_d, b_q, acc
    if BLOCK_D2 > 0:
        if BLOCK_D3 > 0:
            offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        else:
            offs_d2 = BLOCK_D - OVERLAP + tl.arange(0, BLOCK_D2)
        b_q2 = tl.load(p_q_rows + offs_d2[None, :] * sq_d,
                       mask=mask_m[:, None] & (offs_d2 >= BLOCK_D)[None, :], other=0.0)
        acc2 = tl.zeros((BLOCK_M, BLOCK_D2), tl.float32)
    if BLOCK_D3 > 0:
        offs_d3 = BLOCK_D + BLOCK_D2 - OVERLAP + tl.arange(0, BLOCK_D3)
        b_q3 = tl.load(p_q_rows + offs_d3[None, :] * sq_d,
                       mask=mask_m[:, None] & (offs_d3 >= BLOCK_D + BLOCK_D2)[None, :],
                       other=0.0)
        acc3 = tl.zeros((BLOCK_M, BLOCK_D3), tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)

    if PAGED:
        p_k_base = p_k + h_kv * sk_h
        p_v_base = p_v + h_kv * sv_h
    else:
        p_k_base = p_k + b * sk_b + h_kv * sk_h + k_start * sk_s
        p_v_base = p_v + b * sv_b + h_kv * sv_h + k_start * sv_s
    p_pages = p_table + b * st_b
    lo, ulo, uhi, hi = _spans(first_pos + diag, last_pos, seq_k, -left, right, BLOCK_N,
                              HAS_LEFT, HAS_RIGHT)
    if SPLIT:
        s0 = tl.program_id(2) * split_len
        lo = tl.maximum(lo, s0)
        hi = tl.maximum(tl.minimum(hi, s0 + split_len), lo)
        ulo = tl.minimum(tl.maximum(ulo, lo), hi)
        uhi = tl.maximum(tl.minimum(uhi, hi), ulo)
    if ONE_LOOP:  # one instantiation: edge tiles masked by a branch per tile
        acc, acc2, acc3, l_i, m_i = _key_tiles(
            acc, acc2, acc3, l_i, m_i, b_q, b_q2, b_q3, p_k_base, p_v_base, p_pages, sk_b,
            sk_s, sk_d, sv_b, sv_s, sv_d, page, pos, offs_n, offs_d, mask_d, offs_d2, offs_d3,
            seq_k,
            qk_scale, cap, left, right, lo, hi, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP,
            PAGED, PAD_D, BLOCK_D2, BLOCK_D3, PRECISION, INDEX, ulo, uhi, True)
    else:  # masked [lo, ulo) (a window's left edge), whole [ulo, uhi), masked [uhi, hi)
        for part in tl.static_range(3):  # unrolled: three instantiations of the loop
            start = lo if part == 0 else (ulo if part == 1 else uhi)
            stop = ulo if part == 0 else (uhi if part == 1 else hi)
            acc, acc2, acc3, l_i, m_i = _key_tiles(
                acc, acc2, acc3, l_i, m_i, b_q, b_q2, b_q3, p_k_base, p_v_base, p_pages, sk_b,
                sk_s, sk_d, sv_b, sv_s, sv_d, page, pos, offs_n, offs_d, mask_d, offs_d2,
                offs_d3, seq_k, qk_scale, cap, left, right, start, stop, BLOCK_N, part != 1,
                HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, PAD_D, BLOCK_D2, BLOCK_D3, PRECISION,
                INDEX)

    # a row that sees no key (a window past the keys, bottom-right with Sq > Sk, an empty
    # split) has l = 0: its output is 0 and its LSE -inf
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    split = tl.program_id(2).to(INDEX) if SPLIT else 0
    p_o_rows = (p_o + split * so_split + b * so_b + heads[:, None].to(INDEX) * so_h
                + row_q[:, None] * so_s)
    tl.store(p_o_rows + offs_d[None, :] * so_d, (acc / l_safe).to(p_o.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
    if BLOCK_D2 > 0:  # the overlapped columns come from the piece before
        tl.store(p_o_rows + offs_d2[None, :] * so_d, (acc2 / l_safe).to(p_o.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_d2 >= BLOCK_D)[None, :])
    if BLOCK_D3 > 0:
        tl.store(p_o_rows + offs_d3[None, :] * so_d, (acc3 / l_safe).to(p_o.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_d3 >= BLOCK_D + BLOCK_D2)[None, :])
    if WRITE_LSE:
        # natural-log LSE of the scaled scores: m and log2(l) are in base 2; * ln(2)
        tl.store(p_lse + split * sl_split + b * sl_b + heads.to(INDEX) * sl_h + row_q,
                 (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mask_m)


@shape_jit
def _flash_fwd(
    p_q, p_k, p_v, p_o, p_lse, p_cu_q, p_cu_k, p_seqlens_k, p_table,
    sq_b, sq_h, sq_s, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_s, so_d, so_split,
    sl_b, sl_h, sl_split, st_b,
    n_heads, group, seq_q, seq_k, head_dim, qk_scale, cap, left, right, page, split_len,
    bucket_q, bucket_k,  # autotune keys only: the sequence lengths' power-of-two buckets
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RIGHT: tl.constexpr, WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    PAD_D: tl.constexpr, INDEX: tl.constexpr,
    BLOCK_D2: tl.constexpr = 0, BLOCK_D3: tl.constexpr = 0, OVERLAP: tl.constexpr = 0,
    HAS_LEFT: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    BOTTOM_RIGHT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    SEQLENS_K: tl.constexpr = False, PAGED: tl.constexpr = False,
    PACK_GQA: tl.constexpr = False, SPLIT: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False, HEADS: tl.constexpr = 1, ALIGN: tl.constexpr = 1,
):
    """One query tile of one (batch, head) -- or, with PACK_GQA, rows r of one (batch, K/V
    head) that are (query r // group, head r % group), so one K/V tile serves the whole
    group (decode). HAS_RIGHT (an upper bound: causal and/or a window's right side) and
    HAS_LEFT bound the keys each row sees; BOTTOM_RIGHT places query i at i + Sk - Sq.
    VARLEN: sequence b is rows cu[b]..cu[b+1] of packed tensors; SEQLENS_K: key lengths
    per batch (a KV cache); PAGED: keys through a block table; SPLIT: program_id(2) takes
    keys [split * split_len, +split_len) and writes its normalised partial O and LSE for the
    merge (flash-decoding). HEADS > 1: program_id(1) takes HEADS (batch, head)s one after
    another (`[B, H, S, D]` only, HEADS dividing B * H): fewer, longer programs where
    sequences are short. ALIGN > 1: Q's, K's and V's strides (but the last) and the head dim
    came divided by ALIGN; multiplied back, Triton knows that every row starts on 16 bytes
    and the head-dim mask is constant over 16 bytes (the host checked,
    `common.row_alignment`), so it loads tiles 16 bytes at a time and pipelines them, and
    the head-dim pieces are right (`configs.head_dim_pieces`)."""
    if ALIGN > 1:
        head_dim = head_dim * ALIGN
        sq_b, sq_h, sq_s = sq_b * ALIGN, sq_h * ALIGN, sq_s * ALIGN
        sk_b, sk_h, sk_s = sk_b * ALIGN, sk_h * ALIGN, sk_s * ALIGN
        sv_b, sv_h, sv_s = sv_b * ALIGN, sv_h * ALIGN, sv_s * ALIGN
    if HAS_RIGHT and not HAS_LEFT:
        # the last query tiles see the most keys: launch them first, so the short tiles
        # fill the end of the grid instead of leaving SMs idle behind one long tile
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    if HEADS == 1:
        bh = tl.program_id(1).to(INDEX)  # int64 where b * stride can pass 2^31 (`index_dtype`)
        b = bh // (n_heads // group) if PACK_GQA else bh // n_heads
        q_start = b * 0
        k_start = b * 0
        if VARLEN:
            q_start = tl.load(p_cu_q + b).to(INDEX)
            seq_q = tl.load(p_cu_q + b + 1).to(INDEX) - q_start
            k_start = tl.load(p_cu_k + b).to(INDEX)
            seq_k = tl.load(p_cu_k + b + 1).to(INDEX) - k_start
        if SEQLENS_K:
            seq_k = tl.load(p_seqlens_k + b)
        if start_m * BLOCK_M >= (seq_q * group if PACK_GQA else seq_q):
            return  # varlen: this sequence is shorter than the longest
        _forward_tile(bh, start_m, q_start, k_start, seq_q, seq_k, p_q, p_k, p_v, p_o, p_lse,
                      p_table, sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h,
                      sv_s, sv_d, so_b, so_h, so_s, so_d, so_split, sl_b, sl_h, sl_split,
                      st_b, n_heads, group, head_dim, qk_scale, cap, left, right, page,
                      split_len, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_D3, OVERLAP,
                      HAS_RIGHT, WRITE_LSE, PRECISION, PAD_D, INDEX, HAS_LEFT, SOFTCAP,
                      BOTTOM_RIGHT, PAGED, PACK_GQA, SPLIT, ONE_LOOP)
    else:
        for i in range(HEADS):
            bh = (tl.program_id(1) * HEADS + i).to(INDEX)
            _forward_tile(bh, start_m, bh * 0, bh * 0, seq_q, seq_k, p_q, p_k, p_v, p_o,
                          p_lse, p_table, sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d,
                          sv_b, sv_h, sv_s, sv_d, so_b, so_h, so_s, so_d, so_split, sl_b,
                          sl_h, sl_split, st_b, n_heads, group, head_dim, qk_scale, cap,
                          left, right, page, split_len, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2,
                          BLOCK_D3, OVERLAP, HAS_RIGHT, WRITE_LSE, PRECISION, PAD_D, INDEX,
                          HAS_LEFT, SOFTCAP, BOTTOM_RIGHT, PAGED, PACK_GQA, SPLIT, ONE_LOOP)

# Autotune results saved in Triton's cache dir, so a fresh process (run-all starts several)
# does not time every config again; a keyword of newer Tritons, passed where it exists.
_CACHE = ({"cache_results": True}
          if "cache_results" in inspect.signature(triton.autotune).parameters else {})

# Only with FUSEDATTN_AUTOTUNE=1 (`configs.autotune_requested`): the table's config otherwise.
_flash_fwd_autotuned = triton.autotune(
    configs=CONFIGS,
    key=["bucket_q", "bucket_k", "BLOCK_D", "BLOCK_D2", "BLOCK_D3", "OVERLAP", "HAS_RIGHT",
         "PRECISION", "PAD_D"],
    prune_configs_by={"early_config_prune": prune_configs}, **_CACHE,
)(_flash_fwd)

def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor,
                  lse: torch.Tensor | None, is_causal: bool, scale: float,
                  precision: str, config: triton.Config | None = None,
                  mask: Mask | None = None, varlen: Varlen | None = None,
                  cache: KVCache | None = None, splits: int = 1, pack_gqa: bool = False):
    """Launch on validated `[B, H, S, D]` tensors (any strides); writes `out` (and `lse`,
    `[B, H, Sq] float32`); returns `(out, compiled kernel or None)`. `precision`: "ieee",
    "tf32" or "tf32x3", used for fp32 inputs only. The config is the table's
    (`configs.forward_config`), Triton's autotuner's with FUSEDATTN_AUTOTUNE=1, or `config`
    (for timing configs one by one, `fusedattn bench --configs`).

    `mask` (default: `is_causal` top-left) adds windows, softcap and bottom-right
    alignment; `varlen` takes packed sequences (q, k, v, out as `[1, H, total, D]` views,
    lse `[1, H, total_q]`); `cache` reads K/V from a KV cache; `splits` > 1 splits each
    sequence's keys across programs and merges their partials by LSE (flash-decoding);
    `pack_gqa` lets one program serve every query head of a K/V head."""
    mask = mask or Mask(causal=is_causal)
    heads, dim = q.shape[1], q.shape[3]
    heads_kv = k.shape[1]
    group = heads // heads_kv
    if varlen is not None:
        batch, seq_q, seq_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
    if cache is not None and cache.block_table is not None:
        seq_k = cache.block_table.shape[1] * k.shape[2]
    q, k, v = emulation_operands(q, k, v)
    # fp32: "ieee" (exact products) or "tf32"; fp16/bf16 feed the tensor cores as they are
    dot_precision = resolve(q.dtype, precision).dot  # None for fp16/bf16
    # rows on 16 bytes and a head dim of whole 16-byte words: the head dim may be split,
    # and the kernel is told so (`_flash_fwd`'s ALIGN) unless Triton sees it already
    # (strides and head dim multiples of 16, which it specialises on)
    align = row_alignment(q, k, v)
    align = align if dim % align == 0 else 1
    block_d, block_d2, block_d3 = head_dim_pieces(dim, precision=dot_precision,
                                                  aligned=align > 1)
    if all(x % 16 == 0 for t in (q, k, v) for x in t.stride()[:-1]) and dim % 16 == 0:
        align = 1
    rows = seq_q * group if pack_gqa else seq_q
    per_row = batch * (heads_kv if pack_gqa else heads)

    kernel, fixed = _flash_fwd, {}
    if config is None and autotune_requested() and mask == Mask(causal=is_causal) \
            and varlen is None and cache is None and splits == 1 and not pack_gqa:
        kernel = _flash_fwd_autotuned
    else:
        if config is None and (pack_gqa or splits > 1):
            bm, bn, warps, stages = decode_config(dim=dim, rows=rows, seq_k=seq_k,
                                                  programs=per_row, precision=dot_precision)
        elif config is None:
            bm, bn, warps, stages = forward_config(
                dim=dim, seq_q=rows, programs_per_tile_row=per_row,
                causal=mask.causal or mask.window is not None, precision=dot_precision)
        else:
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            warps, stages = config.num_warps, config.num_stages
        fixed = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        if splits > 1:
            split_len = triton.cdiv(triton.cdiv(seq_k, splits), bn) * bn
            splits = triton.cdiv(seq_k, split_len)
    if splits <= 1:
        splits, split_len = 1, 0

    # where the kernel writes: `out`/`lse`, or each split's fp32 partials, merged below
    target, target_lse = out, lse
    if splits > 1:
        target = torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)
        target_lse = torch.empty((splits, *out.shape[:3]), dtype=torch.float32,
                                 device=out.device)
    (qk_scale, cap, left, right), flags = mask.kernel_args(scale)
    if varlen is not None:
        batch_strides = (0, 0, 0, 0)  # q, k, v, out: sequences start at cu_q[b] / cu_k[b]
        seq_args = (varlen.cu_q, varlen.cu_k)
        lse_bh = (0, target_lse.stride(-2)) if target_lse is not None else (0, 0)
    else:
        batch_strides = (q.stride(0), k.stride(0), v.stride(0), target.stride(-4))
        seq_args = (q, q)  # unused pointers
        lse_bh = (target_lse.stride(-3), target_lse.stride(-2)) if target_lse is not None \
            else (0, 0)
    table = cache.block_table if cache is not None and cache.block_table is not None else None

    heads_each = 1
    if fixed and varlen is None and cache is None and splits == 1 and not pack_gqa:
        heads_each = heads_per_program(programs=per_row)
        fixed["HEADS"] = heads_each

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]), per_row // heads_each, splits)

    with kernel_launches():  # (merge_splits launches inside it too)
        compiled = kernel[grid](
            q, k, v, target, target_lse if target_lse is not None else target, *seq_args,
            cache.seqlens if cache is not None else q, table if table is not None else q,
            *(x // align for x in (batch_strides[0], *q.stride()[1:3])), q.stride(3),
            *(x // align for x in (batch_strides[1], *k.stride()[1:3])), k.stride(3),
            *(x // align for x in (batch_strides[2], *v.stride()[1:3])), v.stride(3),
            batch_strides[3], *target.stride()[-3:],
            target.stride(0) if splits > 1 else 0,
            *lse_bh, target_lse.stride(0) if splits > 1 else 0,
            table.stride(0) if table is not None else 0,
            heads, group, seq_q, seq_k, dim // align, qk_scale, cap, left, right,
            k.shape[2] if table is not None else 0, split_len,
            triton.next_power_of_2(seq_q), triton.next_power_of_2(seq_k),
            BLOCK_D=block_d, WRITE_LSE=target_lse is not None, PRECISION=dot_precision,
            PAD_D=block_d > dim, BLOCK_D2=block_d2, BLOCK_D3=block_d3,
            OVERLAP=block_d + block_d2 + block_d3 - dim if block_d2 else 0,
            INDEX=index_dtype(q, k, v, target, rows=target.numel() // max(dim, 1)),
            VARLEN=varlen is not None, SEQLENS_K=cache is not None, PAGED=table is not None,
            PACK_GQA=pack_gqa, SPLIT=splits > 1, ALIGN=align, **flags, **fixed,
            ONE_LOOP=single_key_loop(seq_k=seq_k, precision=dot_precision,
                                     has_left=flags.get("HAS_LEFT", False)),
        )
        if splits > 1:
            merge_splits(target, target_lse, out, lse)
    return out, compiled


def flops(batch: int, heads: int, seq_q: int, seq_k: int, dim: int, causal: bool) -> float:
    """4*B*H*Sq*Sk*D (two GEMMs of 2*Sq*Sk*D each); half of it when causal."""
    f = 4.0 * batch * heads * seq_q * seq_k * dim
    return f / 2 if causal else f

