"""What the flash kernels share: the visibility rule, the tile spans it gives, the scores
(with softcap), the host-side descriptions of a mask, a packed batch and a KV cache, the
offsets' width, and the operands in emulation. `flash.py` (forward), `flash_bwd.py`
(backward) and `splitkv.py` (the split-KV merge) import from here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedattn import configs
from fusedattn.launch import settle_keys
from fusedattn.mode import EMULATION

LOG2E = 1.4426950408889634  # 1/ln(2): exp(x) = exp2(x * LOG2E)

# Integer arguments that the kernels' code gains nothing from knowing more about. Triton
# specialises every int on "== 1" and "% 16 == 0" unless told not to: each new pattern
# compiles the kernel again, and each new pattern of ones may also build a new C launcher
# (the host compiler at the first launch; its cost on the H200 was not measured alone).
# Left unspecialised: head counts (one division per program), the autotuner's keys, the
# LSE's strides (`sl_*`: one float per query row) and decode's page and split sizes.
# Lengths, the head dim and the window bounds stay specialised: without "% 16" on them the
# H200 ran the prefill rows up to 3x slower (bench at 992a64b, 20261130T164821Z; why was
# not profiled). The forward only: the backward's kernels (whose launchers
# `precompile_backward` builds off the main thread) ran 4-29% slower with these
# unspecialised (A/B at dc49211, 20261130T1654Z; not profiled).
SHAPE_INTS = ("n_heads", "group", "bucket_q", "bucket_k", "sl_b", "sl_h", "sl_split", "page",
              "split_len", "seqlens_add", "n_pages")


def shape_jit(fn):
    """`triton.jit`, with the `SHAPE_INTS` that `fn` takes left unspecialised: a new head
    count reuses the compiled kernel and its launcher."""
    import inspect

    names = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[n for n in SHAPE_INTS if n in names])


@triton.jit
def _visible(pos, keys, seq_k, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which (query, key) pairs are seen, on broadcastable `pos` (query positions after the
    alignment) and `keys`: keys inside the sequence, no later than pos + right (causal:
    right = 0) and no earlier than pos - left (a sliding window)."""
    valid = keys < seq_k
    if HAS_RIGHT:
        valid = valid & (keys <= pos + right)
    if HAS_LEFT:
        valid = valid & (keys >= pos - left)
    return valid


@triton.jit
def _spans(first, last, count, lo_off, hi_off, BLOCK: tl.constexpr, HAS_LO: tl.constexpr,
           HAS_HI: tl.constexpr):
    """The partner tiles a run of own indices first..last visits, when own index y sees
    partners x in [y + lo_off, y + hi_off] (bounds only where HAS_LO / HAS_HI) of `count`:
    (lo, ulo, uhi, hi) in steps of BLOCK, with tiles [lo, ulo) and [uhi, hi) masked and
    [ulo, uhi) whole and visible to every own index (no compare, no select). Tiles outside
    [lo, hi) are skipped, not masked. The forward: own = query positions, partner = keys; the
    dK/dV pass: own = keys, partner = query rows."""
    lo = first * 0
    ulo = first * 0
    hi = first * 0 + count
    uhi = first * 0 + count
    if HAS_LO:
        lo = tl.maximum(first + lo_off, 0)
        ulo = last + lo_off
    if HAS_HI:
        hi = tl.minimum(last + hi_off + 1, count)
        uhi = first + hi_off + 1
    lo = lo // BLOCK * BLOCK
    hi = tl.maximum(hi, lo)
    ulo = tl.minimum(tl.maximum(tl.cdiv(ulo, BLOCK) * BLOCK, lo), hi)
    uhi = tl.maximum(tl.minimum(tl.minimum(uhi, count) // BLOCK * BLOCK, hi), ulo)
    return lo, ulo, uhi, hi


@triton.jit
def _scores(dot, qk_scale, cap, SOFTCAP: tl.constexpr):
    """Scores in base 2 from Q K^T: dot * scale * log2(e); with a softcap c,
    c * tanh(dot * scale / c) * log2(e) (here qk_scale = scale / c and cap = c * log2(e)).
    tanh(x) for |x| < 0.3 is its Taylor series to x^9 (the next term is below 2^-24 of
    tanh there), elsewhere 1 - 2 / (exp(2x) + 1) (exact at both ends of the range, and its
    cancellation costs a few ulps at |x| >= 0.3). The series keeps a large cap accurate:
    for c = 1e8 every |x| is tiny and the exp form alone rounded tanh to 0 (uniform
    attention); with it, c * tanh(s / c) tends to s as it should."""
    if SOFTCAP:
        x = dot * qk_scale
        x2 = x * x
        series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * 0.021869488536155203))))
        exp_form = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)
        return tl.where(tl.abs(x) < 0.3, series, exp_form) * cap
    else:
        return dot * qk_scale


def index_dtype(*tensors: torch.Tensor, rows: int = 0):
    """The kernels' offset type: `tl.int32` when every element offset of `tensors` (and
    `rows`, the LSE/delta length) fits in 31 bits, else `tl.int64` (batch and head offsets
    and tiles' first rows; offsets inside a tile stay 32-bit). 32 bits where they suffice,
    the widths used before 64-bit offsets existed. FUSEDATTN_INDEX64=1
    (`configs.OVERRIDES.index64`) forces 64 bits (to measure what they cost)."""
    span = max([rows] + [sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
                         for t in tensors])
    if span >= 2**31 - 1 or configs.OVERRIDES.index64:
        return tl.int64
    return tl.int32


