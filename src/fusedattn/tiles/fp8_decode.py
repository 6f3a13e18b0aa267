"""FP8 (e4m3) decode: the split-KV kernel for `attention_with_kvcache` on e4m3 caches when
a K/V head has few query rows (one decode step of a GQA group, a few speculative tokens).

Why a kernel of its own. `flash_kernels._flash_fwd` computes S = Q K^T and O += P V with
the query rows as the products' M. For decode that M is a handful of rows, so Triton takes
mma.sync, whose 8-bit operands need the product's inner dim contiguous in each thread:
for P V that dim is the keys, and V's rows run along the head dim, so V was gathered from
shared memory byte by byte (128 `LDS.U8` a D128 tile of 128 keys), then widened to fp16:
an e4m3 key tile issued about 2.1x a bf16 one (sm90-compile 0404Z). Here the products are
transposed, the keys as M:

    S^T = K Q^T                  [BLOCK_N, BLOCK_R]  e4m3 x e4m3, K as stored (K-major)
    softmax along the keys (axis 0), the online m per column (= per query row), l kept
    per element of S^T and summed over the keys after the last tile
    O^T = O^T * alpha + V^T P^T  [D, BLOCK_R]        fp16: V widened in registers

With M = BLOCK_N >= 64 Triton takes wgmma: QGMMA for S^T straight from K's bytes, and for
O^T an HGMMA whose A is V^T, widened from e4m3 to fp16 in registers (exact) before any
shared-memory round trip. V is loaded as int32 words (four e4m3 each, a row's 16 bytes a
load), not as bytes, which the loop carried a register each and packed again (PRMTs)
around its back edge, and widened by PTX's `cvt.rn.f16x2.e4m3x2` (`_widen_e4m3`). P
enters the product in fp16: the product's operands are fp16 anyway, and P keeps 11
significant bits where the FP8 formula's e4m3 P keeps 4. Built for sm_90a with Triton
3.6, a D128 key tile of 128 keys is 459-519 SASS instructions a thread against
`_flash_fwd`'s 906-910 and bf16 decode's 425 (evidence/sm90-compile/20261205T0626Z-fp8-
decode-deferred-sum): a compiler's count, not a time.

Masks, paging, lengths, splits, sinks and the outputs are `_flash_fwd`'s (the same
`tiles/common` helpers and arguments); the split partials go to the same merge
(`splitkv.merge_splits`). `flash.flash_forward` launches it where `refusal` returns None.
Not by default yet: until the GPU tier has run it and `scripts/decode_tiles.py` has timed
it against `_flash_fwd` on the H200, it is opt-in, `FUSEDATTN_FP8_DECODE=1`
(`configs.OVERRIDES.fp8_decode`). CI runs the tests on both kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedattn import configs
from fusedattn.launch import settle_keys
from fusedattn.mode import EMULATION
from fusedattn.problem import FP8
from fusedattn.tiles.common import MASK_FLAGS, _scores, _sequence, _spans, _visible, shape_jit
from fusedattn.tiles.flash_kernels import _add_sinks

MAX_ROWS = 32  # query rows of a K/V head (Sq x group) this kernel takes: S^T's N
HEAD_DIMS = (64, 128, 256)
# e4m3 products a wgmma sums in its own accumulator before they join the fp32 scores:
# one instruction's K (32). Triton's sm_90 default (the whole head dim) put the LSE
# 1.1-1.5e-3 off the float64 one on an H100, this 1.2e-3 at most (evidence/nvidia-h100/
# 20261205T144331Z-gpu-tier); what is left is the tensor cores' own sum of 32 products
IMPRECISE_ACC = tl.constexpr(32)
# the interpreter has no inline PTX: there the bytes are taken apart in Triton's ops (the
# same values: e4m3 -> fp16 is exact both ways), which checks the words' addressing and the
# order of their elements in CI; the GPU tier checks the PTX
WIDEN_ASM = tl.constexpr(not EMULATION)


@triton.jit
def _half(x, SHIFT: tl.constexpr):
    """The fp16 in bits SHIFT..SHIFT + 15 of int32 `x` (the cast to int16 keeps the low 16)."""
    return (x >> SHIFT).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _byte(x, SHIFT: tl.constexpr):
    """The e4m3 in bits SHIFT..SHIFT + 7 of int32 `x`, widened to fp16 (exact)."""
    return (x >> SHIFT).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _widen_e4m3(words):
    """`words` [N, W] int32, each four e4m3 values (the first in the low byte, as memory
    holds them) -> [N, 4 * W] fp16, in memory order."""
    if WIDEN_ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 $0, a; "
            "cvt.rn.f16x2.e4m3x2 $1, b; }",
            "=r,=r,r", [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        e0, e1, e2, e3 = _half(lo, 0), _half(lo, 16), _half(hi, 0), _half(hi, 16)
    else:
        e0, e1, e2, e3 = (_byte(words, 0), _byte(words, 8), _byte(words, 16),
                          _byte(words, 24))
    n: tl.constexpr = words.shape[0]
    w: tl.constexpr = words.shape[1]
    # (join stacks on a new last axis: [.., j, i] is element 2 j + i)
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), [n, 4 * w])


@triton.heuristics(MASK_FLAGS | {
    "PAGED": lambda a: a["p_table"] is not None,
    "WRITE_LSE": lambda a: a["p_lse"] is not None,
    "SPLIT": lambda a: a["split_len"] > 0,
    "SINKS": lambda a: a["p_sinks"] is not None,
})
@shape_jit
def _fp8_decode(
    p_q, p_k, p_v, p_o, p_lse, p_seqlens_k, p_table, p_sinks, p_descale,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s,
    so_b, so_h, so_s, so_d, so_split, sl_b, sl_h, sl_split, st_b,
    n_heads, group, seq_q, seq_k, qk_scale, cap, left, right, page, split_len, seqlens_add,
    n_pages,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    INDEX: tl.constexpr,
    # derived from the arguments (the heuristics above), never passed:
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, WRITE_LSE: tl.constexpr, SPLIT: tl.constexpr,
    SINKS: tl.constexpr,
):
    """BLOCK_R rows of one (batch, K/V head), row r being (query r // group, head
    h_kv * group + r % group), over the keys of split program_id(2): the arguments are
    `_flash_fwd`'s for a KV cache with PACK_GQA and BOTTOM_RIGHT (its docstring), except
    that V's strides `sv_*` count int32 words (four e4m3 bytes: the host checked that V's
    rows start on 4 bytes and its head dim is contiguous) and the head dim is HEAD_DIM,
    unpadded, Q's, K's and V's alike."""
    bh = tl.program_id(1).to(INDEX)
    heads_kv = n_heads // group
    b = bh // heads_kv
    h_kv = bh % heads_kv
    _, seq_q, _, seq_k = _sequence(p_seqlens_k, p_seqlens_k, p_seqlens_k, b, seq_q, seq_k,
                                   False, True, INDEX, False, seqlens_add)
    start_r = tl.program_id(0) * BLOCK_R
    diag = seq_k - seq_q  # queries aligned bottom-right: query i at i + Sk - Sq
    offs_r = start_r + tl.arange(0, BLOCK_R)
    offs_m = offs_r // group
    heads = h_kv * group + offs_r % group
    mask_r = offs_r < seq_q * group
    pos = offs_m + diag
    last_pos = tl.minimum((start_r + BLOCK_R - 1) // group, seq_q - 1) + diag
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_w = tl.arange(0, HEAD_DIM // 4)

    row_q = offs_m.to(INDEX)
    b_q = tl.load(p_q + b * sq_b + heads[:, None].to(INDEX) * sq_h + row_q[:, None] * sq_s
                  + offs_d[None, :] * sq_d, mask=mask_r[:, None], other=0.0)
    b_qt = tl.trans(b_q)  # [HEAD_DIM, BLOCK_R]: S^T's B, K-major as float8 needs
    # the scores are (k8 q8^T) * descale_k * descale_q * scale: q's factor its row's head's,
    # a column of S^T
    col_scale = (qk_scale * tl.load(p_descale + heads)
                 * tl.load(p_descale + n_heads + h_kv))[None, :]

    lo, ulo, uhi, hi = _spans(start_r // group + diag, last_pos, seq_k, -left, right,
                              BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if SPLIT:
        s0 = tl.program_id(2) * split_len
        lo = tl.maximum(lo, s0)
        hi = tl.maximum(tl.minimum(hi, s0 + split_len), lo)
        ulo = tl.minimum(tl.maximum(ulo, lo), hi)
        uhi = tl.maximum(tl.minimum(uhi, hi), ulo)
    p_words = p_v.to(tl.pointer_type(tl.int32), bitcast=True)
    if PAGED:
        p_k_base = p_k + h_kv * sk_h
        p_w_base = p_words + h_kv * sv_h
        p_pages = p_table + b * st_b
    else:
        p_k_base = p_k + b * sk_b + h_kv * sk_h
        p_w_base = p_words + b * sv_b + h_kv * sv_h
        p_pages = p_k  # stands in, never read

    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    # l, the rows' sums, kept as S^T's shape and summed over the keys once at the end: a
    # sum along the keys a tile would cross the warps (shuffles, shared memory, a barrier)
    l_acc = tl.zeros((BLOCK_N, BLOCK_R), tl.float32)
    acc = tl.zeros((HEAD_DIM, BLOCK_R), tl.float32)  # O^T
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        mask_n = keys < seq_k
        # the rows of the keys as `flash_kernels._key_tiles` finds them (to become one
        # helper when `_flash_fwd`'s source next changes: its shipped prebuilt entries are
        # keyed by that source, and moving this out of it would miss them all)
        if PAGED:
            blk = tl.load(p_pages + keys // page, mask=mask_n, other=0)
            blk = tl.minimum(tl.maximum(blk, 0), n_pages - 1).to(INDEX)  # inside the cache
            k_rows = blk * sk_b + (keys % page) * sk_s
            v_rows = blk * sv_b + (keys % page) * sv_s
        else:
            first = tl.cast(start_n, INDEX)
            k_rows = first * sk_s + offs_n * sk_s
            v_rows = first * sv_s + offs_n * sv_s
        b_k = tl.load(p_k_base + k_rows[:, None] + offs_d[None, :] * sk_d,
                      mask=mask_n[:, None], other=0.0)
        # keys as the dot's M (64 or more) make it a wgmma, whose e4m3 products Triton
        # sums by default in the tensor cores' narrower accumulator over the whole head
        # dim (sm_90's default); IMPRECISE_ACC adds each instruction's sum in fp32
        qk = tl.dot(b_k, b_qt, max_num_imprecise_acc=IMPRECISE_ACC)
        s = _scores(qk, col_scale, cap, SOFTCAP)  # [BLOCK_N, BLOCK_R]
        if (start_n < ulo) | (start_n >= uhi):  # a tile on a mask's edge, or the last
            s = tl.where(_visible(pos[None, :], keys[:, None], seq_k, left, right, HAS_LEFT,
                                  HAS_RIGHT), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        # a row that has seen no key yet keeps m = -inf; its exponents subtract 0 instead
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + p
        words = tl.load(p_w_base + v_rows[:, None] + offs_w[None, :], mask=mask_n[:, None],
                        other=0)
        b_vt = tl.trans(_widen_e4m3(words))  # [HEAD_DIM, BLOCK_N] fp16
        acc = acc * alpha[None, :] + tl.dot(b_vt, p.to(tl.float16))
        m_i = m_new

    l_i = tl.sum(l_acc, axis=0)
    # a row that sees no key (a window past the keys, an empty split) has l = 0: its
    # output is 0 and its LSE -inf
    if SINKS and not SPLIT:  # O = acc * alpha / l (alpha = 0, acc = 0: a row of no key)
        m_i, l_i, alpha = _add_sinks(p_sinks, heads, m_i, l_i)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i) / alpha
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    l_safe = l_safe / tl.load(p_descale + n_heads + heads_kv + h_kv)  # O takes descale_v
    out = tl.trans(acc / l_safe[None, :])  # [BLOCK_R, HEAD_DIM]
    split = tl.program_id(2).to(INDEX) if SPLIT else 0
    tl.store(p_o + split * so_split + b * so_b + heads[:, None].to(INDEX) * so_h
             + row_q[:, None] * so_s + offs_d[None, :] * so_d,
             out.to(p_o.dtype.element_ty), mask=mask_r[:, None])
    if WRITE_LSE:  # natural-log LSE: m and log2(l) are in base 2
        tl.store(p_lse + split * sl_split + b * sl_b + heads.to(INDEX) * sl_h + row_q,
                 (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mask_r)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache, pack_gqa: bool,
            config) -> str | None:
    """None where this kernel serves a split-KV forward (`flash.flash_forward`'s
    arguments), else why `_flash_fwd` does."""
    if q.dtype != FP8 or cache is None or not pack_gqa:
        return "not an e4m3 KV-cache call"
    if not configs.OVERRIDES.fp8_decode:
        return "not turned on (FUSEDATTN_FP8_DECODE=1)"
    if config is not None:
        return "an explicit config (`_flash_fwd`'s)"
    dim = q.shape[-1]
    if dim not in HEAD_DIMS or v.shape[-1] != dim:
        return f"head dims {dim}/{v.shape[-1]} (this kernel: {HEAD_DIMS}, V's as Q's)"
    rows = q.shape[2] * (q.shape[1] // k.shape[1])
    if rows > MAX_ROWS:
        return f"{rows} query rows a K/V head (this kernel: up to {MAX_ROWS})"
    if v.stride(-1) != 1 or v.data_ptr() % 4 or any(s % 4 for s in v.stride()[:-1]):
        return "V's rows not in whole 4-byte words (its int32 loads)"
    return None


def launch(q, k, v, *, target, target_lse, cache, mask_args, sinks, descale, splits: int,
           split_len: int, tile, index, recording):
    """`_fp8_decode` into `target`/`target_lse`: O and the LSE, or with `splits` > 1 the
    fp32 partials `[splits, B, H, Sq, D]` / `[splits, B, H, Sq]` for the merge.
    `mask_args`: `Mask.kernel_args`; `tile`: `configs.fp8_decode_config`'s. Returns the
    compiled kernel (`Recording.launch`'s)."""
    block_r, block_n, warps, stages = tile
    batch, heads, seq_q, dim = q.shape
    heads_kv = k.shape[1]
    table = cache.block_table
    seq_k = table.shape[1] * k.shape[2] if table is not None else k.shape[2]
    qk_scale, cap, left, right = mask_args
    split = splits > 1
    so = target.stride()[-4:]
    sl = (0, 0) if target_lse is None else target_lse.stride()[-3:-1]
    sv = [s // 4 for s in v.stride()[:3]]
    return recording.launch(
        _fp8_decode, (triton.cdiv(seq_q * (heads // heads_kv), block_r), batch * heads_kv,
                      splits),
        p_q=q, p_k=k, p_v=v, p_o=target, p_lse=target_lse, p_seqlens_k=cache.seqlens,
        p_table=table, p_sinks=sinks, p_descale=descale,
        sq_b=q.stride(0), sq_h=q.stride(1), sq_s=q.stride(2), sq_d=q.stride(3),
        sk_b=k.stride(0), sk_h=k.stride(1), sk_s=k.stride(2), sk_d=k.stride(3),
        sv_b=sv[0], sv_h=sv[1], sv_s=sv[2],
        so_b=so[0], so_h=so[1], so_s=so[2], so_d=so[3],
        so_split=target.stride(0) if split else 0, sl_b=sl[0], sl_h=sl[1],
        sl_split=target_lse.stride(0) if split and target_lse is not None else 0,
        st_b=table.stride(0) if table is not None else 0,
        n_heads=heads, group=heads // heads_kv, seq_q=seq_q, seq_k=seq_k,
        qk_scale=qk_scale, cap=cap, left=left, right=right,
        page=k.shape[2] if table is not None else 0, split_len=split_len if split else 0,
        seqlens_add=cache.added, n_pages=k.shape[0] if table is not None else 0,
        BLOCK_R=block_r, BLOCK_N=block_n, HEAD_DIM=dim, INDEX=index,
        num_warps=warps, num_stages=stages)


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
