"""`fusedattn bench --suite host`: what a call costs the host, against SDPA's (issue 31).

Per problem, in one process, on the same inputs, for each provider (fusedattn, and SDPA
with its own choice of backend, cuDNN and flash, each backend chosen once outside the
loops):
- **host µs a call**: `LOOPS` loops of `CALLS` calls with no synchronisation inside a loop,
  the loop's wall time over its calls (the kernels run asynchronously: while the GPU keeps
  up with the queue, the loop runs at the host's pace); the median loop and the spread
  (fastest and slowest loop). A problem whose GPU time exceeds its host time still
  measures the host: the launch queue (about a thousand launches) is not filled by
  `CALLS` calls.
- **graph GPU µs**: the same call captured once in a CUDA graph and replayed, timed by
  CUDA events around the replays (the GPU's time with no host in the way); "n/a" where a
  call cannot be captured (varlen's default offsets check copies them to the host).
- each provider's output is verified against the float64 reference on one head before
  and after the timing (`verify.check`, the one tolerance table).

The target: fusedattn's host µs at most 1.2x SDPA's (default backend) on the same problem.
The varlen problem has equal lengths, so SDPA's dense call is the same attention.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch

LOOPS, CALLS, WARMUP, REPLAYS = 7, 100, 10, 50
TARGET = 1.2


@dataclass(frozen=True)
class HostProblem:
    kind: str  # "fwd", "fwd+bwd", "varlen", "decode"
    batch: int
    heads: int
    seq: int
    dim: int
    causal: bool = False
    heads_kv: int | None = None

    def label(self) -> str:
        kv = f"/{self.heads_kv}" if self.heads_kv else ""
        keys = "Sk" if self.kind == "decode" else "S"
        return (f"{self.kind} bf16 B{self.batch} H{self.heads}{kv} {keys}{self.seq} D{self.dim}"
                + (" causal" if self.causal else ""))


def problems() -> list[HostProblem]:
    """The issue's problems (short ones, where the host is the bottleneck) and one long."""
    return [HostProblem("fwd", 64, 16, 256, 64), HostProblem("fwd", 1, 8, 128, 64),
            HostProblem("fwd", 4, 32, 4096, 128, True),
            HostProblem("fwd+bwd", 4, 8, 256, 64, True), HostProblem("fwd+bwd", 1, 8, 128, 64),
            HostProblem("varlen", 4, 16, 256, 64, True),
            HostProblem("decode", 32, 32, 8192, 128, True, heads_kv=8)]


def _calls(p: HostProblem, gen: torch.Generator) -> dict:
    """({provider: (SDPA backend or None, call returning O as [B, H, Sq, D])}, the inputs
    and mask for the check)."""
    from torch.nn.attention import SDPBackend
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from fusedattn import attention, attention_varlen, attention_with_kvcache

    def rand(*shape):
        return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)

    hkv = p.heads_kv or p.heads
    q_len = 1 if p.kind == "decode" else p.seq
    q, k, v = rand(p.batch, p.heads, q_len, p.dim), *(rand(p.batch, hkv, p.seq, p.dim)
                                                       for _ in range(2))
    gqa = hkv != p.heads
    causal = p.causal and p.kind != "decode"  # one new query sees the whole cache
    if p.kind == "fwd+bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        dout = rand(*q.shape)

    def plain(fn):
        def call():
            out = fn(q, k, v)
            if p.kind == "fwd+bwd":
                out.backward(dout)
            return out
        return call

    peers = {name: (backend, plain(lambda q, k, v: sdpa(q, k, v, is_causal=causal,
                                                        enable_gqa=gqa)))
             for name, backend in (("sdpa", None), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                   ("sdpa-flash", SDPBackend.FLASH_ATTENTION))}
    calls = {}
    if p.kind in ("fwd", "fwd+bwd"):
        calls["fusedattn"] = (None, plain(lambda q, k, v: attention(
            q, k, v, is_causal=causal, enable_gqa=gqa)))
    elif p.kind == "varlen":
        packed = [t.transpose(1, 2).reshape(-1, t.shape[1], p.dim).contiguous()
                  for t in (q, k, v)]
        cu = torch.arange(0, (p.batch + 1) * p.seq, p.seq, dtype=torch.int32, device="cuda")

        def varlen(check):
            def call():
                out = attention_varlen(*packed, cu, cu, p.seq, p.seq, is_causal=causal,
                                       check_lengths=check)
                return out.reshape(p.batch, p.seq, p.heads, p.dim).transpose(1, 2)
            return call
        calls["fusedattn"] = (None, varlen(True))
        calls["fusedattn check_lengths=False"] = (None, varlen(False))
    else:
        lens = torch.full((p.batch,), p.seq, dtype=torch.int32, device="cuda")
        calls["fusedattn check_lengths=False"] = (None, lambda: attention_with_kvcache(
            q, k, v, cache_seqlens=lens, check_lengths=False))
    calls.update(peers)
    return calls, (q, k, v, causal)


def _host_us(call) -> list[float]:
    loops = []
    for _ in range(LOOPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        loops.append((time.perf_counter() - start) / CALLS * 1e6)
        torch.cuda.synchronize()
    return loops


def _graph_us(call) -> float | str:
    """GPU µs a call, replayed in a CUDA graph; the reason where it cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    except Exception as e:  # noqa: BLE001 (what cannot be captured is reported, not raised)
        torch.cuda.synchronize()
        return f"n/a ({type(e).__name__})"
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS


def _check(out, inputs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusedattn.reference import attention_ref
    from fusedattn_lab.verify import check

    q, k, v, causal = inputs
    qs, ks, vs = (t[0, :1].detach() for t in (q, k, v))  # query head 0 reads K/V head 0
    ref = attention_ref(qs, ks, vs, causal=causal, device="cuda")
    with sdpa_kernel(SDPBackend.MATH):  # the peer in the inputs' precision (any backend)
        peer = torch.nn.functional.scaled_dot_product_attention(
            *(t[None] for t in (qs, ks, vs)), is_causal=causal)[0]
    return check(out[0, :1], ref, peer_error=float((peer.double() - ref).abs().max()))


def measure(p: HostProblem, seed: int = 0) -> list[dict]:
    """The problem's rows, one per provider."""
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(seed)
    calls, inputs = _calls(p, gen)
    rows = []
    for name, (backend, call) in calls.items():
        row = {"problem": p.label(), "provider": name}
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                for _ in range(WARMUP):
                    call()
                before = _check(call(), inputs)
                loops = _host_us(call)
                graph = _graph_us(call)
                after = _check(call(), inputs)
        except RuntimeError as e:  # a backend that refuses the problem
            rows.append(row | {"status": "skipped", "reason": str(e).splitlines()[0][:80]})
            continue
        row |= {"status": "ok" if before.ok and after.ok else "FAIL",
                "host_us": statistics.median(loops), "host_us_min": min(loops),
                "host_us_max": max(loops),
                "graph_gpu_us": graph if isinstance(graph, float) else None,
                "graph_note": "" if isinstance(graph, float) else graph,
                "max_abs_error": max(before.max_abs, after.max_abs), "reason": ""}
        rows.append(row)
    sdpa = next((r["host_us"] for r in rows if r["provider"] == "sdpa" and "host_us" in r),
                None)
    for r in rows:
        r["over_sdpa"] = r["host_us"] / sdpa if sdpa and "host_us" in r else None
    return rows
