"""Errors and checks shared by every entry point: `ProblemError`, the one tensor validator
(`check_qkv`), the index-tensor, window and softcap checks, the head-dim limits; and the
chapter's problem (`Problem`: one `[S, D]` float32 head), which the lab's versions take.

Every bad input raises `ProblemError`, which names the field, the value and what is allowed;
the CLI prints it as one line. Version-specific limits (D <= 256 for the row kernels) live
in the registry (`lab/registry.py`) and are checked through `Limits.check`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from fusedattn.mode import HOW_TO_EMULATE

MIN_BLOCK, MAX_BLOCK = 32, 1024  # one warp .. the CUDA limit of threads per block
MAX_ROW_DIM = 256
"""The chapter's validated head-dimension range for the row kernels (12.4: "CLI limits
DIM <= 256 ... supporting a larger head dimension needs resources and bounds re-checked,
not just the limit removed"). Kept, not raised."""
MAX_FLASH_DIM = 256
"""The flash kernel's head-dimension limit (tiles padded to <= 256 columns; larger ones
overfill a Hopper SM's shared memory and registers): `fusedattn.attention` and the registry."""

MAX_FP32_GRAD_DIM = 128
"""The backward's head-dim limit for fp32 inputs (any precision). On the H200 the GPU tier's
fp32 D=200 gradient test did not finish in 190 s (c387465: 256-column fp32 tiles; the FMA
dots of "ieee" unroll to thousands of instructions per thread); fp16/bf16 go to 256. Inputs
that require grad past it are refused at the call, not at `.backward()`."""

DTYPE = torch.float32


class ProblemError(ValueError):
    """A bad input: `ProblemError(field, value, allowed)`, the field, the offending value,
    and what is allowed.

    It has no __init__ of its own: BaseException keeps the three arguments as `args`, the
    properties below read them, and __str__ words them. That is the form torch.compile
    traces in every version: under `torch.compile(fullgraph=True)` (which lets no exception
    out of a traced region as itself) torch's "Observed exception" error then quotes the
    three arguments; torch 2.11 quoted none when an __init__ set them."""

    @property
    def field(self) -> str:
        return self.args[0]

    @property
    def value(self) -> object:
        return self.args[1]

    @property
    def allowed(self) -> str:
        return self.args[2]

    def __str__(self) -> str:
        return f"{self.args[0]}={self.args[1]!r} is not allowed: {self.args[2]}"


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_block(block: object) -> int:
    """Threads per block for the thread-level kernels: a power of two in 32..1024."""
    if isinstance(block, bool) or not isinstance(block, int) or not (
        MIN_BLOCK <= block <= MAX_BLOCK and is_power_of_two(block)
    ):
        raise ProblemError("block", block, f"a power of two in {MIN_BLOCK}..{MAX_BLOCK}")
    return block


def _check_positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProblemError(field, value, "an integer >= 1")
    return value


@dataclass(frozen=True)
class Problem:
    """One attention problem: Q, K, V are `[seq, dim]` float32, scale 1/sqrt(dim).

    `block` is the number of threads per block used by the thread-level versions; `causal`
    masks key j > i (top-left aligned, so every row keeps at least its own key).
    """

    seq: int
    dim: int
    block: int = 256
    causal: bool = False

    def __post_init__(self) -> None:
        _check_positive("seq", self.seq)
        _check_positive("dim", self.dim)
        check_block(self.block)
        check_flag("causal", self.causal)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.dim)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.seq, self.dim)

    def label(self) -> str:
        return f"{self.seq}x{self.dim}" + (" causal" if self.causal else "")


@dataclass(frozen=True)
class Limits:
    """What a version accepts; checked before anything is allocated."""

    max_dim: int | None = None
    note: str = ""

    def check(self, version: str, problem: Problem) -> None:
        if self.max_dim is not None and problem.dim > self.max_dim:
            raise ProblemError(
                "dim", problem.dim, f"1..{self.max_dim} for version {version!r} ({self.note})"
            )


