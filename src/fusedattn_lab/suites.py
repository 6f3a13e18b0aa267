"""`fusedattn bench`: the flash kernel against PyTorch's attention backends on [B, H, S, D].

Per problem, in one process, on the same inputs: every provider (a registry version with a
`batched` form) is verified against a float64 reference on a slice of heads before timing,
then timed with the primed-event protocol (`lab/timing.py`), and its peak memory of one call is
measured. TFLOP/s = 4*B*H*Sq*Sk*D / time, half of that for causal (`tiles.flash.flops`).
The training suites time the backward alone (`bwd`, 2.5x the forward's FLOPs) or forward
and backward (`fwd+bwd`, 3.5x), with dQ, dK and dV verified against the float64 reference's
autograd gradients first.

Low precision is judged by the one tolerance table: max error <= 2x the error of PyTorch's
own attention in the same precision (the math backend; for tf32, torch-eager with TF32
matmuls) + a floor. Providers that cannot run a problem (the SDPA flash backend on fp32, a
backend that refuses a shape) are recorded as `skipped` with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton

from fusedattn.mode import DEVICE, EMULATION
from fusedattn.precision import Precision, resolve
from fusedattn.problem import ProblemError
from fusedattn_lab.protocol import call_peak
from fusedattn_lab.slices import GradCheck, peer_error, reference_slice
from fusedattn_lab.timing import time_gpu
from fusedattn_lab.verify import tf32_matmuls

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MATERIALIZE_MAX_S = 4096  # they hold B*H*S*S scores: 4*32*16384^2*2 B = 64 GiB at S=16384
CHECK_HEADS = 2  # verified heads per problem (b=0, first and last head): float64 is costly


@dataclass(frozen=True)
class BenchProblem:
    batch: int
    heads: int
    seq: int
    dim: int
    dtype: str
    causal: bool
    precision: str | None = None  # fp32: "ieee", "tf32", "tf32x3"; None = the default, tf32x3
    heads_kv: int | None = None
    mode: str = "fwd"  # what is timed: "fwd", "bwd" (the backward alone) or "fwd+bwd"

    def resolved(self) -> Precision:
        """The problem's precision, resolved once (`fusedattn.precision`)."""
        return resolve(DTYPES[self.dtype], self.precision)

    def dot_precision(self) -> str | None:
        """The precision the products use."""
        return self.resolved().dot

    def label(self) -> str:
        kv = f"/{self.heads_kv}" if self.heads_kv and self.heads_kv != self.heads else ""
        what = "" if self.mode == "fwd" else f"{self.mode} "
        return (f"{what}{self.dtype}{'-' + self.precision if self.precision else ''} "
                f"B{self.batch} H{self.heads}{kv} S{self.seq} D{self.dim}"
                f"{' causal' if self.causal else ''}")

    def flops(self) -> float:
        """FlashAttention's convention: 4*B*H*Sq*Sk*D forward (half causal), the backward
        2.5x the forward (5 GEMMs to the forward's 2), forward + backward 3.5x."""
        from fusedattn.tiles.flash import flops

        return MODES[self.mode] * flops(self.batch, self.heads, self.seq, self.seq, self.dim,
                                        self.causal)


MODES = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # FLOPs as multiples of the forward's


def suites() -> dict[str, list[BenchProblem]]:
    low = [BenchProblem(4, 32, s, d, dt, c) for dt in ("bf16", "fp16") for d in (64, 128)
           for c in (False, True) for s in (512, 1024, 2048, 4096, 8192, 16384)]
    train = [BenchProblem(4, 32, s, d, dt, c, mode=m) for dt in ("bf16", "fp16")
             for d in (64, 128) for c in (False, True) for s in (2048, 4096, 8192)
             for m in ("bwd", "fwd+bwd")]
    return {
        "train-bf16": [p for p in train if p.dtype == "bf16"],
        "train-fp16": [p for p in train if p.dtype == "fp16"],
        "train-fp32": [BenchProblem(1, 16, 4096, 64, "fp32", False, prec, mode="bwd")
                       for prec in ("ieee", "tf32", "tf32x3")],  # tf32x3: the default
        "tiny-train": [BenchProblem(1, 2, 33, 16, dt, c, None, hk, mode=m)
                       for dt in ("fp32", "bf16") for c in (False, True) for hk in (2, 1)
                       for m in ("bwd", "fwd+bwd")],
        "bf16": [p for p in low if p.dtype == "bf16"],
        "fp16": [p for p in low if p.dtype == "fp16"],
        "fp32": [BenchProblem(1, 16, 4096, 64, "fp32", False, prec)
                 for prec in ("ieee", "tf32", "tf32x3")],
        "memory": [BenchProblem(4, 32, 32768, 128, "bf16", False)],
        # the prefill issue's rows, in one run: the tile table's hard cases
        "prefill": [BenchProblem(4, 32, 4096, 128, "bf16", False),
                    BenchProblem(4, 32, 4096, 128, "bf16", True),
                    BenchProblem(4, 32, 4096, 128, "fp16", False),
                    BenchProblem(4, 32, 4096, 128, "fp16", True),
                    BenchProblem(1, 32, 16384, 128, "bf16", True),
                    BenchProblem(4, 32, 4096, 96, "bf16", False),
                    BenchProblem(4, 32, 4096, 192, "bf16", False),
                    BenchProblem(4, 32, 4096, 64, "bf16", False),
                    BenchProblem(2, 32, 8192, 64, "bf16", True),
                    BenchProblem(2, 32, 8192, 128, "bf16", True, heads_kv=8),
                    BenchProblem(1, 16, 16384, 80, "bf16", False),
                    BenchProblem(2, 16, 4096, 96, "bf16", False),
                    BenchProblem(2, 16, 4096, 112, "bf16", False),
                    BenchProblem(2, 16, 4096, 200, "bf16", False),
                    BenchProblem(2, 16, 4096, 256, "bf16", False),
                    BenchProblem(64, 16, 256, 64, "bf16", False),
                    BenchProblem(64, 16, 256, 64, "bf16", True),
                    BenchProblem(1, 16, 4096, 64, "fp32", False, "ieee"),
                    BenchProblem(1, 16, 4096, 64, "fp32", False)],  # the default, tf32x3
        "tiny": [BenchProblem(1, 2, 33, 16, "fp32", c, None, hk) for c in (False, True)
                 for hk in (2, 1)],
    }


