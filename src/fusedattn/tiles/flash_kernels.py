"""The forward's Triton kernel (`flash.py` launches it; its docstring has the algorithm):
`_flash_fwd`, one query tile of one (batch, head), with its key loop `_key_tiles` and the
tile loads `_tile`. Its flags come from the arguments by `triton.heuristics` (the mask's
from `common.MASK_FLAGS`), the sequence offsets from `common._sequence`, shared with the
backward."""

import triton
import triton.language as tl

from fusedattn.launch import settle_keys
from fusedattn.mode import EMULATION
from fusedattn.tiles.common import (
    FP8_P_SCALE,
    MASK_FLAGS,
    _scores,
    _sequence,
    _spans,
    _visible,
    shape_jit,
)

P_SCALE = tl.constexpr(FP8_P_SCALE)
# Triton's interpreter converts fp32 to e4m3 wrongly where rounding up carries out of the
# mantissa (124.7 became 64, not 128: the carry is ORed into the exponent; triton 3.7's
# `interpreter._convert_float`), so there P is rounded to e4m3's 3 mantissa bits in fp32
# first (`_round_e4m3`) and converts exactly; the GPU's conversion rounds right by itself
ROUND_E4M3 = tl.constexpr(EMULATION)


@triton.jit
def _p_as(p, dtype: tl.constexpr):
    """P as the P.V product takes it in V's dtype: float8 at P_SCALE (O's epilogue divides
    it out, with descale_v), else P itself."""
    if dtype.is_fp8():
        p = p * P_SCALE
        if ROUND_E4M3:
            p = _round_e4m3(p)
        return p.to(dtype, fp_downcast_rounding="rtne")
    return p.to(dtype)


