"""The registry: every version of attention forward that fusedattn can run.

CLI, benchmarks, profile, plots and tests read `VERSIONS` and the helpers below; no other
list of version or kernel names exists. Adding a version touches only its kernel module and
one `register(...)` call in `versions.py` (ours) or in `peers.py` (PyTorch's).

A version knows its route, a one-line description, the kernels its timed region launches
(with their symbols, buffers and barrier counts), its limits, its planted variant if it has
one, whether it is the bench's subject or a tolerance peer, and how to allocate its own
buffers: `prepare(q, k, v, problem)` allocates
exactly what the version uses (the online versions allocate no S x S array) and returns a
`Prepared` whose `call()` performs exactly the timed launches.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from fusedattn.problem import (
    MAX_ROW_DIM,
    Limits,
    Problem,
    ProblemError,
    check_tensors,
)

ROUTES = {
    "simt": "thread-level, numba.cuda API (the chapter's HIP route)",
    "tiles": "tile-level, Triton (the chapter's Triton route)",
    "peer": "not ours: PyTorch, for comparison",
}

ROW_LIMITS = Limits(max_dim=MAX_ROW_DIM, note="the chapter's validated range for the row kernels")


@dataclass(frozen=True)
class Kernel:
    """One launch inside a version's timed region: which buffers it reads and writes, and how
    many block-level barriers one block executes (None: none written by us to count, e.g.
    those a compiler inserts for cross-warp reductions, or a library's kernel)."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    barriers: Callable[[Problem], int] | None = field(default=None, repr=False)
    barriers_note: str = ""
    symbol: str | None = None
    """The name inside the symbol that tools print (numba keeps the Python function's name
    in the mangled symbol, Triton the jit function's); None for a library's kernel."""


@dataclass
class Prepared:
    """A version bound to its inputs and its own buffers."""

    call: Callable[[], object]           # exactly the timed launches; writes `out`
    out: torch.Tensor                    # `[S, D]` float32
    buffers: dict[str, torch.Tensor]     # everything the version allocated, `out` included
    resources: Callable[[], list[dict]]  # per-kernel resource fields (after one call)


@dataclass(frozen=True)
class Version:
    name: str
    route: str
    description: str
    launches: tuple[Kernel, ...]  # the kernels inside the timed region, in order
    module: str                # the module holding its kernels (hashed into evidence)
    prepare_fn: Callable[..., Prepared] = field(repr=False)
    limits: Limits = Limits()
    intermediates: int = 0  # S x S float32 arrays written once and read once (chapter 12.2)
    block_k: int | None = None  # keys per tile, for versions that have one
    in_all: bool = True  # part of `--version all` on the chapter's [S, D] float32 problem
    batched: Callable[..., Callable[[], torch.Tensor]] | None = field(default=None, repr=False)
    """For `fusedattn bench`: `batched(q, k, v, causal, precision)` on `[B, H, S, D]` inputs
    returns a call computing O (allocating it); None when the version has no batched form."""
    retune: Callable[[int], Callable[..., Prepared]] | None = field(default=None, repr=False)
    planted: Callable[..., Prepared] | None = field(default=None, repr=False)
    """A prepare function of this version with a barrier removed on purpose (the chapter's
    historical bug), which `check-races` must catch in the kernel named `planted_kernel`."""
    planted_kernel: str | None = None
    bench_subject: bool = False  # the version the bench's ratios are about (ours)
    judges: tuple[str, ...] = ()
    """Tolerance keys (`verify.TOLERANCE`) for which this version is PyTorch's own
    computation in the same precision: the peer whose error sets the relative bound."""

    def with_block_k(self, block_k: int) -> Version:
        """The same version at another BLOCK_K (the sweep of exercise 4)."""
        if self.retune is None:
            raise ProblemError("version", self.name, "a version with a BLOCK_K: "
                               + ", ".join(n for n, v in VERSIONS.items() if v.retune))
        if isinstance(block_k, bool) or not isinstance(block_k, int) or not (
                1 <= block_k <= 1024 and block_k & (block_k - 1) == 0):
            raise ProblemError("block_k", block_k, "a power of two in 1..1024")
        return replace(self, name=f"{self.name}[BLOCK_K={block_k}]", block_k=block_k,
                       prepare_fn=self.retune(block_k))

    def intermediate_models(self, seq: int) -> dict[str, int]:
        """The chapter's two models: capacity n*S^2*4 bytes; traffic (write once, read once)
        n*S^2*8 bytes, i.e. 16*S^2 for the two arrays of the materialized pipeline."""
        return {"capacity_bytes": self.intermediates * seq * seq * 4,
                "traffic_bytes": self.intermediates * seq * seq * 8}

    def prepare(self, q, k, v, problem: Problem) -> Prepared:
        """Validate `q, k, v: [S, D] float32` (contiguous, on the mode's device) against
        `problem` and this version's limits, then allocate its buffers."""
        from fusedattn.mode import DEVICE

        shape = check_tensors(q, k, v, DEVICE)
        if (shape.seq, shape.dim) != (problem.seq, problem.dim):
            raise ProblemError("q.shape", tuple(q.shape),
                               f"[{problem.seq}, {problem.dim}] as the problem says")
        self.limits.check(self.name, problem)
        return self.prepare_fn(q, k, v, problem)

    def source_file(self) -> Path:
        return Path(inspect.getfile(importlib.import_module(self.module)))


VERSIONS: dict[str, Version] = {}


def register(version: Version) -> Version:
    if version.route not in ROUTES:
        raise ValueError(f"unknown route {version.route!r}")
    VERSIONS[version.name] = version
    return version


def kernel_symbols(names: list[str]) -> dict[str, list[str]]:
    """Symbol -> the versions (of `names`) that launch it; kernels without a symbol of ours
    (a library's) are left out."""
    out: dict[str, list[str]] = {}
    for name in names:
        for k in VERSIONS[name].launches:
            if k.symbol is not None:
                out.setdefault(k.symbol, []).append(name)
    return out


def planted_versions() -> list[str]:
    """The versions that carry a planted missing-barrier variant (check-races runs each)."""
    return [n for n, v in VERSIONS.items() if v.planted is not None]


def planted_symbol(name: str) -> str:
    """The symbol racecheck must flag in version `name`'s planted variant."""
    v = VERSIONS[name]
    return next(k.symbol for k in v.launches if k.name == v.planted_kernel)


def bench_subject() -> str:
    """The bench's subject: the provider every ratio is about."""
    return next(n for n, v in VERSIONS.items() if v.bench_subject)


def tolerance_peer(key: str) -> str:
    """The peer whose error sets the bound of tolerance key `key`."""
    found = [n for n, v in VERSIONS.items() if key in v.judges]
    if not found:
        raise ValueError(f"no registered peer judges {key!r}")
    return found[0]


def materializing() -> set[str]:
    """Versions that hold S x S arrays (the bench runs them only up to moderate S)."""
    return {n for n, v in VERSIONS.items() if v.intermediates}


def select(spec: str) -> list[Version]:
    """`all` or a comma-separated list of names -> versions, in registry order for `all`."""
    if spec == "all":
        return [v for v in VERSIONS.values() if v.in_all]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in VERSIONS]
    if unknown or not names:
        raise ProblemError("version", spec, "all, or a comma-separated list of: "
                           + ", ".join(VERSIONS))
    return [VERSIONS[n] for n in dict.fromkeys(names)]


# The library's versions register themselves in `versions.py` and PyTorch's in `peers.py`
# (each module's source hash in the evidence is its own); imported last, as they use the
# classes above, in the order `fusedattn list` shows them.
# isort: off
from fusedattn_lab import versions  # noqa: E402,F401
from fusedattn_lab import peers  # noqa: E402,F401
# isort: on
