"""A model of what the Hopper backward's launch order costs in memory, on the CPU: GQA's
causal "down" programs (`hopper/backward_kernel.py`'s `_key_tile`, `_step`, `_step_row`)
list-scheduled onto the SMs in launch order, one step a time unit on every busy SM, with
each step's Q, dO and dQ tiles passed through an LRU cache the size of L2. A miss of Q or
dO reads its tile from DRAM; a miss of dQ (the TMA reduction's read-modify-write) reads it
and writes it back later. A time unit then lasts the longer of a step's compute and its
misses' DRAM time, so a unit whose programs miss together waits for the memory.

`bwd_order_model.py --makespan` counted only the SMs' time. It picked the across-tail
launch (`notes/patches/bwd-across-tail.patch`), which then lost on an H100
(evidence/nvidia-h100/20261206T1953Z-bwd-across-tail-ab). This model asks whether memory
explains that loss. Nothing in it is fitted; it is checked against 1728Z's Nsight Compute
(B2 GQA moved 9.2 GB across the heads and 0.95 GB head by head: the test
`test_the_l2_model_reads_as_ncu_did_and_its_launches_keep_the_adds_order`).

    python3 scripts/bwd_l2_model.py [--batches 1,2,4] [--l2-mib 50] [--tail 6]

A model, not a time: its units are the step's compute (`--step-us`) and DRAM's bandwidth
(`--tbps`), both set by hand."""

import argparse
import collections

BLOCK_M, BLOCK_N = 64, 128


def launch(order: str, pairs: int, tiles: int, tail: int,
           front: int = 0) -> list[tuple[int, int]]:
    """The (pair, key tile) of each program in launch order: "heads" one pair's key tiles
    after another's (key tile 0, the longest under the causal mask, first), "across" key
    tile n of every pair before any key tile n + 1, "tail" head by head but the last `tail`
    pairs across each other (`notes/patches/bwd-across-tail.patch`), "front" head by head
    but the last `tail` pairs' first `front` key tiles (their longest) first, together
    (`notes/patches/bwd-front.patch` with one pair)."""
    if order == "front":
        moved = [(p, n) for p in range(pairs - min(tail, pairs), pairs) for n in range(front)]
        first = set(moved)
        return moved + [(p, n) for p in range(pairs) for n in range(tiles)
                        if (p, n) not in first]
    k = {"heads": 0, "across": pairs, "tail": min(tail, pairs)}[order]
    before = (pairs - k) * tiles
    out = []
    for pid in range(pairs * tiles):
        if pid >= before:
            pid = (pairs - k + (pid - before) % k) * tiles + (pid - before) // k
        out.append((pid // tiles, pid % tiles))
    return out


def steps(pair: int, n: int, seq: int, group: int, head_bytes: tuple) -> list[list]:
    """A causal program's steps ("down": from the last query tile up to the diagonal, each
    query tile for every head of the group in turn), each a list of (tile, bytes) it
    touches; one empty step at each end (its K and V loads, its dK and dV stores)."""
    q_bytes, dq_bytes = head_bytes
    m_lo = n * BLOCK_N // BLOCK_M * BLOCK_M
    tiles_q = -(-(seq - m_lo) // BLOCK_M)
    out = [[]]
    for j in range(tiles_q):
        m = (m_lo // BLOCK_M) + tiles_q - 1 - j
        for hh in range(group):
            h = pair * group + hh
            out.append([(("q", h, m), q_bytes), (("do", h, m), q_bytes),
                        (("dq", h, m), dq_bytes)])
    out.append([])
    return out


def simulate(order, batch, heads_kv, group, seq, dim, sms, l2_bytes, tail, step_us, tbps,
             front=0):
    """One launch of `order` (`launch`) run to its end: its time units, DRAM gigabytes (the
    misses, dQ's write-backs, K and V read and dK and dV written once a program), L2's hit
    rate, and the modelled ms and TFLOP/s (FA's FLOP count)."""
    tiles = seq // BLOCK_N
    pairs = batch * heads_kv
    head_bytes = (BLOCK_M * dim * 2, BLOCK_M * dim * 4)
    queue = collections.deque(launch(order, pairs, tiles, tail, front))
    running = [None] * sms  # each SM's (steps, next step index)
    cache = collections.OrderedDict()  # tile -> bytes, least recently used first
    used = hits = accesses = 0
    dram = stores = 0  # (dK and dV: written at a program's end, outside its time units)
    seconds = 0.0
    units = 0
    while queue or any(running):
        unit_bytes = 0
        for s in range(sms):
            if running[s] is None and queue:
                pair, n = queue.popleft()
                running[s] = [steps(pair, n, seq, group, head_bytes), 0]
                unit_bytes += 2 * BLOCK_N * dim * 2  # its K and V tiles
                stores += 2 * BLOCK_N * dim * 2  # its dK and dV tiles, the same size
            if running[s] is None:
                continue
            prog, i = running[s]
            for tile, size in prog[i]:
                accesses += 1
                if tile in cache:
                    hits += 1
                    cache.move_to_end(tile)
                    continue
                unit_bytes += size  # read (dQ's too: the reduction reads before it adds)
                cache[tile] = size
                used += size
                while used > l2_bytes:
                    old, old_size = cache.popitem(last=False)
                    used -= old_size
                    if old[0] == "dq":  # written back
                        unit_bytes += old_size
            running[s][1] += 1
            if running[s][1] == len(prog):
                running[s] = None
        dram += unit_bytes
        seconds += max(step_us * 1e-6, unit_bytes / (tbps * 1e12))
        units += 1
    dram += sum(size for tile, size in cache.items() if tile[0] == "dq")
    flops = 2.5 * 4 * batch * heads_kv * group * seq * seq * dim / 2  # causal, FA's count
    return dict(order=order, batch=batch, units=units, dram_gb=round((dram + stores) / 1e9, 2),
                l2_hit=round(hits / accesses, 3), ms=round(seconds * 1e3, 3),
                tflops=round(flops / seconds / 1e12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--l2-mib", type=float, default=50)
    parser.add_argument("--tail", type=int, default=6)
    parser.add_argument("--step-us", type=float, default=2.5,
                        help="a step's compute: 2.5 us is B1's no-adds rate (548 TFLOP/s)")
    parser.add_argument("--tbps", type=float, default=3.0, help="DRAM's bandwidth")
    parser.add_argument("--front", type=int, default=16,
                        help='"front": how many of each moved pair\'s key tiles go first')
    parser.add_argument("--orders", default="heads,across,tail")
    args = parser.parse_args()
    group = args.heads // args.heads_kv
    for batch in map(int, args.batches.split(",")):
        for order in args.orders.split(","):
            print(simulate(order, batch, args.heads_kv, group, args.seq, args.dim, args.sms,
                           int(args.l2_mib * 2**20), args.tail, args.step_us, args.tbps,
                           args.front))


if __name__ == "__main__":
    main()
