"""The per-process protocol for one version on one problem:

    inputs (protocol, seed) -> reference (float64) -> prepare (own buffers)
    -> poison, run once, verify -> time (GPU only) -> verify the last timed output
    -> resource fields
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fusedattn.mode import DEVICE, EMULATION
from fusedattn.problem import DTYPE, Problem, ProblemError
from fusedattn.reference import attention_ref
from fusedattn_lab.inputs import make_inputs
from fusedattn_lab.registry import VERSIONS, Version, tolerance_peer
from fusedattn_lab.timing import time_gpu
from fusedattn_lab.verify import Check, check, needs_peer, poison, precision_key


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

    @property
    def verdict(self) -> str:
        return "PASS" if self.ok else "FAIL"

    @property
    def max_abs(self) -> float:
        """The worse max abs error of the first run and the last timed one."""
        return max(self.before.max_abs, self.after.max_abs if self.after else 0.0)

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.before.reasons + (self.after.reasons if self.after else ())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d


def _sync() -> None:
    if not EMULATION:
        torch.cuda.synchronize()


EMULATION_SLOW = 16 * 16 * 32 * 8
"""S*S*block past which the numba simulator takes long: it runs every CUDA thread as an OS
thread, and the thread-level kernels' work grows as S rows x S keys x the block's threads.
On a 2-core CPU `fusedattn run --version online,materialized` took 6 s at the emulation
default (16x8, block 32) and 27 s at 8x its S*S*block (32x8, block 64); the issue saw the
chapter's 128x64 with block 256 (512x) run past 60 s."""


def _available_ram() -> int:
    """Bytes of RAM the OS could give now (Linux MemAvailable; else free pages)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resource_plan(problem: Problem, versions: list[Version]) -> dict[str, int]:
    """What one `run` of `versions` on `problem` allocates, in bytes: on the device, the
    inputs (q, k, v) and each version's output and S x S arrays (the largest version's, as
    one runs at a time); on the host, the float64 reference (q, k, v and two S x S arrays:
    scores and probabilities)."""
    s, d = problem.seq, problem.dim
    per_version = max((s * d * 4 + v.intermediate_models(s)["capacity_bytes"]
                       for v in versions), default=0)
    return {"device": 3 * s * d * 4 + per_version, "host": 3 * s * d * 8 + 2 * s * s * 8}


def check_resources(problem: Problem, versions: list[Version], warn) -> None:
    """Refuse what cannot fit (device memory on a GPU, RAM in emulation and for the
    reference), naming the figures; `warn(text)` when an emulation run will take long."""
    need = resource_plan(problem, versions)
    ram = _available_ram()
    if EMULATION:
        need = {"RAM": need["device"] + need["host"]}
        have = {"RAM": ram}
    else:
        have = {"device": torch.cuda.mem_get_info()[0], "host": ram}
        need = {"device": need["device"], "host": need["host"]}
    for where, n in need.items():
        if n > 0.9 * have[where]:
            raise ProblemError("seq", problem.seq, f"a problem that fits: {problem.label()} "
                               f"needs {n / 2**30:.2f} GiB of {where} memory (inputs, outputs, "
                               f"S x S arrays, the float64 reference), {have[where] / 2**30:.2f}"
                               " GiB is free")
    threaded = [v for v in versions if v.route == "simt"]
    work = problem.seq * problem.seq * problem.block
    if EMULATION and threaded and work > EMULATION_SLOW:
        warn(f"emulation of {problem.label()} with block {problem.block}: the CUDA simulator "
             f"runs every thread as an OS thread; {', '.join(v.name for v in threaded)} will "
             f"take long (about {work / EMULATION_SLOW:.0f}x the work of 32x8 with block 64, "
             "which took half a minute on a 2-core CPU)")


def peer_error(q, k, v, problem: Problem, ref: torch.Tensor, protocol: str | None
               ) -> float | None:
    """The max error of PyTorch's own computation in the same precision (the registry's
    peer for this tolerance key) on the same inputs, where the bound is relative to it;
    None where the bound is fixed (the chapter's protocols)."""
    if not needs_peer(DTYPE, None, protocol):
        return None
    peer = VERSIONS[tolerance_peer(precision_key(DTYPE, None, protocol))]
    prepared = peer.prepare(q, k, v, problem)
    prepared.call()
    return float((prepared.out.double().cpu() - ref.double().cpu()).abs().max())


@dataclass(frozen=True)
class Case:
    """One problem's inputs (from its protocol and seed), their float64 reference, and the
    peer error of its bound: built once (`case_for`), shared by every version measured."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor
    protocol: str
    peer_error: float | None


def case_for(problem: Problem, settings: Settings) -> Case:
    q, k, v = make_inputs(problem, settings.inputs, settings.seed, DEVICE)
    ref = attention_ref(q, k, v, causal=problem.causal)
    return Case(q, k, v, ref, settings.inputs,
                peer_error(q, k, v, problem, ref, settings.inputs))


def measure(version: Version, problem: Problem, settings: Settings,
            case: Case | None = None) -> Record:
    """Run the protocol on `case` (built here when not given)."""
    case = case or case_for(problem, settings)
    q, k, v, ref = case.q, case.k, case.v, case.ref
    bound = {"protocol": case.protocol, "peer_error": case.peer_error}
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
    peak, _ = call_peak(prepared.call)
    return {"peak_bytes": peak, "baseline_bytes": baseline, "version_bytes": peak - baseline}


def call_peak(call) -> tuple[int, int]:
    """The device-memory high-water mark of one `call()` (after its first call did the
    one-time work), and that minus what was allocated before it: `(peak, call_bytes)`.
    The one way peak memory is measured (run-all's memory units, the bench)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()  # the peak restarts at what is held now
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak, peak - before
