"""Online attention, thread-level, by key tiles: the chapter's next round (issue 16).

`online` (online.py) pays 3 + log2(B) block barriers per key: one score is reduced across
the block, then thread 0 updates m, l, alpha, beta, then everyone rescales. The first
tiled round (commit a2037d0) cut that to 4 barriers per 32-key tile and still lost to
`materialized`: inside a step only 32 threads computed scores, their shared-memory reads
hit one bank, and one thread per row ran the tile's exps while the block waited.

This round gives every thread the whole online recurrence of one query row over a share
of the keys, so nothing is reduced across threads until the very end:

    a block of B threads serves R rows (a power of two): thread t takes row t mod R
    and key split s = t div R of B/R splits; its q row and acc row live in registers.
    per tile of T keys (T = B/R splits x K keys each):
      1. all threads load K[j0:j0+T], V[j0:j0+T] into shared memory             barrier
      2. each thread, alone, over its K keys of the tile:
           s_j = q . k_j (a dot product against a broadcast K row: the lanes of a warp
           in one split read the same word; a warp's splits are a pad word apart, in
           different banks, so no bank conflict), m_new =
           max(m, max_j s_j), acc and l rescaled once by exp(m - m_new), then
           acc += exp(s_j - m_new) v_j                                        barrier
    at the end, the splits hand (m, l, acc) down a tree through shared memory (split
    h + i to split i, h = B/2R .. 1), merged by their maxima as the online recurrence
    does: 2 barriers per round. Split 0 writes O = acc / l.

Barriers per block: 2 per tile + 2 per merge round (`tiled_plan.Plan.barriers`): 16 at
128x64, block 256, R=4 (2 tiles of 64 keys, a 6-level tree), against online's 1409 per row
and the first round's 17. The rows per block R (`tiled_plan.auto_rows`): about one block
per SM. Masked keys (the ragged last tile, causal keys past the row) get s = -inf (the
chapter's mask), so exp gives them weight 0; a split that has seen no key yet keeps m =
-inf and l = 0 and gets weight 0 in the merge. Causal blocks stop after their last row's
key.

Shared memory: the K/V tile, 2 T (D + pad) floats (T shrinks with D to stay within 48 KB),
reused for the merge slots. Traffic: K and V are read once per block, S/R times in all, against S
times for `online`.
"""

from __future__ import annotations

import functools
import math

import torch
from numba import cuda, float32

from fusedattn_lab.simt._launch import F32, as_array, simulated_threads, stream
from fusedattn_lab.simt.tiled_plan import SHARED_LIMIT, Plan, auto_rows, check_rows


