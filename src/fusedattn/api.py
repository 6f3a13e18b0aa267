"""`fusedattn.attention` (defined here, in `fusedattn.api`): the flash kernel behind an
SDPA-like API, as a PyTorch custom op.

    attention(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, return_lse=False,
              precision=None, window=None, softcap=None, sinks=None, deterministic=True,
              descale_q=None, descale_k=None, descale_v=None)

`q: [..., H, Sq, D]`, `k, v: [..., H_kv, Sk, D]` (up to 8 dims, any strides; `[S, D]` and
`[H, S, D]` work too), fp16, bf16 or fp32, on the GPU (CPU tensors in emulation). Returns `O`
shaped like q (with v's head dim), in q's memory layout where q is dense with its head dim
innermost (`new_out`: a transposed `[B, S, H, D]` q, Hugging Face's, gives O in `[B, S, H,
D]` memory, as SDPA's cuDNN and flash backends do), else contiguous; and with
`return_lse=True` also the natural-log log-sum-exp of each row's scaled scores, `[..., H,
Sq] float32`. `precision`, for fp32 inputs only: None (the default,
"tf32x3"), "tf32x3" (tensor cores, each product as three TF32 products of the high and low
parts, big*big + big*small + small*big: within fp32's error bound, not bitwise IEEE; the
technique of SDPA's fp32 "efficient" kernel), "ieee" (exact fp32 products, FMA on CUDA
cores: about 4x slower) or "tf32" (tensor cores, 10-bit mantissas, TF32's bound); fp16 and
bf16 take None only. Every bad input raises `ProblemError`.

Masks are aligned top-left, as SDPA's `is_causal`: query i sits at position i. `window =
(left, right)` (None for an unbounded side; an integer of any size, a side of Sq + Sk or
more being exactly None) lets it see keys i - left .. i + right (with `is_causal`, right
is 0); key tiles outside every row's window are skipped, not masked.
`softcap=c` maps each scaled score s to c * tanh(s / c) before the mask (Gemma 2's logit
softcap). A row that sees no key gives O = 0 and LSE = -inf.
`sinks: [H]` (float32, bf16 or fp16; gpt-oss's attention sinks) adds one logit per query
head to every row's softmax denominator, carrying no value:
O_i = sum_j exp(s_ij) V_j / (exp(sink_h) + sum_j exp(s_ij)); the LSE then includes it (a
row that sees no key gives O = 0 and LSE = sink_h), and the sinks are differentiable:
d sink_h = -sum_i exp(sink_h - LSE_i) (rowsum(dO_i * O_i) - dLSE_i). -inf is no sink.
(`attention_varlen` and `attention_with_kvcache` align bottom-right, as FlashAttention
does.)

FP8: q, k and v in `torch.float8_e4m3fn` (all three) stand for q * descale_q, k * descale_k
and v * descale_v, FlashAttention-3's factors: each None (1.0) or a float32 tensor of one
element (per tensor) or `[H]` for q, `[H_kv]` for k and v (per head). O comes back in
bfloat16 (with the LSE of the dequantised scores). The scores are the float8 values'
products in fp32; P enters its product with V in e4m3 (at a power-of-two scale,
`tiles.common.FP8_P_SCALE`). Head dims 64, 128 and 256 (the Hopper kernel at equal
q/k and v head dims, V transposed for it first; the portable kernel any pair). Autograd
cannot take FP8's gradients (a float8 tensor cannot hold one), so inputs (or sinks) that
require grad are refused: `fusedattn.attention_fp8_backward` gives them, for an autograd
Function of the caller's (`fusedattn.fp8`). Precision modes and the factors on other dtypes
are refused too. `attention_varlen` takes FP8 the same way (forward), and
`attention_with_kvcache` takes e4m3 q, caches and new keys with the same factors (FlashAttention-3's
`flash_attn_with_kvcache` form; its module docstring).

Under `torch.autocast` (on the inputs' device type) fp32 q, k and v run in autocast's
dtype, as SDPA's do, and the output comes back in it; an explicit `precision` keeps fp32
(it names fp32's products). `attention_varlen` does the same; `attention_with_kvcache`
does not (its caches are written in place).

Differentiable: `.backward()` runs the backward kernels (the Hopper kernel or the
portable ones, `tiles/flash_bwd.py`: deterministic, no S x S array) for every combination
the forward takes, except fp32 head dims over 128 (`problem.MAX_FP32_GRAD_DIM`), refused
at the call.
With `return_lse=True` the LSE is differentiable too (d LSE_i / d s_ij = P_ij). First-order
gradients only: a double backward raises `ProblemError`. `deterministic=False` lets the
Hopper backward race its fp32 dQ adds (faster: docs/training.md; the bits of dQ may then
differ from run to run); the portable backward is deterministic either way.

Registered as `torch.ops.fusedattn.flash_fwd` and `torch.ops.fusedattn.flash_bwd`
(`torch.library.custom_op` with fake implementations, the backward through
`register_autograd`), so `torch.compile(fullgraph=True)` traces the forward and the backward
without a graph break. A refused input under `torch.compile(fullgraph=True)` surfaces as
torch's "Observed exception" error, which quotes the `ProblemError` (fullgraph lets no
exception out of a traced region as itself); without fullgraph it is the `ProblemError`.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch

from fusedattn import dispatch
from fusedattn.launch import KeptPlan, Plans
from fusedattn.mode import DEVICE
from fusedattn.precision import resolve
from fusedattn.problem import (
    FP8,
    MAX_FLASH_DIM,
    MAX_FP32_GRAD_DIM,
    SCALE_MAX,
    ProblemError,
    check_flag,
    check_fp8,
    check_qkv,
    check_sinks,
    check_softcap,
    check_window,
    clamp_window,
    transforms_active,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RANK = 8  # leading batch dims past B: [..., H, S, D] up to 8 dims in all
LAYOUTS = {2: "[S, D]", 3: "[H, S, D]", 4: "[B, H, S, D]",
           **{r: f"[..., H, S, D] (up to {MAX_RANK} dims)" for r in range(5, MAX_RANK + 1)}}


@functools.lru_cache(maxsize=1024)
def _mask(is_causal: bool, window_left: int, window_right: int, softcap: float,
          bottom_right: bool = False):
    """The kernels' `Mask` from the ops' plain arguments (-1: no window side; 0.0: no
    softcap), made once per arguments (a backward asks for it each call; `Mask` is
    frozen)."""
    from fusedattn.tiles.common import Mask

    window = None
    if window_left >= 0 or window_right >= 0:
        window = (window_left if window_left >= 0 else None,
                  window_right if window_right >= 0 else None)
    return Mask(causal=is_causal, window=window, softcap=softcap or None,
                bottom_right=bottom_right)


def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               is_causal: bool, scale: float, precision: str, window_left: int,
               window_right: int, softcap: float, deterministic: bool = True,
               descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward on validated `[B, H, S, D]` tensors: (O, LSE). The custom op's body, and
    what eager calls directly (no dispatcher on the way: issue 31's host cost).
    `deterministic` is the backward's (it rides with the forward's options to it);
    `descale` float8 inputs' factors (`fp8_descale`), O then bfloat16."""
    out, lse = new_outputs(q, v, q.shape[:3], like_q=True)
    _launch(q, k, v, out, lse, sinks, is_causal, scale, precision, window_left, window_right,
            softcap, descale)
    return out, lse