def check_resolved(name: str, t: torch.Tensor) -> None:
    """`t` without a pending negation: a lazy negative view (`x.conj().imag` of a complex
    `x`, `torch._neg_view`) holds -t's values as t's bytes with a bit that says so, and a
    kernel reads the bytes (it read -k for k: silently wrong). Refused, not copied: a
    cache is written in place, and a copy made each call would hide the cost. Not while
    torch.compile traces: dynamo cannot trace `is_neg`, and inductor itself reads such an
    input's bytes (torch 2.13: `torch.compile(lambda k: k + 0)` of one returns k;
    pytorch/pytorch#145093)."""
    if not torch.compiler.is_compiling() and t.is_neg():
        raise ProblemError(f"{name}.is_neg()", True, f"a tensor without a pending negation "
                           f"(a lazy negative view): pass {name}.resolve_neg()")


transforms_active = torch._C._are_functorch_transforms_active  # (vmap, grad, ... around us)


def check_no_transform() -> None:
    """No functorch transform (`torch.func.vmap`, `grad`, `jvp`, `jacrev`, ...) around the
    call: the kernels read their tensors' storage, which a transform's wrapped tensors do
    not have (vmap gave "Cannot access data pointer of Tensor that doesn't have storage",
    torch.func.grad an error about `setup_context`). Not while torch.compile traces:
    dynamo does not put the query in its graph (its own functorch support traces
    through it)."""
    if not torch.compiler.is_compiling() and transforms_active():
        raise ProblemError("torch.func", "a transform (vmap, grad, jvp, ...) around the "
                           "call", "a call outside torch.func's transforms: torch.autograd "
                           "(loss.backward(), torch.autograd.grad) gives fusedattn's "
                           "gradients, and a batch dimension does what vmap would")


def check_qkv(q: object, k: object, v: object, *, device: torch.device, ranks: dict[int, str],
              dtypes: tuple[torch.dtype, ...], contiguous: bool = False) -> None:
    """The one tensor validator, for every entry point (the public ops and the registry's
    `[S, D]` versions): each of q, k, v a tensor of an allowed rank (`ranks`: rank -> its
    layout, for the message), dtype and device (and contiguous where asked); then one rank,
    one dtype and one device for the three. Each failure names the field."""
    layouts = ", ".join(ranks.values())
    kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    check_no_transform()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ProblemError(name, type(t).__name__, "a torch.Tensor")
        if t.is_nested or t.layout != torch.strided:
            raise ProblemError(f"{name}.layout", "nested" if t.is_nested else str(t.layout),
                               "a dense (strided) tensor; pack nested sequences for "
                               "attention_varlen")
        if t.dim() not in ranks:
            raise ProblemError(f"{name}.shape", tuple(t.shape), layouts)
        if t.dtype not in dtypes:
            raise ProblemError(f"{name}.dtype", str(t.dtype), kinds)
        if t.device.type != device.type:
            raise ProblemError(f"{name}.device", str(t.device), f"a {device.type} tensor"
                               + (f" ({HOW_TO_EMULATE})" if device.type == "cuda" else ""))
        if contiguous and not t.is_contiguous():
            raise ProblemError(f"{name}.strides", t.stride(), "a contiguous tensor (row-major)")
        check_resolved(name, t)
    if not (q.dim() == k.dim() == v.dim()):
        raise ProblemError("ranks", (q.dim(), k.dim(), v.dim()), "q, k and v of one rank")
    if not (q.dtype == k.dtype == v.dtype):
        raise ProblemError("dtypes", (str(q.dtype), str(k.dtype), str(v.dtype)), "one dtype")
    if not (q.device == k.device == v.device):
        raise ProblemError("devices", (str(q.device), str(k.device), str(v.device)),
                           "one device")


def check_index_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    """`t` an int32 tensor on `device` (lengths, offsets, block tables), returned
    contiguous: the kernels read index tensors as rows of consecutive ints, so the caller
    checks and launches with the returned tensor, and what is checked is what is read (a
    strided view is copied, a few bytes). Its shape is the caller's to check."""
    if not isinstance(t, torch.Tensor):
        raise ProblemError(name, type(t).__name__, "an int32 tensor")
    if t.dtype != torch.int32 or t.device.type != device.type:
        raise ProblemError(f"{name}.dtype", f"{t.dtype} on {t.device}",
                           f"torch.int32 on the {device.type} device")
    check_resolved(name, t)
    return t.contiguous()


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_window(window: object) -> tuple[int | None, int | None] | None:
    """None, or `(left, right)`: each None (unbounded) or an integer >= 0, of any size
    (`clamp_window` then bounds it by the sequence lengths)."""
    if window is None:
        return None
    if not isinstance(window, tuple | list) or len(window) != 2 or any(
            w is not None and (not is_int(w) or w < 0) for w in window):
        raise ProblemError("window", window, "None or (left, right), each None (unbounded) "
                           "or an integer >= 0 (FlashAttention's -1, unbounded, is None "
                           "here)")
    return tuple(None if w is None else int(w) for w in window)