def row_alignment(*tensors: torch.Tensor) -> int:
    """The elements in 16 bytes (8 for fp16/bf16) if every row of `tensors` starts on 16
    bytes -- the data 16-byte aligned, the last stride 1, every other stride a multiple of
    it -- else 1. Where it holds (and the head dim is a multiple of it), the forward is
    told so (`_flash_fwd`'s ALIGN) and may split the head dim (`configs.head_dim_pieces`)."""
    align = 16 // tensors[0].element_size()
    for t in tensors:
        if (t.element_size() * align != 16 or t.data_ptr() % 16 or t.stride(-1) != 1
                or any(s % align for s in t.stride()[:-1])):
            return 1
    return align


def emulation_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' operands as they are, except bf16 in the interpreter: there they become
    fp32 copies, because the interpreter's bf16 `tl.dot` returns garbage (an upstream bug:
    values near 8e8 for inputs of N(0,1)). Products from fp32 copies of bf16 values are
    exact, so emulated bf16 is at least as accurate as the GPU's; outputs keep their dtype."""
    if EMULATION:
        return tuple(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)
    return tensors


@dataclass(frozen=True)
class Mask:
    """What each query sees, as the kernels take it: `causal` and `window = (left, right)`
    (None for an unbounded side) around each query's position, which is its row
    (top-left) or its row + Sk - Sq (`bottom_right`); `softcap` c maps each scaled score s
    to c * tanh(s / c). The forward and the backward kernels read the same arguments."""

    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    bottom_right: bool = False

    def kernel_args(self, scale: float) -> tuple[float, float, int, int]:
        """(qk_scale, cap, left, right) as the kernels take them: a window side -1 where it
        is unbounded (causal: right = 0, a window's right side adds nothing), cap 0.0
        without a softcap. The kernels derive their flags from these (`MASK_FLAGS`)."""
        left, right = self.window if self.window is not None else (None, None)
        if self.causal:
            right = 0
        if self.softcap:
            qk_scale, cap = scale / self.softcap, self.softcap * LOG2E
        else:
            qk_scale, cap = scale * LOG2E, 0.0
        return (qk_scale, cap, -1 if left is None else left, -1 if right is None else right)

    def span(self) -> int | None:
        """The most keys a row sees where a window bounds both of its sides (left given;
        right given, or 0 under causal), else None."""
        _, _, left, right = self.kernel_args(1.0)
        return left + right + 1 if left >= 0 and right >= 0 else None


# FP8 (e4m3) inputs: P = exp(s - m) in [0, 1] enters the P.V product as e4m3 times this (a
# power of two: exact to apply and to divide out), so that P's small values land in e4m3's
# normal range (from 2^-6; subnormals to 2^-9) instead of flushing to 0: P >= 2^-14 stays
# normal, and 256 * 1 stays under e4m3's largest finite value, 448
FP8_P_SCALE = 256.0

MASK_FLAGS = {
    "HAS_LEFT": lambda a: a["left"] >= 0,   # a window's left edge
    "HAS_RIGHT": lambda a: a["right"] >= 0,  # causal, or a window's right edge
    "SOFTCAP": lambda a: a["cap"] > 0,
}
"""The mask's constexprs of the forward and backward kernels, derived from their `left`,
`right` and `cap` arguments (`Mask.kernel_args`) by `triton.heuristics`."""


@triton.jit
def _sequence(p_cu_q, p_cu_k, p_seqlens_k, b, seq_q, seq_k, VARLEN: tl.constexpr,
              SEQLENS_K: tl.constexpr, INDEX: tl.constexpr, WIDE: tl.constexpr,
              seqlens_add=0):
    """(first query row, query count, first key row, key count) of sequence b, for the
    forward and the backward: packed (VARLEN: rows cu[b]..cu[b+1] of q and of k),
    per-sequence key lengths (SEQLENS_K: a KV cache, `p_seqlens_k[b] + seqlens_add` keys,
    the keys this call appended added, clamped to 0..seq_k, the capacity: reads stay
    inside the sequence's rows whatever unchecked lengths hold), or the batch's own
    `seq_q`, `seq_k`.
    WIDE: the counts as INDEX-bit tensors (the backward's row arithmetic); else the
    batch's lengths stay the arguments they came as (the forward's)."""
    q_start = b * 0
    k_start = b * 0
    if WIDE:
        seq_q = b * 0 + seq_q
        seq_k = b * 0 + seq_k
    if VARLEN:
        q_start = tl.load(p_cu_q + b).to(INDEX)
        seq_q = tl.load(p_cu_q + b + 1).to(INDEX) - q_start
        k_start = tl.load(p_cu_k + b).to(INDEX)
        seq_k = tl.load(p_cu_k + b + 1).to(INDEX) - k_start
    if SEQLENS_K:
        seq_k = tl.minimum(tl.maximum(tl.load(p_seqlens_k + b) + seqlens_add, 0), seq_k)
    return q_start, seq_q, k_start, seq_k


@dataclass(frozen=True)
class Varlen:
    """A packed batch for the kernels: sequence b is rows cu_q[b]..cu_q[b+1] of q (and of
    cu_k's of k, v); the tensors come as `[1, H, total, D]` views."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_q.numel() - 1


@dataclass(frozen=True)
class KVCache:
    """Keys of a cache for the kernels: `seqlens [B] int32` keys per sequence before this
    call's `added` keys (the kernels read `seqlens + added`, clamped to the capacity); with
    `block_table [B, max_blocks] int32` the cache is paged, `[num_blocks, H_kv, page, D]`,
    and the kernels clamp each block index to 0..num_blocks - 1."""

    seqlens: torch.Tensor
    block_table: torch.Tensor | None = None
    added: int = 0


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