def new_outputs(q, v, lse_shape, like_q: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """O (`new_out`, `like_q` its) and the LSE, float32 `lse_shape` (`[B, H, Sq]`; varlen's
    `[H, total_q]`), made fresh (dense, aligned); None for the LSE where `lse_shape` is
    None: the kernels then write none (`WRITE_LSE`), and the call saves an allocation
    (issue 31's host cost)."""
    return new_out(q, v, like_q), (None if lse_shape is None else
                                   torch.empty(lse_shape, dtype=torch.float32,
                                               device=q.device))


def _launch(q, k, v, out, lse, sinks, is_causal, scale, precision, window_left, window_right,
            softcap, descale, keep: list | None = None):
    """`dispatch.forward` into `out` and `lse` (`keep` receives its plan)."""
    dispatch.forward(q, k, v, out=out, lse=lse, is_causal=is_causal, scale=scale,
                     precision=precision,
                     mask=_mask(is_causal, window_left, window_right, softcap), sinks=sinks,
                     descale=descale, keep=keep)


def _kept_forward(call, q, k, v, sinks, descale, lse=True):
    """`attention`'s eager forward, by `dispatch.kept_forward` with the plan its call key
    keeps (`_Call.plan`). The call key holds which of the tensors are one object, so it
    settles the dispatch's plan key but for `dispatch.plan_context`. A call autograd
    records runs it inside `_FlashCall`. `lse`: whether the LSE is made and written (a
    call that neither returns it nor keeps it for a backward makes none: `new_outputs`)."""
    out, lse = new_outputs(q, v, q.shape[:3] if lse else None, like_q=True)
    dispatch.kept_forward(call.plan, dispatch.forward_inputs(q, k, v, out, lse, sinks=sinks,
                                                             descale=descale),
                          lambda keep: _launch(q, k, v, out, lse, sinks, *call.options[:6],
                                               descale, keep))
    return out, lse


def new_out(q: torch.Tensor, v: torch.Tensor, like_q: bool = False) -> torch.Tensor:
    """O's tensor: q's shape with V's head dim, q's dtype (bfloat16 for float8 inputs),
    contiguous; with `like_q` (`attention`'s O), in q's memory layout where that is q's
    shape and dtype and q is dense with its head dim innermost: `torch.empty_like`'s
    preserve_format, which keeps a dense tensor's strides (PyTorch's cuDNN attention
    allocates its O the same way). Hugging Face's q is a `[B, S, H, D]` projection seen
    as `[B, H, S, D]`; O in `[B, S, H, D]` memory makes the integration's
    `out.transpose(1, 2).contiguous()` a view, not a copy kernel a layer. Both forward
    kernels write O by its strides (the Hopper one through a descriptor of them, as it
    reads such a q) and the backward reads it by them; decode and varlen keep O
    contiguous (split-KV's merge writes rows contiguous). `torch.empty_like` reads fewer
    arguments than `new_empty` (issue 31's host cost)."""
    if q.shape[-1] == v.shape[-1] and q.dtype != FP8:
        # (a contiguous q first: preserve_format's layout search cost the plain forward
        # 0.5-0.9 us a call on the H100's host, evidence/nvidia-h100/20261205T2227Z-host-ab)
        if like_q and not q.is_contiguous() and q.stride(-1) == 1:
            return torch.empty_like(q)  # (a q not dense gets contiguous strides)
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return q.new_empty((*q.shape[:-1], v.shape[-1]),
                       dtype=torch.bfloat16 if q.dtype == FP8 else q.dtype)


def fp8_descale(q: torch.Tensor, descales: tuple, heads: int, heads_kv: int) -> torch.Tensor:
    """Checked descale factors (`problem.check_fp8`; descale_q, _k, _v) of a float8 `q` as
    the kernel reads them: float32 `[H + 2 * H_kv]`, q's per query head, then k's and v's
    per K/V head (1.0 for None). A tensor per call (not in a call's cached decisions: the
    factors are tensors of the call's); the entry points call it for float8 q only (a
    bf16 call passes None and reads no head counts)."""
    parts = []
    for d, n in zip(descales, (heads, heads_kv, heads_kv), strict=True):
        parts.append(torch.ones(n, dtype=torch.float32, device=q.device) if d is None
                     else d.reshape(-1).expand(n))
    return torch.cat(parts)


def _flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
               sinks: torch.Tensor | None, is_causal: bool, scale: float, precision: str,
               window_left: int, window_right: int, softcap: float,
               deterministic: bool = True, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's kernels: (dQ, dK, dV, dsinks), dsinks empty without sinks (an op
    returns tensors only). The backward op's body; `backend` is the `use_backend` choice
    the forward ran under."""
    return sink_grads(_kept_backward(None, dout, q, k, v, out, lse, dlse, sinks, is_causal,
                                     scale, precision, window_left, window_right, softcap,
                                     deterministic, backend), lse)


def _kept_backward(kept, dout, q, k, v, out, lse, dlse, sinks, is_causal, scale, precision,
                   window_left, window_right, softcap, deterministic, backend):
    """`flash_backward`'s (dq, dk, dv[, dsinks]) with `kept` (`launch.KeptPlan` or None),
    the backward's plan kept with the forward call's key (`_Call.backward`): `_flash_bwd`
    without the op's empty dsinks, what an eager backward runs (`_backward`)."""
    from fusedattn.tiles.flash_bwd import flash_backward

    return flash_backward(
        dout, q, k, v, out, lse, dlse, is_causal=is_causal, scale=scale, precision=precision,
        mask=_mask(is_causal, window_left, window_right, softcap), sinks=sinks,
        backend=backend, deterministic=deterministic, kept=kept)