@functools.cache
def _kernel(plan: Plan, planted: bool):
    """The kernel for one plan: head dim, rows, splits, keys per split and merge rounds are
    compile-time constants, so the q and acc rows are register arrays and the load loop
    unrolls (every thread's global loads of a tile in flight at once). `planted`: the
    variant without the barrier that ends a tile, so the next tile's loads overwrite K/V
    while slower warps still read them (check-races must catch it)."""
    dim, keys, rows, splits = plan.dim, plan.keys, plan.rows, plan.splits
    nthreads, tile = plan.block, plan.tile
    tile_floats = plan.tile_floats
    loads = -(-tile * dim // nthreads)  # elements of K (and of V) per thread per tile
    slots = plan.slots
    slot = plan.slot_floats
    quads = dim // 4  # the dot product in 4 independent partial sums

    @cuda.jit
    def _online_tiled_kernel(q, k, v, out, scale, causal):
        tid = cuda.threadIdx.x
        seq = k.shape[0]
        lane = tid % rows
        split = tid // rows
        first = cuda.blockIdx.x * rows
        row = first + lane
        live = row < q.shape[0]
        smem = cuda.shared.array(0, float32)  # dynamic: the K/V tile, then the merge slots
        v_tile = tile_floats

        q_row = cuda.local.array(dim, float32)
        acc = cuda.local.array(dim, float32)
        s = cuda.local.array(keys, float32)
        for d in range(dim):
            q_row[d] = q[row, d] * scale if live else float32(0.0)
            acc[d] = 0.0
        m = float32(-math.inf)
        l_sum = float32(0.0)

        # Causal: the block's last row sees keys 0..first+rows-1; later tiles are skipped.
        n_keys = min(seq, first + rows) if causal else seq
        mine = split * keys  # this split's first key within a tile
        for start in range(0, n_keys, tile):
            for i in range(loads):
                idx = tid + i * nthreads
                j = start + idx // dim
                at = idx + idx // (keys * dim)  # one pad word per split
                if idx < tile * dim:
                    if j < seq:
                        smem[at] = k[j, idx % dim]
                        smem[v_tile + at] = v[j, idx % dim]
                    else:
                        smem[at] = 0.0
                        smem[v_tile + at] = 0.0
            # Barrier: the K/V tile is in shared memory before any score reads it.
            cuda.syncthreads()
            m_new = m
            for j in range(keys):
                key = start + mine + j
                if key < seq and (not causal or key <= row):
                    # This key's row of the tile as a view: its constant indices need
                    # no negative-index wrap (one address, then immediate offsets).
                    base = (mine + j) * dim + split  # one pad word per split before it
                    k_row = smem[base:base + dim]
                    d0 = d1 = d2 = d3 = float32(0.0)
                    for c in range(quads):
                        d0 += q_row[4 * c] * k_row[4 * c]
                        d1 += q_row[4 * c + 1] * k_row[4 * c + 1]
                        d2 += q_row[4 * c + 2] * k_row[4 * c + 2]
                        d3 += q_row[4 * c + 3] * k_row[4 * c + 3]
                    for d in range(4 * quads, dim):
                        d0 += q_row[d] * k_row[d]
                    dot = (d0 + d1) + (d2 + d3)
                    s[j] = dot
                    m_new = max(m_new, dot)
                else:
                    s[j] = -math.inf  # -inf, not 0: exp gives it weight 0
            if m_new > m:  # the running max moved: rescale once per tile, not per key
                alpha = math.exp(m - m_new)  # exp(-inf) = 0 before the first visible key
                l_sum *= alpha
                for d in range(dim):
                    acc[d] *= alpha
                m = m_new
            for j in range(keys):
                if s[j] > -math.inf:
                    p = math.exp(s[j] - m)
                    l_sum += p
                    base = v_tile + (mine + j) * dim + split
                    v_row = smem[base:base + dim]
                    for d in range(dim):
                        acc[d] += p * v_row[d]
            if not planted:
                # Barrier: every thread is done with this tile's K and V before the next
                # tile overwrites them.
                cuda.syncthreads()

        # Merge the splits into split 0 as a tree (`Plan.merge_rounds`): at level h, split
        # h + i hands (m, l, acc) to split i through slot i - first_i, `slots` per round.
        h = splits // 2
        while h >= 1:
            for first_i in range(0, h, slots):
                count = min(slots, h - first_i)
                if split >= h + first_i and split < h + first_i + count:
                    at = (split - h - first_i) * slot
                    smem[at + lane] = m
                    smem[at + rows + lane] = l_sum
                    for d in range(dim):
                        smem[at + 2 * rows + lane * (dim + 1) + d] = acc[d]
                # Barrier: the states are in their slots before their receivers read them
                # (the first time, every split is also done with the last K/V tile).
                cuda.syncthreads()
                if split >= first_i and split < first_i + count:
                    at = (split - first_i) * slot
                    m_other = smem[at + lane]
                    m_new = max(m, m_other)
                    if m_new > -math.inf:
                        a = math.exp(m - m_new)
                        b = math.exp(m_other - m_new)
                        l_sum = l_sum * a + smem[at + rows + lane] * b
                        for d in range(dim):
                            acc[d] = acc[d] * a + smem[at + 2 * rows + lane * (dim + 1) + d] * b
                        m = m_new
                # Barrier: the receivers have read the slots before the next round writes.
                cuda.syncthreads()
            h //= 2

        if split == 0 and live:
            for d in range(dim):
                out[row, d] = acc[d] / l_sum

    return _online_tiled_kernel


def allocate(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The buffers this version needs: only O `[S, D]` float32, no S x S array."""
    return {"out": torch.empty_like(q)}


def online_tiled_attention(q, k, v, bufs: dict[str, torch.Tensor], *, block: int,
                           rows: int | None = None, causal: bool = False,
                           planted: bool = False) -> list:
    """One launch, grid (ceil(S / rows),), `block` threads; writes `bufs["out"]`. `rows`
    per block: None picks `tiled_plan.auto_rows` (about one block per SM). `planted`: the
    variant without the end-of-tile barrier (check-races must catch it). Returns the
    launches as `(kernel, name, grid, block, dynamic shared bytes)`."""
    seq, dim = q.shape
    rows = rows or auto_rows(seq, block, dim) or 1
    check_rows(rows, block)
    plan = Plan(rows, block, dim)
    if not plan.fits():
        raise ValueError(f"online-tiled: {plan.shared_bytes} bytes of shared memory at "
                         f"D={dim}, rows={rows}, block={block}; a block gets {SHARED_LIMIT}")
    kernel = _kernel(plan, planted)
    grid = math.ceil(seq / rows)
    scale = F32(1.0 / math.sqrt(dim))
    with simulated_threads():
        kernel[grid, block, stream(), plan.shared_bytes](
            as_array(q), as_array(k), as_array(v), as_array(bufs["out"]), scale, causal)
    return [(kernel, "online_tiled", grid, block, plan.shared_bytes)]
