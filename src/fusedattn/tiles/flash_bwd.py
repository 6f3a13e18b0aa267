"""FlashAttention-2-style backward in Triton: no S x S array, fp32 accumulation, no atomics.

Given the forward's O and natural-log LSE, and dO (and optionally dLSE, the gradient of the
LSE output), with s = scale * Q K^T and P = exp(s - LSE):

    delta_i = rowsum(dO_i * O_i) - dLSE_i                     # preprocess, [B, H, Sq] fp32
    dV_j    = sum_i P_ij dO_i                                  # dK/dV pass, by key tiles
    dP_ij   = dO_i . V_j
    dS_ij   = P_ij (dP_ij - delta_i)                           # d loss / d s_ij
    dK_j    = scale * sum_i dS_ij Q_i
    dQ_i    = scale * sum_j dS_ij K_j                          # dQ pass, by query tiles

(dLSE enters through d LSE_i / d s_ij = P_ij, so the LSE output is differentiable for the
price of one subtraction.) P is recomputed from Q, K and the LSE in both passes, in base 2:
exp(s - LSE) = exp2(s * log2(e) - LSE * log2(e)).

Determinism: each dK/dV tile is owned by one program, which loops over every query tile of
every query head of its GQA group; each dQ tile by one program looping over the key tiles.
No float atomics, so the same inputs give the same bits on every run. The price is that
P and dP are computed twice (once per pass): 7 GEMMs of [BLOCK] tiles instead of 5, the
FLOP convention still counts 2.5x the forward (FlashAttention's).

Extra memory: delta, 4 * B * H * Sq bytes; dQ, dK, dV are written once in the input dtype
(no fp32 dQ accumulator is needed without atomics).

Offsets: batch and head offsets and each tile's first row take `INDEX` bits, 64 where a
tensor passes 2^31 elements (`flash.index_dtype`); offsets inside a tile stay 32-bit.

Causal is top-left aligned, as in the forward: query i sees keys j <= i. A key tile is seen
by the query tiles from its own first key onwards: those straddling the diagonal (and the
ragged last tile) run with masks, those wholly past it without.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import triton
import triton.language as tl

from fusedattn.configs import backward_configs, backward_single_loop
from fusedattn.mode import EMULATION, kernel_launches
from fusedattn.precision import resolve
from fusedattn.tiles.common import (
    Mask,
    Varlen,
    _scores,
    _spans,
    _visible,
    emulation_operands,
    index_dtype,
)


@triton.jit
def _bwd_preprocess(p_o, p_do, p_dlse, p_delta,
                    so_b, so_h, so_s, so_d, sdo_b, sdo_h, sdo_s, sdo_d,
                    n_heads, seq_q, head_dim,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) - dLSE for BLOCK_M rows of one (batch, head)."""
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
                sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d, mask_d, seq_q, seq_k, diag,
                qk_scale, cap, left, right, lo, hi,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PAD_D: tl.constexpr,
                PRECISION: tl.constexpr, INDEX: tl.constexpr, ulo=0, uhi=0,
                MIXED: tl.constexpr = False):
    """Query tiles [lo, hi) against one key tile: accumulate dK (unscaled) and dV. MASKED
    for the tiles on a mask's edge and the ragged last query tile; rows past Sq load zeros
    (dO = 0 and delta = 0 give them dS = 0 and no dV). MIXED: all of [lo, hi) in one loop,
    the loads always bounded, tiles outside [ulo, uhi) masked (`flash._key_tiles`'s one
    loop, the same trade)."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        first = tl.cast(start_m, INDEX)
        p_qt = p_q_base + first * sq_s + offs_m[None, :] * sq_s + offs_d[:, None] * sq_d
        p_do = p_do_base + first * sdo_s + offs_m[:, None] * sdo_s + offs_d[None, :] * sdo_d
        if MASKED or MIXED:
            mask_m = rows < seq_q
            b_qt = tl.load(p_qt, mask=mask_m[None, :] & mask_d[:, None], other=0.0)
            b_do = tl.load(p_do, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            lse = tl.load(p_lse_base + rows, mask=mask_m, other=0.0)
            delta = tl.load(p_delta_base + rows, mask=mask_m, other=0.0)
            # a row that saw no key (LSE = -inf) has P = 0: take LSE = +inf
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
        else:
            if PAD_D:
                b_qt = tl.load(p_qt, mask=mask_d[:, None], other=0.0)
                b_do = tl.load(p_do, mask=mask_d[None, :], other=0.0)
            else:
                b_qt = tl.load(p_qt)
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


@triton.jit
def _sequence(p_cu_q, p_cu_k, b, seq_q, seq_k, VARLEN: tl.constexpr, INDEX: tl.constexpr):
    """(first query row, query count, first key row, key count) of sequence b."""
    if VARLEN:
        q_start = tl.load(p_cu_q + b).to(INDEX)
        k_start = tl.load(p_cu_k + b).to(INDEX)
        return (q_start, tl.load(p_cu_q + b + 1).to(INDEX) - q_start, k_start,
                tl.load(p_cu_k + b + 1).to(INDEX) - k_start)
    else:
        return b * 0, b * 0 + seq_q, b * 0, b * 0 + seq_k


@triton.jit
def _flash_bwd_dkdv(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_cu_q, p_cu_k,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sdk_b, sdk_h, sdk_s, sdk_d, sdv_b, sdv_h, sdv_s, sdv_d,
    sl_b, sl_h, n_heads, n_heads_kv, group, seq_q, seq_k, head_dim, scale, qk_scale, cap,
    left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, PAD_D: tl.constexpr,
    INDEX: tl.constexpr, HAS_LEFT: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    BOTTOM_RIGHT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False,
):
    """dK and dV of BLOCK_N keys of one (batch, K/V head), summed over its query heads.
    ONE_LOOP: the query tiles in one loop (edge tiles masked by a branch per tile), not three."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1).to(INDEX)
    b = bhk // n_heads_kv
    h_kv = bhk % n_heads_kv
    q_start, seq_q, k_start, seq_k = _sequence(p_cu_q, p_cu_k, b, seq_q, seq_k, VARLEN, INDEX)
    if start_n >= seq_k:
        return  # varlen: this sequence has fewer keys than the longest
    diag = seq_k - seq_q if BOTTOM_RIGHT else 0
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keys = start_n + offs_n
    mask_d = offs_d < head_dim
    mask_kd = (keys < seq_k)[:, None] & mask_d[None, :]
    first_n = k_start + start_n
    b_k = tl.load(p_k + b * sk_b + h_kv * sk_h + first_n * sk_s + offs_n[:, None] * sk_s
                  + offs_d[None, :] * sk_d, mask=mask_kd, other=0.0)
    b_v = tl.load(p_v + b * sv_b + h_kv * sv_h + first_n * sv_s + offs_n[:, None] * sv_s
                  + offs_d[None, :] * sv_d, mask=mask_kd, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)

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
                                 mask_d, seq_q, seq_k, diag, qk_scale, cap, left, right, lo,
                                 hi, BLOCK_M, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D,
                                 PRECISION, INDEX, ulo, uhi, True)
        else:
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, seq_q, seq_k, diag, qk_scale, cap, left, right, lo,
                                 ulo, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D,
                                 PRECISION, INDEX)
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, seq_q, seq_k, diag, qk_scale, cap, left, right, ulo,
                                 uhi, BLOCK_M, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D,
                                 PRECISION, INDEX)
            dk, dv = _dkdv_tiles(dk, dv, b_k, b_v, p_q_base, p_do_base, p_lse_base,
                                 p_delta_base, sq_s, sq_d, sdo_s, sdo_d, keys, offs_m, offs_d,
                                 mask_d, seq_q, seq_k, diag, qk_scale, cap, left, right, uhi,
                                 hi, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D,
                                 PRECISION, INDEX)
    dk *= scale
    tl.store(p_dk + b * sdk_b + h_kv * sdk_h + first_n * sdk_s + offs_n[:, None] * sdk_s
             + offs_d[None, :] * sdk_d, dk.to(p_dk.dtype.element_ty), mask=mask_kd)
    tl.store(p_dv + b * sdv_b + h_kv * sdv_h + first_n * sdv_s + offs_n[:, None] * sdv_s
             + offs_d[None, :] * sdv_d, dv.to(p_dv.dtype.element_ty), mask=mask_kd)


