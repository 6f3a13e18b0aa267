"""GPU timing: CUDA events around exactly a version's launches, with the GPU kept busy.

Why prime: a Python launch costs tens of microseconds, longer than these kernels run. With
an idle GPU the start event fires at once and the end event waits for the host to finish
launching, so the events measure Python. Here a `torch.cuda._sleep` spin kernel, longer than
the host needs to issue the version's launches, is queued before each start event: by the
time the GPU reaches the start event, all launches are already queued behind it, and the
events see GPU time only. The host cost of one call is measured separately (wall clock
around the call, no synchronisation) and reported as its own figure.

`mode="graph"` captures the call once into a CUDA graph and times its replays instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

MODES = ("events", "graph")


@dataclass(frozen=True)
class Timing:
    mode: str
    times_ms: list[float]   # GPU time of every timed repetition
    host_us: list[float]    # host wall time of every timed call (launch cost)
    prime_ms: float         # GPU busy time queued before each start event

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def max_ms(self) -> float:
        return max(self.times_ms)

    @property
    def host_us_median(self) -> float:
        return statistics.median(self.host_us)

    def summary(self) -> dict:
        return {"mode": self.mode, "median_ms": self.median_ms, "min_ms": self.min_ms,
                "max_ms": self.max_ms, "host_us_median": self.host_us_median,
                "prime_ms": self.prime_ms}

    def to_dict(self) -> dict:
        return asdict(self) | self.summary()


_CYCLES_PER_MS: float | None = None


def _sleep_cycles_per_ms() -> float:
    """Calibrate `torch.cuda._sleep` once per process: spin cycles per millisecond."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = cycles / start.elapsed_time(end)
    return _CYCLES_PER_MS


def _host_cost_ms(fn: Callable[[], object], calls: int = 5) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def time_gpu(fn: Callable[[], object], *, warmup: int, repeat: int, mode: str = "events"
             ) -> Timing:
    """Time `fn` (exactly the version's launches) `repeat` times after `warmup` calls."""
    if mode not in MODES:
        raise ValueError(f"timing mode {mode!r}: allowed {MODES}")
    for _ in range(warmup):
        fn()
    target = fn
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # as torch recommends: one call on a side stream before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        target = graph.replay
        target()
    # Keep the GPU busy for 3x the host cost of one call (at least 0.2 ms) before each start.
    prime_ms = max(0.2, 3.0 * _host_cost_ms(target))
    cycles = int(prime_ms * _sleep_cycles_per_ms())
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    host_us = []
    torch.cuda.synchronize()
    for i in range(repeat):
        torch.cuda._sleep(cycles)
        starts[i].record()
        t0 = time.perf_counter()
        target()
        host_us.append((time.perf_counter() - t0) * 1e6)
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing(mode, times, host_us, prime_ms)
