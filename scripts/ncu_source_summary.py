"""Read Nsight Compute's source view of one kernel (`ncu -i REP --page source --csv
--print-source sass`, as `h200_round.sh ncusrc` writes it; .gz too) and say where its warps
wait: the stall reasons of the sampled warps, without those parked for the whole kernel
(Triton rounds a warp-specialised kernel's warps up to whole warpgroups: the spare warps wait
at a `bar.sync` and their samples, all "barrier", say nothing of the work), the
instructions with the most samples, the instruction mix per `--per` units of work, and with
`--window LO HI` the samples of that address range in blocks of `--block` instructions.

    python3 scripts/ncu_source_summary.py CSV [--top 30] [--per N] [--window 0x3200 0x5e00]
                                              [--kernel NAME] [--key-loops]

`--kernel NAME` reads that kernel's part of a CSV that holds several (ncu's source page
lists each profiled kernel in turn, e.g. the FP8 call's V transpose before the attention
kernel). `--key-loops` shares the samples of the key loops (the innermost loops that hold
a wgmma) out by what their instructions do: mbarrier and named-barrier waits, wgmma issue
and waits, the row max, exp2 and the sums, O's rescale, P's conversion, the rest.
"""

import argparse
import collections
import csv
import gzip
import io
import re


def read(path: str, kernel: str | None = None) -> tuple[list[str], list[list[str]]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    if kernel is not None:  # that kernel's part: from its name's line to the next kernel's
        start = text.index(f'"Kernel Name","{kernel}"')
        end = text.find('"Kernel Name"', start + 1)
        text = text[start:end if end >= 0 else len(text)]
    rows = list(csv.reader(io.StringIO(text[text.index('"Address"'):])))
    return rows[0], rows[1:]


# what an instruction of the key loop does, by its opcode's start (`key_loops`)
KINDS = (("waits (mbarriers, turn, bar.sync)", ("SYNCS", "BAR", "BRA")),
         ("wgmma issue and waits", ("HGMMA", "QGMMA", "WARPGROUP")),
         ("row max", ("FMNMX", "SHFL")),
         ("exp2 and the sums", ("MUFU", "FFMA", "FADD")),
         ("rescale (FMUL)", ("FMUL",)),
         ("P's conversion", ("F2FP", "PRMT", "LOP3", "SHF")))  # (SHFL: the row max's)


def key_loops(header, rows) -> tuple[list[tuple[int, int]], collections.Counter]:
    """The key loops (offsets of the innermost loops, a predicated branch back, that hold a
    wgmma) and their samples by `KINDS` ("other" for the rest)."""
    col = {name: i for i, name in enumerate(header)}
    base = int(rows[0][col["Address"]], 16)
    ins = [(int(r[col["Address"]], 16) - base, r[col["Source"]].strip(),
            int(r[col["Warp Stall Sampling (All Samples)"]] or 0)) for r in rows]
    loops = []
    for off, src, _ in ins:
        target = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", src)
        if src.startswith("@") and target and int(target[1], 16) - base < off:
            lo = int(target[1], 16) - base
            if any("GMMA" in s for o, s, _ in ins if lo <= o <= off):
                loops.append((lo, off))
    inner = [x for x in loops if not any(x != y and x[0] <= y[0] and y[1] <= x[1]
                                         for y in loops)]
    kinds = collections.Counter()
    for lo, hi in inner:
        for off, src, samples in ins:
            if lo <= off <= hi:
                op = opcode(src)
                kind = next((k for k, starts in KINDS if op.startswith(starts)), "other")
                kinds[kind] += samples
    return inner, kinds


def opcode(source: str) -> str:
    words = source.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30, help="instructions with the most samples")
    ap.add_argument("--per", type=float, default=0, help="divide the mix by this (units of "
                    "work, e.g. warp-tiles)")
    ap.add_argument("--window", nargs=2, default=None, help="LO HI offsets (hex)")
    ap.add_argument("--block", type=int, default=24)
    ap.add_argument("--kernel", default=None, help="the kernel's name, where the CSV holds "
                    "several")
    ap.add_argument("--key-loops", action="store_true", help="the key loops' samples by "
                    "what their instructions do")
    args = ap.parse_args()
    header, rows = read(args.csv, args.kernel)
    if args.key_loops:
        inner, kinds = key_loops(header, rows)
        total = sum(kinds.values())
        print(f"key loops {[(hex(lo), hex(hi)) for lo, hi in inner]}: {total} samples")
        for kind, n in kinds.most_common():
            print(f"  {kind:36s} {n:7d} {100 * n / max(total, 1):5.1f}%")
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(rows[0][col["Address"]], 16)
    samples = col["Warp Stall Sampling (All Samples)"]
    executed = col["Instructions Executed"]

    def count(row, name):
        return int(row[col[name]] or 0)

    # parked: a NOP whose samples are all barrier and that ran once a warp (no loop)
    parked = [r for r in rows if opcode(r[col["Source"]]) == "NOP"
              and count(r, "stall_barrier") == int(r[samples] or 0) > 100]
    work = [r for r in rows if r not in parked]
    total = sum(int(r[samples] or 0) for r in work)
    print(f"samples {total} (parked warps' {sum(int(r[samples] or 0) for r in parked)} "
          f"left out), instructions executed {sum(int(r[executed] or 0) for r in rows)}")
    reasons = collections.Counter({s: sum(count(r, s) for r in work) for s in stalls})
    for name, n in reasons.most_common(10):
        print(f"  {name[6:]:18s} {n:8d} {100 * n / total:5.1f}%")
    print("instructions with the most samples (offset, source, top reasons):")
    for r in sorted(work, key=lambda r: -int(r[samples] or 0))[:args.top]:
        top = sorted(((count(r, s), s[6:]) for s in stalls), reverse=True)[:3]
        print(f"{int(r[samples] or 0):7d} {int(r[col['Address']], 16) - base:#07x} "
              f"{r[col['Source']].strip()[:58]:58s} "
              + ", ".join(f"{s}={n}" for n, s in top if n))
    if args.per:
        mix = collections.Counter()
        for r in rows:
            mix[opcode(r[col["Source"]])] += int(r[executed] or 0)
        print(f"instruction mix per {args.per:g}: "
              + ", ".join(f"{op} {n / args.per:.1f}" for op, n in mix.most_common(16)))
    if args.window:
        lo, hi = (int(x, 16) for x in args.window)
        inside = [r for r in rows if lo <= int(r[col["Address"]], 16) - base < hi]
        for i in range(0, len(inside), args.block):
            block = inside[i:i + args.block]
            n = sum(int(r[samples] or 0) for r in block)
            why = collections.Counter({s[6:]: sum(count(r, s) for r in block) for s in stalls})
            ops = collections.Counter(opcode(r[col["Source"]]) for r in block)
            print(f"{int(block[0][col['Address']], 16) - base:#07x} {n:6d} "
                  + " ".join(f"{k}={v}" for k, v in why.most_common(3) if v) + " | "
                  + " ".join(f"{k}{v}" for k, v in ops.most_common(4)))


if __name__ == "__main__":
    main()