def providers() -> list[str]:
    from fusedattn_lab.registry import VERSIONS

    return [n for n, v in VERSIONS.items() if v.batched is not None]


def _inputs(p: BenchProblem, seed: int):
    """q, k, v (leaves that require grad when the backward is timed), and dO for it."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dt = DTYPES[p.dtype]
    hk = p.heads_kv or p.heads
    shapes = ((p.batch, p.heads, p.seq, p.dim), (p.batch, hk, p.seq, p.dim),
              (p.batch, hk, p.seq, p.dim), (p.batch, p.heads, p.seq, p.dim))
    q, k, v, dout = (torch.randn(s, generator=gen, device=DEVICE, dtype=torch.float32).to(dt)
                     for s in shapes)
    if p.mode == "fwd":
        return q, k, v
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def _grad_call(forward, q, k, v, dout, mode: str):
    """The timed call of a backward mode: the backward alone (on one forward graph, kept)
    or forward and backward; returns (dq, dk, dv)."""
    if mode == "bwd":
        out = forward()
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), (q, k, v), dout)


@dataclass
class BenchRow:
    problem: str
    provider: str
    batch: int
    heads: int
    seq: int
    dim: int
    dtype: str
    causal: bool
    precision: str
    mode: str                   # fwd | bwd | fwd+bwd: what was timed (BenchProblem.mode)
    status: str                 # ok | FAIL | skipped
    reason: str
    max_abs_error: float | None
    tolerance: float | None
    median_ms: float | None
    min_ms: float | None
    max_ms: float | None
    tflops: float | None
    peak_bytes: int | None      # high-water mark of one call, inputs included
    call_bytes: int | None      # peak minus what was allocated before the call


def config_name(c) -> str:
    """A flash config as a provider name: flash@BLOCK_MxBLOCK_N-wWARPS-sSTAGES."""
    return (f"flash@{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}-w{c.num_warps}"
            f"-s{c.num_stages}")


def _config_calls(q, k, v, p: BenchProblem) -> list[tuple[str, object]]:
    """(name, make call) for every config the autotuner would time on this problem, each
    run as the only config: the tuning table behind `flash`'s choice."""
    from fusedattn.configs import CONFIGS, candidates
    from fusedattn.tiles.flash import flash_forward

    def make(config):
        def call():
            out = torch.empty_like(q)
            flash_forward(q, k, v, out=out, lse=None, is_causal=p.causal,
                          scale=p.dim ** -0.5, precision=p.dot_precision(), config=config)
            return out
        return lambda: call

    return [(config_name(c), make(c))
            for c in candidates(CONFIGS, p.dim, triton.next_power_of_2(p.seq),
                                p.dot_precision())]


