"""A model of how a causal launch's items land on the SMs: the makespan of each way the
Hopper forward can hand them out, against the ideal (the work spread evenly). It is the
reasoning behind `hopper.forward.LPT_SECTIONS` and `CAUSAL_CLAIMS` (docs/decisions.md,
"Causal items claimed on the persistent grid"), not a time (and `causal_item`, the kernel's
item map transcribed, checked by `check_causal_items`): an item costs its key tiles,
and a program pays `--overhead` key tiles more for each item whose start nothing hides.

    python3 scripts/schedule_model.py [--overhead 1.0] [--hidden 0.15] [--section 16]

The grids:
- `one program an item`: programs launch in item order and the hardware gives each to the
  first SM that frees up (greedy list scheduling); every item pays the overhead (its Q
  load, its first keys and its O store with nothing under them, one CTA an SM);
- `fixed shares`: a persistent grid, program p takes items p, p + SMs, ...; the next item's
  loads run under the current one (two Q slots), so an item pays `--hidden` alone;
- `claims`: a persistent grid whose programs take the next item in order as they free up
  (`CAUSAL_CLAIMS`), an item paying `--hidden`.

Each in two orders: a head's tiles together, the longest first (the kernel's order before
2026-12-06), and the longest tiles first across sections of `--section` heads
(`LPT_SECTIONS`)."""

import argparse
import heapq
import json
import sys

SMS = 132  # an H100's and an H200's
ROWS = {  # name: (batch, heads, query rows = keys, rows an item, keys a key tile)
    "B4 H32 S4096 D128": (4, 32, 4096, 128, 128),
    "B1 H32 S16384 D128": (1, 32, 16384, 128, 128),
    "B2 H32 S8192 D64 (three warpgroups)": (2, 32, 8192, 192, 128),
    "B1 H32 S8192 (GQA's 32 query heads)": (1, 32, 8192, 128, 128),
    "B1 H16 S4096 D128": (1, 16, 4096, 128, 128),
    "B8 H16 S2048 D64": (8, 16, 2048, 128, 128),
    "B16 H16 S1024 D128": (16, 16, 1024, 128, 128),
    "B64 H16 S256 D128": (64, 16, 256, 128, 128),
}


def item_work(seq: int, tile: int, block_n: int) -> list[float]:
    """Key tiles each query tile of a causal (top-left, Sq = Sk) head sees, tile 0 first."""
    tiles = -(-seq // tile)
    return [float(-(-min((m + 1) * tile, seq) // block_n)) for m in range(tiles)]


def order(heads: int, work: list[float], section: int) -> list[float]:
    """The items' work in launch order: `section` 1 takes a head's tiles together, the
    longest first; more takes the longest tiles first across that many heads at a time."""
    items = []
    for first in range(0, heads, section):
        pairs = min(section, heads - first)
        for rank in range(len(work)):
            items += [work[-1 - rank]] * pairs
    return items


def causal_item(t: int, n_items: int, n_tiles_m: int, section: int) -> tuple[int, int]:
    """The Hopper forward kernel's dense causal item map (`forward_kernel._item`),
    transcribed: item t -> ((batch, head) pair, query tile), the longest tiles first across
    sections of `section` pairs, the last section holding what is left."""
    first_bh = t // (section * n_tiles_m) * section
    pairs = min(section, n_items // n_tiles_m - first_bh)
    within = t - first_bh * n_tiles_m
    rank = within // pairs
    return first_bh + within - rank * pairs, n_tiles_m - 1 - rank


def check_causal_items(pairs: int, n_tiles_m: int, section: int) -> str:
    """"ok" where `causal_item` gives every (pair, tile) once, each section's pairs together
    and within a section no tile before a longer one; else what went wrong."""
    n_items = pairs * n_tiles_m
    seen = [causal_item(t, n_items, n_tiles_m, section) for t in range(n_items)]
    if sorted(seen) != [(bh, m) for bh in range(pairs) for m in range(n_tiles_m)]:
        return "not every (pair, tile) once"
    for t in range(1, n_items):
        (bh0, m0), (bh1, m1) = seen[t - 1], seen[t]
        if bh1 // section == bh0 // section and m1 > m0:
            return f"item {t}: tile {m1} after the shorter tile {m0} in its section"
        if bh1 // section < bh0 // section:
            return f"item {t}: back to an earlier section"
    return "ok"


def greedy(items: list[float], programs: int, overhead: float) -> float:
    """Each item, in order, to the program that frees up first: the last one's end."""
    ends = [0.0] * programs
    for work in items:
        heapq.heapreplace(ends, ends[0] + work + overhead)
    return max(ends)


def fixed_shares(items: list[float], programs: int, overhead: float) -> float:
    """Program p takes items p, p + programs, ...: the busiest one's sum."""
    loads = [0.0] * programs
    for i, work in enumerate(items):
        loads[i % programs] += work + overhead
    return max(loads)


def makespans(batch: int, heads: int, seq: int, tile: int, block_n: int, *,
              overhead: float, hidden: float, section: int, sms: int = SMS) -> dict:
    """Each grid and order's makespan over the ideal (total work / SMs, no overhead)."""
    work = item_work(seq, tile, block_n)
    pairs = batch * heads
    ideal = sum(work) * pairs / sms
    result = {}
    for name, sec in (("head's tiles together", 1), ("longest first in sections", section)):
        items = order(pairs, work, sec)
        programs = min(sms, len(items))
        result[f"one program an item, {name}"] = greedy(items, sms, overhead) / ideal
        result[f"fixed shares, {name}"] = fixed_shares(items, programs, hidden) / ideal
        result[f"claims, {name}"] = greedy(items, programs, hidden) / ideal
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--overhead", type=float, default=1.0,
                    help="key tiles an item pays where nothing hides its start and end")
    ap.add_argument("--hidden", type=float, default=0.15,
                    help="key tiles an item pays on a persistent grid (two Q slots)")
    ap.add_argument("--section", type=int, default=16, help="heads a section holds")
    ap.add_argument("--json", action="store_true", help="one JSON object, not a table")
    args = ap.parse_args()
    table = {name: makespans(*row, overhead=args.overhead, hidden=args.hidden,
                             section=args.section) for name, row in ROWS.items()}
    if args.json:
        json.dump(table, sys.stdout, indent=1)
        return 0
    for name, result in table.items():
        print(name)
        for grid, ratio in result.items():
            print(f"  {grid:48s} {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
