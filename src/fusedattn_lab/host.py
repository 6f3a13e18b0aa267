"""`fusedattn bench --suite host`: what a call costs the host, against SDPA's (issue 31).

Per problem, in one process, on the same inputs, for each provider (fusedattn, and SDPA
with its own choice of backend, cuDNN and flash, each backend chosen around its own loops):
- **host µs a call**: `LOOPS` loops of `CALLS` calls with no synchronisation inside a loop,
  the loop's wall time over its calls (the kernels run asynchronously: while the GPU keeps
  up with the queue, the loop runs at the host's pace); the median loop and the spread
  (fastest and slowest loop). The providers take turns loop by loop (round k times every
  provider's k-th loop), so a host that drifts during the run moves them alike: the H200's
  host moved a provider's figure by up to 70% between runs of one commit
  (evidence/nvidia-h200/20261202T1519Z-host-ab), which timing the providers one after
  another turned into ratios. A problem whose GPU time exceeds its host time still
  measures the host: the launch queue (about a thousand launches) is not filled by
  `CALLS` calls.
- **graph GPU µs**: the same call captured once in a CUDA graph and replayed, timed by
  CUDA events around the replays (the GPU's time with no host in the way); "n/a" where a
  call cannot be captured (varlen's default offsets check copies them to the host).
- each provider's output is verified against the float64 reference on one head before
  and after the timing (`verify.check`, the one tolerance table).

The target: fusedattn's host µs at most 1.2x SDPA's (default backend) on the same problem.
The varlen problem has equal lengths, so SDPA's dense call is the same attention. The
"layer" problems are a Hugging Face layer's forward for every provider: q, k and v are
`[B, S, H, D]` projections seen as `[B, H, S, D]`, and the timed call ends in
`out.transpose(1, 2).contiguous()`, a copy kernel unless O is in q's layout (fusedattn's
since 2c40f95, SDPA's cuDNN and flash backends'); its graph GPU µs count the copy too.
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
    kind: str  # "fwd", "fwd+bwd", "layer", "varlen", "decode", "decode+append"
    batch: int
    heads: int
    seq: int
    dim: int
    causal: bool = False
    heads_kv: int | None = None

    def label(self) -> str:
        kv = f"/{self.heads_kv}" if self.heads_kv else ""
        keys = "Sk" if self.kind.startswith("decode") else "S"
        return (f"{self.kind} bf16 B{self.batch} H{self.heads}{kv} {keys}{self.seq} D{self.dim}"
                + (" causal" if self.causal else ""))


def problems() -> list[HostProblem]:
    """The issue's problems (short ones, where the host is the bottleneck) and one long."""
    return [HostProblem("fwd", 64, 16, 256, 64), HostProblem("fwd", 1, 8, 128, 64),
            HostProblem("fwd", 4, 32, 4096, 128, True),
            HostProblem("fwd+bwd", 4, 8, 256, 64, True), HostProblem("fwd+bwd", 1, 8, 128, 64),
            # a Hugging Face layer's forward: q, k, v its [B, S, H, D] projections seen as
            # [B, H, S, D], O given back as [B, S, H, D] (`.transpose(1, 2).contiguous()`,
            # timed: a copy kernel unless O is in q's layout)
            HostProblem("layer", 64, 16, 256, 64, True),
            HostProblem("layer", 4, 32, 4096, 128, True, heads_kv=8),
            HostProblem("varlen", 4, 16, 256, 64, True),
            HostProblem("decode", 32, 32, 8192, 128, True, heads_kv=8),
            # a server's step: the new key and value appended to the cache, then the
            # attention (the peers: torch's copy into the cache's last row, then SDPA)
            HostProblem("decode+append", 32, 32, 8192, 128, True, heads_kv=8)]


