"""Decode's kernels and tiles timed against each other, e4m3 and bf16, in one process (the GPU
only).

`attention_with_kvcache`'s kernels (`flash.flash_forward` with the GQA group packed, split-KV
at `kvcache.chosen_splits`' count, bottom-right causal) on the serving bench's fp8-decode
inputs (B32 H32/8, one new query over 8192 keys a sequence, per-head factors; bf16: the same
values dequantised): e4m3 on `tiles.fp8_decode` (kind "fp8_decode", opt-in) at each
of `FP8_DECODE`'s tiles (BLOCK_R, BLOCK_N, warps, stages; the rule's first), and e4m3 and
bf16 on `_flash_fwd` (kind "flash_fwd", e4m3's default) at each tile
(BLOCK_M, BLOCK_N, warps, stages): the table's first, then `fusedattn_lab.tune.DECODE`'s.
The tiles take turns (A B C ... A B C, `--rounds`
times, each a median of 30 calls by `fusedattn_lab.timing.time_gpu`); every output is
checked as the bench checks it (the float64 reference of the dequantised values on its
first and last head, the FP8 formula's error by torch as the bound), and each tile's
output after timing against its first (bits).

    python3 scripts/decode_tiles.py --dims 64,128,256 [--rounds 3] [--out DIR]
    (writes DIR/decode_tiles.json; `--tiny`: a small problem checked, not timed, as
    emulation runs it)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from triton.runtime.errors import OutOfResources

from fusedattn.api import fp8_descale
from fusedattn.configs import decode_config, fp8_decode_config
from fusedattn.kvcache import chosen_splits
from fusedattn.mode import DEVICE
from fusedattn.tiles import flash
from fusedattn.tiles.common import KVCache, Mask
from fusedattn.tiles.dequantize import dequantize_as
from fusedattn_lab.evidence import environment, write_json
from fusedattn_lab.serving import ServingProblem, _fp8_decode, _fp8_inputs
from fusedattn_lab.timing import time_gpu
from fusedattn_lab.tune import DECODE
from fusedattn_lab.verify import check

# `tiles.fp8_decode`'s candidates beside its rule's tile (`configs.fp8_decode_config`): 64
# to 256 keys, 4 or 8 warps, 2 or 3 stages (scripts/portable_compile_report.py builds the rule's)
FP8_DECODE = [(16, 64, 4, 2), (16, 128, 4, 2), (16, 128, 4, 3), (16, 256, 4, 2),
              (16, 128, 8, 2)]


def _call(q, k, v, descale, kernel, tile, splits):
    """The kernel as `attention_with_kvcache` launches it, at `tile` (precision "ieee", as
    kvcache passes for 16-bit and e4m3 inputs: unused past fp32). `kernel` "fp8_decode":
    `tiles.fp8_decode` with `tile` in place of its rule's; "flash_fwd": `_flash_fwd` by an
    explicit config (which `fp8_decode` refuses)."""
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    bm, bn, warps, stages = tile
    config = None if kernel == "fp8_decode" else triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
    cache = KVCache(torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=DEVICE))

    def call():
        rule = flash.fp8_decode_config
        flash.fp8_decode_config = lambda **kw: tile
        try:
            return flash.flash_forward(
                q, k, v, out=out, lse=None, is_causal=True, scale=q.shape[3] ** -0.5,
                precision="ieee", config=config, mask=Mask(causal=True, bottom_right=True),
                cache=cache, splits=splits, pack_gqa=True, descale=descale)[0]
        finally:
            flash.fp8_decode_config = rule
    return call


def run(dim: int, rounds: int, tiny: bool = False) -> list[dict]:
    """Every tile, e4m3 and bf16 (the same values dequantised), at head dim `dim` (`tiny`:
    B2 H4/2 over 40 keys, the check without timing: emulation's)."""
    p = ServingProblem("fp8-decode", *((2, 4, 2, 1, 40) if tiny else (32, 32, 8, 1, 8192)),
                       dim)
    _, verify, peer_error = _fp8_decode(p, torch.Generator(device=DEVICE).manual_seed(0))
    (q8, k8, v8), factors, _, _ = _fp8_inputs(p, torch.Generator(device=DEVICE).manual_seed(0))
    bf16 = [dequantize_as(t, f, torch.bfloat16) for t, f in zip((q8, k8, v8), factors,
                                                                 strict=True)]
    bound = peer_error()  # the FP8 formula's by torch: the bench's bound for both dtypes
    splits = chosen_splits(p.batch, p.heads, 1, p.heads_kv, p.seq_k)
    group = p.heads // p.heads_kv
    table = {(dt, "flash_fwd"): tuple(decode_config(dim=dim, rows=group, seq_k=p.seq_k,
                                                    programs=p.batch * p.heads_kv,
                                                    fp8=dt == "e4m3"))
             for dt in ("e4m3", "bf16")}
    table["e4m3", "fp8_decode"] = fp8_decode_config(dim=dim, rows=group)
    tiles = {("e4m3", "fp8_decode"): FP8_DECODE, ("e4m3", "flash_fwd"): DECODE,
             ("bf16", "flash_fwd"): DECODE}
    cases = [(dt, kernel, tile) for (dt, kernel), rest in tiles.items()
             for tile in list(dict.fromkeys([table[dt, kernel], *rest]))[:2 if tiny else None]]
    calls, first, rows = {}, {}, []
    for case in cases:
        dt, kernel, tile = case
        tensors, descale = ((q8, k8, v8), fp8_descale(q8, factors, p.heads, p.heads_kv)) \
            if dt == "e4m3" else (bf16, None)
        call = _call(*tensors, descale, kernel, tile, splits)
        try:
            first[case] = call().clone()
        except OutOfResources as e:  # (a tile whose stages do not fit the SM)
            rows.append(dict(dtype=dt, kernel=kernel, dim=dim, tile=list(tile),
                             table=tile == table[dt, kernel], ok=False,
                             reasons=[f"does not fit: {e}"]))
            print(f"{dt} {kernel} D{dim} {tile}: does not fit ({e})", flush=True)
            continue
        calls[case] = call
    cases = list(calls)
    times = {c: [] for c in cases}
    for _ in range(rounds):
        for case in cases:
            times[case].append(time_gpu(calls[case], warmup=5, repeat=30).median_ms)
    for case in cases:
        dt, kernel, tile = case
        result = check(*verify(first[case]), peer_error=bound)
        same = torch.equal(calls[case](), first[case])
        ms = statistics.median(times[case]) if rounds else float("nan")
        cache_bytes = 2 * p.batch * p.heads_kv * p.seq_k * dim * (1 if dt == "e4m3" else 2)
        rows.append(dict(dtype=dt, kernel=kernel, dim=dim, tile=list(tile),
                         table=tile == table[dt, kernel], splits=splits, ms=ms,
                         rounds=times[case], gbps=cache_bytes / ms / 1e6,
                         ok=bool(result.ok) and same, same_bits=same,
                         reasons=list(result.reasons)))
        print(f"{dt} {kernel} D{dim} {tile}{' (rule/table)' if rows[-1]['table'] else ''}: "
              f"{ms:.4f} ms, {rows[-1]['gbps']:.0f} GB/s, ok={rows[-1]['ok']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="emulation's check, no timing")
    args = ap.parse_args()
    rows = [r for dim in map(int, args.dims.split(","))
            for r in run(dim, 0 if args.tiny else args.rounds, args.tiny)]
    if args.out:
        write_json(f"{args.out}/decode_tiles.json", dict(environment=environment(), rows=rows))


if __name__ == "__main__":
    main()
