"""The backward's Triton kernels (`flash_bwd.py` launches them; its docstring has the
algorithm): the preprocess (delta = rowsum(dO * O) - dLSE), the dK/dV pass by key tiles and
the dQ pass by query tiles, each loop's tile work in its own helper. The mask's flags come
from the arguments (`common.MASK_FLAGS`), the sequence offsets from `common._sequence`,
shared with the forward."""

import triton
import triton.language as tl

from fusedattn.launch import settle_keys
from fusedattn.tiles.common import MASK_FLAGS, _scores, _sequence, _spans, _visible


@triton.jit(do_not_specialize=("n_sem", "sem_chunk", "n_docs", "sort_docs", "sa_b", "sa_h",
                               "sa_s"))
def _bwd_preprocess(p_o, p_do, p_dlse, p_delta, p_dq_acc, p_sem, p_cu_k,
                    so_b, so_h, so_s, so_d, sdo_b, sdo_h, sdo_s, sdo_d, sa_b, sa_h, sa_s,
                    n_heads, seq_q, head_dim, dim_q, n_sem, sem_chunk, n_docs, sort_docs,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr,
                    ZERO: tl.constexpr, BLOCK_DQ: tl.constexpr, ORDER_DOCS: tl.constexpr):
    """delta = rowsum(dO * O) - dLSE for BLOCK_M rows of one (batch, head). ZERO (the
    Hopper backward's, `hopper.backward`): also zero the same rows of dQ's fp32
    accumulator (`p_dq_acc`, `[B, H, seq_q, dim_q]` of strides sa_b, sa_h, sa_s, 1: q's
    where the Hopper kernel adds by TMA) and `sem_chunk` of the `n_sem` int32 counters
    (`p_sem`) each program, in place of two fills. ORDER_DOCS (its compact varlen grid):
    program (0, 0) also writes the order its programs take the `n_docs` sequences in
    (`_document_order`) after the counters (`p_sem + n_sem`)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = ((start + offs_m) < seq_q)[:, None] & (offs_d < head_dim)[None, :]
    b_o = tl.load(p_o + b * so_b + h * so_h + start * so_s + offs_m[:, None] * so_s
                  + offs_d[None, :] * so_d, mask=mask, other=0.0).to(tl.float32)
    b_do = tl.load(p_do + b * sdo_b + h * sdo_h + start * sdo_s + offs_m[:, None] * sdo_s
                   + offs_d[None, :] * sdo_d, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(b_o * b_do, axis=1)
    rows = bh * seq_q + start + offs_m
    if HAS_DLSE:
        delta -= tl.load(p_dlse + rows, mask=(start + offs_m) < seq_q, other=0.0)
    tl.store(p_delta + rows, delta, mask=(start + offs_m) < seq_q)
    if ZERO:
        offs_dq = tl.arange(0, BLOCK_DQ)
        acc_rows = b * sa_b + h * sa_h + (start + offs_m) * sa_s
        tl.store(p_dq_acc + acc_rows[:, None] + offs_dq[None, :],
                 tl.zeros([BLOCK_M, BLOCK_DQ], dtype=tl.float32),
                 mask=((start + offs_m) < seq_q)[:, None] & (offs_dq < dim_q)[None, :])
        # this program's counters: chunk after chunk in launch order
        first = (bh * tl.num_programs(0) + tl.program_id(0)) * sem_chunk
        for i in range(0, sem_chunk, BLOCK_M):
            at = first + i + offs_m
            tl.store(p_sem + at, tl.zeros([BLOCK_M], dtype=tl.int32),
                     mask=(i + offs_m < sem_chunk) & (at < n_sem))
    if ORDER_DOCS:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _document_order(p_sem + n_sem, p_cu_k, n_docs, sort_docs)


# the most sequences `_document_order` sorts (its rank's block); past it, their own order
SORT_MAX_DOCS = tl.constexpr(256)


@triton.jit
def _document_order(p_order, p_cu_k, n_docs, sort_docs):
    """The sequences' order for the Hopper backward's compact varlen grid (`hopper.
    backward`): `p_order[r]` the sequence launched r-th. `sort_docs` (at most SORT_MAX_DOCS
    sequences): the most keys first, ties by index, so that the longest programs start
    first and none ends the launch late; else 0, 1, 2, ... A sequence's rank counts those
    before it (a [SORT_MAX_DOCS, 32] comparison a turn)."""
    lanes = tl.arange(0, 32)
    if sort_docs != 0:
        i = tl.arange(0, SORT_MAX_DOCS)
        inside = i < n_docs
        keys = (tl.load(p_cu_k + i + 1, mask=inside, other=0)
                - tl.load(p_cu_k + i, mask=inside, other=0))
        rank = tl.zeros([SORT_MAX_DOCS], dtype=tl.int32)
        for c in range(0, n_docs, 32):
            j = c + lanes
            there = j < n_docs
            keys_j = (tl.load(p_cu_k + j + 1, mask=there, other=0)
                      - tl.load(p_cu_k + j, mask=there, other=0))
            first = (keys_j[None, :] > keys[:, None]) | (
                (keys_j[None, :] == keys[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum((first & there[None, :]).to(tl.int32), 1)
        tl.store(p_order + rank, i, mask=inside)
    else:
        for c in range(0, n_docs, 32):
            tl.store(p_order + c + lanes, c + lanes, mask=c + lanes < n_docs)


@triton.jit
def _grad_scores(s2, p, dp, delta, cap, SOFTCAP: tl.constexpr):
    """d loss / d (scale * Q K^T) from P and dP: P (dP - delta), times the softcap's
    derivative 1 - tanh^2 (tanh = s2 / cap, s2 the capped base-2 score) when there is one."""
    ds = p * (dp - delta)
    if SOFTCAP:
        t = s2 / cap
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base, p_delta_base,
                sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d, mask_d, offs_dv, mask_dv,
                seq_q, seq_k, diag, qk_scale, cap, left, right, lo, hi,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PAD_D: tl.constexpr,
                PAD_DV: tl.constexpr, PRECISION: tl.constexpr, INDEX: tl.constexpr, ulo=0,
                uhi=0, MIXED: tl.constexpr = False):
    """Query tiles [lo, hi) against one key tile: accumulate dK (unscaled) and dV. MASKED
    for the tiles on a mask's edge and the ragged last query tile; rows past Sq load zeros
    (dO = 0 and delta = 0 give them dS = 0 and no dV). MIXED: all of [lo, hi) in one loop,
    the loads always bounded, tiles outside [ulo, uhi) masked (`flash._key_tiles`'s one
    loop, the same trade)."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        first = tl.cast(start_m, INDEX)
        p_qt = p_q_base + first * sq_s + offs_m[None, :] * sq_s + offs_d[:, None] * sq_d
        p_do = p_do_base + first * sdo_s + offs_m[:, None] * sdo_s + offs_dv[None, :] * sdo_d
        if MASKED or MIXED:
            mask_m = rows < seq_q
            b_qt = tl.load(p_qt, mask=mask_m[None, :] & mask_d[:, None], other=0.0)
            b_do = tl.load(p_do, mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
            lse = tl.load(p_lse_base + rows, mask=mask_m, other=0.0)
            delta = tl.load(p_delta_base + rows, mask=mask_m, other=0.0)
            # a row that saw no key (LSE = -inf) has P = 0: take LSE = +inf
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
        else:
            if PAD_D:
                b_qt = tl.load(p_qt, mask=mask_d[:, None], other=0.0)
            else:
                b_qt = tl.load(p_qt)
            if PAD_DV:
                b_do = tl.load(p_do, mask=mask_dv[None, :], other=0.0)
            else:
                b_do = tl.load(p_do)
            lse = tl.load(p_lse_base + rows)
            delta = tl.load(p_delta_base + rows)
        s_t = _scores(tl.dot(b_k, b_qt, input_precision=PRECISION), qk_scale, cap, SOFTCAP)
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)          # LSE to base 2
        edge = MASKED  # MIXED: a tile outside the whole ones [ulo, uhi)
        if MIXED:
            edge = (start_m < ulo) | (start_m >= uhi)
        if edge:
            valid = _visible(rows[None, :] + diag, keys[:, None], seq_k, left, right,
                             HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(valid, p_t, 0.0)
        dv += tl.dot(p_t.to(b_do.dtype), b_do, input_precision=PRECISION)
        dp_t = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)    # [BLOCK_N, BLOCK_M]
        ds_t = _grad_scores(s_t, p_t, dp_t, delta[None, :], cap, SOFTCAP)
        dk += tl.dot(ds_t.to(b_qt.dtype), tl.trans(b_qt), input_precision=PRECISION)
    return dk, dv


