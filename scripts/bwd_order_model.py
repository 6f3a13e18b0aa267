"""A model of the Hopper backward's deterministic dQ adds (`hopper/backward_kernel.py`),
run on the CPU: for random shapes, masks and SM counts, each order's walk and its place in
line (`_key_tile`, `_step_row`, `_dq_order`, transcribed here) are checked to

- give every query tile's counter each program that adds into it once, its places
  0 .. k-1 (a gap or a repeat would hang the kernel or race it);
- run to the end when programs launch in order onto `sms` slots and each step waits for
  its place ("up" and "down" on any number of SMs, one head or several, "down" launched
  head by head or across them; "rotated" with a head's key tiles all resident, as
  `hopper.backward.order` takes it);
- and show what "in order" rests on: blocks dispatched out of their ids' order can hang
  "up" and "down", which the GPU does not promise against (`run`'s `dispatch`); with a
  ticket each (`tickets`, a program's place taken as it starts) any dispatch order runs.

The GPU tier runs the kernel itself under each order (`test_every_order_of_the_
deterministic_adds_is_right_and_repeats`); this covers the shapes it does not (Sq far from
Sk, windows in both alignments, one SM). It checks the formulas as transcribed: change
both together.

Varlen's compact grid (`compact_launch`) is checked against the full one (`full_launch`):
the same programs with keys, in the same order within each sequence, so the argument above
carries over whatever order the sequences take (`varlen_makespan`: longest first).

It also models one launch's tail (`makespan`: a list schedule, the adds' waits left out),
the case for launching "down" across the heads (`hopper.backward.DOWN_ACROSS_HEADS`).

    python3 scripts/bwd_order_model.py [--cases N] [--seed S] [--makespan] [--varlen]"""

import argparse
import heapq
import random

