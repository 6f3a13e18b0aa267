"""The per-process protocol for one version on one problem:

    inputs (protocol, seed) -> reference (float64) -> prepare (own buffers)
    -> poison, run once, verify -> time (GPU only) -> verify the last timed output
    -> resource fields
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from fusedattn.inputs import make_inputs
from fusedattn.mode import DEVICE, EMULATION
from fusedattn.problem import DTYPE, Problem
from fusedattn.reference import attention_ref
from fusedattn.timing import time_gpu
from fusedattn.verify import Check, check, fp32_peer_error, needs_peer, poison
from fusedattn.versions import Version


@dataclass(frozen=True)
class Settings:
    inputs: str = "uniform"
    seed: int = 0
    warmup: int = 5
    repeat: int = 20
    timing: str = "events"


@dataclass
class Record:
    """One (version, problem) measurement in one process."""

    version: str
    route: str
    seq: int
    dim: int
    block: int
    causal: bool
    settings: dict
    before: Check
    after: Check | None    # None in emulation (no timed runs)
    timing: dict | None    # None in emulation: no times
    resources: list[dict]

    @property
    def ok(self) -> bool:
        return self.before.ok and (self.after is None or self.after.ok)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = "PASS" if self.ok else "FAIL"
        return d


def _sync() -> None:
    if not EMULATION:
        torch.cuda.synchronize()


def measure(version: Version, problem: Problem, settings: Settings,
            inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            ref: torch.Tensor | None = None) -> Record:
    """Run the protocol; `inputs`/`ref` may be passed to share them between versions."""
    if inputs is None:
        inputs = make_inputs(problem, settings.inputs, settings.seed, DEVICE)
    q, k, v = inputs
    if ref is None:
        ref = attention_ref(q, k, v, causal=problem.causal)
    bound = {"protocol": settings.inputs, "peer_error": None}
    if needs_peer(DTYPE, None, settings.inputs):
        bound["peer_error"] = fp32_peer_error(q, k, v, ref, causal=problem.causal)
    prepared = version.prepare(q, k, v, problem)
    poison(prepared.out)
    prepared.call()
    _sync()
    before = check(prepared.out, ref, **bound)
    after = timing = None
    if not EMULATION:
        poison(prepared.out)
        timing = time_gpu(prepared.call, warmup=settings.warmup, repeat=settings.repeat,
                          mode=settings.timing).to_dict()
        after = check(prepared.out, ref, **bound)
    return Record(version.name, version.route, problem.seq, problem.dim, problem.block,
                  problem.causal, asdict(settings), before, after, timing, prepared.resources())


def measure_peak(version: Version, problem: Problem, settings: Settings) -> dict:
    """Peak device memory of one call, meant for a fresh process (GPU only).

    Every buffer is a torch tensor, so torch's allocator statistics see them all:
    `baseline_bytes` is what the inputs occupy, `peak_bytes` the high-water mark of
    prepare + one call, `version_bytes` the difference (the version's own buffers and
    temporaries). A first call runs before the peak is reset: one-time work is not the
    call's memory (Triton's autotuner times configs with a 256 MiB L2-flush buffer, which
    made flash's first call peak at 256 MiB on a 128x64 problem).
    """
    if EMULATION:
        return {"peak_bytes": None, "baseline_bytes": None, "version_bytes": None}
    inputs = make_inputs(problem, settings.inputs, settings.seed, DEVICE)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    prepared = version.prepare(*inputs, problem)
    prepared.call()  # compile / autotune
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # the peak restarts at what is held now
    prepared.call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_bytes": peak, "baseline_bytes": baseline, "version_bytes": peak - baseline}
