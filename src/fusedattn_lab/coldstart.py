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
precompiled; CUDA's context and cuBLAS are warm by then, which favours it slightly). A
training problem imports what torch's autograd imports on a process's first backward with
a given gradient (sympy, through `torch.fx.experimental.symbolic_shapes`) before either
call, and reports that import's time on its own (`torch_backward_import_s`: on the H200's
host 3.3 s where Python compiled sympy's sources, 1.9-2.7 s with their bytecode; before,
our first call paid it and SDPA's, after ours, did not). Each
problem runs in three fresh processes (`MODES`: an empty cache, after a primer, after
`fusedattn.warmup`), and each also times a second new shape of the same kind (another
length and batch) with the compiles it caused. Issue 31's targets: with an empty cache
the first forward at most 1 s and forward + backward at most 2 s; after warmup at most
0.1 s; a new shape in a warm process no compile (at most 50 ms).
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
    """The first-call cases of issue 31 (bf16 H28/4 S1777 D112 causal, forward + backward
    at S3001 D64 causal, fp32 S999 D80 at fp32's default, tf32x3) and the Hopper kernel's
    (bf16 S1000 D128)."""
    from fusedattn_lab.suites import BenchProblem

    return [BenchProblem(2, 28, 1777, 112, "bf16", True, heads_kv=4),
            BenchProblem(1, 8, 3001, 64, "bf16", True, mode="fwd+bwd"),
            BenchProblem(1, 4, 999, 80, "fp32", False),
            BenchProblem(2, 8, 1000, 128, "bf16", False)]


MODES = ("empty cache", "after a primer", "after warmup")
"""How each problem's fresh process starts: an empty Triton cache and the problem's call
first; the same after one small call of another kind (`primer_s`: a fresh install's first
call, which also builds Triton's launcher stubs with the host compiler); a cache filled
by `fusedattn.warmup` for the problem's kind in another process before."""


def second_shape(p):
    """Another call of the problem's kind (dtype, head dim, mask, heads): another length
    and batch, the "new shape in a warm process" case."""
    from dataclasses import replace

    return replace(p, batch=p.batch + 1, seq=p.seq + 123)


def warmup_spec(p) -> dict:
    """`fusedattn.warmup`'s arguments for the problem's kind, up to its second shape."""
    longest = second_shape(p).seq
    return dict(head_dims=(p.dim,), heads=(p.heads,), heads_kv=(p.heads_kv or p.heads,),
                dtypes=(p.dtype,), causal=(p.causal,), training=p.mode != "fwd",
                max_len=min(16384, 1 << (longest - 1).bit_length()))


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


def _inputs(p, gen):
    import torch

    from fusedattn_lab.suites import DTYPES

    return [torch.randn((p.batch, n, p.seq, p.dim), generator=gen, device="cuda")
            .to(DTYPES[p.dtype]).requires_grad_(p.mode != "fwd")
            for n in (p.heads, p.heads_kv or p.heads, p.heads_kv or p.heads)]