BLOCK_M, BLOCK_N = 64, 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def program(pid, n_tiles, order, seq_q, seq_k, left, right, bottom):
    """Key tile pid's (its query tiles' first rows in walk order, its place at each)."""
    n = pid if order == "down" else n_tiles - 1 - pid
    k0 = n * BLOCK_N
    diag = seq_k - seq_q if bottom else 0
    m_lo, m_hi = 0, seq_q
    if right >= 0:
        m_lo = max(k0 - diag - right, 0) // BLOCK_M * BLOCK_M
    if left >= 0:
        m_hi = min(k0 + BLOCK_N + left - diag, seq_q)
    m_hi = max(m_hi, m_lo)
    n_steps = cdiv(m_hi - m_lo, BLOCK_M)
    rot = n * cdiv(seq_q, BLOCK_M) // max(n_tiles, 1) if order == "rotated" else 0
    rows, places = [], []
    for j in range(n_steps):
        turned = rot + j - (n_steps if rot + j >= n_steps else 0)
        tile = {"up": j, "rotated": turned}.get(order, n_steps - 1 - j)
        m0 = m_lo + tile * BLOCK_M
        last = n_tiles - 1
        if right >= 0:  # (never negative for a tile this program reaches)
            last = min(last, (m0 + BLOCK_M - 1 + diag + right) // BLOCK_N)
        mine = min(n_tiles - 1, cdiv((m0 // BLOCK_M + 1) * n_tiles, n_steps) - 1)
        first = max(m0 + diag - left, 0) // BLOCK_N if left >= 0 else 0
        rows.append(m0)
        places.append({"up": last - n, "down": n - first,
                       "rotated": mine - n if n <= mine else mine + n_tiles - n}[order])
    return rows, places


def launches(order, n_tiles, heads, across):
    """The programs in launch order as (head, pid): a head's programs one after another,
    or ("down" with `across`, `backward_kernel.DOWN_ACROSS`) pid 0 of every head, then
    pid 1 of every one, ..."""
    if across and order == "down":
        return [(h, p) for p in range(n_tiles) for h in range(heads)]
    return [(h, p) for h in range(heads) for p in range(n_tiles)]


def compact_launch(lengths, heads, order, programs):
    """Varlen's compact grid (`_key_tile`'s COMPACT) in launch order: each of `programs`
    pids as (sequence, K/V head, key tile), None past the last sequence. A pid's sequence
    is the count of sequences whose programs (their key tiles x `heads`) all come before
    it (`forward_kernel._document`'s prefix sum); within one, head by head, each head's
    key tiles highest first but under "down"."""
    ends, total = [], 0
    for n in lengths:
        total += cdiv(n, BLOCK_N) * heads
        ends.append(total)
    out = []
    for pid in range(programs):
        b = sum(end <= pid for end in ends)
        if b == len(lengths):
            out.append(None)
            continue
        first = ends[b - 1] if b else 0
        tiles = max(cdiv(lengths[b], BLOCK_N), 1)
        n = (pid - first) % tiles
        out.append((b, min((pid - first) // tiles, heads - 1),
                    n if order == "down" else tiles - 1 - n))
    return out


def full_launch(lengths, heads, order):
    """The full varlen grid's programs with keys in launch order (the longest sequence's
    key tiles for every sequence, head by head; those past a sequence's keys left out)."""
    tiles = cdiv(max(lengths), BLOCK_N)
    out = []
    for b, length in enumerate(lengths):
        for h in range(heads):
            for p in range(tiles):
                n = p if order == "down" else tiles - 1 - p
                if n * BLOCK_N < length:
                    out.append((b, h, n))
    return out


def run(order, seq_q, seq_k, left, right, bottom, sms, heads=1, across=False,
        dispatch=None, tickets=False) -> str:
    """"ok", or why the launch breaks: a query tile's places not 0 .. k-1, or a hang (no
    resident program can move). `dispatch(remaining)` picks which of the block ids not yet
    dispatched (ascending) goes onto a free slot next, by its index in them (None: the
    lowest, in order). A block takes the program of its id in the launch order, or with
    `tickets` the next program in it whichever block it is (`notes/patches/
    bwd-tickets.patch`: each program's place from a counter as it starts)."""
    n_tiles = cdiv(seq_k, BLOCK_N)
    progs = [program(p, n_tiles, order, seq_q, seq_k, left, right, bottom)
             for p in range(n_tiles)]
    places = {}
    for rows, mine in progs:
        for m0, place in zip(rows, mine, strict=True):
            places.setdefault(m0, []).append(place)
    for m0, got in places.items():
        if sorted(got) != list(range(len(got))):
            return f"query tile {m0 // BLOCK_M}: places {sorted(got)}"
    # each head its own counters, the same programs (heads share the shapes)
    counter = {(h, m0): 0 for h in range(heads) for m0 in places}
    queue = launches(order, n_tiles, heads, across)
    at = dict.fromkeys(queue, 0)
    resident, launched, done = [], 0, 0
    remaining = list(range(len(queue)))  # the block ids not yet dispatched
    while done < len(queue):
        while len(resident) < sms and remaining:
            block = remaining.pop(0 if dispatch is None else dispatch(remaining))
            resident.append(queue[launched if tickets else block])
            launched += 1
        moved = False
        for h, pid in list(resident):
            rows, mine = progs[pid]
            if at[h, pid] == len(rows):
                resident.remove((h, pid))
                done, moved = done + 1, True
            elif counter[h, rows[at[h, pid]]] == mine[at[h, pid]]:
                counter[h, rows[at[h, pid]]] += 1
                at[h, pid], moved = at[h, pid] + 1, True
        if not moved:
            return f"hangs with programs {resident} waiting"
    return "ok"


def makespan(order, seq, heads, sms, across, causal=True) -> float:
    """A list schedule of one launch's programs (`launches`) on `sms` SMs, each taking its
    steps (query tiles) plus 2 for its start and end, the adds' waits left out: its end
    over the perfect share (total / sms), 1.0 at best. The question it answers: how much
    a launch order's tail costs where programs are few (DOWN_ACROSS_HEADS)."""
    n_tiles = cdiv(seq, BLOCK_N)
    steps = [len(program(p, n_tiles, order, seq, seq, -1, 0 if causal else -1, False)[0]) + 2
             for p in range(n_tiles)]
    free = [0] * sms
    for _, pid in launches(order, n_tiles, heads, across):
        heapq.heappush(free, heapq.heappop(free) + steps[pid])
    return max(free) / (sum(steps) * heads / sms)


def varlen_makespan(lengths, heads, sms, block_m=BLOCK_M, longest_first=False) -> float:
    """`makespan` of the compact varlen grid under a causal mask and "up" (each sequence's
    heads one after another, each head's key tiles highest first), the sequences in their
    order or, `longest_first`, the most keys first (`hopper.backward.VARLEN_LONGEST_FIRST`);
    a program takes its steps of `block_m` query rows plus 2."""
    order = sorted(lengths, reverse=True) if longest_first else lengths
    steps = [cdiv(n - k0 // block_m * block_m, block_m) + 2 for n in order
             for _ in range(heads) for k0 in range((cdiv(n, BLOCK_N) - 1) * BLOCK_N, -1,
                                                   -BLOCK_N)]
    free = [0] * sms
    for s in steps:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free) / (sum(steps) / sms)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--makespan", action="store_true",
                    help="also the tail of 'down' launched head by head and across the heads")
    ap.add_argument("--varlen", action="store_true",
                    help="also the tail of the compact varlen grid, sequences in their order "
                         "and longest first (issue 33's 24 documents, H16)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    runs = failures = 0
    for _ in range(args.cases):
        seq_q, seq_k = rng.randint(1, 3000), rng.randint(1, 3000)
        mask = rng.choice(["none", "causal", "causal bottom-right", "window", "left", "right"])
        left = right = -1
        bottom = mask == "causal bottom-right" or (mask == "window" and rng.random() < 0.5)
        if mask.startswith("causal"):
            right = 0
        elif mask == "window":
            left, right = rng.randint(0, 500), rng.randint(0, 300)
        elif mask == "left":
            left = rng.randint(0, 500)
        elif mask == "right":
            right = rng.randint(0, 500)
        for order in ("down", "up", "rotated"):
            if order == "rotated" and mask != "none":
                continue  # (the launcher takes it unmasked only)
            heads, across = rng.choice([1, 1, 3]), rng.random() < 0.5
            sms = cdiv(seq_k, BLOCK_N) if order == "rotated" else rng.choice([1, 2, 5, 132])
            if order == "rotated":
                heads = 1  # (a head's key tiles resident: the launcher's condition)
            verdict = run(order, seq_q, seq_k, left, right, bottom, sms, heads, across)
            runs += 1
            if verdict != "ok":
                failures += 1
                print(f"{order}, {mask}, Sq {seq_q}, Sk {seq_k}, window ({left}, {right}), "
                      f"{sms} SMs, {heads} heads{', across' if across else ''}: {verdict}")
    print(f"{runs} runs, {failures} failed")
    if args.makespan:
        print("causal 'down' on 132 SMs, a list schedule's end over the perfect share:")
        for batch, heads_kv, seq in ((1, 8, 8192), (2, 8, 8192), (4, 8, 8192), (4, 32, 4096)):
            one, across = (makespan("down", seq, batch * heads_kv, 132, a) for a in (0, 1))
            print(f"  B{batch} H_kv{heads_kv} S{seq}: head by head {one:.3f}, across the "
                  f"heads {across:.3f} ({one / across:.2f}x)")
    if args.varlen:
        from fusedattn_lab.serving import _lengths

        lengths = list(_lengths(24, 32768, 0))
        print("causal varlen, 24 documents, H16, 132 SMs, a list schedule's end over the "
              "perfect share:")
        for block_m, dim in ((64, 128), (128, 64)):
            given, first = (varlen_makespan(lengths, 16, 132, block_m, f) for f in (0, 1))
            print(f"  D{dim} ({block_m}-row steps): their order {given:.3f}, longest first "
                  f"{first:.3f}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