def clamp_window(window: tuple[int | None, int | None] | None, seq_q: int,
                 seq_k: int) -> tuple[int | None, int | None] | None:
    """A window side of at least `seq_q + seq_k` becomes None (unbounded), which it equals
    exactly: a query's position lies in [-seq_q, seq_k) under either alignment, so such a
    side reaches past every key. What remains is below 2^31 for any tensor the kernels take,
    so `pos + right` and `pos - left` cannot overflow their 32-bit arithmetic."""
    if window is None:
        return None
    far = seq_q + seq_k
    window = tuple(None if w is None or w >= far else w for w in window)
    return None if window == (None, None) else window


def check_flag(name: str, value: object) -> None:
    """A switch (is_causal, enable_gqa, return_lse, ...): True or False, not a truthy
    stand-in such as 1 or "yes" (a SymBool too: a comparison of shapes under
    torch.compile)."""
    if not isinstance(value, (bool, torch.SymBool)):
        raise ProblemError(name, value, "True or False")


SCALE_MAX = 1e30
"""The largest `scale`: the kernels fold scale * log2(e) into their fp32 scores, and a
scale of 3e38 made ordinary scores infinite and every row NaN (1e300 the fold itself;
evidence/cpu/20261203T0830Z-cpu-checks); like the softcap's, the bound keeps scores of
usual inputs finite."""

SOFTCAP_RANGE = (1e-30, 1e30)
"""Softcaps the kernels compute in fp32 without overflow or underflow: they scale the
scores by `scale / softcap` and multiply tanh by `softcap * log2(e)`, both normal fp32
numbers for a cap in this range at the usual scales (1/sqrt(D)); a cap of 1e-40 made the
first infinite and an all-zero row's 0 * inf a NaN."""


def check_softcap(softcap: object) -> float | None:
    """None, or a number in `SOFTCAP_RANGE` (scores s become softcap * tanh(s / softcap))."""
    if softcap is None:
        return None
    low, high = SOFTCAP_RANGE
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (
            math.isfinite(softcap) and low <= softcap <= high):
        hint = (" (a flag is not a softcap: None for none, or the cap itself)"
                if isinstance(softcap, bool) else
                " (FlashAttention's 0.0, no softcap, is None here)"
                if isinstance(softcap, numbers.Real) and softcap == 0 else "")
        raise ProblemError("softcap", softcap, f"None or a number in {low:g}..{high:g}{hint}")
    return float(softcap)


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn  # FP8 inputs: `attention` alone, forward (issue 34)
FP8_HEAD_DIMS = (64, 128, 256)
FP8_GRAD_HEAD_DIMS = (64, 128)  # `fp8.attention_fp8_backward(precision="fp32")`: its limit


def _check_descale(name: str, d: object, n: int, device: torch.device) -> None:
    """A descale factor (FlashAttention-3's descale_q/k/v): None, or a float32 tensor of one
    element (per tensor) or `[n]` (per head) on `device`; its values are not read here
    (that would wait for the GPU)."""
    if d is None:
        return
    if not isinstance(d, torch.Tensor):
        raise ProblemError(name, type(d).__name__, f"None or a float32 torch.Tensor of 1 or "
                           f"{n} elements")
    if d.dtype != torch.float32:
        raise ProblemError(f"{name}.dtype", str(d.dtype), "float32")
    if d.dim() > 1 or d.numel() not in (1, n):
        raise ProblemError(f"{name}.shape", tuple(d.shape),
                           f"() or [1] (per tensor) or [{n}] (per head)")
    if d.device != device:
        raise ProblemError(f"{name}.device", str(d.device), f"{device}, as q")
    check_resolved(name, d)


DESCALE_NAMES = ("descale_q", "descale_k", "descale_v")


