"""A model of the Hopper forward's varlen work items (`hopper/forward_kernel.py`'s
`_document` and `_item` under VARLEN, and `hopper.forward`'s item count), run on the CPU:
for random document lengths (empty ones included), head counts and tile heights, it checks
that the grid's items

- give every (document, head, query tile) exactly once;
- leave empty only the grid's last items, at most one a document for each head.

The GPU tier runs the kernel itself on documents of many lengths
(`test_hopper_varlen_with_empty_and_one_token_sequences`, more than 32 documents in
`test_hopper_varlen_over_many_documents`); this covers the counts it does not. It checks
the formulas as transcribed: change both together.

    python3 scripts/varlen_items_model.py [--cases N] [--seed S]"""

import argparse
import random

LANES = 32  # documents a step of `_document`'s prefix sum


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def items(lengths, heads: int, tile: int) -> int:
    """The grid's items (`hopper.forward`): an upper bound on the documents' tiles x heads."""
    return (sum(lengths) + len(lengths) * (tile - 1)) // tile * heads


def document(t: int, cu: list, heads: int, tile: int) -> tuple[int, int]:
    """`_document`: (document b, its first item) for item t."""
    n = len(cu) - 1
    before = b = first = 0
    for c in range(0, n, LANES):
        ends, total = [], before
        for i in range(c, c + LANES):
            total += cdiv(cu[i + 1] - cu[i], tile) * heads if i < n else 0
            ends.append((i < n, total))
        done = [end for inside, end in ends if inside and end <= t]
        b += len(done)
        first = max([first, *done])
        before = total
    return b, first


def item(t: int, cu: list, heads: int, tile: int, causal: bool):
    """`_item` under VARLEN: (document, head, tile) of item t, or None for an empty one."""
    n = len(cu) - 1
    b, first = document(t, cu, heads, tile)
    safe = min(b, n - 1)
    seq = cu[safe + 1] - cu[safe]
    tiles = max(cdiv(seq, tile), 1)
    h, m = divmod(t - first, tiles)
    if causal:
        m = tiles - 1 - m
    return (b, h, m) if b < n and m * tile < seq else None


def check(lengths, heads: int, tile: int, causal: bool) -> str:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    seen, empty_from = set(), None
    for t in range(items(lengths, heads, tile)):
        got = item(t, cu, heads, tile, causal)
        if got is None:
            empty_from = t if empty_from is None else empty_from
            continue
        if empty_from is not None:
            return f"item {t} is live after the empty item {empty_from}"
        if got in seen:
            return f"item {t} repeats {got}"
        seen.add(got)
    want = {(b, h, m) for b, n in enumerate(lengths) for h in range(heads)
            for m in range(cdiv(n, tile))}
    if seen != want:
        return f"{len(want - seen)} tiles never given, {len(seen - want)} not wanted"
    empty = items(lengths, heads, tile) - len(want)
    if empty > max(len(lengths) - 1, 0) * heads:
        return f"{empty} empty items for {len(lengths)} documents x {heads} heads"
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    for case in range(args.cases):
        docs = rng.choice([1, 2, 3, 24, 31, 32, 33, 64, 70, 100])
        lengths = [rng.choice([0, 1, rng.randint(0, 5000)]) for _ in range(docs)]
        heads, tile = rng.choice([1, 2, 16]), rng.choice([128, 192])
        causal = rng.random() < 0.5
        verdict = check(lengths, heads, tile, causal)
        if verdict != "ok":
            print(f"case {case}: {lengths} heads={heads} tile={tile} causal={causal}: "
                  f"{verdict}")
            return 1
    print(f"{args.cases} cases ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