# The LSE's strides (one float per query row) left unspecialised: B * H * Sq and Sq are
# multiples of 16 in patterns the lengths alone do not tell (Sq = 1500, H = 4), and each
# new pattern compiled both kernels again after `fusedattn.warmup` (issue 31). The
# lengths and the head dim stay specialised (common.SHAPE_INTS says why).
LSE_STRIDES = ("sl_b", "sl_h")


@triton.heuristics(MASK_FLAGS)
@triton.jit(do_not_specialize=LSE_STRIDES)
def _flash_bwd_dkdv(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_cu_q, p_cu_k,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sdk_b, sdk_h, sdk_s, sdk_d, sdv_b, sdv_h, sdv_s, sdv_d,
    sl_b, sl_h, n_heads, n_heads_kv, group, seq_q, seq_k, head_dim, head_dim_v, scale,
    qk_scale, cap, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, PAD_D: tl.constexpr, INDEX: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAD_DV: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False,
    # derived from `left`, `right` and `cap` (`common.MASK_FLAGS`), never passed:
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """dK and dV of BLOCK_N keys of one (batch, K/V head), summed over its query heads.
    ONE_LOOP: the query tiles in one loop (edge tiles masked by a branch per tile), not three.
    V, dO and dV have `head_dim_v` columns (BLOCK_DV), Q, K and dK `head_dim` (BLOCK_D)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1).to(INDEX)
    b = bhk // n_heads_kv
    h_kv = bhk % n_heads_kv
    q_start, seq_q, k_start, seq_k = _sequence(p_cu_q, p_cu_k, p_cu_q, b, seq_q, seq_k,
                                               VARLEN, False, INDEX, True)
    if start_n >= seq_k:
        return  # varlen: this sequence has fewer keys than the longest
    diag = seq_k - seq_q if BOTTOM_RIGHT else 0
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keys = start_n + offs_n
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    mask_kd = (keys < seq_k)[:, None] & mask_d[None, :]
    mask_vd = (keys < seq_k)[:, None] & mask_dv[None, :]
    first_n = k_start + start_n
    b_k = tl.load(p_k + b * sk_b + h_kv * sk_h + first_n * sk_s + offs_n[:, None] * sk_s
                  + offs_d[None, :] * sk_d, mask=mask_kd, other=0.0)
    b_v = tl.load(p_v + b * sv_b + h_kv * sv_h + first_n * sv_s + offs_n[:, None] * sv_s
                  + offs_dv[None, :] * sv_d, mask=mask_vd, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)

    # query i (position i + diag) sees key j when j - diag - right <= i <= j - diag + left
    lo, ulo, uhi, hi = _spans(start_n, tl.minimum(start_n + BLOCK_N, seq_k) - 1, seq_q,
                              -diag - right, left - diag, BLOCK_M, HAS_RIGHT, HAS_LEFT)
    for g in range(group):
        h = h_kv * group + g
        p_q_base = p_q + b * sq_b + h * sq_h + q_start * sq_s
        p_do_base = p_do + b * sdo_b + h * sdo_h + q_start * sdo_s
        p_lse_base = p_lse + b * sl_b + h * sl_h + q_start
        p_delta_base = p_delta + b * sl_b + h * sl_h + q_start
        if ONE_LOOP:
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, offs_dv, mask_dv, seq_q, seq_k, diag, qk_scale, cap,
                                 left, right, lo, hi, BLOCK_M, False, HAS_LEFT, HAS_RIGHT,
                                 SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX, ulo, uhi, True)
        else:
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, offs_dv, mask_dv, seq_q, seq_k, diag, qk_scale, cap,
                                 left, right, lo, ulo, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
                                 SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX)
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, offs_dv, mask_dv, seq_q, seq_k, diag, qk_scale, cap,
                                 left, right, ulo, uhi, BLOCK_M, False, HAS_LEFT, HAS_RIGHT,
                                 SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX)
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, offs_dv, mask_dv, seq_q, seq_k, diag, qk_scale, cap,
                                 left, right, uhi, hi, BLOCK_M, True, HAS_LEFT, HAS_RIGHT,
                                 SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX)
    dk *= scale
    tl.store(p_dk + b * sdk_b + h_kv * sdk_h + first_n * sdk_s + offs_n[:, None] * sdk_s
             + offs_d[None, :] * sdk_d, dk.to(p_dk.dtype.element_ty), mask=mask_kd)
    tl.store(p_dv + b * sdv_b + h_kv * sdv_h + first_n * sdv_s + offs_n[:, None] * sdv_s
             + offs_dv[None, :] * sdv_d, dv.to(p_dv.dtype.element_ty), mask=mask_vd)


@triton.jit
def _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s, sv_d,
              pos, offs_n, offs_d, mask_d, offs_dv, mask_dv, seq_k, qk_scale, cap, left,
              right, lo, hi, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
              PAD_D: tl.constexpr, PAD_DV: tl.constexpr, PRECISION: tl.constexpr,
              INDEX: tl.constexpr, ulo=0, uhi=0, MIXED: tl.constexpr = False):
    """Key tiles [lo, hi) against one query tile: accumulate dQ (unscaled). MASKED for the
    tiles on a mask's edge and the ragged last key tile; MIXED as in `_dkdv_tiles`."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        first = tl.cast(start_n, INDEX)
        p_kt = p_k_base + first * sk_s + offs_n[None, :] * sk_s + offs_d[:, None] * sk_d
        p_vt = p_v_base + first * sv_s + offs_n[None, :] * sv_s + offs_dv[:, None] * sv_d
        if MASKED or MIXED:
            mask_n = keys < seq_k
            b_kt = tl.load(p_kt, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            b_vt = tl.load(p_vt, mask=mask_n[None, :] & mask_dv[:, None], other=0.0)
        else:
            if PAD_D:
                b_kt = tl.load(p_kt, mask=mask_d[:, None], other=0.0)
            else:
                b_kt = tl.load(p_kt)
            if PAD_DV:
                b_vt = tl.load(p_vt, mask=mask_dv[:, None], other=0.0)
            else:
                b_vt = tl.load(p_vt)
        s = _scores(tl.dot(b_q, b_kt, input_precision=PRECISION), qk_scale, cap, SOFTCAP)
        p = tl.exp2(s - lse2[:, None])
        edge = MASKED  # MIXED: a tile outside the whole ones [ulo, uhi)
        if MIXED:
            edge = (start_n < ulo) | (start_n >= uhi)
        if edge:
            valid = _visible(pos[:, None], keys[None, :], seq_k, left, right, HAS_LEFT,
                             HAS_RIGHT)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(b_do, b_vt, input_precision=PRECISION)
        ds = _grad_scores(s, p, dp, delta[:, None], cap, SOFTCAP)
        dq += tl.dot(ds.to(b_kt.dtype), tl.trans(b_kt), input_precision=PRECISION)
    return dq


@triton.heuristics(MASK_FLAGS)
@triton.jit(do_not_specialize=LSE_STRIDES)
def _flash_bwd_dq(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_cu_q, p_cu_k,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sdq_b, sdq_h, sdq_s, sdq_d,
    sl_b, sl_h, n_heads, group, seq_q, seq_k, head_dim, head_dim_v, scale, qk_scale, cap,
    left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, PAD_D: tl.constexpr, INDEX: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAD_DV: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False,
    # derived from `left`, `right` and `cap` (`common.MASK_FLAGS`), never passed:
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """dQ of BLOCK_M query rows of one (batch, head); ONE_LOOP as in `_flash_bwd_dkdv`."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(INDEX)
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group
    q_start, seq_q, k_start, seq_k = _sequence(p_cu_q, p_cu_k, p_cu_q, b, seq_q, seq_k,
                                               VARLEN, False, INDEX, True)
    if start_m >= seq_q:
        return
    diag = seq_k - seq_q if BOTTOM_RIGHT else 0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    mask_m = rows < seq_q
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    mask_md = mask_m[:, None] & mask_d[None, :]
    first_m = q_start + start_m
    b_q = tl.load(p_q + b * sq_b + h * sq_h + first_m * sq_s + offs_m[:, None] * sq_s
                  + offs_d[None, :] * sq_d, mask=mask_md, other=0.0)
    b_do = tl.load(p_do + b * sdo_b + h * sdo_h + first_m * sdo_s + offs_m[:, None] * sdo_s
                   + offs_dv[None, :] * sdo_d, mask=mask_m[:, None] & mask_dv[None, :],
                   other=0.0)
    lse = tl.load(p_lse + b * sl_b + h * sl_h + q_start + rows, mask=mask_m, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(p_delta + b * sl_b + h * sl_h + q_start + rows, mask=mask_m, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    p_k_base = p_k + b * sk_b + h_kv * sk_h + k_start * sk_s
    p_v_base = p_v + b * sv_b + h_kv * sv_h + k_start * sv_s
    lo, ulo, uhi, hi = _spans(start_m + diag, tl.minimum(start_m + BLOCK_M, seq_q) - 1 + diag,
                              seq_k, -left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    pos = rows + diag
    if ONE_LOOP:
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, offs_dv, mask_dv, seq_k, qk_scale,
                       cap, left, right, lo, hi, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                       SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX, ulo, uhi, True)
    else:
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, offs_dv, mask_dv, seq_k, qk_scale,
                       cap, left, right, lo, ulo, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                       SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX)
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, offs_dv, mask_dv, seq_k, qk_scale,
                       cap, left, right, ulo, uhi, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                       SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX)
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, offs_dv, mask_dv, seq_k, qk_scale,
                       cap, left, right, uhi, hi, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                       SOFTCAP, PAD_D, PAD_DV, PRECISION, INDEX)
    dq *= scale
    tl.store(p_dq + b * sdq_b + h * sdq_h + first_m * sdq_s + offs_m[:, None] * sdq_s
             + offs_d[None, :] * sdq_d, dq.to(p_dq.dtype.element_ty), mask=mask_md)


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
