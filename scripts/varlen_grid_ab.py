"""A/B of the Hopper varlen forward's grid (`hopper.forward.VARLEN_DYNAMIC`): one program
per work item against the persistent grid, on the varlen bench suite's batch (24 documents
of 64-3848 tokens, `fusedattn_lab.serving._lengths`), H16, D64 and D128, causal and not.

Each row: both settings called alternately (ABAB...), the first output of each checked
against the float64 reference (`fusedattn_lab.verify.check`, the portable path's error as
the peer's), every output after timing compared bit for bit with that first one, and the
two settings' outputs with each other (the grid moves items between programs, never the
arithmetic of one). Each round's median of 30 calls (`fusedattn_lab.timing.time_gpu`), and
the median of the rounds. The GPU only (the Hopper kernel runs on sm90).

    python3 scripts/varlen_grid_ab.py --out DIR   (writes DIR/varlen_grid_ab.json)
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from fusedattn import attention_varlen
from fusedattn.dispatch import use_backend
from fusedattn.hopper import forward as knobs
from fusedattn.reference import varlen_ref
from fusedattn_lab.evidence import REPO, environment, sha256_file, write_json
from fusedattn_lab.serving import _lengths
from fusedattn_lab.timing import time_gpu
from fusedattn_lab.verify import check

ROWS = [(128, True), (128, False), (64, True), (64, False)]  # (head dim, causal)
HEADS = 16
ROUNDS = 3  # A/B alternations per row


def _batch(dim: int):
    lengths = _lengths(24, 32768, 0)
    total = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(dim)
    q, k, v = (torch.randn(total, HEADS, dim, device="cuda", dtype=torch.bfloat16,
                           generator=g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)
    return q, k, v, cu, lengths


def row(dim: int, causal: bool) -> dict:
    q, k, v, cu, lengths = _batch(dim)
    longest = max(lengths)
    flops = sum(4 * n * n * dim * HEADS // (2 if causal else 1) for n in lengths)
    outs, errs, times = {}, {}, {True: [], False: []}
    default = knobs.VARLEN_DYNAMIC

    def call(backend="hopper"):
        with use_backend(backend):
            return attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal,
                                    check_lengths=False)

    ref = varlen_ref(q, k, v, cu, cu, causal=causal, device="cuda")
    peer = (call("portable").double() - ref).abs().max().item()
    for _ in range(ROUNDS):
        for setting in (True, False):
            knobs.VARLEN_DYNAMIC = setting
            first = call()
            if setting not in outs:
                verdict = check(first, ref, peer_error=peer)
                if not verdict.ok:
                    raise SystemExit(f"D{dim} causal={causal} VARLEN_DYNAMIC={setting}: "
                                     f"{'; '.join(verdict.reasons)}")
                outs[setting], errs[setting] = first, verdict.max_abs
            t = time_gpu(call, warmup=5, repeat=30)
            times[setting].append(t.median_ms)
            if not torch.equal(call(), outs[setting]):
                raise SystemExit(f"D{dim} causal={causal} VARLEN_DYNAMIC={setting}: "
                                 "the output changed between calls")
    knobs.VARLEN_DYNAMIC = default
    same = torch.equal(outs[True], outs[False])
    result = {"dim": dim, "causal": causal, "heads": HEADS, "lengths": lengths,
              "bit_identical": same}
    for setting, name in ((True, "dynamic"), (False, "persistent")):
        ms = statistics.median(times[setting])
        result[name] = {"ms": ms, "rounds_ms": times[setting], "tflops": flops / ms / 1e9,
                        "max_err": errs[setting]}
    print(f"varlen D{dim} causal={causal}: dynamic {result['dynamic']['tflops']:.0f}, "
          f"persistent {result['persistent']['tflops']:.0f} TFLOP/s, "
          f"errs {result['dynamic']['max_err']:.2e}/{result['persistent']['max_err']:.2e}, "
          f"bit-identical {same}", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    results = [row(dim, causal) for dim, causal in ROWS]
    write_json(f"{args.out}/varlen_grid_ab.json", dict(
        rows=results, environment=environment(), command=" ".join(sys.argv),
        sources={str(p.relative_to(REPO)): sha256_file(p)
                 for p in sorted(REPO.glob("src/fusedattn/hopper/forward*.py"))}))


if __name__ == "__main__":
    main()
