"""The registry: every version of attention forward that fusedattn can run.

CLI, benchmarks, profile, plots and tests read `VERSIONS` and the helpers below; no other
list of version or kernel names exists. Adding a version touches only its kernel module and
one `register(...)` call here (ours) or in `peers.py` (PyTorch's).

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
    MAX_FLASH_DIM,
    MAX_ROW_DIM,
    Limits,
    Problem,
    ProblemError,
    check_tensors,
)
from fusedattn.simt.tiled_plan import barriers_per_block

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


# --- thread-level (numba.cuda) -------------------------------------------------------------

def _prepare_simt(module: str, launcher: str, **options):
    """Prepare function of a numba.cuda version: its module's `allocate`, then its launcher
    with the problem's block and mask and `options`."""

    def prepare(q, k, v, problem: Problem) -> Prepared:
        from fusedattn.simt._launch import resource_fields

        mod = importlib.import_module(module)
        bufs = mod.allocate(q)
        fn = getattr(mod, launcher)
        last: list = []

        def call():
            last[:] = fn(q, k, v, bufs, block=problem.block, causal=problem.causal, **options)

        return Prepared(call, bufs["out"], bufs, lambda: resource_fields(last))

    return prepare


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _prepare_materialized_planted(q, k, v, problem: Problem) -> Prepared:
    """materialized with the row softmax that lacks the read-the-max barrier."""
    from fusedattn.simt import materialized

    bufs = materialized.allocate(q)
    kernel = materialized.planted_softmax_kernel()

    def call():
        materialized.materialized_attention(q, k, v, bufs, block=problem.block,
                                            softmax_kernel=kernel)

    return Prepared(call, bufs["out"], bufs, lambda: [])


register(Version(
    "materialized", "simt",
    "3 launches: scores [S,S] -> row softmax P [S,S] -> P.V; S x S arrays in global memory",
    (Kernel("scores", ("Q", "K"), ("Scores",), lambda p: 0, "one thread per (i, j)",
            "_scores_kernel"),
     # per row: partial max, log2(B) max levels, the read-the-max wait, partial sum, log2(B)
     Kernel("softmax_rows", ("Scores",), ("P",), lambda p: 3 + 2 * _log2(p.block),
            "per block (= per query row): 3 + 2*log2(block)", "_softmax_rows_kernel"),
     Kernel("pv", ("P", "V"), ("O",), lambda p: 0, "one thread per (i, d)", "_pv_kernel")),
    "fusedattn.simt.materialized",
    _prepare_simt("fusedattn.simt.materialized", "materialized_attention"), ROW_LIMITS,
    intermediates=2, planted=_prepare_materialized_planted, planted_kernel="softmax_rows",
))
register(Version(
    "online", "simt",
    "1 launch: one block per query row, online softmax key by key, barriers per key",
    (Kernel("online_rows", ("Q", "K", "V"), ("O",),
            lambda p: 1 + p.seq * (3 + _log2(p.block)),
            "per block (= per query row): 1 + S*(3 + log2(block))", "_online_rows_kernel"),),
    "fusedattn.simt.online",
    _prepare_simt("fusedattn.simt.online", "online_attention"), ROW_LIMITS,
))


def _tiled_limits(rows: int) -> Limits:
    """Head dims whose K/V tiles and row state fit a block's 48 KB of shared memory."""
    from fusedattn.simt.tiled_plan import SHARED_LIMIT, shared_bytes

    dim = next(d for d in range(MAX_ROW_DIM, 0, -1) if shared_bytes(rows, d) <= SHARED_LIMIT)
    return Limits(max_dim=dim, note=f"K/V tiles and {rows} row(s) of state in 48 KB of "
                  "shared memory")


for _rows, _name in ((1, "online-tiled"), (4, "online-tiled-4")):
    register(Version(
        _name, "simt",
        f"1 launch: a block per {_rows} query row(s), K/V tiles of 32 keys in shared memory, "
        "one max/sum update per tile: 4 barriers per tile",
        (Kernel("online_tiled", ("Q", "K", "V"), ("O",),
                lambda p: barriers_per_block(p.seq),
                "per block: 1 + 4*ceil(S/32) (load, scores, row statistics, accumulate)",
                "_online_tiled_kernel"),),
        "fusedattn.simt.online_tiled",
        _prepare_simt("fusedattn.simt.online_tiled", "online_tiled_attention", rows=_rows),
        _tiled_limits(_rows),
        planted=_prepare_simt("fusedattn.simt.online_tiled", "online_tiled_attention",
                              rows=_rows, planted=True),
        planted_kernel="online_tiled",
    ))


# --- tile-level (Triton) -------------------------------------------------------------------

def _prepare_rows(block_k: int):
    """Prepare function of the Triton row kernel at one BLOCK_K (t0, t1, and sweeps)."""

    def prepare(q, k, v, problem: Problem) -> Prepared:
        from fusedattn.tiles.rows import rows_attention, triton_resources

        out = torch.empty_like(q)
        last: list = [None]

        def call():
            last[0] = rows_attention(q, k, v, block_k=block_k, out=out,
                                     causal=problem.causal)[1]

        return Prepared(call, out, {"out": out},
                        lambda: [triton_resources(last[0], "rows_fwd", q.shape[0])])

    return prepare


for _name, _bk in (("t0", 16), ("t1", 32)):
    register(Version(
        _name, "tiles",
        f"1 launch: one program per query row, online softmax over BLOCK_K={_bk} key tiles",
        (Kernel("rows_fwd", ("Q", "K", "V"), ("O",), None,
                "inserted by Triton for cross-warp tl.sum/tl.max; not counted",
                "_rows_fwd_kernel"),),
        "fusedattn.tiles.rows", _prepare_rows(_bk), ROW_LIMITS, block_k=_bk,
        retune=_prepare_rows,
    ))


# --- the flash kernel ----------------------------------------------------------------------

def _prepare_flash(q, k, v, problem: Problem) -> Prepared:
    from fusedattn.tiles.flash import flash_forward
    from fusedattn.tiles.rows import triton_resources

    out = torch.empty_like(q)
    q4, k4, v4, o4 = (t[None, None] for t in (q, k, v, out))  # [S, D] as [1, 1, S, D]
    last: list = [None]

    def call():
        last[0] = flash_forward(q4, k4, v4, out=o4, lse=None, is_causal=problem.causal,
                                scale=problem.scale, precision="ieee")[1]

    return Prepared(call, out, {"out": out},
                    lambda: [triton_resources(last[0], "flash_fwd", None)])


def _flash_batched(q, k, v, causal: bool, precision: str | None):
    from fusedattn.api import attention

    gqa = q.shape[-3] != k.shape[-3]
    return lambda: attention(q, k, v, is_causal=causal, enable_gqa=gqa, precision=precision)


register(Version(
    "flash", "tiles",
    "1 launch: FlashAttention-2 style, BLOCK_M query rows x BLOCK_N key tiles, tl.dot "
    "(fp32: ieee)",
    (Kernel("flash_fwd", ("Q", "K", "V"), ("O",), None,
            "inserted by Triton around tl.dot and the row reductions; not counted",
            "_flash_fwd"),),
    "fusedattn.tiles.flash", _prepare_flash,
    Limits(max_dim=MAX_FLASH_DIM, note="head dims up to 256, padded to a power of two >= 16"),
    batched=_flash_batched, bench_subject=True,
))


# The peers register themselves in their own module (their source hash in the evidence is
# theirs alone); imported last, as they use the classes above.
from fusedattn.lab import peers  # noqa: E402,F401
