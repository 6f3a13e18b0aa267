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
wholly past the diagonal are not visited, and those wholly before it run without any mask
(`_key_tiles` is instantiated twice: unmasked whole tiles, then the diagonal/ragged ones).
Head dims up to 256, padded to a power of two >= 16 (masked). fp32 inputs use
`input_precision="ieee"` (exact FMA) unless "tf32" or "tf32x3" is asked for.

HBM traffic per (batch, head), the fewest bytes: read Q, K, V once, write O (and LSE):
(2*Sq + 2*Sk) * D * itemsize (+ 4*Sq). K and V are re-read once per query tile, i.e.
ceil(Sq / BLOCK_M) times, from L2 when it holds them. FLOPs: 4 * Sq * Sk * D (half causal).
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

from fusedattn.configs import autotune_requested, forward_config
from fusedattn.mode import EMULATION
from fusedattn.precision import resolve

LOG2E = 1.4426950408889634  # 1/ln(2): exp(x) = exp2(x * LOG2E)


@triton.jit
def _key_tiles(acc, l_i, m_i, b_q, p_k_base, p_v_base, sk_s, sk_d, sv_s, sv_d,
               offs_m, offs_n, offs_d, mask_d, seq_k, qk_scale, lo, hi,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               PAD_D: tl.constexpr, PRECISION: tl.constexpr, INDEX: tl.constexpr):
    """Key tiles [lo, hi) of one query tile: the online-softmax update. MASKED=False for
    tiles wholly inside the keys and wholly visible to every row of the tile (no compare, no
    select per element, no bounds on the loads); MASKED=True for the diagonal tiles (causal)
    and the ragged last one. PAD_D: the head dim is padded up to BLOCK_D (masked columns)."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        mask_n = keys < seq_k
        first = tl.cast(start_n, INDEX)  # the tile's first row (INDEX bits); inside it, 32
        p_kt = (p_k_base + first * sk_s
                + offs_n[None, :] * sk_s + offs_d[:, None] * sk_d)         # [BLOCK_D, BLOCK_N]
        p_vt = (p_v_base + first * sv_s
                + offs_n[:, None] * sv_s + offs_d[None, :] * sv_d)         # [BLOCK_N, BLOCK_D]
        if MASKED:
            b_kt = tl.load(p_kt, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        elif PAD_D:
            b_kt = tl.load(p_kt, mask=mask_d[:, None], other=0.0)
        else:
            b_kt = tl.load(p_kt)
        s = tl.dot(b_q, b_kt, input_precision=PRECISION) * qk_scale      # [BLOCK_M, BLOCK_N]
        if MASKED:
            valid = mask_n[None, :]
            if IS_CAUSAL:
                valid = valid & (keys[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        # Every row sees key 0, which is in the first tile visited, so m_i is finite from
        # the first tile on and a row whose keys in a later tile are all masked keeps m_i.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            b_v = tl.load(p_vt, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        elif PAD_D:
            b_v = tl.load(p_vt, mask=mask_d[None, :], other=0.0)
        else:
            b_v = tl.load(p_vt)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd(
    p_q, p_k, p_v, p_o, p_lse,
    sq_b, sq_h, sq_s, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_s, so_d,
    n_heads, group, seq_q, seq_k, head_dim, qk_scale,
    bucket_q, bucket_k,  # autotune keys only: the sequence lengths' power-of-two buckets
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    PAD_D: tl.constexpr, INDEX: tl.constexpr,
):
    if IS_CAUSAL:
        # the last query tiles see the most keys: launch them first, so the short tiles
        # fill the end of the grid instead of leaving SMs idle behind one long tile
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    bh = tl.program_id(1).to(INDEX)  # int64 where b * stride can pass 2^31 (`index_dtype`)
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group  # GQA: `group` query heads share one K/V head

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_q
    mask_d = offs_d < head_dim

    first_m = (start_m * BLOCK_M).to(INDEX)
    p_q_tile = (p_q + b * sq_b + h * sq_h + first_m * sq_s
                + tl.arange(0, BLOCK_M)[:, None] * sq_s + offs_d[None, :] * sq_d)
    b_q = tl.load(p_q_tile, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    p_k_base = p_k + b * sk_b + h_kv * sk_h
    p_v_base = p_v + b * sv_b + h_kv * sv_h
    if IS_CAUSAL:
        # keys before this tile's first row are visible to all its rows; the last key any
        # of its rows sees is its last row: stop there (tiles past the diagonal are skipped)
        open_end = tl.minimum(start_m * BLOCK_M, seq_k)
        hi = tl.minimum(seq_k, (start_m + 1) * BLOCK_M)
    else:
        open_end = seq_k
        hi = seq_k
    open_end = open_end // BLOCK_N * BLOCK_N  # whole key tiles only
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, b_q, p_k_base, p_v_base, sk_s, sk_d, sv_s, sv_d,
                               offs_m, offs_n, offs_d, mask_d, seq_k, qk_scale, 0, open_end,
                               BLOCK_N, False, IS_CAUSAL, PAD_D, PRECISION, INDEX)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, b_q, p_k_base, p_v_base, sk_s, sk_d, sv_s, sv_d,
                               offs_m, offs_n, offs_d, mask_d, seq_k, qk_scale, open_end, hi,
                               BLOCK_N, True, IS_CAUSAL, PAD_D, PRECISION, INDEX)

    out = acc / l_i[:, None]
    p_o_tile = (p_o + b * so_b + h * so_h + first_m * so_s
                + tl.arange(0, BLOCK_M)[:, None] * so_s + offs_d[None, :] * so_d)
    tl.store(p_o_tile, out.to(p_o.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    if WRITE_LSE:
        # natural-log LSE of the scaled scores: m and log2(l) are in base 2; * ln(2)
        tl.store(p_lse + bh * seq_q + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453,
                 mask=mask_m)


# Hopper configs, (BLOCK_M, BLOCK_N, warps, stages). Tensor cores (fp16, bf16, tf32):
# 128-row query tiles feed wgmma (a warpgroup of 4 warps takes 64 rows); 64-row tiles give
# more programs when B*H*Sq is small. The four kept are those that won on the H200 (bf16
# D=64 causal S=8192/16384, D=128 S=4096, fp32-tf32 S=4096, each config timed alone with
# `fusedattn bench --configs`); 128x64 with 4 warps (3 or 4 stages), 64x128 and 64x64 with
# 4 stages never did and went. fp32-ieee runs tl.dot as FMA on CUDA cores, where a thread's
# share of the tile sets the shared-memory traffic per FMA: it tries both sets (at S=4096,
# D=64 the FMA set alone reached 12.3 TFLOP/s). Short queries (bucket <= 256) try only
# small tiles: there one 128-row tile would be the whole grid of a head, and compiling
# fewer configs keeps a fresh process's first call short.
TENSOR_CORE = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4))
FMA = ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2),
       (32, 64, 4, 2), (64, 32, 4, 3), (32, 32, 2, 2), (128, 64, 4, 3))
SHORT = ((64, 64, 4, 3), (32, 32, 4, 2), (16, 32, 2, 2), (16, 16, 1, 1))
SHORT_SEQ = 256  # a query length bucket up to this tries the SHORT configs only


def _shape(c: triton.Config) -> tuple[int, int, int, int]:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
           for bm, bn, w, st in dict.fromkeys(TENSOR_CORE + FMA + SHORT)]


def candidates(configs, head_dim: int, bucket_q: int, precision) -> list:
    """The configs worth timing for one problem: the short-sequence set for short queries,
    else both sets for fp32-ieee and the tensor-core set otherwise; for head dims over 128
    only tiles of <= 64 (K, V and an accumulator of 256 columns overfill a Hopper SM's
    shared memory and registers at 128)."""
    if bucket_q <= SHORT_SEQ:
        sets = SHORT
    else:
        sets = TENSOR_CORE + FMA if precision == "ieee" else TENSOR_CORE
    keep = [c for c in configs if _shape(c) in sets]
    if head_dim > 128:
        keep = [c for c in keep if c.kwargs["BLOCK_N"] <= 64 and c.kwargs["BLOCK_M"] <= 64]
    return keep or configs[:1]


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    return candidates(configs, args["head_dim"], args["bucket_q"], args["PRECISION"])


# Autotune results saved in Triton's cache dir, so a fresh process (run-all starts several)
# does not time every config again; a keyword of newer Tritons, passed where it exists.
_CACHE = ({"cache_results": True}
          if "cache_results" in inspect.signature(triton.autotune).parameters else {})

# Only with FUSEDATTN_AUTOTUNE=1 (`configs.autotune_requested`): the table's config otherwise.
_flash_fwd_autotuned = triton.autotune(
    configs=CONFIGS,
    key=["bucket_q", "bucket_k", "BLOCK_D", "IS_CAUSAL", "PRECISION", "PAD_D"],
    prune_configs_by={"early_config_prune": _prune}, **_CACHE,
)(_flash_fwd)


def index_dtype(*tensors: torch.Tensor, rows: int = 0):
    """The kernels' offset type: `tl.int32` when every element offset of `tensors` (and
    `rows`, the LSE/delta length) fits in 31 bits, else `tl.int64` (batch and head offsets
    and tiles' first rows; offsets inside a tile stay 32-bit). 32 bits where they suffice,
    the widths used before 64-bit offsets existed. FUSEDATTN_INDEX64=1 forces 64 bits (to
    measure what they cost)."""
    span = max([rows] + [sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
                         for t in tensors])
    if span >= 2**31 - 1 or os.environ.get("FUSEDATTN_INDEX64") == "1":
        return tl.int64
    return tl.int32


def emulation_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' operands as they are, except bf16 in the interpreter: there they become
    fp32 copies, because the interpreter's bf16 `tl.dot` returns garbage (an upstream bug:
    values near 8e8 for inputs of N(0,1)). Products from fp32 copies of bf16 values are
    exact, so emulated bf16 is at least as accurate as the GPU's; outputs keep their dtype."""
    if EMULATION:
        return tuple(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)
    return tensors


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor,
                  lse: torch.Tensor | None, is_causal: bool, scale: float,
                  precision: str, config: triton.Config | None = None):
    """Launch on validated `[B, H, S, D]` tensors (any strides); writes `out` (and `lse`,
    `[B, H, Sq] float32`); returns `(out, compiled kernel or None)`. `precision`: "ieee",
    "tf32" or "tf32x3", used for fp32 inputs only. The config is the table's
    (`configs.forward_config`), Triton's autotuner's with FUSEDATTN_AUTOTUNE=1, or `config`
    (for timing configs one by one, `fusedattn bench --configs`)."""
    batch, heads, seq_q, dim = q.shape
    seq_k, heads_kv = k.shape[2], k.shape[1]
    q, k, v = emulation_operands(q, k, v)
    block_d = max(16, triton.next_power_of_2(dim))
    # fp32: "ieee" (exact products) or "tf32"; fp16/bf16 feed the tensor cores as they are
    dot_precision = resolve(q.dtype, precision).dot  # None for fp16/bf16

    def grid(meta):
        return (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)

    kernel, fixed = _flash_fwd, {}
    if config is None and autotune_requested():
        kernel = _flash_fwd_autotuned
    else:
        if config is None:
            bm, bn, warps, stages = forward_config(
                dim=dim, seq_q=seq_q, programs_per_tile_row=batch * heads, causal=is_causal,
                precision=dot_precision)
        else:
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            warps, stages = config.num_warps, config.num_stages
        fixed = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    compiled = kernel[grid](
        q, k, v, out, lse if lse is not None else out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        heads, heads // heads_kv, seq_q, seq_k, dim, scale * LOG2E,
        triton.next_power_of_2(seq_q), triton.next_power_of_2(seq_k),
        BLOCK_D=block_d, IS_CAUSAL=is_causal, WRITE_LSE=lse is not None,
        PRECISION=dot_precision, PAD_D=block_d != dim,
        INDEX=index_dtype(q, k, v, out, rows=batch * heads * seq_q), **fixed,
    )
    return out, compiled


def flops(batch: int, heads: int, seq_q: int, seq_k: int, dim: int, causal: bool) -> float:
    """4*B*H*Sq*Sk*D (two GEMMs of 2*Sq*Sk*D each); half of it when causal."""
    f = 4.0 * batch * heads * seq_q * seq_k * dim
    return f / 2 if causal else f