@triton.jit
def _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s, sv_d,
              pos, offs_n, offs_d, mask_d, seq_k, qk_scale, cap, left, right, lo, hi,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PAD_D: tl.constexpr,
              PRECISION: tl.constexpr, INDEX: tl.constexpr, ulo=0, uhi=0,
              MIXED: tl.constexpr = False):
    """Key tiles [lo, hi) against one query tile: accumulate dQ (unscaled). MASKED for the
    tiles on a mask's edge and the ragged last key tile; MIXED as in `_dkdv_tiles`."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        first = tl.cast(start_n, INDEX)
        p_kt = p_k_base + first * sk_s + offs_n[None, :] * sk_s + offs_d[:, None] * sk_d
        p_vt = p_v_base + first * sv_s + offs_n[None, :] * sv_s + offs_d[:, None] * sv_d
        if MASKED or MIXED:
            mask_n = keys < seq_k
            b_kt = tl.load(p_kt, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            b_vt = tl.load(p_vt, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        elif PAD_D:
            b_kt = tl.load(p_kt, mask=mask_d[:, None], other=0.0)
            b_vt = tl.load(p_vt, mask=mask_d[:, None], other=0.0)
        else:
            b_kt = tl.load(p_kt)
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


@triton.jit
def _flash_bwd_dq(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_cu_q, p_cu_k,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    sdo_b, sdo_h, sdo_s, sdo_d, sdq_b, sdq_h, sdq_s, sdq_d,
    sl_b, sl_h, n_heads, group, seq_q, seq_k, head_dim, scale, qk_scale, cap, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, PAD_D: tl.constexpr,
    INDEX: tl.constexpr, HAS_LEFT: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    BOTTOM_RIGHT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ONE_LOOP: tl.constexpr = False,
):
    """dQ of BLOCK_M query rows of one (batch, head); ONE_LOOP as in `_flash_bwd_dkdv`."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(INDEX)
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group
    q_start, seq_q, k_start, seq_k = _sequence(p_cu_q, p_cu_k, b, seq_q, seq_k, VARLEN, INDEX)
    if start_m >= seq_q:
        return
    diag = seq_k - seq_q if BOTTOM_RIGHT else 0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m
    mask_m = rows < seq_q
    mask_d = offs_d < head_dim
    mask_md = mask_m[:, None] & mask_d[None, :]
    first_m = q_start + start_m
    b_q = tl.load(p_q + b * sq_b + h * sq_h + first_m * sq_s + offs_m[:, None] * sq_s
                  + offs_d[None, :] * sq_d, mask=mask_md, other=0.0)
    b_do = tl.load(p_do + b * sdo_b + h * sdo_h + first_m * sdo_s + offs_m[:, None] * sdo_s
                   + offs_d[None, :] * sdo_d, mask=mask_md, other=0.0)
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
                       sv_d, pos, offs_n, offs_d, mask_d, seq_k, qk_scale, cap, left, right,
                       lo, hi, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D, PRECISION,
                       INDEX, ulo, uhi, True)
    else:
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, seq_k, qk_scale, cap, left, right,
                       lo, ulo, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D, PRECISION,
                       INDEX)
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, seq_k, qk_scale, cap, left, right,
                       ulo, uhi, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D,
                       PRECISION, INDEX)
        dq = _dq_tiles(dq, b_q, b_do, lse2, delta, p_k_base, p_v_base, sk_s, sk_d, sv_s,
                       sv_d, pos, offs_n, offs_d, mask_d, seq_k, qk_scale, cap, left, right,
                       uhi, hi, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PAD_D, PRECISION,
                       INDEX)
    dq *= scale
    tl.store(p_dq + b * sdq_b + h * sdq_h + first_m * sdq_s + offs_m[:, None] * sdq_s
             + offs_d[None, :] * sdq_d, dq.to(p_dq.dtype.element_ty), mask=mask_md)


