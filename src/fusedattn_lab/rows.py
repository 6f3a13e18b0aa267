"""Triton row route: one program per query row, online softmax over tiles of BLOCK_K keys.

Algorithm (chapter 12.4, Triton tab), for query row `i`:

    m_i = -inf; l_i = 0; acc = 0                       # running max, sum, numerator [D]
    for each tile of BLOCK_K keys j0..j0+BLOCK_K-1:
        s      = (K_tile @ q_i) * scale                # [BLOCK_K] scores
        s      = where(key < S, s, -inf)               # past the end: -inf, so exp() = 0
        m_new  = max(m_i, max(s))
        alpha  = exp(m_i - m_new)                      # rescales the history
        p      = exp(s - m_new)                        # unnormalised weights
        acc    = acc * alpha + sum_j p_j V_j
        l_i    = l_i * alpha + sum_j p_j
        m_i    = m_new
    O_i = acc / l_i                                    # the one division

Causal (`causal=True`): row i sees keys 0..i only; the loop ends at key i, so key tiles
wholly past the diagonal are skipped. Every row keeps at least key i itself.

Shape contract: `q, k, v, out: [S, D] float32`, contiguous; BLOCK_D = next power of two
>= D, masked past D. Nothing S x S is stored: per row, K and V are read once
(2*S*D*4 bytes) and 4*D bytes are written. The product is an elementwise multiply and
reduction, not `tl.dot`: one query row gives a [1, D] operand, below tl.dot's 16-row minimum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedattn.mode import kernel_launches  # (and mode is fixed before triton.jit runs)


@triton.jit
def _rows_fwd_kernel(
    p_q, p_k, p_v, p_out,
    seq, dim, scale,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    row = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    offs_k = tl.arange(0, BLOCK_K)

    row_start = tl.cast(row, tl.int64) * dim  # 64-bit: S * D may pass 2^31
    b_q = tl.load(p_q + row_start + offs_d, mask=mask_d, other=0.0)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)

    # Causal: keys j > row take no part. Tiles that start past the row are never loaded
    # (the loop stops at row + 1), not computed and thrown away; the row's last tile is
    # masked inside like the tail tile.
    n_keys = tl.minimum(seq, row + 1) if IS_CAUSAL else seq
    for start in range(0, n_keys, BLOCK_K):
        keys = start + offs_k
        mask_k = keys < n_keys
        mask_kd = mask_k[:, None] & mask_d[None, :]
        tile_start = tl.cast(start, tl.int64) * dim  # 64-bit tile start, 32-bit inside
        p_kt = p_k + tile_start + offs_k[:, None] * dim + offs_d[None, :]
        b_k = tl.load(p_kt, mask=mask_kd, other=0.0)
        s = tl.sum(b_k * b_q[None, :], axis=1) * scale          # [BLOCK_K]
        # -inf, not 0: a 0 would join the max and add exp(0 - m) to the sum.
        s = tl.where(mask_k, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))              # finite: the tile has >= 1 key
        alpha = tl.exp(m_i - m_new)                             # exp(-inf) = 0 on the first tile
        p = tl.exp(s - m_new)                                   # masked keys: exp(-inf) = 0
        p_vt = p_v + tile_start + offs_k[:, None] * dim + offs_d[None, :]
        b_v = tl.load(p_vt, mask=mask_kd, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * b_v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new

    tl.store(p_out + row_start + offs_d, acc / l_i, mask=mask_d)


def rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    block_k: int = 16, out: torch.Tensor | None = None, causal: bool = False,
    num_warps: int = 4,
):
    """Launch `_rows_fwd_kernel` once: grid (S,). Returns `(out, compiled)`.

    `q, k, v: [S, D] float32` contiguous (validated by the caller); `out` is written in place
    when given. `compiled` is Triton's compiled kernel (None in the interpreter), for
    resource fields.
    """
    seq, dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    with kernel_launches():
        compiled = _rows_fwd_kernel[(seq,)](
            q, k, v, out, seq, dim, 1.0 / dim**0.5,
            BLOCK_K=block_k, BLOCK_D=triton.next_power_of_2(dim), IS_CAUSAL=causal,
            num_warps=num_warps,
        )
    return out, compiled


def triton_resources(compiled, name: str, grid: int) -> dict:
    """Resource fields of a compiled Triton kernel (None in the interpreter)."""
    meta = getattr(compiled, "metadata", None)
    return {
        "kernel": name,
        "grid": (grid,) if grid is not None else None,
        "block": (32 * meta.num_warps,) if meta is not None else None,
        "num_warps": getattr(meta, "num_warps", None),
        "num_stages": getattr(meta, "num_stages", None),
        "regs_per_thread": getattr(compiled, "n_regs", None),
        "spills": getattr(compiled, "n_spills", None),
        "static_shared_bytes": getattr(meta, "shared", None),
        "dynamic_shared_bytes": 0,
        "local_bytes_per_thread": None,
    }