def sink_grads(grads: tuple, like: torch.Tensor) -> tuple:
    """The backward ops' four outputs: `flash_backward`'s (dq, dk, dv[, dsinks]), an empty
    dsinks where there are no sinks."""
    return grads if len(grads) == 4 else (*grads, like.new_empty(0))


_flash_fwd_op = torch.library.custom_op("fusedattn::flash_fwd", _flash_fwd, mutates_args=())
_flash_bwd_op = torch.library.custom_op("fusedattn::flash_bwd", _flash_bwd, mutates_args=())


@_flash_fwd_op.register_fake
def _(q, k, v, sinks, is_causal, scale, precision, window_left, window_right, softcap,
      deterministic=True, descale=None):
    return new_outputs(q, v, q.shape[:3], like_q=True)


@_flash_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, sinks, is_causal, scale, precision, window_left,
      window_right, softcap, deterministic=True, backend="auto"):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            lse.new_empty(0 if sinks is None else sinks.shape[0]))


# the forward op's arguments after q, k, v and sinks that its backward takes too
BACKWARD_OPTIONS = ("is_causal", "scale", "precision", "window_left", "window_right",
                    "softcap", "deterministic")


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, *options = inputs
    # the options the backward takes; FP8's descale, after them, never has a gradient
    # (`check_fp8` refuses FP8 inputs that require grad)
    options = options[:len(BACKWARD_OPTIONS)]
    out, lse = output
    # an output the loss does not use gets None, not a tensor of zeros: the backward then
    # skips dLSE (HAS_DLSE=False, as `precompile_backward` compiled it) instead of reading 0s
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, sinks, out, lse)
    ctx.options = options
    ctx.kept = None  # `_FlashCall` gives its call's kept backward plan
    # the path's choice now: autograd may run the backward on a thread of its own
    ctx.backend = dispatch.current_backend()