def measure(problem: dict, primer: bool) -> dict:
    """In this process: the first and second call of `attention` (and SDPA's first), a
    second new shape of the same kind, each call's compiles; the first verified."""
    import torch
    import triton

    from fusedattn.api import attention
    from fusedattn.reference import attention_ref
    from fusedattn_lab.suites import BenchProblem
    from fusedattn_lab.verify import check

    p = BenchProblem(**problem)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gqa = (p.heads_kv or p.heads) != p.heads

    split = {}  # the timed call's forward alone (fwd+bwd: the rest is its backward)

    def call(q, k, v, fn=None):
        def run():
            start = time.perf_counter()
            out = (fn or attention)(q, k, v, is_causal=p.causal, **(
                {} if fn else {"precision": p.precision}), enable_gqa=gqa)
            if p.mode != "fwd":
                torch.cuda.synchronize()
                split.update(forward_s=time.perf_counter() - start, compiles=len(compiles))
                out.backward(torch.ones_like(out))
            return out
        return run

    q, k, v = _inputs(p, gen)
    q2, k2, v2 = _inputs(second_shape(p), gen)
    torch.cuda.synchronize()
    result = {"problem": p.label()}
    if p.mode != "fwd":  # torch's own import on a process's first backward with a given
        # gradient (`autograd._make_grads`: symbolic_shapes, sympy), whatever the attention:
        # done and timed here, so that neither our first call nor SDPA's (after it) pays it
        start = time.perf_counter()
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
        result["torch_backward_import_s"] = time.perf_counter() - start
    if primer:
        tiny = torch.randn((1, 1, 16, 16), device="cuda", dtype=torch.float16)
        result["primer_s"] = _timed(lambda: attention(tiny, tiny, tiny))[1]
    compiles: list[dict] = []  # (before `call`'s first run: it counts them)
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    listens = hasattr(compilation, "listener")  # Triton 3.4 and later
    if listens:
        compilation.listener = _compile_listener(compiles)
    profile_to = os.environ.get("FUSEDATTN_FIRST_CALL_PROFILE")  # `first_call_profile`
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        out, first = profiler.runcall(_timed, call(q, k, v))
        profiler.dump_stats(profile_to)
    else:
        out, first = _timed(call(q, k, v))
    first_compiles = list(compiles)
    first_split = dict(split)
    _, second_shape_s = _timed(call(q2, k2, v2))
    if listens:
        compilation.listener = None
    _, second = _timed(call(q, k, v))
    _, sdpa_first = _timed(call(q, k, v, torch.nn.functional.scaled_dot_product_attention))
    ref = attention_ref(q[0, :1], k[0, :1], v[0, :1], causal=p.causal, device="cuda")
    peer = torch.nn.functional.scaled_dot_product_attention(
        *(t[:1, :1].detach().cpu() for t in (q, k, v)), is_causal=p.causal)[0]
    verdict = check(out[0, :1], ref, precision=p.precision,
                    peer_error=float((peer.double() - ref.cpu()).abs().max()))
    return result | {
        "first_call_s": first, "second_call_s": second, "second_shape_s": second_shape_s,
        "second_shape_compiles": len(compiles) - len(first_compiles),
        "sdpa_first_call_s": sdpa_first, "verified": verdict.ok,
        "max_abs_error": verdict.max_abs,
        # compiles overlap (the backward's run on threads): the sum can pass first_call_s
        "compile_sum_s": sum(r["total"] for r in first_compiles),
        "compiles": compile_profile(first_compiles),
        # fwd+bwd: the first call's forward alone (synchronised) and the compiles done by
        # then (the backward's start on threads at the forward); the backward is the rest
        **({"first_forward_s": first_split["forward_s"],
            "forward_compiles": first_split["compiles"]} if first_split else {})}


def warmup_process(spec: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    """`fusedattn.warmup(**spec)` in a fresh process (environment `env`, default this
    one's), its answer as JSON on the last line of its stdout."""
    return subprocess.run([sys.executable, "-c", "import json, sys, fusedattn; print(json."
                           "dumps(fusedattn.warmup(**json.loads(sys.argv[1]))))",
                           json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=900)


def run_fresh(problem, mode: str = MODES[0], profile: str | None = None) -> dict:
    """One problem in a fresh process, started as `mode` says (`MODES`); `profile`: a path
    where that process writes cProfile's stats of its first call."""
    label = f"{problem.label()} ({mode})"
    with tempfile.TemporaryDirectory(prefix="fusedattn-coldstart-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1",
                   **({"FUSEDATTN_FIRST_CALL_PROFILE": profile} if profile else {}))
        warm_s = None
        if mode == "after warmup":
            start = time.perf_counter()
            warm = warmup_process(warmup_spec(problem), env)
            warm_s = time.perf_counter() - start
            if warm.returncode != 0:
                tail = " | ".join(warm.stderr.strip().splitlines()[-3:])
                return {"problem": label, "error": f"warmup exit {warm.returncode}: {tail}"}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fusedattn_lab.coldstart",
                               json.dumps(asdict(problem)), str(mode == "after a primer")],
                              capture_output=True, text=True, env=env, timeout=600)
        wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"problem": label, "error": f"exit {proc.returncode}: {tail}"}
    return dict(json.loads(lines[-1][len(MARK):]), problem=label, process_s=wall,
                warmup_process_s=warm_s)


if __name__ == "__main__":
    print(MARK + json.dumps(measure(json.loads(sys.argv[1]), sys.argv[2] == "True")))