@triton.jit
def _round_e4m3(x):
    """x >= 0 (fp32) rounded to nearest even at 3 mantissa bits, on its bits: a carry out
    of the mantissa lands in the exponent, as it should."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    return bits.to(tl.float32, bitcast=True)


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
def _key_tiles(acc, acc2, l_i, m_i, b_q, b_q2, p_k_base, p_v_base, p_pages,
               sk_b, sk_s, sk_d, sv_b, sv_s, sv_d, page, n_pages, pos, offs_n, offs_d, mask_d,
               offs_d2,
               offs_dv, mask_dv, offs_dv2,
               seq_k, qk_scale, cap, left, right, lo, hi, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAD_D: tl.constexpr,
               BLOCK_D2: tl.constexpr, PAD_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
               PRECISION: tl.constexpr, INDEX: tl.constexpr,
               ulo=0, uhi=0, MIXED: tl.constexpr = False):
    """Key tiles [lo, hi) of one query tile: the online-softmax update. MASKED=False for
    tiles wholly inside the keys and wholly visible to every row of the tile (no compare, no
    select per element, no bounds on the loads); MASKED=True for the tiles on a mask's edge
    (causal diagonal, window edge) and the ragged last one. PAD_D: the head dim is padded up
    to BLOCK_D (masked columns). BLOCK_D2 > 0: the head dim is split in two pieces, columns
    [0, BLOCK_D) (`b_q`, `acc`) and BLOCK_D2 columns `offs_d2` (`b_q2`, `acc2`), neither
    padded or masked (the second may overlap the first: `_flash_fwd`), each product one
    dot per piece (`configs.head_dim_pieces`). V's head dim has its own (`offs_dv`,
    `mask_dv`, PAD_DV, BLOCK_DV2 > 0: `offs_dv2` and `acc2`): Q's and K's where they are
    alike. PAGED: key j lives in page
    `pages[j // page]` of the cache (`sk_b`/`sv_b` the page stride), row j % page, the
    page index clamped to 0..n_pages - 1 (an unchecked table reads inside the cache).
    MIXED=True: all of [lo, hi) in one loop, tiles outside [ulo, uhi) masked (a branch per
    tile), the loads always bounded."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        mask_n = keys < seq_k
        if PAGED:
            blk = tl.load(p_pages + keys // page, mask=mask_n, other=0)
            blk = tl.minimum(tl.maximum(blk, 0), n_pages - 1).to(INDEX)  # inside the cache
            k_rows = blk * sk_b + (keys % page) * sk_s
            v_rows = blk * sv_b + (keys % page) * sv_s
        else:
            first = tl.cast(start_n, INDEX)  # the tile's first row (INDEX bits); inside, 32
            k_rows = first * sk_s + offs_n * sk_s
            v_rows = first * sv_s + offs_n * sv_s
        b_kt = _tile(p_k_base + k_rows[None, :] + offs_d[:, None] * sk_d,  # [BLOCK_D, BLOCK_N]
                     mask_n[None, :], mask_d[:, None], MASKED, MIXED, PAD_D)
        qk = tl.dot(b_q, b_kt, input_precision=PRECISION)
        if BLOCK_D2 > 0:  # the second piece: bounded by the keys alone
            b_kt2 = _tile(p_k_base + k_rows[None, :] + offs_d2[:, None] * sk_d,
                          mask_n[None, :], mask_n[None, :], MASKED, MIXED, False)
            qk = tl.dot(b_q2, b_kt2, qk, input_precision=PRECISION)
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
        b_v = _tile(p_v_base + v_rows[:, None] + offs_dv[None, :] * sv_d,  # [BLOCK_N, BLOCK_DV]
                    mask_n[:, None], mask_dv[None, :], MASKED, MIXED, PAD_DV)
        acc = acc * alpha[:, None] + tl.dot(_p_as(p, b_v.dtype), b_v,
                                            input_precision=PRECISION)
        if BLOCK_DV2 > 0:
            b_v2 = _tile(p_v_base + v_rows[:, None] + offs_dv2[None, :] * sv_d,
                         mask_n[:, None], mask_n[:, None], MASKED, MIXED, False)
            acc2 = acc2 * alpha[:, None] + tl.dot(_p_as(p, b_v2.dtype), b_v2,
                                                  input_precision=PRECISION)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def _add_sinks(p_sinks, heads, m_i, l_i):
    """Each row's sink (the logit of its query head, natural-log units) into its online
    state, in the kernels' base 2: (m, l, the factor O's accumulator takes), m the larger of
    the scores' max and the sink, so no exponent can overflow."""
    sink = tl.load(p_sinks + heads) * 1.4426950408889634  # log2(e)
    m_new = tl.maximum(m_i, sink)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no sink, no key: l stays 0
    alpha = tl.exp2(m_i - m_use)
    return m_new, l_i * alpha + tl.exp2(sink - m_use), alpha


@triton.heuristics(MASK_FLAGS | {
    "VARLEN": lambda a: a["p_cu_q"] is not None,
    "SEQLENS_K": lambda a: a["p_seqlens_k"] is not None,
    "PAGED": lambda a: a["p_table"] is not None,
    "WRITE_LSE": lambda a: a["p_lse"] is not None,
    "SPLIT": lambda a: a["split_len"] > 0,
    "SINKS": lambda a: a["p_sinks"] is not None,
    "FP8": lambda a: a["p_descale"] is not None,
    "PAD_D": lambda a: a["BLOCK_D"] > a["head_dim"] * a["ALIGN"],
    "OVERLAP": lambda a: a["BLOCK_D"] + a["BLOCK_D2"] - a["head_dim"] * a["ALIGN"]
    if a["BLOCK_D2"] else 0,
    "PAD_DV": lambda a: a["BLOCK_DV"] > a["head_dim_v"] * a["ALIGN"],
    "OVERLAP_V": lambda a: a["BLOCK_DV"] + a["BLOCK_DV2"] - a["head_dim_v"] * a["ALIGN"]
    if a["BLOCK_DV2"] else 0,
})
@shape_jit
def _flash_fwd(
    p_q, p_k, p_v, p_o, p_lse, p_cu_q, p_cu_k, p_seqlens_k, p_table, p_sinks, p_descale,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_s, so_d, so_split, sl_b, sl_h, sl_split, st_b,
    n_heads, group, seq_q, seq_k, head_dim, head_dim_v, qk_scale, cap, left, right, page,
    split_len, seqlens_add, n_pages,
    bucket_q, bucket_k,  # autotune keys only: the sequence lengths' power-of-two buckets
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
    PRECISION: tl.constexpr, INDEX: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, PACK_GQA: tl.constexpr, ONE_LOOP: tl.constexpr,
    ALIGN: tl.constexpr,
    # derived from the arguments (the heuristics above), never passed:
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, SEQLENS_K: tl.constexpr, PAGED: tl.constexpr,
    WRITE_LSE: tl.constexpr, SPLIT: tl.constexpr, SINKS: tl.constexpr, FP8: tl.constexpr,
    PAD_D: tl.constexpr, OVERLAP: tl.constexpr, PAD_DV: tl.constexpr,
    OVERLAP_V: tl.constexpr,
):
    """One query tile of one (batch, head) -- or, with PACK_GQA, rows r of one (batch, K/V
    head) that are (query r // group, head r % group), so one K/V tile serves the whole
    group (decode). From the arguments: a window side `left`/`right` >= 0 bounds the keys
    each row sees (causal: right = 0; -1: unbounded), `cap` > 0 a softcap; BOTTOM_RIGHT
    places query i at i + Sk - Sq. `p_cu_q`/`p_cu_k` given (VARLEN): sequence b is rows
    cu[b]..cu[b+1] of packed tensors; `p_seqlens_k` (SEQLENS_K): key lengths per batch (a
    KV cache, plus `seqlens_add` keys this call appended, clamped to 0..seq_k: `_sequence`);
    `p_table` (PAGED): keys through a block table of `n_pages` pages; `split_len` > 0 (SPLIT):
    program_id(2) takes keys [split * split_len, +split_len) and writes its normalised
    partial O and LSE for the merge (flash-decoding); `p_sinks` (SINKS): a logit per query
    head that joins each row's denominator and LSE and carries no value (with SPLIT the
    merge adds it); `p_descale` (FP8: q, k, v in float8 e4m3) the dequantisation factors,
    float32 `[H + 2 * H_kv]`: q's per query head, then k's and v's per K/V head (the scores
    take q's and k's, O takes v's; P enters the P.V product in e4m3 at P_SCALE).
    ALIGN > 1: Q's, K's and V's strides (but the last) and the head dim came divided by
    ALIGN; multiplied back, Triton knows that every row starts on 16 bytes and the head-dim
    mask is constant over 16 bytes (the host checked, `common.row_alignment`), so its loads
    of a row are 16-byte accesses, and the head-dim pieces are right
    (`configs.head_dim_pieces`). `head_dim_v` (V's and O's, in BLOCK_DV and BLOCK_DV2
    pieces) may differ from Q's and K's (DeepSeek's MLA: 192 and 128)."""
    if ALIGN > 1:
        head_dim = head_dim * ALIGN
        head_dim_v = head_dim_v * ALIGN
        sq_b, sq_h, sq_s = sq_b * ALIGN, sq_h * ALIGN, sq_s * ALIGN
        sk_b, sk_h, sk_s = sk_b * ALIGN, sk_h * ALIGN, sk_s * ALIGN
        sv_b, sv_h, sv_s = sv_b * ALIGN, sv_h * ALIGN, sv_s * ALIGN
    if HAS_RIGHT and not HAS_LEFT:
        # the last query tiles see the most keys: launch them first, so the short tiles
        # fill the end of the grid instead of leaving SMs idle behind one long tile
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    bh = tl.program_id(1).to(INDEX)  # int64 where b * stride can pass 2^31 (`index_dtype`)
    if PACK_GQA:
        b = bh // (n_heads // group)
        h_kv = bh % (n_heads // group)
    else:
        b = bh // n_heads
        h = bh % n_heads
        h_kv = h // group  # GQA: `group` query heads share one K/V head
    q_start, seq_q, k_start, seq_k = _sequence(p_cu_q, p_cu_k, p_seqlens_k, b, seq_q, seq_k,
                                               VARLEN, SEQLENS_K, INDEX, False, seqlens_add)
    rows_total = seq_q * group if PACK_GQA else seq_q
    if start_m * BLOCK_M >= rows_total:
        return  # varlen: this sequence is shorter than the longest
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
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_r < rows_total
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    pos = offs_m + diag
    last_pos = tl.minimum((start_m * BLOCK_M + BLOCK_M - 1) // (group if PACK_GQA else 1),
                          seq_q - 1) + diag

    row_q = (q_start + offs_m).to(INDEX)
    p_q_rows = p_q + b * sq_b + heads[:, None].to(INDEX) * sq_h + row_q[:, None] * sq_s
    b_q = tl.load(p_q_rows + offs_d[None, :] * sq_d, mask=mask_m[:, None] & mask_d[None, :],
                  other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    # the head dim's second piece: columns BLOCK_D .. + BLOCK_D2, OVERLAP columns earlier
    # where it is wider than what is left (its loads stay inside the row, unmasked); Q's
    # overlapped columns are zeros there, so they count once. Without one, the first
    # piece's tensors stand in, never read. V's and O's pieces likewise (OVERLAP_V: O's
    # overlapped columns are stored from the first piece)
    offs_d2, b_q2, offs_dv2, acc2 = offs_d, b_q, offs_dv, acc
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D - OVERLAP + tl.arange(0, BLOCK_D2)
        b_q2 = tl.load(p_q_rows + offs_d2[None, :] * sq_d,
                       mask=mask_m[:, None] & (offs_d2 >= BLOCK_D)[None, :], other=0.0)
    if BLOCK_DV2 > 0:
        offs_dv2 = BLOCK_DV - OVERLAP_V + tl.arange(0, BLOCK_DV2)
        acc2 = tl.zeros((BLOCK_M, BLOCK_DV2), tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if FP8:  # the scores are (q8 k8^T) * descale_q * descale_k * scale, q's factor the
        # row's head's (packed GQA: the rows of one tile are several heads)
        heads_kv = n_heads // group
        qk_scale = (qk_scale * tl.load(p_descale + heads)
                    * tl.load(p_descale + n_heads + h_kv))[:, None]

    if PAGED:
        p_k_base = p_k + h_kv * sk_h
        p_v_base = p_v + h_kv * sv_h
    else:
        p_k_base = p_k + b * sk_b + h_kv * sk_h + k_start * sk_s
        p_v_base = p_v + b * sv_b + h_kv * sv_h + k_start * sv_s
    p_pages = p_k  # stands in, never read, where the cache is not paged
    if PAGED:
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
        acc, acc2, l_i, m_i = _key_tiles(
            acc, acc2, l_i, m_i, b_q, b_q2, p_k_base, p_v_base, p_pages, sk_b, sk_s, sk_d,
            sv_b, sv_s, sv_d, page, n_pages, pos, offs_n, offs_d, mask_d, offs_d2, offs_dv,
            mask_dv, offs_dv2, seq_k, qk_scale, cap, left, right, lo, hi, BLOCK_N, False, HAS_LEFT,
            HAS_RIGHT, SOFTCAP, PAGED, PAD_D, BLOCK_D2, PAD_DV, BLOCK_DV2, PRECISION, INDEX,
            ulo, uhi, True)
    else:  # masked [lo, ulo) (a window's left edge), whole [ulo, uhi), masked [uhi, hi)
        for part in tl.static_range(3):  # unrolled: three instantiations of the loop
            start = lo if part == 0 else (ulo if part == 1 else uhi)
            stop = ulo if part == 0 else (uhi if part == 1 else hi)
            acc, acc2, l_i, m_i = _key_tiles(
                acc, acc2, l_i, m_i, b_q, b_q2, p_k_base, p_v_base, p_pages, sk_b, sk_s,
                sk_d, sv_b, sv_s, sv_d, page, n_pages, pos, offs_n, offs_d, mask_d, offs_d2,
                offs_dv, mask_dv, offs_dv2, seq_k, qk_scale, cap, left, right, start, stop, BLOCK_N,
                part != 1, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAGED, PAD_D, BLOCK_D2, PAD_DV,
                BLOCK_DV2, PRECISION, INDEX)

    # a row that sees no key (a window past the keys, bottom-right with Sq > Sk, an empty
    # split) has l = 0: its output is 0 and its LSE -inf
    if SINKS and not SPLIT:  # O = acc * alpha / l (alpha = 0, acc = 0: a row of no key)
        m_i, l_i, alpha = _add_sinks(p_sinks, heads, m_i, l_i)
        l_safe = (tl.where(l_i == 0.0, 1.0, l_i) / alpha)[:, None]
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:  # O = (P8 V8) * descale_v / P_SCALE / l
        l_safe = l_safe * (P_SCALE / tl.load(p_descale + n_heads + heads_kv + h_kv))
    split = tl.program_id(2).to(INDEX) if SPLIT else 0
    p_o_rows = (p_o + split * so_split + b * so_b + heads[:, None].to(INDEX) * so_h
                + row_q[:, None] * so_s)
    tl.store(p_o_rows + offs_dv[None, :] * so_d, (acc / l_safe).to(p_o.dtype.element_ty),
             mask=mask_m[:, None] & mask_dv[None, :])
    if BLOCK_DV2 > 0:  # the overlapped columns come from the piece before
        tl.store(p_o_rows + offs_dv2[None, :] * so_d,
                 (acc2 / l_safe).to(p_o.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_dv2 >= BLOCK_DV)[None, :])
    if WRITE_LSE:
        # natural-log LSE of the scaled scores: m and log2(l) are in base 2; * ln(2)
        tl.store(p_lse + split * sl_split + b * sl_b + heads.to(INDEX) * sl_h + row_q,
                 (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mask_m)


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