def _gradients(ctx, dout, dlse) -> tuple:
    """(dq, dk, dv, dsinks or None) of a call's backward (`_backward`, `_FlashCall`)."""
    q, k, v, sinks, out, lse = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    args = (dout, q, k, v, out, lse, dlse, sinks, *ctx.options, ctx.backend)
    if eager_backward(dout, q, dlse):
        grads = _kept_backward(ctx.kept, *args)
    else:
        grads = _flash_bwd_op(*args)
    return (*grads[:3], grads[3] if sinks is not None else None)


def _backward(ctx, dout, dlse):  # (none for the options and FP8's descale)
    return (*_gradients(ctx, dout, dlse), *(None,) * (len(ctx.options) + 1))


_flash_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def refuse_double_backward(ctx, *grads):
    """The backward ops' own backward: gradients of gradients are not implemented."""
    raise ProblemError("double backward", "a gradient of fusedattn's gradients (create_graph"
                       "=True, then backward again)", "first-order gradients only; use "
                       "torch.nn.functional.scaled_dot_product_attention for higher orders")


_flash_bwd_op.register_autograd(refuse_double_backward)


def eager_autograd(name: str, body, setup_context, backward) -> type:
    """The `torch.autograd.Function` that gives a custom op's body, in eager, the op's own
    autograd (`setup_context`, `backward`) without the op's dispatch (issue 31: the op's
    dispatch cost more host time than SDPA's whole call). Its forward takes `ctx` itself:
    a Function with a separate `setup_context` binds its arguments through
    `inspect.signature` on every call (torch 2.11: about 60 µs of an 826 µs training step
    under cProfile, evidence/nvidia-h200/20261201T1515Z-host-profile/after-2135f30.json)."""
    def forward(ctx, *args):
        output = body(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})


