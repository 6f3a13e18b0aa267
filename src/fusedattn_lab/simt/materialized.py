"""Materialized attention: three launches with S x S arrays between them (chapter 12.2).

    Q, K -> scores [S, S] -> P [S, S] -> (P @ V) -> O [S, D]

1. `_scores_kernel`: one thread per query-key pair, `row = i // S`, `col = i % S`, a dot
   product over D times scale, written to Scores.
2. `_softmax_rows_kernel`: one block per row; a max reduction in shared memory, then the
   same shared array reused for the sum; stable softmax; writes P.
3. `_pv_kernel`: one thread per output element, `row = i // D`, `d = i % D`, sums over keys.

Causal (`causal=True`): key j > i takes no part: Scores gets -inf there without a dot
product, the softmax reads keys 0..i only and writes P = 0 past them, P.V sums j <= i.

Traffic of the intermediates (algorithmic, not hardware counters): Scores and P are each
written once and read once: 2 arrays * 2 passes * S*S * 4 bytes = 16*S^2 bytes
(S=128: 256 KiB); their capacity is 2*S^2*4 bytes. (The softmax here reads its Scores row
twice, once for the max and once for exp, so it issues 20*S^2 bytes of requests; the
second read hits in cache for these sizes.)
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from fusedattn_lab.simt._launch import F32, as_array, simulated_threads, stream

SCORES_THREADS = 256  # threads per block for the elementwise launches 1 and 3


@cuda.jit
def _scores_kernel(q, k, scores, scale, causal):
    i = cuda.grid(1)
    seq = scores.shape[0]
    if i < seq * seq:
        row = i // seq
        col = i % seq
        if causal and col > row:
            scores[row, col] = -math.inf  # masked: no dot product computed
            return
        acc = float32(0.0)
        for d in range(q.shape[1]):
            acc += q[row, d] * k[col, d]
        scores[row, col] = acc * scale


def _make_softmax_kernel(read_barrier: bool):
    """Build the row-softmax kernel; `read_barrier=False` plants the chapter's historical bug
    (no wait between "every thread has read the max" and "the array is reused for the sum")
    and exists only for the race checker's tests."""

    @cuda.jit
    def _softmax_rows_kernel(scores, p, causal):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        # Causal: only keys 0..row are read; the rest of the row of P is written as 0.
        seq = min(scores.shape[1], row + 1) if causal else scores.shape[1]
        red = cuda.shared.array(0, float32)  # blockDim.x floats, dynamic

        local = float32(-math.inf)
        for j in range(tid, seq, nthreads):
            local = max(local, scores[row, j])
        red[tid] = local
        # Barrier: every partial max is in `red` before the tree reads its neighbours.
        cuda.syncthreads()
        stride = nthreads // 2
        while stride > 0:
            if tid < stride:
                red[tid] = max(red[tid], red[tid + stride])
            # Barrier: this level's writes are visible before the next level reads them.
            cuda.syncthreads()
            stride //= 2
        row_max = red[0]
        if read_barrier:
            # Barrier: every thread has *read* red[0] (the max) before any thread overwrites
            # red with its partial sum below (the chapter's 2026-09-11 fix; without it a fast
            # thread's sum can replace the max that a slow thread has not read yet).
            cuda.syncthreads()

        local = float32(0.0)
        for j in range(tid, seq, nthreads):
            local += math.exp(scores[row, j] - row_max)
        red[tid] = local
        # Barrier: every partial sum is in `red` before the tree reads it.
        cuda.syncthreads()
        stride = nthreads // 2
        while stride > 0:
            if tid < stride:
                red[tid] += red[tid + stride]
            # Barrier: this level's sums are visible before the next level reads them.
            cuda.syncthreads()
            stride //= 2
        inv_sum = float32(1.0) / red[0]
        for j in range(tid, seq, nthreads):
            p[row, j] = math.exp(scores[row, j] - row_max) * inv_sum
        for j in range(seq + tid, scores.shape[1], nthreads):
            p[row, j] = 0.0

    return _softmax_rows_kernel


_softmax_rows_kernel = _make_softmax_kernel(read_barrier=True)


def planted_softmax_kernel():
    """The chapter's historical bug, for `fusedattn check-races` and its tests only: the row
    softmax without the wait between reading the max and reusing `red` for the sum."""
    return _make_softmax_kernel(read_barrier=False)


@cuda.jit
def _pv_kernel(p, v, out, causal):
    i = cuda.grid(1)
    seq, dim = v.shape
    if i < seq * dim:
        row = i // dim
        d = i % dim
        acc = float32(0.0)
        for j in range(min(seq, row + 1) if causal else seq):  # causal: P is 0 past row
            acc += p[row, j] * v[j, d]
        out[row, d] = acc


def allocate(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The buffers this version needs: Scores and P `[S, S]`, O `[S, D]`, all float32."""
    seq = q.shape[0]
    return {
        "scores": torch.empty((seq, seq), dtype=q.dtype, device=q.device),
        "p": torch.empty((seq, seq), dtype=q.dtype, device=q.device),
        "out": torch.empty_like(q),
    }


def materialized_attention(q, k, v, bufs: dict[str, torch.Tensor], *, block: int,
                           causal: bool = False, softmax_kernel=None) -> list:
    """Launch the three kernels on torch's current stream; writes `bufs["out"]`.

    Returns its launches as `(kernel, name, grid, block, dynamic shared bytes)` for
    `_launch.resource_fields`. `softmax_kernel` replaces the row softmax
    (the race checker's planted variant); leave it None.
    """
    seq, dim = q.shape
    scale = F32(1.0 / math.sqrt(dim))
    softmax = _softmax_rows_kernel if softmax_kernel is None else softmax_kernel
    st = stream()
    aq, ak, av = as_array(q), as_array(k), as_array(v)
    ascores, ap, aout = as_array(bufs["scores"]), as_array(bufs["p"]), as_array(bufs["out"])

    grid1 = math.ceil(seq * seq / SCORES_THREADS)
    shared = block * 4  # one float32 per thread for the reductions
    grid3 = math.ceil(seq * dim / SCORES_THREADS)
    with simulated_threads():
        _scores_kernel[grid1, SCORES_THREADS, st](aq, ak, ascores, scale, causal)
        softmax[seq, block, st, shared](ascores, ap, causal)
        _pv_kernel[grid3, SCORES_THREADS, st](ap, av, aout, causal)
    return [
        (_scores_kernel, "scores", grid1, SCORES_THREADS, 0),
        (softmax, "softmax_rows", seq, block, shared),
        (_pv_kernel, "pv", grid3, SCORES_THREADS, 0),
    ]