def run_problem(p: BenchProblem, names: list[str], *, warmup: int, repeat: int,
                seed: int = 0, configs: bool = False) -> list[BenchRow]:
    """Verify, time and measure every provider in `names` on one problem; with `configs`,
    also every flash config the autotuner chooses from, one by one (forward only)."""
    from fusedattn_lab.registry import VERSIONS, materializing
    from fusedattn_lab.verify import check, needs_peer

    inputs = _inputs(p, seed)
    q, k, v = inputs[:3]
    makers = [(n, lambda n=n: VERSIONS[n].batched(q, k, v, p.causal, p.precision))
              for n in names]
    if p.mode == "fwd":
        if configs:
            makers += _config_calls(q, k, v, p)
        heads = sorted({0, p.heads - 1})[:CHECK_HEADS]
        ref = reference_slice(q, k, v, p.causal, heads)
        peer_err = (peer_error(q, k, v, p, heads, ref) if needs_peer(q.dtype, p.precision)
                    else None)

        def verify(out):
            r = check(out[0, heads], ref, precision=p.precision, peer_error=peer_err)
            return r.ok, r.max_abs, r.tolerance, list(r.reasons)
    else:
        verify = GradCheck(*inputs, p)
        makers = [(n, lambda make=make: _grad_call(make(), *inputs, p.mode))
                  for n, make in makers]
    rows = []
    for name, make in makers:
        base = dict(problem=p.label(), provider=name, batch=p.batch, heads=p.heads, seq=p.seq,
                    dim=p.dim, dtype=p.dtype, causal=p.causal,
                    precision=p.dot_precision() or "", mode=p.mode,
                    max_abs_error=None, tolerance=None, median_ms=None, min_ms=None,
                    max_ms=None, tflops=None, peak_bytes=None, call_bytes=None)
        if name in materializing() and p.seq > MATERIALIZE_MAX_S:
            rows.append(BenchRow(status="skipped", reason=f"materializes B*H*S*S scores; "
                                 f"run up to S={MATERIALIZE_MAX_S}", **base))
            continue
        with tf32_matmuls(p.resolved().peer_tf32):
            row = _measure(p, make, verify, base, warmup, repeat)
        rows.append(row)
    return rows


def _measure(p: BenchProblem, make, verify, base: dict, warmup: int, repeat: int
             ) -> BenchRow:
    """One provider: first call (a refusal is recorded, not fatal), verify, then time and
    the peak memory of one call, on the GPU."""
    try:
        call = make()
        out = call()
        if not EMULATION:
            torch.cuda.synchronize()
    except Exception as exc:  # a backend that refuses this problem: recorded, not fatal
        return BenchRow(status="skipped", reason=f"{type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160]}", **base)
    ok, max_abs, tol, reasons = verify(out)
    base.update(max_abs_error=max_abs, tolerance=tol)
    del out
    if not EMULATION and ok:
        t = time_gpu(call, warmup=warmup, repeat=repeat)
        peak, call_bytes = call_peak(call)
        base.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                    tflops=p.flops() / (t.median_ms * 1e-3) / 1e12,
                    peak_bytes=peak, call_bytes=call_bytes)
    return BenchRow(status="ok" if ok else "FAIL", reason="; ".join(reasons), **base)


def with_ratios(rows: list[BenchRow]) -> list[dict]:
    """Each row as a dict, plus `flash_over_<peer>`: our TFLOP/s over each peer's, per
    problem (None where either is missing)."""
    out = []
    by_problem: dict[str, dict[str, BenchRow]] = {}
    from fusedattn_lab.registry import bench_subject

    subject = bench_subject()
    for r in rows:
        by_problem.setdefault(r.problem, {})[r.provider] = r
    for r in rows:
        d = asdict(r)
        ours = by_problem[r.problem].get(subject)
        if r.provider != subject and ours and ours.tflops and r.tflops:
            d["flash_over_this"] = ours.tflops / r.tflops
        else:
            d["flash_over_this"] = None
        out.append(d)
    return out


# A/B suites (`fusedattn bench --ab`, `fusedattn_lab.ab`): the backward's one loop against
# three (short and long, causal or not, the cold-start row, fp32); the forward's head dims
# in two pieces against one padded piece (each dim that splits, D80/D96 causal, prefill's
# D80, fp32); and the pieces whose second overlaps the first (72 = 64 + 16, ...).
AB_SUITES = {
    "ab-train": [BenchProblem(4, 32, s, d, "bf16", c, mode="bwd") for s in (1024, 2048, 4096)
                 for d in (64, 128) for c in (False, True)] + [
        BenchProblem(64, 16, 256, 64, "bf16", False, mode="bwd"),
        BenchProblem(64, 16, 256, 64, "bf16", True, mode="bwd"),
        BenchProblem(2, 8, 1000, 128, "bf16", True, mode="fwd+bwd"),
        BenchProblem(1, 16, 4096, 64, "fp32", False, mode="bwd")],
    "ab-split": [BenchProblem(2, 16, 4096, d, "bf16", False) for d in (48, 80, 96, 144, 160,
                                                                       192)] + [
        BenchProblem(2, 16, 4096, 80, "bf16", True), BenchProblem(2, 16, 4096, 96, "bf16", True),
        BenchProblem(1, 16, 16384, 80, "bf16", False), BenchProblem(1, 4, 700, 96, "fp32", False)],
    "ab-overlap": [BenchProblem(2, 16, 4096, d, "bf16", False) for d in (72, 88, 136, 168,
                                                                         176)] + [
        BenchProblem(2, 16, 4096, 72, "bf16", True), BenchProblem(1, 16, 16384, 72, "bf16", False)],
}


def check_suite(name: str) -> list[BenchProblem]:
    all_suites = suites() | AB_SUITES
    if name == "all":
        return [p for s in ("bf16", "fp16", "fp32", "train-bf16", "train-fp16", "train-fp32")
                for p in all_suites[s]]
    if name not in all_suites:
        raise ProblemError("suite", name, "one of " + ", ".join([*all_suites, "all"]))
    return all_suites[name]