def call_op(op, function, body, *args, grad: bool):
    """An entry point's call of its custom op: the op itself while torch.compile traces
    (fake implementations, no graph break); else the body, through `function`
    (`eager_autograd`) where autograd records the call (`grad`)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args) if grad else body(*args)


def eager_backward(*tensors) -> bool:
    """Whether a backward runs its body directly (`_kept_backward`, with the call's kept
    plan or None): on plain tensors in eager. Else it runs the backward op: where its graph
    is recorded (create_graph: the op's autograd refuses a double backward) or traced
    (torch.compile's AOT autograd traces the backward with fake tensors, outside dynamo:
    `is_compiling` alone does not tell)."""
    for t in tensors:
        if t is not None and t.__class__ is not _TENSOR:
            return False
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling())


_Flash = eager_autograd("_Flash", _flash_fwd, _setup_context, _backward)

# A/B switch (scripts/host_profile.py --train): a call autograd records replays the plans
# its call key keeps (`_FlashCall`); False sends it through `_Flash`, the dispatch's plan
# keys and the backward's, as before 56d483a
KEEP_RECORDED = True


class _FlashCall(torch.autograd.Function):
    """`attention`'s eager forward on a call autograd records, with the op's autograd
    (`_setup_context`, `_backward`): the forward replays the plan its call key keeps
    (`_kept_forward`), and the backward keeps its plan beside it (`_Call.backward`), so
    neither takes a plan key of every tensor again (issue 31: a training step's Python,
    evidence/nvidia-h200/20261202T1504Z-train-host-bwd-order). The options ride in `call`,
    one argument (autograd's `apply` costs host time by argument)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call, descale):
        output = _kept_forward(call, q, k, v, sinks, descale)
        _setup_context(ctx, (q, k, v, sinks, *call.options), output)
        ctx.kept = call.backward
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_gradients(ctx, dout, dlse), None, None)  # (none for `call`, `descale`)


def recorded_apply(function: type, *args):
    """`function.apply(*args)` for an entry point's Function that autograd records
    (`_FlashCall`, `varlen._VarlenCall`), without `Function.apply`'s Python layer where no
    functorch transform is active: torch's `apply` makes a closure, asks whether
    `setup_context` is overridden and unwraps dead functorch wrappers by a generator, on
    every call, before the C `apply` it ends in. Here the same unwrapping, then that C
    `apply` (kept per Function in `_C_APPLY`): about 8,000 instructions fewer a training
    step on the development CPU, 1.1-1.5% (evidence/cpu/20261205T2215Z-recorded-apply). Under
    a transform (which `problem.check_no_transform` refuses first), or a torch without
    these internals, `function.apply` itself (issue 31: a training step's host cost)."""
    if _UNWRAP is None or transforms_active():
        return function.apply(*args)
    apply = _C_APPLY.get(function)
    if apply is None:
        apply = _C_APPLY[function] = super(torch.autograd.Function, function).apply
    return apply(*[_UNWRAP(a) if isinstance(a, _TENSOR) else a for a in args])


_UNWRAP = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_C_APPLY: dict = {}


def check_options(q, k, v, is_causal, scale, precision, window, softcap):
    """The options every entry point shares (attention, varlen, KV cache): is_causal,
    scale, precision for q's dtype, window, softcap; one head dim for q and k, and v's
    (which may differ: DeepSeek's MLA, 192 and 128), each within the limit. Returns
    (window, softcap) normalised."""
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ProblemError("head_dim", (d, k.shape[-1], v.shape[-1]),
                           "one head dim for q and k (v's may differ)")
    if d > MAX_FLASH_DIM or v.shape[-1] > MAX_FLASH_DIM:
        raise ProblemError("head_dim", (d, v.shape[-1]),
                           f"1..{MAX_FLASH_DIM} for q/k and for v")
    check_flag("is_causal", is_causal)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not 0 < scale <= SCALE_MAX):
        raise ProblemError("scale", scale, f"None or a number > 0, at most {SCALE_MAX:g}")
    if precision is not None and q.dtype != torch.float32:
        raise ProblemError("precision", precision, "None for float16/bfloat16/float8_e4m3fn "
                           "inputs (their products run on tensor cores as they are); 'ieee', "
                           "'tf32' or 'tf32x3' for float32 only")
    resolve(q.dtype, precision)
    return check_window(window), check_softcap(softcap)


def check_grad_dim(q, k, v, sinks=None) -> None:
    """fp32 inputs that require grad (q, k, v or the sinks): head dims up to the
    backward's fp32 limit."""
    d = max(q.shape[-1], v.shape[-1])
    wants_grad = wants_grads((q, k, v, sinks))
    if wants_grad and q.dtype == torch.float32 and d > MAX_FP32_GRAD_DIM:
        raise ProblemError("head_dim", d, f"1..{MAX_FP32_GRAD_DIM} for float32 inputs that "
                           "require grad (the backward's fp32 limit; fp16/bf16 go to "
                           f"{MAX_FLASH_DIM}, and without grad fp32 does too)")


