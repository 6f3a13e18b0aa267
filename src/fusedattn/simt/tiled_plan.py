"""online-tiled's sizes, without numba: the key tile, the shared memory a block needs and
the barriers it executes. The registry reads them to state limits and barrier counts
without importing the kernel module (numba takes a fifth of a second to import)."""

from __future__ import annotations

import math

TILE = 32  # keys per tile: one warp's worth of (row, key) pairs per row
SHARED_LIMIT = 48 * 1024  # static + dynamic shared memory a block gets without opting in


def shared_bytes(rows: int, dim: int) -> int:
    """Dynamic shared memory of one block: K and V tiles (2*TILE*D floats), the rows' q and
    acc (2*rows*D), the scores (rows*TILE) and per-row m, l, alpha (3*rows)."""
    return 4 * (2 * TILE * dim + 2 * rows * dim + rows * TILE + 3 * rows)


def barriers_per_block(seq: int) -> int:
    """1 (initialisation) + 4 per key tile (load, scores, row statistics, accumulate),
    for the block that visits every tile."""
    return 1 + 4 * math.ceil(seq / TILE)
