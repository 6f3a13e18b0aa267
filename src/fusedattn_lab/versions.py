"""The library's versions, as data: each `register(...)` names a version's route, its
kernels (symbols, buffers, barrier counts), limits, planted variant and how it prepares its
own buffers. The registry (`registry.py`) collects them; nothing else lists them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from fusedattn.problem import MAX_FLASH_DIM, MAX_ROW_DIM, Limits, Problem, ProblemError
from fusedattn_lab.registry import (
    ROW_LIMITS,
    Kernel,
    Prepared,
    Version,
    register,
)

# --- thread-level (numba.cuda) -------------------------------------------------------------

def _prepare_simt(module: str, launcher: str, **options):
    """Prepare function of a numba.cuda version: its module's `allocate`, then its launcher
    with the problem's block and mask and `options`."""

    def prepare(q, k, v, problem: Problem) -> Prepared:
        from fusedattn_lab.simt._launch import resource_fields

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
    from fusedattn_lab.simt import materialized

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
    "fusedattn_lab.simt.materialized",
    _prepare_simt("fusedattn_lab.simt.materialized", "materialized_attention"), ROW_LIMITS,
    intermediates=2, planted=_prepare_materialized_planted, planted_kernel="softmax_rows",
))
register(Version(
    "online", "simt",
    "1 launch: one block per query row, online softmax key by key, barriers per key",
    (Kernel("online_rows", ("Q", "K", "V"), ("O",),
            lambda p: 1 + p.seq * (3 + _log2(p.block)),
            "per block (= per query row): 1 + S*(3 + log2(block))", "_online_rows_kernel"),),
    "fusedattn_lab.simt.online",
    _prepare_simt("fusedattn_lab.simt.online", "online_attention"), ROW_LIMITS,
))


@dataclass(frozen=True)
class TiledLimits(Limits):
    """online-tiled's limits depend on the block and the rows per block (`rows`, None for
    `tiled_plan.auto_rows`): the K/V tile and the merge slots must fit a block's 48 KB of
    shared memory, and the rows must divide the block. `max_dim` (listed) is at block 256."""

    rows: int | None = None

    @classmethod
    def of(cls, rows: int | None) -> TiledLimits:
        probe = cls(rows=rows)
        dim = next(d for d in range(MAX_ROW_DIM, 0, -1) if probe._plan(256, d) is not None)
        return cls(max_dim=dim, note="K/V tiles and merge slots in 48 KB of shared memory, "
                   "at block 256", rows=rows)

    def _plan(self, block: int, dim: int, seq: int = 128):
        from fusedattn_lab.simt.tiled_plan import Plan, auto_rows

        rows = self.rows or auto_rows(seq, block, dim)
        if rows is None or block % rows:
            return None
        plan = Plan(rows, block, dim)
        return plan if plan.fits() else None

    def plan(self, problem: Problem):
        return self._plan(problem.block, problem.dim, problem.seq)

    def check(self, version: str, problem: Problem) -> None:
        if problem.dim > MAX_ROW_DIM:
            super().check(version, problem)
        if self.plan(problem) is None:
            dims = [d for d in range(1, MAX_ROW_DIM + 1)
                    if self._plan(problem.block, d, problem.seq) is not None]
            allowed = f"1..{dims[-1]}" if dims else "none"
            raise ProblemError("dim", problem.dim, f"{allowed} for version {version!r} at "
                               f"block {problem.block} (K/V tiles and merge slots in 48 KB "
                               "of shared memory)")


for _rows, _name, _how in (
        (None, "online-tiled", "rows per block chosen from S and the SM count "
         "(about one block per SM)"),
        (4, "online-tiled-4", "4 rows per block (the most blocks, the least K/V reuse)")):
    _limits = TiledLimits.of(_rows)
    register(Version(
        _name, "simt",
        f"1 launch: a thread per (row, key split) runs the online recurrence over its keys; "
        f"K/V tiles in shared memory serve all the block's rows; {_how}; 2 barriers per "
        "tile, a tree merge of the splits at the end",
        (Kernel("online_tiled", ("Q", "K", "V"), ("O",),
                lambda p, lim=_limits: lim.plan(p).barriers(p.seq),
                "per block: 2 per tile + 2 per merge round", "_online_tiled_kernel"),),
        "fusedattn_lab.simt.online_tiled",
        _prepare_simt("fusedattn_lab.simt.online_tiled", "online_tiled_attention", rows=_rows),
        _limits,
        planted=_prepare_simt("fusedattn_lab.simt.online_tiled", "online_tiled_attention",
                              rows=_rows, planted=True),
        planted_kernel="online_tiled",
    ))


# --- tile-level (Triton) -------------------------------------------------------------------

def _prepare_rows(block_k: int):
    """Prepare function of the Triton row kernel at one BLOCK_K (t0, t1, and sweeps)."""

    def prepare(q, k, v, problem: Problem) -> Prepared:
        from fusedattn_lab.rows import rows_attention, triton_resources

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
        "fusedattn_lab.rows", _prepare_rows(_bk), ROW_LIMITS, block_k=_bk,
        retune=_prepare_rows,
    ))


# --- the flash kernel ----------------------------------------------------------------------

def _prepare_flash(q, k, v, problem: Problem) -> Prepared:
    from fusedattn.tiles.flash import flash_forward
    from fusedattn_lab.rows import triton_resources

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
    "fusedattn.tiles.flash_kernels", _prepare_flash,
    Limits(max_dim=MAX_FLASH_DIM, note="head dims up to 256, padded to a power of two >= 16"),
    batched=_flash_batched, bench_subject=True,
))


def _flash_on(backend: str):
    """`flash` with its path forced (`fusedattn.dispatch.use_backend`): the A/B of the
    Hopper kernel against the portable one on the same inputs."""
    def batched(q, k, v, causal: bool, precision: str | None):
        from fusedattn.api import attention
        from fusedattn.dispatch import use_backend

        gqa = q.shape[-3] != k.shape[-3]

        def call():
            with use_backend(backend):
                return attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                 precision=precision)

        return call

    return batched


for _backend, _module, _what in (
        ("portable", "fusedattn.tiles.flash_kernels", "the portable tl.* kernel"),
        ("hopper", "fusedattn.hopper.forward_kernel",
         "the Hopper Gluon kernel (warp-specialised, TMA, wgmma)")):
    register(Version(
        f"flash-{_backend}", "tiles", f"`flash` forced onto {_what}",
        (Kernel("flash_fwd", ("Q", "K", "V"), ("O",)),), _module, _prepare_flash,
        in_all=False, batched=_flash_on(_backend),
    ))