def kernel_options(window, softcap) -> tuple[int, int, float]:
    """(window_left, window_right, softcap) as the custom ops take them: -1 for no window
    side, 0.0 for no softcap."""
    left, right = window if window is not None else (None, None)
    return (-1 if left is None else left, -1 if right is None else right, softcap or 0.0)


def wants_grads(tensors) -> bool:
    """Autograd records a call on these tensors (None for an absent one)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _validate(q, k, v, is_causal, scale, enable_gqa, precision, window=None, softcap=None,
              sinks=None, descales=None):
    """`attention`'s checks (the ring's and Ulysses' too): `descales`, FP8's factors
    (`problem.DESCALE_NAMES`), only from `attention`, which alone takes float8_e4m3fn
    inputs."""
    check_qkv(q, k, v, device=DEVICE, ranks=LAYOUTS,
              dtypes=DTYPES if descales is None else (*DTYPES, FP8))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() == 0:
            raise ProblemError(f"{name}.shape", tuple(t.shape), "no zero-sized dimension")
    options = check_options(q, k, v, is_causal, scale, precision, window, softcap)
    check_flag("enable_gqa", enable_gqa)
    if k.shape[:-1] != v.shape[:-1]:
        raise ProblemError("k/v shapes", (tuple(k.shape), tuple(v.shape)),
                           "k and v alike but for the head dim")
    if q.shape[:-3] != k.shape[:-3]:
        raise ProblemError("batch", (tuple(q.shape[:-3]), tuple(k.shape[:-3])),
                           "the same batch dims for q and k/v")
    if q.dim() >= 3:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hq != hkv and not enable_gqa:
            raise ProblemError("heads", (hq, hkv), "equal q and k/v heads, or enable_gqa=True "
                               "with k/v heads dividing q heads")
        if hq % hkv:
            raise ProblemError("heads", (hq, hkv), "k/v heads dividing q heads (GQA/MQA)")
    check_sinks(sinks, q.shape[-3] if q.dim() >= 3 else 1, q.device)
    check_grad_dim(q, k, v, sinks)
    if descales is not None:
        check_fp8(q, v, descales, *_heads(q, k), wants_grads((q, k, v, sinks)))
    return options


def _heads(q, k) -> tuple[int, int]:
    """(query heads, K/V heads) of `[..., H, S, D]` (1 and 1 for `[S, D]`)."""
    return (q.shape[-3], k.shape[-3]) if q.dim() >= 3 else (1, 1)


class _Call(NamedTuple):
    """What `attention` decides from a call's metadata, kept per key (`call_key`)."""

    options: tuple  # the ops' arguments after q, k, v: is_causal, scale, precision, ...
    grad: bool      # autograd records the call
    plan: KeptPlan  # the forward's plan (`_kept_forward`)
    backward: KeptPlan  # the backward's plan where autograd records it (`flash_backward`)


def typed(x):
    """A key part that tells 1, 1.0 and True apart (they hash alike)."""
    return x.__class__, x


def call_key(tensors, options, window, *extra):
    """The metadata an entry point's checks and decisions read, for its call cache: each
    tensor's shape, strides, dtype, device and 16-byte alignment (`launch.tensor_key`'s
    parts, laid flat: one tuple a call, not one a tensor) and whether it requires grad
    (each one's, not only whether any does: the checks refuse a float8 input that does,
    and not a descale factor), whether autograd records the call, which tensors are one
    object (a plan recorded on `attention(x, x, x)` must not serve three tensors: a tensor
    passed again stands in the key as the position of its first place, its metadata not
    read twice; varlen's offsets are often one tensor for q and k), the options with
    their types (1, 1.0 and True hash alike), the window's sides with theirs, and `extra`
    as it is. Each tensor's place starts with None, a position (an int) or its shape, so
    the layout of the parts can be read back one way only.
    None for a call that takes the full path each time: tensor subclasses, lazy negative
    views, a window that is not a pair, unhashable options, nested or sparse tensors (the
    full path says what is wrong with them)."""
    if window is not None:
        if type(window) not in (tuple, list) or len(window) != 2:
            return None
        window = (*window, *map(type, window))
    parts, grad, ids = [*options, *map(type, options), window, *extra], False, []
    try:
        hash((options, window, extra))  # (a tensor's parts always hash: the lookup hashes
        for t in tensors:               # the whole key, once)
            if t is None:
                parts.append(None)
                continue
            if (at := id(t)) in ids:  # one object again: where it first stood
                parts.append(ids.index(at))
                continue
            if t.__class__ is not _TENSOR or t.is_neg():
                return None
            wants = t.requires_grad
            parts += (t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() & 15, wants)
            grad = grad or wants
            ids.append(at)
        key = (*parts, grad and torch.is_grad_enabled())
    except (TypeError, RuntimeError):  # RuntimeError: a nested tensor has no strides, a
        return None                    # sparse one no pointer
    return key


