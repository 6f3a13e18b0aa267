"""online-tiled's sizes, without numba: how a block's threads split rows and keys, the key
tile, the shared memory a block needs and the barriers it executes. The registry reads them
to state limits and barrier counts without importing the kernel module (numba takes a fifth
of a second to import)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

SHARED_LIMIT = 48 * 1024  # static + dynamic shared memory a block gets without opting in
TILE_TARGET = 64  # keys per tile the plan aims for: fewer barriers, more shared memory


@dataclass(frozen=True)
class Plan:
    """A block of `block` threads serving `rows` query rows: thread t takes row t mod rows
    and key split t div rows of `splits` = block / rows. Each tile stages `tile` = splits x
    `keys` keys of K and V in shared memory; split s takes keys s*keys .. s*keys + keys - 1
    of it. The lanes of a warp that share a split read the same K/V word (a broadcast); the
    splits of one warp (rows < 32) are `split_stride` = keys*D + 1 words apart, so they fall
    in different banks (no bank conflict either way)."""

    rows: int
    block: int
    dim: int

    @property
    def splits(self) -> int:
        return self.block // self.rows

    @property
    def keys(self) -> int:
        """Keys per split per tile: TILE_TARGET keys per tile, fewer where the K/V tile would
        overfill shared memory (at least 1)."""
        fit = (SHARED_LIMIT // (2 * 4 * self.splits) - 1) // self.dim
        return max(1, min(max(1, TILE_TARGET // self.splits), fit))

    @property
    def split_stride(self) -> int:
        return self.keys * self.dim + 1

    @property
    def tile_floats(self) -> int:
        """Shared-memory words of the K tile (and of the V tile)."""
        return self.splits * self.split_stride

    @property
    def tile(self) -> int:
        return self.splits * self.keys

    @property
    def slot_floats(self) -> int:
        """One merge slot: m, l and acc of `rows` rows, acc rows padded to D + 1 words so
        that a warp's rows fall in different banks."""
        return self.rows * (self.dim + 1) + 2 * self.rows

    @property
    def slots(self) -> int:
        """Merge slots that fit in shared memory (0 with one split: nothing to merge; a plan
        with splits but no slot does not fit)."""
        room = max(SHARED_LIMIT // 4, 2 * self.tile_floats)
        return min(self.splits // 2, room // self.slot_floats)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the K and V tile (2 * tile_floats), reused at the end for
        the merge slots."""
        return 4 * max(2 * self.tile_floats, self.slots * self.slot_floats)

    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_LIMIT and (self.splits == 1 or self.slots > 0)

    def merge_rounds(self) -> list[tuple[int, int, int]]:
        """The merge as a tree: at level h (splits/2, splits/4, .., 1) split h + i hands its
        state to split i; `slots` of those at a time. Returns (h, first, count) rounds."""
        rounds = []
        h = self.splits // 2
        while h >= 1:
            step = max(1, self.slots)
            rounds += [(h, i, min(step, h - i)) for i in range(0, h, step)]
            h //= 2
        return rounds

    def barriers(self, seq: int) -> int:
        """For the block that visits every tile: 2 per tile (tile loaded; tile consumed before
        the next load overwrites it), then 2 per merge round (slots written; slots read)."""
        return 2 * math.ceil(seq / self.tile) + 2 * len(self.merge_rounds())


def check_rows(rows: int, block: int) -> None:
    """`rows` a power of two that divides `block` (a power of two), so the splits are a
    power of two (the merge tree)."""
    if rows < 1 or rows & (rows - 1) or block % rows:
        raise ValueError(f"online-tiled: {rows} rows per block need a power of two that "
                         f"divides the block ({block} threads)")


SMS_DEFAULT = 132  # the H200's SM count: what emulation assumes when it picks rows


def sm_count() -> int:
    """The current GPU's SM count (SMS_DEFAULT without one); read once per device."""
    import torch

    if torch.cuda.is_available():
        return _device_sms(torch.cuda.current_device())
    return SMS_DEFAULT


@functools.cache
def _device_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_rows(seq: int, block: int, dim: int, sms: int | None = None) -> int:
    """Rows per block for `online-tiled`: the power of two nearest (in log2) to S / SMs, so
    the grid is about one block per SM: fewer rows leave K/V tiles less reused, more leave
    SMs idle. On the H200 (sweep in evidence/README.md) that picked the fastest of 4..128
    rows at S = 128..16384. Among the plans that fit (None if none does)."""
    target = max(seq / (sms or sm_count()), 1e-9)
    fitting = [r for r in (2 ** i for i in range(block.bit_length()))
               if block % r == 0 and Plan(r, block, dim).fits()]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (abs(math.log2(r / target)), -r))
