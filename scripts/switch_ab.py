"""A/B of one of the Hopper forward's switches (`hopper.forward`'s module constants, part
of the forward's plan key) in one process, on dense, window and varlen rows.

Each row: the settings called in turn (A B C A B C ..., `--rounds` times), the first output
of each checked against the float64 reference (`fusedattn_lab.verify.check`, the portable
path's error as the peer's; dense and window rows on the first batch's first four heads, the
whole output on varlen rows), every output after timing compared bit for bit with that
setting's first, and each setting's output with the first setting's (reported: a switch
that moves the arithmetic differs, one that moves only work or registers should not). Each
round's median of 30 calls (`fusedattn_lab.timing.time_gpu`), the median of the rounds.
The GPU only (the Hopper kernel runs on sm90).

    python3 scripts/switch_ab.py --switch MASK_FORM --values 2,0,1 [--rows a,b] [--out DIR]
    (values: Python literals, comma-separated, tuples in parentheses, the first the
    reference; writes DIR/switch_ab-NAME.json)

    python3 scripts/switch_ab.py --switch TILES --entries --values \
        "{},{(96, 96): (64, 32, 64, 32, 64, 64, 4)}"
    (--entries: each value is entries laid over the table as it stands, {} the table
    itself)

    python3 scripts/switch_ab.py --switch PINGPONG --values True,2 --set THREAD_ARRIVES=True
    (--set NAME=LITERAL, repeatable: other switches held at those values through the
    whole A/B, restored after it)
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from pathlib import Path

import torch

from fusedattn import attention, attention_varlen
from fusedattn.dispatch import use_backend
from fusedattn.hopper import forward as knobs
from fusedattn.reference import attention_ref, varlen_ref
from fusedattn.varlen import offsets_of
from fusedattn_lab.evidence import REPO, environment, sha256_file, write_json
from fusedattn_lab.serving import _lengths
from fusedattn_lab.switches import literal_switches
from fusedattn_lab.timing import time_gpu
from fusedattn_lab.verify import check

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hopper_check import varlen_lengths  # noqa: E402  (scripts/, beside this one)

# name: ("dense", B, H, H_kv, S, D, causal[, Dv]) (Dv: V's own head dim, else D) |
# ("window", B, H, S, D, left) (causal, the window bench suite's row) | ("varlen", D,
# causal[, longest]) (the varlen suite's 24 documents, H16; with `longest`, hopper_check's
# varlen sweep's documents: 16k tokens of [longest / 2, longest] each) | ("fp8", B, H, S, D,
# causal) (float8 e4m3 q, k, v, unit factors; O in bfloat16)
ROWS = {
    "d128": ("dense", 4, 32, 32, 4096, 128, False),
    "d128c": ("dense", 4, 32, 32, 4096, 128, True),
    "d128c16k": ("dense", 1, 32, 32, 16384, 128, True),
    "gqa": ("dense", 1, 32, 8, 8192, 128, True),
    "d64": ("dense", 4, 32, 32, 4096, 64, False),
    "d64c": ("dense", 2, 32, 32, 8192, 64, True),
    "d80": ("dense", 4, 32, 32, 4096, 80, False),
    "d80c": ("dense", 4, 32, 32, 4096, 80, True),
    "d80long": ("dense", 1, 16, 16, 16384, 80, False),  # the prefill suite's D80 row
    "d96": ("dense", 4, 32, 32, 4096, 96, False),
    "d96b2": ("dense", 2, 16, 16, 4096, 96, False),  # the prefill suite's other D96 row
    # causal from 8192 rows (`WARPGROUPS_MIN_ROWS_BOUNDED`: three warpgroups where named)
    "d80c8k": ("dense", 2, 32, 32, 8192, 80, True),
    "d96c8k": ("dense", 2, 32, 32, 8192, 96, True),
    "d192": ("dense", 4, 32, 32, 4096, 192, False),
    "d192c": ("dense", 4, 32, 32, 4096, 192, True),
    "d256": ("dense", 2, 16, 16, 4096, 256, False),  # the prefill suite's D256 row
    "mla": ("dense", 4, 32, 32, 4096, 192, False, 128),  # the mla suite's rows
    "mlac": ("dense", 4, 32, 32, 4096, 192, True, 128),
    "window": ("window", 1, 32, 8192, 128, 1024),
    "varlen128c": ("varlen", 128, True),
    "varlen64c": ("varlen", 64, True),
    "varlen128": ("varlen", 128, False),
    "varlen64c1k": ("varlen", 64, True, 1024),
    "varlen64c2k": ("varlen", 64, True, 2048),
    "varlen64c4k": ("varlen", 64, True, 4096),
    "varlen128c1k": ("varlen", 128, True, 1024),
    # short rows, 16k tokens a call (hopper_check's sweep): an item's fixed costs weigh most
    "s256d64": ("dense", 64, 16, 16, 256, 64, False),
    "s256d64c": ("dense", 64, 16, 16, 256, 64, True),
    "s512d64c": ("dense", 32, 16, 16, 512, 64, True),
    "s1024d64": ("dense", 16, 16, 16, 1024, 64, False),
    "s1024d64c": ("dense", 16, 16, 16, 1024, 64, True),
    "s512d96": ("dense", 32, 16, 16, 512, 96, False),
    "s256d128": ("dense", 64, 16, 16, 256, 128, False),
    "s256d128c": ("dense", 64, 16, 16, 256, 128, True),
    "s1024d128": ("dense", 16, 16, 16, 1024, 128, False),
    "s1024d128c": ("dense", 16, 16, 16, 1024, 128, True),
    "s2048d128": ("dense", 8, 16, 16, 2048, 128, False),
    "s2048d64c": ("dense", 8, 16, 16, 2048, 64, True),
    "s4096d64c": ("dense", 4, 16, 16, 4096, 64, True),
    "s256d192": ("dense", 64, 16, 16, 256, 192, False),
    "s1024d192": ("dense", 16, 16, 16, 1024, 192, False),
    "s2048d192": ("dense", 8, 16, 16, 2048, 192, False),
    "fp8d64": ("fp8", 4, 32, 4096, 64, False),  # the fp8 bench suite's rows
    "fp8d64c": ("fp8", 4, 32, 4096, 64, True),
    "fp8d128": ("fp8", 4, 32, 4096, 128, False),
    "fp8d128c": ("fp8", 4, 32, 4096, 128, True),
    "fp8d256": ("fp8", 4, 32, 4096, 256, False),
    "fp8d256c": ("fp8", 4, 32, 4096, 256, True),
}
SLICE_HEADS = 4  # dense and window rows: the reference of batch 0's first heads
FP8_BOUND = 2 ** -4  # fp8 rows: the largest error allowed, a share of |reference|'s largest


def problem(spec):
    """(call(backend), reference, the part of the output the reference covers, flops)."""
    kind = spec[0]
    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    if kind == "varlen":
        _, d, causal, *longest = spec
        lengths = varlen_lengths(*longest) if longest else _lengths(24, 32768, 0)
        q, k, v = (rand(sum(lengths), 16, d) for _ in range(3))
        cu = offsets_of(lengths, "cuda")

        def call(backend="hopper"):
            with use_backend(backend):
                return attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths),
                                        is_causal=causal, check_lengths=False)
        flops = sum(4 * n * n * d * 16 // (2 if causal else 1) for n in lengths)
        return call, varlen_ref(q, k, v, cu, cu, causal=causal, device="cuda"), (
            lambda o: o), flops
    if kind == "fp8":
        _, b, h, s, d, causal = spec
        q, k, v = (rand(b, h, s, d).to(torch.float8_e4m3fn) for _ in range(3))
        window, hk = None, h

        def call(backend="hopper"):
            with use_backend(backend):
                return attention(q, k, v, is_causal=causal)
        flops = 4 * b * h * s * s * d // (2 if causal else 1)
    elif kind == "window":
        _, b, h, s, d, left = spec
        q, k, v = (rand(b, h, s, d) for _ in range(3))
        window, hk, causal = (left, None), h, True

        def call(backend="hopper"):
            with use_backend(backend):
                return attention(q, k, v, is_causal=True, window=window)
        flops = 4 * b * h * d * sum(min(i + 1, left + 1) for i in range(s))
    else:
        _, b, h, hk, s, d, causal, *dv = spec
        q, k = (rand(b, n, s, d) for n in (h, hk))
        v = rand(b, hk, s, *(dv or [d]))
        window = None

        def call(backend="hopper"):
            with use_backend(backend):
                return attention(q, k, v, is_causal=causal, enable_gqa=hk != h)
        flops = 2 * b * h * s * s * (d + (dv or [d])[0]) // (2 if causal else 1)
    kv = max(1, SLICE_HEADS * hk // h)
    ref = attention_ref(q[:1, :SLICE_HEADS], k[:1, :kv], v[:1, :kv], causal=causal,
                        window=window, device="cuda")
    return call, ref, (lambda o: o[:1, :SLICE_HEADS]), flops


def row(name: str, switch: str, values: list, rounds: int) -> dict:
    call, ref, part, flops = problem(ROWS[name])
    fp8 = ROWS[name][0] == "fp8"  # (checked by FP8_BOUND: no portable peer to run)
    peer = None if fp8 else (part(call("portable")).double() - ref).abs().max().item()
    default = getattr(knobs, switch)
    outs, errs = {}, {}
    times = {i: [] for i in range(len(values))}
    try:
        for _ in range(rounds):
            for i, value in enumerate(values):
                setattr(knobs, switch, value)
                first = call()
                if i not in outs:
                    if fp8:  # P in e4m3: the FP8 tests' bound
                        err = (part(first).double() - ref).abs().max().item()
                        if not err <= FP8_BOUND * ref.abs().max().item():
                            raise SystemExit(f"{name} {switch}={value!r}: error {err:.3g} "
                                             f"over {FP8_BOUND} of the reference's largest")
                    else:
                        verdict = check(part(first), ref, peer_error=peer)
                        if not verdict.ok:
                            raise SystemExit(f"{name} {switch}={value!r}: "
                                             f"{'; '.join(verdict.reasons)}")
                        err = verdict.max_abs
                    outs[i], errs[i] = first, err
                times[i].append(time_gpu(call, warmup=5, repeat=30).median_ms)
                if not torch.equal(call(), outs[i]):
                    raise SystemExit(f"{name} {switch}={value!r}: the output changed "
                                     "between calls")
    finally:
        setattr(knobs, switch, default)
    result = {"row": name, "spec": list(ROWS[name]), "settings": []}
    for i, value in enumerate(values):
        ms = statistics.median(times[i])
        result["settings"].append({
            "value": repr(value), "ms": ms, "rounds_ms": times[i], "tflops": flops / ms / 1e9,
            "max_err": errs[i], "same_bits_as_first": torch.equal(outs[i], outs[0])})
    cells = ", ".join(f"{s['value']}: {s['tflops']:.0f} (err {s['max_err']:.1e}, "
                      f"{'same' if s['same_bits_as_first'] else 'other'} bits)"
                      for s in result["settings"])
    print(f"{name} {switch}: {cells}", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, help="a module constant of hopper.forward")
    ap.add_argument("--values", required=True, help="Python literals, comma-separated")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--entries", action="store_true",
                    help="each value is a dict of entries laid over the switch's table")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=LITERAL",
                    help="another switch held at a value through the A/B (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not hasattr(knobs, args.switch) or not args.switch.isupper():
        ap.error(f"--switch {args.switch!r}: not one of hopper.forward's switches")
    try:
        values = list(ast.literal_eval(f"({args.values},)"))  # (tuples' commas kept)
    except (ValueError, SyntaxError) as e:
        ap.error(f"--values {args.values!r}: Python literals, comma-separated ({e})")
    if args.entries:
        table = getattr(knobs, args.switch)
        if not isinstance(table, dict) or not all(isinstance(v, dict) for v in values):
            ap.error(f"--entries: {args.switch} and each value must be dicts")
        values = [{**table, **v} for v in values]
    held = literal_switches(ap.error, "--set", args.set, knobs, exclude=(args.switch,))
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: {unknown} unknown; rows are {', '.join(ROWS)}")
    before = {name: getattr(knobs, name) for name in held}
    try:
        for name, value in held.items():
            setattr(knobs, name, value)
        results = [row(r, args.switch, values, args.rounds) for r in rows]
    finally:
        for name, value in before.items():
            setattr(knobs, name, value)
    write_json(f"{args.out}/switch_ab-{args.switch}.json", dict(
        switch=args.switch, held={k: repr(v) for k, v in held.items()}, rows=results,
        environment=environment(),
        command=" ".join(sys.argv),
        sources={str(p.relative_to(REPO)): sha256_file(p)
                 for p in sorted(REPO.glob("src/fusedattn/hopper/forward*.py"))}))


if __name__ == "__main__":
    main()
