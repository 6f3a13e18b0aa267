"""`fusedattn tune`: time each kernel's candidate configs on this GPU and write the winners
into the tuned table that `configs.py` reads before its rules.

Per case (kernel, dtype and precision, head dim, causal, sequence length), on inputs of the
case's size: every candidate is run once and verified against the float64 reference (the
forward's output, the backward's dQ, dK and dV, decode's output, each judged by the one
tolerance table), then timed with the primed-event protocol (`lab/timing.time_gpu`); the
fastest verified candidate is the entry for the case's `configs.table_key`. A candidate
that does not compile or launch (shared memory, registers) or fails verification is kept
in the report with its reason, never chosen. The table is merged with the file's existing
entries and written atomically, with the machine and the commit that ran.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton

from fusedattn.configs import (
    CONFIGS,
    SHORT_SEQ,
    backward_configs,
    candidates,
    decode_config,
    forward_config,
    table_key,
)
from fusedattn.mode import DEVICE
from fusedattn_lab.suites import DTYPES, BenchProblem

KERNELS = ("fwd", "bwd", "decode")
# the backward's candidates: dK/dV tiles x dQ tiles (each kernel's own winners on the H200
# and smaller ones that fit 256-column heads and fp32)
BWD_DKDV = ((32, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 1))
BWD_DQ = ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1))
# the forward past D=128 (K, V and a 256-column accumulator): the tiles that fit, from
# scripts/fwd_configs.py's D256 sweep (20261130T1550Z), beside the autotuner's two
WIDE_FWD = ((128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2))
# decode's: (16, 64, 8, 3) and (16, 32, 4, 3) are the D256 tiles that do not spill on sm_90a
# (1 KB a thread at (16, 64, 4, 3): evidence/sm90-compile/20261204T2347Z-fp8-decode)
DECODE = ((16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 4, 4), (16, 256, 8, 3),
          (32, 128, 4, 3), (64, 64, 4, 3), (16, 64, 8, 3), (16, 32, 4, 3))


@dataclass(frozen=True)
class TuneCase:
    kernel: str
    dtype: str
    precision: str | None
    dim: int
    causal: bool
    seq: int            # keys (decode: the cache length)
    batch: int
    heads: int
    heads_kv: int
    rows: int = 0       # decode: new queries per sequence

    def problem(self) -> BenchProblem:
        mode = "bwd" if self.kernel == "bwd" else "fwd"
        return BenchProblem(self.batch, self.heads, self.seq, self.dim, self.dtype,
                            self.causal, self.precision, self.heads_kv, mode=mode)

    def key(self) -> str:
        dot = self.problem().dot_precision()
        if self.kernel == "decode":
            group = self.heads // self.heads_kv
            return table_key("decode", precision=dot, dim=self.dim, causal=False,
                             seq=self.rows * group, programs=self.batch * self.heads_kv)
        programs = self.batch * (self.heads_kv if self.kernel == "bwd" else self.heads)
        return table_key(self.kernel, precision=dot, dim=self.dim, causal=self.causal,
                         seq=self.seq, programs=programs)

    def label(self) -> str:
        return f"{self.kernel} {self.problem().label()}" + (
            f" rows{self.rows}" if self.kernel == "decode" else "")


def default_cases(kernel: str, dtype: str, precision: str | None, dims, seqs, causals,
                  batch_heads: tuple[int, int] | None = None) -> list[TuneCase]:
    """B*H of 128 (B4 H32) from S 1024 up; 1024 heads' worth below (B64 H16); decode at
    B32 H32/8 with one new query. `batch_heads` replaces the forward's and backward's
    (B, H): a grid that does not fill the SMs is a key of its own (the chapter's B1 H1)."""
    cases = []
    for dim, seq, causal in itertools.product(dims, seqs,
                                              (False,) if kernel == "decode" else causals):
        if kernel == "decode":  # no mask: the new queries see the whole cache
            cases.append(TuneCase("decode", dtype, precision, dim, False, seq, 32, 32, 8, 1))
            continue
        batch, heads = batch_heads or ((4, 32) if seq >= 1024 else (64, 16))
        cases.append(TuneCase(kernel, dtype, precision, dim, causal, seq, batch, heads, heads))
    return cases


def candidate_configs(case: TuneCase) -> list:
    """The configs worth timing for `case` (the backward's as (dK/dV, dQ) pairs). The first
    is what the kernel takes today (the table's entry, else the rule): it is always timed,
    so an entry can only replace it with a config that ran faster on the case it names."""
    dot = case.problem().dot_precision()
    if case.kernel == "bwd":
        pairs = list(itertools.product(BWD_DKDV, BWD_DQ))
        if case.dim > 128 or case.dtype == "fp32":
            pairs = [p for p in pairs if max(p[0][:2]) <= 64 and max(p[1][:2]) <= 64]
        current = backward_configs(dim=case.dim, itemsize=DTYPES[case.dtype].itemsize,
                                   precision=dot, causal=case.causal, seq=case.seq,
                                   programs=case.batch * case.heads_kv)
        return list(dict.fromkeys([tuple(map(tuple, current)), *pairs]))
    if case.kernel == "decode":
        rows = case.rows * case.heads // case.heads_kv
        current = decode_config(dim=case.dim, rows=rows, seq_k=case.seq, precision=dot,
                                programs=case.batch * case.heads_kv)
        return list(dict.fromkeys([tuple(current),
                                   *(c for c in DECODE if c[0] >= min(rows, 16))]))
    keep = candidates(CONFIGS, case.dim, triton.next_power_of_2(case.seq), dot)
    current = forward_config(dim=case.dim, seq_q=case.seq, causal=case.causal,
                             programs_per_tile_row=case.batch * case.heads, precision=dot)
    wide = WIDE_FWD if case.dim > 128 and triton.next_power_of_2(case.seq) > SHORT_SEQ else ()
    return list(dict.fromkeys([tuple(current), *wide, *(
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in keep)]))


def _inputs(case: TuneCase, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dt = DTYPES[case.dtype]
    seq_q = case.rows if case.kernel == "decode" else case.seq
    shapes = ((case.batch, case.heads, seq_q, case.dim),
              (case.batch, case.heads_kv, case.seq, case.dim),
              (case.batch, case.heads_kv, case.seq, case.dim),
              (case.batch, case.heads, seq_q, case.dim))
    return [torch.randn(s, generator=gen, device=DEVICE).to(dt) for s in shapes]


def _verifier(case: TuneCase, inputs):
    """verify(out) -> (ok, reasons) for every candidate of `case`: the float64 reference
    (and the low-precision peer's error) computed once per case, not per candidate."""
    from fusedattn_lab.slices import GradCheck, peer_error, reference_slice
    from fusedattn_lab.verify import check, needs_peer

    q, k, v, dout = inputs
    p = case.problem()
    if case.kernel == "bwd":
        grads = GradCheck(q, k, v, dout, p)
        return lambda got: grads(got)[::3]
    heads = sorted({0, case.heads - 1})
    ref = reference_slice(q, k, v, case.causal, heads)
    err = peer_error(q, k, v, p, heads, ref) if needs_peer(q.dtype, p.precision) else None

    def verify(got):
        result = check(got[0, heads], ref, precision=p.precision, peer_error=err)
        return result.ok, list(result.reasons)
    return verify


def _saved_forward(case: TuneCase, inputs):
    """(O, LSE) of the forward, what every backward candidate of `case` reads: run once."""
    from fusedattn.tiles.flash import flash_forward

    q, k, v, _ = inputs
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    flash_forward(q, k, v, out=out, lse=lse, is_causal=case.causal, scale=case.dim ** -0.5,
                  precision=case.problem().resolved().op)
    return out, lse


def _call(case: TuneCase, config, inputs, saved=None):
    """The timed call of one candidate (`saved`: the backward's `_saved_forward`)."""
    from fusedattn.tiles.common import KVCache, Mask
    from fusedattn.tiles.flash import flash_forward
    from fusedattn.tiles.flash_bwd import flash_backward

    q, k, v, dout = inputs
    scale = case.dim ** -0.5
    precision = case.problem().resolved().op
    if case.kernel == "bwd":
        out, lse = saved
        return lambda: flash_backward(dout, q, k, v, out, lse, None, is_causal=case.causal,
                                      scale=scale, precision=precision, configs=config)
    out = torch.empty_like(q)
    fixed = triton.Config({"BLOCK_M": config[0], "BLOCK_N": config[1]},
                          num_warps=config[2], num_stages=config[3])
    extra = {}
    if case.kernel == "decode":
        seqlens = torch.full((case.batch,), case.seq, dtype=torch.int32, device=DEVICE)
        extra = dict(mask=Mask(causal=False, bottom_right=True), cache=KVCache(seqlens),
                     pack_gqa=True)
    return lambda: flash_forward(q, k, v, out=out, lse=None, is_causal=case.causal,
                                 scale=scale, precision=precision, config=fixed, **extra)[0]


def run_case(case: TuneCase, *, warmup: int, repeat: int) -> tuple[list | None, list[dict]]:
    """Time every candidate of `case`; (the winner as JSON, a report row per candidate)."""
    from fusedattn_lab.timing import time_gpu

    inputs = _inputs(case)
    verify = _verifier(case, inputs)
    saved = _saved_forward(case, inputs) if case.kernel == "bwd" else None
    report = []
    for config in candidate_configs(case):
        row = {"case": case.label(), "key": case.key(), "config": str(config),
               "status": "ok", "reason": "", "median_ms": None}
        try:
            call = _call(case, config, inputs, saved)
            got = call()
            torch.cuda.synchronize()
        except Exception as exc:  # a candidate that does not compile or launch: reported
            row.update(status="skipped", reason=f"{type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:120]}")
            report.append(row)
            continue
        ok, reasons = verify(got)
        if not ok:
            row.update(status="FAIL", reason="; ".join(reasons)[:160])
        else:
            row["median_ms"] = time_gpu(call, warmup=warmup, repeat=repeat).median_ms
        report.append(row)
    timed = [r for r in report if r["median_ms"] is not None]
    if not timed:
        return None, report
    best = min(timed, key=lambda r: r["median_ms"])
    config = candidate_configs(case)[[r["config"] for r in report].index(best["config"])]
    return [list(c) for c in config] if case.kernel == "bwd" else list(config), report


def write_table(path, entries: dict, provenance: dict) -> dict:
    """Merge `entries` into the table at `path` (created if missing) and write it whole
    and atomically; returns the merged table."""
    import json

    from fusedattn_lab.evidence import write_atomic

    table = {"provenance": [], "entries": {}}
    if path.is_file():
        table = json.loads(path.read_text())
    table["entries"].update(entries)
    table["provenance"].append(dict(provenance, keys=sorted(entries)))
    write_atomic(path, json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table
