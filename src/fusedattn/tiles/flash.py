"""FlashAttention-2-style forward in Triton: query tiles x key tiles, tensor cores. This
module launches it (`flash_forward`); the kernel is in `flash_kernels.py`.

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
Head dims up to 256: a power of two >= 16, padded (masked), or for fp16/bf16 two
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

from fusedattn.configs import (
    CONFIGS,
    autotune_requested,
    decode_config,
    forward_config,
    fp8_decode_config,
    head_dim_pieces,
    prune_configs,
    single_key_loop,
)
from fusedattn.launch import Recording
from fusedattn.mode import kernel_launches
from fusedattn.precision import resolve
from fusedattn.tiles import fp8_decode
from fusedattn.tiles.common import (
    KVCache,
    Mask,
    Varlen,
    emulation_operands,
    index_dtype,
    row_alignment,
)
from fusedattn.tiles.flash_kernels import _flash_fwd
from fusedattn.tiles.splitkv import merge_splits

# Autotune results saved in Triton's cache dir, so a fresh process (run-all starts several)
# does not time every config again; a keyword of newer Tritons, passed where it exists.
_CACHE = ({"cache_results": True}
          if "cache_results" in inspect.signature(triton.autotune).parameters else {})

# Only with FUSEDATTN_AUTOTUNE=1 (`configs.autotune_requested`): the table's config otherwise.
# Its keys are arguments (the autotuner keys before the heuristics derive the flags):
# `right` tells causal (0) from full (-1), the head dim tells padded from not.
_flash_fwd_autotuned = triton.autotune(
    configs=CONFIGS,
    key=["bucket_q", "bucket_k", "BLOCK_D", "BLOCK_D2", "BLOCK_DV", "right", "PRECISION",
         "head_dim", "head_dim_v"],
    prune_configs_by={"early_config_prune": prune_configs}, **_CACHE,
)(_flash_fwd)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor,
                  lse: torch.Tensor | None, is_causal: bool, scale: float,
                  precision: str, config: triton.Config | None = None,
                  mask: Mask | None = None, varlen: Varlen | None = None,
                  cache: KVCache | None = None, splits: int = 1, pack_gqa: bool = False,
                  recording: Recording | None = None, sinks: torch.Tensor | None = None,
                  descale: torch.Tensor | None = None):
    """Launch on validated `[B, H, S, D]` tensors (any strides); writes `out` (and `lse`,
    `[B, H, Sq] float32`); returns `(out, compiled kernel or None)`. `precision`: "ieee",
    "tf32" or "tf32x3", used for fp32 inputs only. The config is the table's
    (`configs.forward_config`), Triton's autotuner's with FUSEDATTN_AUTOTUNE=1, or `config`
    (for timing configs one by one, `fusedattn bench --configs`).

    `mask` (default: `is_causal` top-left) adds windows, softcap and bottom-right
    alignment; `varlen` takes packed sequences (q, k, v, out as `[1, H, total, D]` views,
    lse `[1, H, total_q]`); `cache` reads K/V from a KV cache; `splits` > 1 splits each
    sequence's keys across programs and merges their partials by LSE (flash-decoding);
    `pack_gqa` lets one program serve every query head of a K/V head; `sinks` (`[H]`
    float32, contiguous) adds attention sinks to every row's denominator. `recording`
    (`launch.Recording`) records the launches for the caller's plan (split-KV's partials as
    its scratch); under the autotuner the call is not replayable (its config varies).
    `descale` (float8 e4m3 q, k, v): their dequantisation factors, float32
    `[H + 2 * H_kv]` (`api.fp8_descale`); `out` is then bfloat16."""
    mask = mask or Mask(causal=is_causal)
    heads, dim, dim_v = q.shape[1], q.shape[3], v.shape[3]
    heads_kv = k.shape[1]
    group = heads // heads_kv
    if varlen is not None:
        batch, seq_q, seq_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
    table = cache.block_table if cache is not None else None
    if table is not None:
        seq_k = table.shape[1] * k.shape[2]
    q, k, v = emulation_operands(q, k, v)
    # fp32: "ieee" (exact products) or "tf32"; fp16/bf16 feed the tensor cores as they are
    dot_precision = resolve(q.dtype, precision).dot  # None for fp16/bf16
    # rows on 16 bytes and a head dim of whole 16-byte words: the head dim may be split,
    # and the kernel is told so (ALIGN) unless Triton sees it already (strides and head dim
    # multiples of 16, which it specialises on)
    align = row_alignment(q, k, v)
    align = align if dim % align == 0 and dim_v % align == 0 else 1
    block_d, block_d2 = head_dim_pieces(dim, precision=dot_precision, aligned=align > 1)
    block_dv, block_dv2 = head_dim_pieces(dim_v, precision=dot_precision, aligned=align > 1)
    if all(x % 16 == 0 for t in (q, k, v) for x in t.stride()[:-1]) and dim % 16 == 0 \
            and dim_v % 16 == 0:
        align = 1
    widest = max(dim, dim_v)  # the tiles' sizes follow the wider of the two head dims
    rows = seq_q * group if pack_gqa else seq_q
    per_row = batch * (heads_kv if pack_gqa else heads)

    kernel, fixed = _flash_fwd, {}
    # e4m3 decode of few rows a K/V head: its own kernel (`fp8_decode`'s docstring says why)
    transposed = fp8_decode.refusal(q, k, v, cache=cache, pack_gqa=pack_gqa,
                                    config=config) is None
    if config is None and autotune_requested() and mask == Mask(causal=is_causal) \
            and varlen is None and cache is None and splits == 1 and not pack_gqa:
        kernel = _flash_fwd_autotuned
    else:
        if transposed:
            bm, bn, warps, stages = fp8_decode_config(dim=dim, rows=rows)
        elif config is None and (pack_gqa or splits > 1):
            bm, bn, warps, stages = decode_config(dim=widest, rows=rows, seq_k=seq_k,
                                                  programs=per_row, precision=dot_precision,
                                                  fp8=descale is not None)
        elif config is None:
            bm, bn, warps, stages = forward_config(
                dim=widest, seq_q=rows, programs_per_tile_row=per_row,
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
    recording = recording if recording is not None else Recording()
    target, target_lse = out, lse
    if splits > 1:
        target = torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)
        target_lse = torch.empty((splits, *out.shape[:3]), dtype=torch.float32,
                                 device=out.device)
        recording.scratch(target, target_lse)
    qk_scale, cap, left, right = mask.kernel_args(scale)
    # varlen: no batch strides, sequences start at cu_q[b] / cu_k[b]
    packed = varlen is not None
    lse_strides = (0, 0, 0) if target_lse is None else (
        0 if packed else target_lse.stride(-3), target_lse.stride(-2),
        target_lse.stride(0) if splits > 1 else 0)

    def divided(t):  # strides (but the last) divided by ALIGN, multiplied back in the kernel
        return [0 if packed and i == 0 else x // align for i, x in enumerate(t.stride()[:3])]

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]), per_row, splits)

    index = index_dtype(q, k, v, target, rows=target.numel() // max(dim_v, 1))
    if transposed:
        compiled = fp8_decode.launch(
            q, k, v, target=target, target_lse=target_lse, cache=cache,
            mask_args=(qk_scale, cap, left, right), sinks=sinks, descale=descale,
            splits=splits, split_len=split_len, tile=(bm, bn, warps, stages), index=index,
            recording=recording)
    else:
        (sq_b, sq_h, sq_s), (sk_b, sk_h, sk_s), (sv_b, sv_h, sv_s) = map(divided, (q, k, v))
        args = dict(
            p_q=q, p_k=k, p_v=v, p_o=target, p_lse=target_lse,
            p_cu_q=varlen.cu_q if packed else None, p_cu_k=varlen.cu_k if packed else None,
            p_seqlens_k=cache.seqlens if cache is not None else None, p_table=table,
            p_sinks=sinks, p_descale=descale, sq_b=sq_b, sq_h=sq_h, sq_s=sq_s,
            sq_d=q.stride(3),
            sk_b=sk_b, sk_h=sk_h, sk_s=sk_s, sk_d=k.stride(3),
            sv_b=sv_b, sv_h=sv_h, sv_s=sv_s, sv_d=v.stride(3),
            so_b=0 if packed else target.stride(-4), so_h=target.stride(-3),
            so_s=target.stride(-2), so_d=target.stride(-1),
            so_split=target.stride(0) if splits > 1 else 0,
            sl_b=lse_strides[0], sl_h=lse_strides[1], sl_split=lse_strides[2],
            st_b=table.stride(0) if table is not None else 0,
            n_heads=heads, group=group, seq_q=seq_q, seq_k=seq_k, head_dim=dim // align,
            head_dim_v=dim_v // align,
            qk_scale=qk_scale, cap=cap, left=left, right=right,
            page=k.shape[2] if table is not None else 0, split_len=split_len,
            seqlens_add=cache.added if cache is not None else 0,
            n_pages=k.shape[0] if table is not None else 0,
            bucket_q=triton.next_power_of_2(seq_q), bucket_k=triton.next_power_of_2(seq_k),
            BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_DV=block_dv, BLOCK_DV2=block_dv2,
            PRECISION=dot_precision, INDEX=index, BOTTOM_RIGHT=mask.bottom_right,
            PACK_GQA=pack_gqa, ALIGN=align,
            ONE_LOOP=single_key_loop(seq_k=seq_k, precision=dot_precision,
                                     has_left=left >= 0),
            **fixed)
        if fixed:
            compiled = recording.launch(kernel, (triton.cdiv(rows, fixed["BLOCK_M"]),
                                                 per_row, splits), **args)
        else:  # the autotuner's: its grid is a function of the config it picks
            recording.unreplayable()
            with kernel_launches():
                compiled = kernel[grid](**args)
    if splits > 1:
        merge_splits(target, target_lse, out, lse, launcher=recording.launch, sinks=sinks)
    return out, compiled


def flops(batch: int, heads: int, seq_q: int, seq_k: int, dim: int, causal: bool) -> float:
    """4*B*H*Sq*Sk*D (two GEMMs of 2*Sq*Sk*D each); half of it when causal."""
    f = 4.0 * batch * heads * seq_q * seq_k * dim
    return f / 2 if causal else f

