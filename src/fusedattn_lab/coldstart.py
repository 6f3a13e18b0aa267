"""`fusedattn bench --suite coldstart`: the first call on a new shape, in a fresh process with
an empty Triton cache (every kernel compiled from source), against SDPA's first call.

Each problem runs in its own `python -m fusedattn_lab.coldstart` process with
`TRITON_CACHE_DIR` set to a new temporary folder. The process imports fusedattn and first
makes one small call of another kind (fp16, D=16: `primer_s`, a fresh install's first call,
which also builds Triton's launcher and driver stubs with the host compiler), then makes the
inputs, synchronises, and times with `time.perf_counter` around the first `attention()`
call of the problem and a `torch.cuda.synchronize()` (host time: its kernels' compiles,
launch and run: the "new shape" cost; Triton's compilation listener records each
compile's stages, so the row shows where that time went), then a second call the same way
(the kernels alone, for scale), and verifies the output against the float64 reference.
SDPA's first call is timed the same way in the same process, after ours (its kernels are
precompiled; CUDA's context and cuBLAS are warm by then, which favours it slightly). The
target of the prefill issue: the first call at most 1.5 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

MARK = "COLDSTART "


def problems():
    """The first-call cases: the shapes that stalled (bf16 S1000 D128, fp16 S3000 D64, fp32
    S700 D96 exact and at fp32's default, tf32x3) and a backward."""
    from fusedattn_lab.suites import BenchProblem

    return [BenchProblem(2, 8, 1000, 128, "bf16", False),
            BenchProblem(2, 8, 3000, 64, "fp16", True),
            BenchProblem(1, 4, 700, 96, "fp32", False, "ieee"),
            BenchProblem(1, 4, 700, 96, "fp32", False),
            BenchProblem(2, 8, 1000, 128, "bf16", True, mode="fwd+bwd")]


def _compile_listener(records: list[dict]):
    """A `triton.knobs.compilation.listener` that appends each compile's times (seconds):
    the kernel, `ir` (Python source to Triton IR) and each lowering stage (ttir, ttgir, llir,
    ptx, cubin: the last is ptxas), and `total`. Cache hits are skipped."""
    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            return
        stages = {"ir": times.ir_initialization / 1e6}
        stages.update((name, us / 1e6) for name, us in times.lowering_stages)
        records.append({"kernel": metadata.get("name", "?"), "total": times.total / 1e6,
                        **stages})
    return listener


def compile_profile(records: list[dict]) -> str:
    """One line per compile, e.g. "_flash_fwd 0.81 s (ir 0.03, ttir 0.01, ..., cubin 0.4)"."""
    return "; ".join(
        f"{r['kernel']} {r['total']:.2f} s ("
        + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k not in ("kernel", "total"))
        + ")" for r in records)


def _timed(fn):
    import torch

    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def measure(problem: dict) -> dict:
    """In this process: first and second call of `attention` (and of SDPA), verified."""
    import torch
    import triton

    from fusedattn.api import attention
    from fusedattn.reference import attention_ref
    from fusedattn_lab.suites import DTYPES, BenchProblem
    from fusedattn_lab.verify import check

    p = BenchProblem(**problem)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((p.batch, p.heads, p.seq, p.dim), generator=gen, device="cuda")
               .to(DTYPES[p.dtype]).requires_grad_(p.mode != "fwd") for _ in range(3))
    torch.cuda.synchronize()

    def ours():
        out = attention(q, k, v, is_causal=p.causal, precision=p.precision)
        if p.mode != "fwd":
            out.backward(torch.ones_like(out))
        return out

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p.causal)
        if p.mode != "fwd":
            out.backward(torch.ones_like(out))
        return out

    tiny = torch.randn((1, 1, 16, 16), device="cuda", dtype=torch.float16)
    _, primer = _timed(lambda: attention(tiny, tiny, tiny))
    compiles: list[dict] = []
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    listens = hasattr(compilation, "listener")  # Triton 3.4 and later
    if listens:
        compilation.listener = _compile_listener(compiles)
    out, first = _timed(ours)
    if listens:
        compilation.listener = None
    _, second = _timed(ours)
    _, sdpa_first = _timed(sdpa)
    ref = attention_ref(q[0, :1], k[0, :1], v[0, :1], causal=p.causal, device="cuda")
    peer = torch.nn.functional.scaled_dot_product_attention(
        *(t[:1, :1].detach().cpu() for t in (q, k, v)), is_causal=p.causal)[0]
    result = check(out[0, :1], ref, precision=p.precision,
                   peer_error=float((peer.double() - ref.cpu()).abs().max()))
    return {"problem": p.label(), "primer_s": primer, "first_call_s": first,
            "second_call_s": second,
            "sdpa_first_call_s": sdpa_first, "verified": result.ok,
            "max_abs_error": result.max_abs,
            # compiles overlap (the backward's run on threads): the sum can pass first_call_s
            "compile_sum_s": sum(r["total"] for r in compiles),
            "compiles": compile_profile(compiles)}


def run_fresh(problem) -> dict:
    """One problem in a fresh process with an empty Triton cache."""
    with tempfile.TemporaryDirectory(prefix="fusedattn-coldstart-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fusedattn_lab.coldstart",
                               json.dumps(asdict(problem))], capture_output=True, text=True,
                              env=env, timeout=600)
        wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"problem": problem.label(), "error": f"exit {proc.returncode}: {tail}"}
    return dict(json.loads(lines[-1][len(MARK):]), process_s=wall)


if __name__ == "__main__":
    print(MARK + json.dumps(measure(json.loads(sys.argv[1]))))