_TENSOR = torch.Tensor


def elsewhere(t) -> bool:
    """Whether `t` is a CUDA tensor on another device than the current one. An entry point
    then makes its call again under `torch.cuda.device(t.device)`, as torch's own ops run
    on their inputs' device: Triton compiles, loads and launches on the current device,
    so a model spread over GPUs (`device_map="auto"` moves a layer's tensors, not the
    current device) would launch cuda:1's tensors on cuda:0. Never while torch.compile
    traces (dynamo would put the device query in the graph; a compiled graph runs under
    its inputs' device)."""
    index = t.get_device() if t.__class__ is _TENSOR else -1  # (-1: a CPU tensor)
    return (index >= 0 and not torch.compiler.is_compiling()
            and index != _current_device())


_current_device = getattr(torch._C, "_cuda_getDevice", None)  # (None in a CPU build)

GRID_ROWS = 65535
"""The most programs a CUDA grid takes along its y (and z) axis. The portable kernels, the
backward's preprocess and the decode kernels put a program row per (batch entry, head)
there, so an entry point makes a call with more rows in batches (`batches`): CUDA
refuses a launch of more (window attention's batch of 128 images x 64 windows at 16
heads is 131072 rows). `test_a_grid_of_more_rows_than_cuda_takes` runs such calls on
the GPU tier (passed on the H200: evidence/nvidia-h200/20261205T141848Z-gpu-tier)."""


def batches(count: int, heads: int, spare: int = 0) -> list[slice] | None:
    """Slices of `count` batch entries (sequences) such that (a slice's entries + `spare`)
    x `heads` (the program rows an entry takes) fits GRID_ROWS, or None where one call
    holds them all. `spare`: entries a launch adds (varlen's FP8 V transpose takes one
    row of programs more than its sequences)."""
    if (count + spare) * heads <= GRID_ROWS:
        return None
    step = GRID_ROWS // heads - spare
    if step < 1:
        raise ProblemError("heads", heads, f"at most {GRID_ROWS // (1 + spare)} (a GPU "
                           "grid's rows)")
    return [slice(i, min(i + step, count)) for i in range(0, count, step)]


_CALLS = Plans()


