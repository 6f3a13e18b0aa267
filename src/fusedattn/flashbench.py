"""`fusedattn bench`: the flash kernel against PyTorch's attention backends on [B, H, S, D].

Per problem, in one process, on the same inputs: every provider (a registry version with a
`batched` form) is verified against a float64 reference on a slice of heads before timing,
then timed with the primed-event protocol (`timing.py`), and its peak memory of one call is
measured. TFLOP/s = 4*B*H*Sq*Sk*D / time, half of that for causal (`tiles.flash.flops`).

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
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MATERIALIZING = ("sdpa-math", "torch-eager")
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
    precision: str | None = None  # fp32 opt-in "tf32" or "tf32x3"; None = exact (ieee)
    heads_kv: int | None = None

    def dot_precision(self) -> str | None:
        """The precision the products use: the opt-in one, "ieee" for fp32 by default, None
        for fp16/bf16 (tensor cores as they are)."""
        return self.precision or ("ieee" if self.dtype == "fp32" else None)

    def label(self) -> str:
        kv = f"/{self.heads_kv}" if self.heads_kv and self.heads_kv != self.heads else ""
        return (f"{self.dtype}{'-' + self.precision if self.precision else ''} B{self.batch} "
                f"H{self.heads}{kv} S{self.seq} D{self.dim}{' causal' if self.causal else ''}")


def suites() -> dict[str, list[BenchProblem]]:
    low = [BenchProblem(4, 32, s, d, dt, c) for dt in ("bf16", "fp16") for d in (64, 128)
           for c in (False, True) for s in (512, 1024, 2048, 4096, 8192, 16384)]
    return {
        "bf16": [p for p in low if p.dtype == "bf16"],
        "fp16": [p for p in low if p.dtype == "fp16"],
        "fp32": [BenchProblem(1, 16, 4096, 64, "fp32", False, prec)
                 for prec in (None, "tf32", "tf32x3")],
        "memory": [BenchProblem(4, 32, 32768, 128, "bf16", False)],
        "tiny": [BenchProblem(1, 2, 33, 16, "fp32", c, None, hk) for c in (False, True)
                 for hk in (2, 1)],
    }


def providers() -> list[str]:
    from fusedattn.versions import VERSIONS

    return [n for n, v in VERSIONS.items() if v.batched is not None]


def _inputs(p: BenchProblem, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dt = DTYPES[p.dtype]
    hk = p.heads_kv or p.heads
    shapes = ((p.batch, p.heads, p.seq, p.dim), (p.batch, hk, p.seq, p.dim),
              (p.batch, hk, p.seq, p.dim))
    return tuple(torch.randn(s, generator=gen, device=DEVICE, dtype=torch.float32).to(dt)
                 for s in shapes)


def _kv_heads(q, k, heads: list[int]) -> list[int]:
    """The K/V head each query head reads (GQA: `H / H_kv` query heads share one)."""
    group = q.shape[1] // k.shape[1]
    return [h // group for h in heads]


def _reference_slice(q, k, v, causal: bool, heads: list[int]) -> torch.Tensor:
    """float64 attention of batch 0, the given query heads, on the inputs' device."""
    kv = _kv_heads(q, k, heads)
    return attention_ref(q[0, heads], k[0, kv], v[0, kv], causal=causal, device=q.device)


def _peer_error(q, k, v, p: BenchProblem, heads, ref) -> float:
    """PyTorch's own attention in the same precision, on the verified slice."""
    from fusedattn.versions import VERSIONS

    peer = "torch-eager" if p.precision == "tf32" else "sdpa-math"
    kv = _kv_heads(q, k, heads)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = p.precision == "tf32"
    try:
        out = VERSIONS[peer].batched(q[:1, heads], k[:1, kv], v[:1, kv], p.causal,
                                     p.precision)()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return float((out[0].double() - ref).abs().max())


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
    from fusedattn.tiles.flash import CONFIGS, candidates, flash_forward

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
    also every flash config the autotuner chooses from, one by one."""
    from fusedattn.tiles.flash import flops
    from fusedattn.timing import time_gpu
    from fusedattn.verify import TOLERANCE, check, precision_key
    from fusedattn.versions import VERSIONS

    q, k, v = _inputs(p, seed)
    makers = [(n, lambda n=n: VERSIONS[n].batched(q, k, v, p.causal, p.precision))
              for n in names]
    if configs:
        makers += _config_calls(q, k, v, p)
    heads = sorted({0, p.heads - 1})[:CHECK_HEADS]
    ref = _reference_slice(q, k, v, p.causal, heads)
    key = precision_key(q.dtype, p.precision)
    peer_err = None if TOLERANCE[key].abs_max is not None else _peer_error(q, k, v, p, heads,
                                                                           ref)
    rows = []
    for name, make in makers:
        base = dict(problem=p.label(), provider=name, batch=p.batch, heads=p.heads, seq=p.seq,
                    dim=p.dim, dtype=p.dtype, causal=p.causal,
                    precision=p.dot_precision() or "",
                    max_abs_error=None, tolerance=None, median_ms=None, min_ms=None,
                    max_ms=None, tflops=None, peak_bytes=None, call_bytes=None)
        if name in MATERIALIZING and p.seq > MATERIALIZE_MAX_S:
            rows.append(BenchRow(status="skipped", reason=f"materializes B*H*S*S scores; "
                                 f"run up to S={MATERIALIZE_MAX_S}", **base))
            continue
        tf32 = p.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            call = make()
            out = call()
            if not EMULATION:
                torch.cuda.synchronize()
        except Exception as exc:  # a backend that refuses this problem: recorded, not fatal
            torch.backends.cuda.matmul.allow_tf32 = False
            rows.append(BenchRow(status="skipped", reason=f"{type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:160]}", **base))
            continue
        result = check(out[0, heads], ref, precision=p.precision, peer_error=peer_err)
        base.update(max_abs_error=result.max_abs, tolerance=result.tolerance)
        del out
        status, reason = ("ok", "") if result.ok else ("FAIL", "; ".join(result.reasons))
        if not EMULATION and result.ok:
            t = time_gpu(call, warmup=warmup, repeat=repeat)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            call()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            base.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                        tflops=flops(p.batch, p.heads, p.seq, p.seq, p.dim, p.causal)
                        / (t.median_ms * 1e-3) / 1e12,
                        peak_bytes=peak, call_bytes=peak - before)
        torch.backends.cuda.matmul.allow_tf32 = False
        rows.append(BenchRow(status=status, reason=reason, **base))
    return rows


def with_ratios(rows: list[BenchRow]) -> list[dict]:
    """Each row as a dict, plus `flash_over_<peer>`: our TFLOP/s over each peer's, per
    problem (None where either is missing)."""
    out = []
    by_problem: dict[str, dict[str, BenchRow]] = {}
    for r in rows:
        by_problem.setdefault(r.problem, {})[r.provider] = r
    for r in rows:
        d = asdict(r)
        ours = by_problem[r.problem].get("flash")
        if r.provider != "flash" and ours and ours.tflops and r.tflops:
            d["flash_over_this"] = ours.tflops / r.tflops
        else:
            d["flash_over_this"] = None
        out.append(d)
    return out


def check_suite(name: str) -> list[BenchProblem]:
    all_suites = suites()
    if name == "all":
        return [p for s in ("bf16", "fp16", "fp32") for p in all_suites[s]]
    if name not in all_suites:
        raise ProblemError("suite", name, "one of " + ", ".join([*all_suites, "all"]))
    return all_suites[name]
