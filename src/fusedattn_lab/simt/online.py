"""Online attention, thread-level: one block per query row, threads cooperate along D
(chapter 12.4, HIP tab). No S x S array exists.

Per key j, in one block:
  1. each thread: partial dot product q_i . k_j over its d = tid, tid+nthreads, ...
  2. shared-memory tree reduction to one score;
  3. thread 0: m' = max(m, s), alpha = exp(m - m'), beta = exp(s - m'),
     l = l*alpha + beta; publishes m, l, alpha, beta in `state[0:4]` (as in the chapter);
  4. every thread: numerator[d] = numerator[d]*alpha + beta*V[j, d].
At the end, out[i, d] = numerator[d] / l.

Causal: row i scans keys 0..i only (the rest are never scored).

Block-level barriers per query row: 1 (state init) + S * (1 + log2(nthreads) + 2): one
after the partials, one per tree level, one to publish alpha/beta, one before the next key
may overwrite them. For nthreads=256 that is 11 per key, 1409 at S=128: the cost the
chapter's 12.6 names ("less write-back is not automatically faster").

Traffic per row: q_i once, K and V once each: (1 + 2*S) * D * 4 bytes read, D*4 written;
K and V are re-read by every row (no reuse across query rows).
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from fusedattn.problem import MAX_ROW_DIM
from fusedattn_lab.simt._launch import F32, as_array, simulated_threads, stream

STATE_SLOTS = 4  # m, l, alpha, beta


@cuda.jit
def _online_rows_kernel(q, k, v, out, scale, causal):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    seq, dim = k.shape
    red = cuda.shared.array(0, float32)  # blockDim.x floats, dynamic
    numerator = cuda.shared.array(MAX_ROW_DIM, float32)  # acc, unnormalised, [D]
    state = cuda.shared.array(STATE_SLOTS, float32)  # m, l, alpha, beta

    for d in range(tid, dim, nthreads):
        numerator[d] = 0.0
    if tid == 0:
        state[0] = -math.inf
        state[1] = 0.0
    # Barrier: the initial state is written before any thread reads it.
    cuda.syncthreads()

    # Causal: keys j > row are skipped, never scored (row keeps at least key `row`).
    n_keys = min(seq, row + 1) if causal else seq
    for j in range(n_keys):
        partial = float32(0.0)
        for d in range(tid, dim, nthreads):
            partial += q[row, d] * k[j, d]
        red[tid] = partial
        # Barrier: every partial dot product is in `red` before the tree reads it.
        cuda.syncthreads()
        stride = nthreads // 2
        while stride > 0:
            if tid < stride:
                red[tid] += red[tid + stride]
            # Barrier: this level's sums are visible before the next level reads them.
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            score = red[0] * scale
            old_max = state[0]
            new_max = max(old_max, score)
            alpha = math.exp(old_max - new_max)  # exp(-inf) = 0 at the first key
            beta = math.exp(score - new_max)
            state[0] = new_max
            state[1] = state[1] * alpha + beta
            state[2] = alpha
            state[3] = beta
        # Barrier: alpha and beta are published before every thread reads them.
        cuda.syncthreads()
        for d in range(tid, dim, nthreads):
            numerator[d] = numerator[d] * state[2] + state[3] * v[j, d]
        # Barrier: every thread has read alpha/beta (and thread 0 red[0]) before the next
        # key overwrites `red` and thread 0 overwrites `state`.
        cuda.syncthreads()

    for d in range(tid, dim, nthreads):
        out[row, d] = numerator[d] / state[1]


def allocate(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The buffers this version needs: only O `[S, D]` float32, no S x S array."""
    return {"out": torch.empty_like(q)}


def online_attention(q, k, v, bufs: dict[str, torch.Tensor], *, block: int,
                     causal: bool = False) -> list:
    """One launch, grid (S,), `block` threads; writes `bufs["out"]`. Returns the launches
    as `(kernel, name, grid, block, dynamic shared bytes)`."""
    seq, dim = q.shape
    scale = F32(1.0 / math.sqrt(dim))
    shared = block * 4  # one float32 per thread for the score reduction
    with simulated_threads():
        _online_rows_kernel[seq, block, stream(), shared](
            as_array(q), as_array(k), as_array(v), as_array(bufs["out"]), scale, causal
        )
    return [(_online_rows_kernel, "online_rows", seq, block, shared)]