def _launches(dout, q, k, v, out, lse, dlse, delta, dq, dk, dv, *, precision: str, configs,
              mask: Mask, varlen: Varlen | None, scale: float) -> list[tuple]:
    """The backward's three launches as (kernel, grid, args, keyword args): the
    preprocess (delta), the dK/dV pass, the dQ pass. `flash_backward` runs them;
    `precompile_backward` compiles them ahead (Triton's `warmup`) from stand-ins."""
    rows_b, heads, rows_q, dim = q.shape  # rows_q: all query rows (packed: total_q)
    heads_kv = k.shape[1]
    if varlen is not None:
        batch, seq_q, seq_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
        seq_args = (varlen.cu_q, varlen.cu_k)
    else:
        batch, seq_q, seq_k = rows_b, rows_q, k.shape[2]
        seq_args = (q, q)  # unused pointers
    block_d = max(16, triton.next_power_of_2(dim))
    dot_precision = resolve(q.dtype, precision).dot  # None for fp16/bf16
    pre_m = 64 if not EMULATION else 16
    launches = [(_bwd_preprocess, (triton.cdiv(rows_q, pre_m), rows_b * heads),
                 (out, dout, dlse if dlse is not None else delta, delta, *out.stride(),
                  *dout.stride(), heads, rows_q, dim),
                 dict(BLOCK_M=pre_m, BLOCK_D=block_d, HAS_DLSE=dlse is not None))]
    (km, kn, kw, ks), (qm, qn, qw, qs) = configs or backward_configs(
        dim=dim, itemsize=q.element_size(), precision=dot_precision,
        causal=mask.causal or mask.window is not None, seq=seq_k, programs=batch * heads_kv)
    (qk_scale, cap, left, right), flags = mask.kernel_args(scale)
    common = dict(BLOCK_D=block_d, PRECISION=dot_precision, PAD_D=block_d != dim,
                  INDEX=index_dtype(q, k, v, dout, out, rows=rows_b * heads * rows_q),
                  VARLEN=varlen is not None, **flags)
    # one loop or three: dK/dV loops over the queries, dQ over the keys
    edges = dict(precision=dot_precision, has_left=flags.get("HAS_LEFT", False),
                 has_right=flags.get("HAS_RIGHT", False))
    one_dkdv = backward_single_loop(seq=seq_q, **edges)
    one_dq = backward_single_loop(seq=seq_k, **edges)
    packed = varlen is not None  # sequences start at cu[b]: no batch strides

    def strides(*tensors):
        return [x for t in tensors for x in ((0 if packed else t.stride(0)), *t.stride()[1:])]

    lse_bh = (0 if packed else heads * rows_q, rows_q)
    launches.append((_flash_bwd_dkdv, (triton.cdiv(seq_k, kn), batch * heads_kv),
                     (q, k, v, dout, lse, delta, dk, dv, *seq_args,
                      *strides(q, k, v, dout, dk, dv), *lse_bh, heads, heads_kv,
                      heads // heads_kv, seq_q, seq_k, dim, scale, qk_scale, cap, left, right),
                     dict(BLOCK_M=km, BLOCK_N=kn, num_warps=kw, num_stages=ks,
                          ONE_LOOP=one_dkdv, **common)))
    launches.append((_flash_bwd_dq, (triton.cdiv(seq_q, qm), batch * heads),
                     (q, k, v, dout, lse, delta, dq, *seq_args, *strides(q, k, v, dout, dq),
                      *lse_bh, heads, heads // heads_kv, seq_q, seq_k, dim, scale, qk_scale,
                      cap, left, right),
                     dict(BLOCK_M=qm, BLOCK_N=qn, num_warps=qw, num_stages=qs,
                          ONE_LOOP=one_dq, **common)))
    return launches


# Compiling the backward ahead, while the forward compiles and runs: a fresh shape's
# forward + backward otherwise pays for three compiles one after another (5-7 s on the
# H200, `bench --suite coldstart`). Triton's compile releases the GIL in its passes and in
# ptxas, so threads overlap. One pool per process; a backward waits for what is in flight
# (never compiling a kernel twice at once); a shape is submitted once.
_POOL: ThreadPoolExecutor | None = None
_PENDING: list[Future] = []
_SUBMITTED: set[tuple] = set()


def precompile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        is_causal: bool, scale: float, precision: str,
                        mask: Mask | None = None) -> None:
    """Start compiling the backward of `attention(q, k, v, ...)` on background threads,
    from stand-ins shaped as the forward's outputs and dO (contiguous, as autograd hands
    them on); returns at once. A backward whose operands specialise differently compiles
    its own kernels as usual. Nothing in emulation (the interpreter compiles nothing)."""
    global _POOL
    mask = mask or Mask(causal=is_causal)
    key = (q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(), mask, precision,
           q.device)
    if EMULATION or key in _SUBMITTED:
        return
    _SUBMITTED.add(key)
    # stand-ins: a compile reads dtypes, strides and pointer alignment, never the data, so
    # q, k and v stand for dQ, dK, dV (`empty_like`: the same strides where dense) and q for
    # O and dO where it is contiguous as they are; only the LSE-sized buffer is new
    out = q if q.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    launches = _launches(out, q, k, v, out, lse, None, lse, q, k, v, precision=precision,
                         configs=None, mask=mask, varlen=None, scale=scale)
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=3, thread_name_prefix="fusedattn-compile")

    def compile_one(kernel, grid, args, kwargs):
        with torch.cuda.device(q.device):  # the thread's current device is the inputs'
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            # and what the first launch would do next: load the module, build the launcher
            # (the host compiler), here off the main thread
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()

    _PENDING.extend(_POOL.submit(compile_one, *launch) for launch in launches)