def _prepare(q, k, v, is_causal, scale, enable_gqa, precision, window, softcap,
             sinks, deterministic=True, descales=None) -> _Call:
    """The full path's checks and decisions (every bad input raises `ProblemError`)."""
    window, softcap = _validate(q, k, v, is_causal, scale, enable_gqa, precision, window,
                                softcap, sinks, descales or (None,) * 3)
    if not isinstance(deterministic, bool):
        raise ProblemError("deterministic", deterministic, "True (the same bits every run) or "
                           "False (the Hopper backward may race its dQ adds: faster)")
    window = clamp_window(window, q.shape[-2], k.shape[-2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    options = (is_causal, scale, resolve(q.dtype, precision).op,
               *kernel_options(window, softcap), deterministic)
    return _Call(options, wants_grads((q, k, v, sinks)), KeptPlan(), KeptPlan())


def autocast_inputs(q, k, v, precision) -> tuple:
    """q, k, v in autocast's dtype where `torch.autocast` is on for their device type and
    they are fp32 with no explicit `precision` (SDPA's behaviour); else as given. A device
    type autocast does not know (meta tensors) passes as given, for the validator to refuse
    (torch raises on the question)."""
    if precision is not None or not isinstance(q, torch.Tensor) or q.dtype != torch.float32:
        return q, k, v
    kind = q.device.type  # (a new torch.device a read: read once)
    # (asked only of a type autocast may not know: torch 2.11's torch.compile cannot trace
    # `is_autocast_available`, a graph break under fullgraph=True, GPU tier 073555Z)
    if kind not in ("cuda", "cpu") and not torch.amp.is_autocast_available(kind):
        return q, k, v
    if not torch.is_autocast_enabled(kind):
        return q, k, v
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                 else t for t in (q, k, v))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
              scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
              precision: str | None = None, window: tuple[int | None, int | None] | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              deterministic: bool = True, descale_q: torch.Tensor | None = None,
              descale_k: torch.Tensor | None = None, descale_v: torch.Tensor | None = None):
    """Attention forward with the flash kernel; see the module docstring. A call whose
    metadata (`call_key`) was seen skips the checks and decisions it already passed."""
    if elsewhere(q):
        with torch.cuda.device(q.device):
            return attention(**locals())  # (only the parameters are local here)
    q, k, v = autocast_inputs(q, k, v, precision)
    compiling = torch.compiler.is_compiling()
    descales = (descale_q, descale_k, descale_v)
    key = None if compiling else call_key(
        (q, k, v, sinks, *descales),
        (is_causal, scale, enable_gqa, precision, softcap, deterministic, return_lse),
        window)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        check_flag("return_lse", return_lse)
        call = _prepare(q, k, v, is_causal, scale, enable_gqa, precision, window, softcap,
                        sinks, deterministic, descales)
        if not compiling and (parts := batches(*_as_4d(q)[0].shape[:2])):
            return _in_batches(parts, q, k, v, return_lse, dict(
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, precision=precision,
                window=window, softcap=softcap, sinks=sinks, deterministic=deterministic,
                descale_q=descale_q, descale_k=descale_k, descale_v=descale_v))
        if call.grad and not compiling:
            from fusedattn.tiles.flash_bwd import precompile_backward

            # the backward's kernels compile on other threads while the forward's does
            precompile_backward(*_as_4d(q, k, v), is_causal=is_causal, scale=call.options[1],
                                precision=call.options[2], mask=_mask(*call.options[:1],
                                                                      *call.options[3:6]),
                                deterministic=call.options[6])
        if key is not None:
            _CALLS.put(key, call)
    descale = None if q.dtype != FP8 else fp8_descale(q, descales, *_heads(q, k))
    sinks = None if sinks is None else as_sinks(sinks)
    dims = q.dim()
    q4, k4, v4 = (q, k, v) if dims == 4 else _as_4d(q, k, v)
    if compiling or (call.grad and not KEEP_RECORDED):
        out, lse = call_op(_flash_fwd_op, _Flash, _flash_fwd, q4, k4, v4, sinks,
                           *call.options, descale, grad=call.grad)
    elif call.grad:
        out, lse = recorded_apply(_FlashCall, q4, k4, v4, sinks, call, descale)
    else:
        out, lse = _kept_forward(call, q4, k4, v4, sinks, descale, lse=return_lse)
    if dims != 4:
        out = out.reshape(*q.shape[:-1], v.shape[-1])
    if not return_lse:
        return out
    return out, lse.reshape(q.shape[:-1]) if dims != 4 else lse


def _in_batches(parts, q, k, v, return_lse: bool, options: dict):
    """`attention` over `parts` (`batches`) of the `[B, H, S, D]` view's batch, joined (a
    call never kept: each part's is)."""
    q4, k4, v4 = _as_4d(q, k, v)
    got = joined([attention(q4[part], k4[part], v4[part], return_lse=return_lse, **options)
                  for part in parts], return_lse)
    if not return_lse:
        return got.reshape(*q.shape[:-1], v.shape[-1])
    return got[0].reshape(*q.shape[:-1], v.shape[-1]), got[1].reshape(q.shape[:-1])


def joined(parts: list, return_lse: bool, lse_dim: int = 0):
    """What a call made in batches (`batches`) returns, from its parts' returns: O joined
    on its first dimension, and with `return_lse` the LSE on `lse_dim` (varlen's
    `[H, total]`: 1)."""
    if not return_lse:
        return torch.cat(parts)
    return (torch.cat([out for out, _ in parts]),
            torch.cat([lse for _, lse in parts], dim=lse_dim))


def as_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Checked sinks as the kernels read them: float32, contiguous (a no-op for such; a
    cast autograd sees through for a bf16 or fp16 parameter)."""
    return None if sinks is None else sinks.to(torch.float32).contiguous()


def _as_4d(*tensors):
    """`[..., H, S, D]` as `[B, H, S, D]` (`[S, D]` as `[1, 1, S, D]`), 4-D ones as they are."""
    if tensors[0].dim() == 4:
        return tensors
    return tuple(t.reshape((-1,) + t.shape[-3:]) if t.dim() >= 3 else t[None, None]
                 for t in tensors)