def _calls(p: HostProblem, gen: torch.Generator, libraries: dict,
           device: str = "cuda") -> dict:
    """({provider: (SDPA backend or None, call returning O as [B, H, Sq, D], varlen's
    packed as `[B * S, H, D]`, a layer's as `[B, S, H, D]`)}, the inputs, mask and whether
    O comes as a layer's, for the check). `libraries`: {name: a module with fusedattn's
    entry points}, each a provider (`scripts/host_ab.py` passes an older commit's beside
    this one). `device`: "cpu" in emulation (a test of the calls, no timing)."""
    from torch.nn.attention import SDPBackend
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def rand(*shape):
        return torch.randn(shape, generator=gen, device=device).to(
            torch.bfloat16 if device == "cuda" else torch.float32)

    hkv = p.heads_kv or p.heads
    decode = p.kind.startswith("decode")
    q_len = 1 if decode else p.seq
    q, k, v = rand(p.batch, p.heads, q_len, p.dim), *(rand(p.batch, hkv, p.seq, p.dim)
                                                       for _ in range(2))
    layer = p.kind == "layer"
    if layer:  # the projections' memory, [B, S, H, D], seen as [B, H, S, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    gqa = hkv != p.heads
    causal = p.causal and not decode  # one new query sees the whole cache
    appended = None
    if p.kind == "decode+append":  # each call writes them at the cache's last row
        appended = [rand(p.batch, hkv, 1, p.dim) for _ in range(2)]
    if p.kind == "fwd+bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        dout = rand(*q.shape)

    def plain(fn):
        def call():
            out = fn(q, k, v)
            if p.kind == "fwd+bwd":
                out.backward(dout)
            if layer:
                return out.transpose(1, 2).contiguous()
            return out
        return call

    def peer(q, k, v):
        if appended is not None:
            k[:, :, -1:].copy_(appended[0])
            v[:, :, -1:].copy_(appended[1])
        return sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)

    peers = {name: (backend, plain(peer))
             for name, backend in (("sdpa", None), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                   ("sdpa-flash", SDPBackend.FLASH_ATTENTION))}
    calls = {}
    cu = torch.arange(0, (p.batch + 1) * p.seq, p.seq, dtype=torch.int32, device=device)
    lens = torch.full((p.batch,), p.seq - (appended is not None), dtype=torch.int32,
                      device=device)
    packed = [t.transpose(1, 2).reshape(-1, t.shape[1], p.dim).contiguous()
              for t in (q, k, v)] if p.kind == "varlen" else None
    for name, lib in libraries.items():
        if p.kind in ("fwd", "fwd+bwd", "layer"):
            calls[name] = (None, plain(lambda q, k, v, lib=lib: lib.attention(
                q, k, v, is_causal=causal, enable_gqa=gqa)))
        elif p.kind == "varlen":
            def varlen(check, lib=lib):
                def call():  # (O packed, `[total, H, D]`: `_check` views it as SDPA's)
                    return lib.attention_varlen(*packed, cu, cu, p.seq, p.seq,
                                                is_causal=causal, check_lengths=check)
                return call
            calls[name] = (None, varlen(True))
            calls[f"{name} check_lengths=False"] = (None, varlen(False))
        else:
            def step(check, lib=lib):
                def call():  # (the default, check_lengths=True: the lengths read each call)
                    return lib.attention_with_kvcache(
                        q, k, v, cache_seqlens=lens, check_lengths=check,
                        **({} if appended is None else dict(k_new=appended[0],
                                                            v_new=appended[1])))
                return call
            calls[name] = (None, step(True))
            calls[f"{name} check_lengths=False"] = (None, step(False))
    calls.update(peers)
    return calls, (q, k, v, causal, layer)


def _host_us(call) -> float:
    """One loop's host µs a call (`CALLS` calls, synchronised before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    took = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return took


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

    q, k, v, causal, layer = inputs
    if out.dim() == 3:  # varlen's packed O, viewed outside the timed call
        out = out.reshape(q.shape[0], q.shape[2], q.shape[1], -1).transpose(1, 2)
    if layer:  # a layer's [B, S, H, D]
        out = out.transpose(1, 2)
    qs, ks, vs = (t[0, :1].detach() for t in (q, k, v))  # query head 0 reads K/V head 0
    ref = attention_ref(qs, ks, vs, causal=causal, device=q.device)
    with sdpa_kernel(SDPBackend.MATH):  # the peer in the inputs' precision (any backend)
        peer = torch.nn.functional.scaled_dot_product_attention(
            *(t[None] for t in (qs, ks, vs)), is_causal=causal)[0]
    return check(out[0, :1], ref, peer_error=float((peer.double() - ref).abs().max()))


def measure(p: HostProblem, seed: int = 0, libraries: dict | None = None) -> list[dict]:
    """The problem's rows, one per provider (`libraries` as `_calls` takes them; default
    fusedattn itself), their loops taking turns."""
    from torch.nn.attention import sdpa_kernel

    import fusedattn

    gen = torch.Generator(device="cuda").manual_seed(seed)
    calls, inputs = _calls(p, gen, libraries or {"fusedattn": fusedattn})

    def under(backend):
        return sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()

    rows, state = {}, {}
    for name, (backend, call) in calls.items():
        rows[name] = {"problem": p.label(), "provider": name}
        try:
            with under(backend):
                for _ in range(WARMUP):
                    call()
                state[name] = {"before": _check(call(), inputs), "loops": []}
        except RuntimeError as e:  # a backend that refuses the problem
            rows[name] |= {"status": "skipped", "reason": str(e).splitlines()[0][:80]}
    for _ in range(LOOPS):
        for name, got in state.items():
            backend, call = calls[name]
            with under(backend):
                got["loops"].append(_host_us(call))
    for name, got in state.items():
        backend, call = calls[name]
        try:
            with under(backend):
                graph = _graph_us(call)
                after = _check(call(), inputs)
        except RuntimeError as e:
            rows[name] |= {"status": "FAIL", "reason": str(e).splitlines()[0][:80]}
            continue
        before, loops = got["before"], got["loops"]
        rows[name] |= {"status": "ok" if before.ok and after.ok else "FAIL",
                       "host_us": statistics.median(loops), "host_us_min": min(loops),
                       "host_us_max": max(loops),
                       "graph_gpu_us": graph if isinstance(graph, float) else None,
                       "graph_note": "" if isinstance(graph, float) else graph,
                       "max_abs_error": max(before.max_abs, after.max_abs), "reason": ""}
    rows = list(rows.values())
    sdpa = next((r["host_us"] for r in rows if r["provider"] == "sdpa" and "host_us" in r),
                None)
    for r in rows:
        r["over_sdpa"] = r["host_us"] / sdpa if sdpa and "host_us" in r else None
    return rows