def check_fp8(q: torch.Tensor, v: torch.Tensor, descales: tuple, heads: int,
              heads_kv: int, wants_grad: bool) -> None:
    """FP8's inputs (`attention` with float8_e4m3fn q, k, v) and its dequantisation
    factors `descales` (`DESCALE_NAMES`): each None (1.0) or a float32 tensor of one element
    (per tensor) or `[H]` for q, `[H_kv]` for k and v (per head), on q's device, given only
    with FP8 inputs. FP8
    takes head dims `FP8_HEAD_DIMS` and no gradient: a float8 tensor cannot hold one
    (autograd casts gradients to the input's dtype; `fp8.attention_fp8_backward` gives
    them)."""
    fp8 = q.dtype == FP8
    for name, d in zip(DESCALE_NAMES, descales, strict=True):
        if d is not None and not fp8:
            raise ProblemError(name, "a tensor", f"None for {str(q.dtype).removeprefix('torch.')} "
                               "inputs (the factors dequantise float8_e4m3fn q, k, v)")
        _check_descale(name, d, heads if name == "descale_q" else heads_kv, q.device)
    if not fp8:
        return
    dims = (q.shape[-1], v.shape[-1])
    if any(d not in FP8_HEAD_DIMS for d in dims):
        raise ProblemError("head_dim", dims, "for float8_e4m3fn inputs, "
                           f"{', '.join(map(str, FP8_HEAD_DIMS))} for q/k and for v")
    if wants_grad:
        raise ProblemError("requires_grad", True, "float8_e4m3fn inputs (and sinks) without "
                           "grad: a float8 tensor cannot hold a gradient; take them with "
                           "fusedattn.attention_fp8_backward, or train in bfloat16")


def check_grad_inputs(q: torch.Tensor, v: torch.Tensor, dout: object,
                      descale_do: object, heads: int) -> None:
    """The FP8 backward's `dout` (`fp8`): shaped as the forward's O (q's shape with v's
    head dim), bfloat16/float16/float32 or float8_e4m3fn (with `descale_do`, None, one
    element or `[H]` of q's `heads`), on q's device."""
    shape = (*q.shape[:-1], v.shape[-1])
    dtypes = (torch.bfloat16, torch.float16, torch.float32, FP8)
    if not isinstance(dout, torch.Tensor):
        raise ProblemError("dout", type(dout).__name__, "a torch.Tensor")
    if tuple(dout.shape) != shape:
        raise ProblemError("dout.shape", tuple(dout.shape), f"{list(shape)}, the forward's O")
    if dout.dtype not in dtypes:
        raise ProblemError("dout.dtype", str(dout.dtype), " or ".join(
            str(d).removeprefix("torch.") for d in dtypes))
    if dout.device != q.device:
        raise ProblemError("dout.device", str(dout.device), f"{q.device}, as q")
    check_resolved("dout", dout)
    if descale_do is not None and dout.dtype != FP8:
        raise ProblemError("descale_do", "a tensor", "None unless dout is float8_e4m3fn")
    _check_descale("descale_do", descale_do, heads, q.device)


def check_sinks(sinks: object, heads: int, device: torch.device) -> None:
    """None, or attention sinks: a `[H]` floating tensor, one logit per query head (natural-
    log units, as the scaled scores), on the inputs' device. The kernels read them as
    float32 (`api.as_sinks`); values are not read here (that would wait for the GPU): -inf
    is no sink, NaN or +inf give NaN rows."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise ProblemError("sinks", type(sinks).__name__, "None or a torch.Tensor [H]")
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ProblemError("sinks.shape", tuple(sinks.shape),
                           f"[{heads}]: one logit per query head")
    if sinks.dtype not in SINK_DTYPES:
        raise ProblemError("sinks.dtype", str(sinks.dtype), "float32, bfloat16 or float16")
    if sinks.device != device:
        raise ProblemError("sinks.device", str(sinks.device), f"{device}, as q")
    check_resolved("sinks", sinks)


def check_tensors(q: object, k: object, v: object, device: torch.device) -> Problem:
    """Validate Q, K, V for the row versions and return the problem they describe.

    `q, k, v: [S, D] float32`, contiguous, on `device`, all the same shape.
    """
    check_qkv(q, k, v, device=device, ranks={2: "2 dimensions [S, D]"}, dtypes=(DTYPE,),
              contiguous=True)
    if not (q.shape == k.shape == v.shape):
        raise ProblemError(
            "shapes",
            (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
            "q, k and v of one shape [S, D]",
        )
    seq, dim = q.shape
    return Problem(seq=_check_positive("S", seq), dim=_check_positive("D", dim))