def _wait_for_precompiles() -> None:
    """Let the background compiles finish (their errors, if any, come back when the
    backward compiles the same kernel itself)."""
    while _PENDING:
        _PENDING.pop().exception()  # waits; the error itself is not raised here


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, *,
                   is_causal: bool, scale: float, precision: str, configs=None,
                   mask: Mask | None = None, varlen: Varlen | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention` on validated `[B, H, S, D]` tensors (any strides).

    `lse: [B, H, Sq] float32` is the forward's natural-log LSE; `dlse` its gradient or None.
    Returns `(dq, dk, dv)` (`empty_like` q, k, v: their strides where dense, else
    contiguous), in the inputs' dtype (dK, dV summed over the query heads that share each
    K/V head). `configs`: ((BLOCK_M, BLOCK_N, warps, stages) for dK/dV, the same for dQ), to
    time other tiles; default `configs.backward_configs`. `mask` and `varlen` as in
    `flash.flash_forward` (packed sequences come as `[1, H, total, D]` views)."""
    mask = mask or Mask(causal=is_causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    q, k, v, dout = emulation_operands(q, k, v, dout)
    lse = lse.contiguous()
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    _wait_for_precompiles()
    with kernel_launches():
        for kernel, grid, args, kwargs in _launches(
                dout, q, k, v, out, lse, dlse, delta, dq, dk, dv, precision=precision,
                configs=configs, mask=mask, varlen=varlen, scale=scale):
            kernel[grid](*args, **kwargs)
    return dq, dk, dv
