"""Online attention, thread-level, by key tiles: the chapter's next round (issue 16).

`online` (online.py) pays 3 + log2(B) block barriers per key: one score is reduced across
the block, then thread 0 updates m, l, alpha, beta, then everyone rescales. Here a block
serves ROWS query rows and walks the keys TILE at a time, staging each K/V tile in shared
memory once for all its rows (the reuse the Triton flash kernel gets from its tiles):

    per tile of TILE keys:
      1. all threads load K[j0:j0+TILE], V[j0:j0+TILE] into shared memory      barrier
      2. all threads compute the ROWS x TILE scores, one (row, key) pair each
         (a whole dot product over D per pair; masked slots get -inf)          barrier
      3. one thread per row: m_new = max(m, max_j s), alpha = exp(m - m_new),
         p_j = exp(s_j - m_new) in place, l = l * alpha + sum_j p_j           barrier
      4. all threads: acc[r, d] = acc[r, d] * alpha[r] + sum_j p[r, j] V[j, d]  barrier

so 4 barriers per tile instead of (3 + log2 B) per key: at S=128, TILE=32, B=256 that is
1 + 4*4 = 17 per block against online's 1409 per row. The ragged last tile and causal
keys past a row get -inf (the chapter's mask), so exp gives them weight 0.

Shared memory (dynamic, sized by D; `tiled_plan.shared_bytes`): K and V tiles 2*TILE*D
floats, the rows' q and acc 2*ROWS*D, scores ROWS*TILE, per-row m, l, alpha 3*ROWS:
73 KB at D=256, ROWS=4. Past 48 KB a block must opt in to more, which numba does not, so
the launcher refuses it: head dims up to 185 with one row, 168 with four.

Traffic per block: its ROWS rows of q once, K and V once each: K and V are read
S/ROWS times in all, against S times for `online`.
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from fusedattn.simt._launch import F32, as_array, simulated_threads, stream
from fusedattn.simt.tiled_plan import SHARED_LIMIT, TILE, shared_bytes


@cuda.jit
def _online_tiled_kernel(q, k, v, out, scale, causal, rows, skip_stats_barrier):
    block = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    seq, dim = k.shape
    first = block * rows
    n_rows = min(rows, q.shape[0] - first)
    smem = cuda.shared.array(0, float32)  # dynamic: carved into the regions below
    k_tile = 0                           # [TILE, dim]
    v_tile = TILE * dim                  # [TILE, dim]
    q_rows = 2 * TILE * dim              # [rows, dim]
    acc = q_rows + rows * dim            # [rows, dim], unnormalised numerators
    scores = acc + rows * dim            # [rows, TILE], then p in place
    m_i = scores + rows * TILE           # [rows]
    l_i = m_i + rows                     # [rows]
    alpha = l_i + rows                   # [rows]

    for idx in range(tid, n_rows * dim, nthreads):
        smem[q_rows + idx] = q[first + idx // dim, idx % dim]
        smem[acc + idx] = 0.0
    for r in range(tid, n_rows, nthreads):
        smem[m_i + r] = -math.inf
        smem[l_i + r] = 0.0
    # Barrier: q rows, acc, m and l are initialised before any thread reads them.
    cuda.syncthreads()

    # Causal: the block's last row sees keys 0..first+n_rows-1; later tiles are skipped.
    n_keys = min(seq, first + n_rows) if causal else seq
    for start in range(0, n_keys, TILE):
        for idx in range(tid, TILE * dim, nthreads):
            j = start + idx // dim
            if j < seq:
                smem[k_tile + idx] = k[j, idx % dim]
                smem[v_tile + idx] = v[j, idx % dim]
            else:
                smem[k_tile + idx] = 0.0
                smem[v_tile + idx] = 0.0
        # Barrier: the K/V tile is in shared memory before any score reads it.
        cuda.syncthreads()
        for pair in range(tid, n_rows * TILE, nthreads):
            r = pair // TILE
            j = pair % TILE
            key = start + j
            if key < seq and (not causal or key <= first + r):
                dot = float32(0.0)
                for d in range(dim):
                    dot += smem[q_rows + r * dim + d] * smem[k_tile + j * dim + d]
                smem[scores + pair] = dot * scale
            else:
                smem[scores + pair] = -math.inf  # -inf, not 0: exp gives it weight 0
        # Barrier: every score of the tile is written before the row statistics read them.
        cuda.syncthreads()
        for r in range(tid, n_rows, nthreads):
            old = smem[m_i + r]
            new = old
            for j in range(TILE):
                new = max(new, smem[scores + r * TILE + j])
            # every row sees key 0 in the first tile, so `new` is finite from then on
            a = math.exp(old - new)  # exp(-inf) = 0 at the first tile
            total = float32(0.0)
            for j in range(TILE):
                p = math.exp(smem[scores + r * TILE + j] - new)
                smem[scores + r * TILE + j] = p
                total += p
            smem[m_i + r] = new
            smem[l_i + r] = smem[l_i + r] * a + total
            smem[alpha + r] = a
        if not skip_stats_barrier:  # False but in the planted variant (check-races)
            # Barrier: p and alpha are published before the accumulators read them.
            cuda.syncthreads()
        for idx in range(tid, n_rows * dim, nthreads):
            r = idx // dim
            d = idx % dim
            total = float32(0.0)
            for j in range(TILE):
                total += smem[scores + r * TILE + j] * smem[v_tile + j * dim + d]
            smem[acc + idx] = smem[acc + idx] * smem[alpha + r] + total
        # Barrier: every thread is done with this tile's K, V, p and alpha before the next
        # tile overwrites them.
        cuda.syncthreads()

    for idx in range(tid, n_rows * dim, nthreads):
        out[first + idx // dim, idx % dim] = smem[acc + idx] / smem[l_i + idx // dim]


def allocate(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The buffers this version needs: only O `[S, D]` float32, no S x S array."""
    return {"out": torch.empty_like(q)}


def online_tiled_attention(q, k, v, bufs: dict[str, torch.Tensor], *, block: int,
                           rows: int = 1, causal: bool = False,
                           planted: bool = False) -> list:
    """One launch, grid (ceil(S / rows),), `block` threads; writes `bufs["out"]`.
    `planted`: the variant without the barrier between the row statistics and the
    accumulators (check-races must catch it). Returns the launches as `(kernel, name,
    grid, block, dynamic shared bytes)`."""
    seq, dim = q.shape
    shared = shared_bytes(rows, dim)
    if shared > SHARED_LIMIT:
        raise ValueError(f"online-tiled: {shared} bytes of shared memory at D={dim}, "
                         f"rows={rows}; a block gets {SHARED_LIMIT}")
    grid = math.ceil(seq / rows)
    scale = F32(1.0 / math.sqrt(dim))
    with simulated_threads():
        _online_tiled_kernel[grid, block, stream(), shared](
            as_array(q), as_array(k), as_array(v), as_array(bufs["out"]), scale, causal,
            rows, planted)
    return [(_online_tiled_kernel, "online_tiled", grid, block, shared)]
