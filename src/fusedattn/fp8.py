"""The backward of FP8 attention (issue 34.3): `attention_fp8_backward`.

`attention(q8, k8, v8, descale_q=, descale_k=, descale_v=)` runs FP8 (e4m3) inputs forward.
Autograd cannot take their gradients: a float8 tensor cannot hold one (autograd casts every
gradient to its input's dtype), so that call refuses inputs that require grad. A framework
that trains in FP8 keeps the forward in an autograd Function of its own, as
FlashAttention-3's and TransformerEngine's FP8 attention do, and calls this for the
gradients with respect to the values the float8 tensors stand for (q8 * descale_q, ...), in
bfloat16.

Which products run in FP8: none. With `precision="fp32"` the gradients come from today's
formulas (the portable backward: dV = P^T dO, dP = dO V^T, dS = P (dP - delta),
dK = dS^T Q, dQ = dS K) on the dequantised inputs in fp32 (tf32x3 products, exact to
fp32's bound), with delta = rowsum(dO * O) from O recomputed in fp32, not from the FP8
forward's bf16 O. Measured
by `scripts/fp8_backward_error.py` against float64 autograd (docs/decisions.md#fp8), in
units of the bf16 storage floor: with the FP8 forward's O in delta, dQ erred by 14-28 and
dK by 13-18; with O in fp32, every gradient by under 0.01; rounding dO to e4m3 for its
products put dQ and dK back at 13-25 and dV at 7-11 (from 0), and P and dS in e4m3 added
up to 2 more. The recompute costs one more forward pass, in fp32; the
gradients are then those of the dequantised inputs, within bf16's storage error.

`precision="bf16"`, the default, trades that exactness for the bf16 kernels (the Hopper
forward and backward where they serve): the dequantised values rounded to bfloat16, O
recomputed in bfloat16 and the backward of `attention` on them, as bf16 training takes its
gradients. Its delta comes from that bf16 O, not from the FP8 forward's (whose P went
through e4m3). Its bound is that of bf16 attention's gradients: twice the same formulas'
error done by torch in bfloat16 (`fusedattn_lab.peers.fp8_backward_peer(dtype=
torch.bfloat16)`). On the H200 it ran 7-22x the fp32 route's rate (D128: 283 against 12.8
TFLOP/s), which runs the portable kernels in tf32x3, and 360 at D128 since its values are
dequantised in one launch (`tiles.dequantize`; docs/decisions.md#fp8). `precision="fp32"`
keeps the exact route, at D64 and D128."""


from __future__ import annotations

import torch

from fusedattn.problem import FP8, FP8_GRAD_HEAD_DIMS, ProblemError, check_grad_inputs
from fusedattn.tiles.dequantize import dequantize_as


def attention_fp8_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, *,
                           descale_q: torch.Tensor | None = None,
                           descale_k: torch.Tensor | None = None,
                           descale_v: torch.Tensor | None = None,
                           descale_do: torch.Tensor | None = None, is_causal: bool = False,
                           scale: float | None = None, enable_gqa: bool = False,
                           window: tuple[int | None, int | None] | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           precision: str = "bf16"):
    """Gradients of `out = attention(q, k, v, ..., descale_q=..., descale_k=...,
    descale_v=...)` (float8_e4m3fn q, k, v) for the upstream gradient `dout` of `out`:
    `(dq, dk, dv)` in bfloat16, with respect to q * descale_q, k * descale_k and
    v * descale_v, shaped as q, k, v (and with `sinks`, `dsinks` float32 `[H]` last).
    `dout`: bfloat16, float16 or float32, or float8_e4m3fn standing for dout * descale_do
    (None, one element, or `[H]`). The options are the forward's, as it was called; the
    forward's O and LSE are not needed (both are recomputed: the module docstring).
    `precision="bf16"` (the default): the bf16 kernels on the dequantised values rounded to
    bfloat16 (bf16 training's error: the module docstring), at every head dim the FP8
    forward takes. `precision="fp32"`: the fp32 formulas (exact to bf16 storage, at the
    portable fp32 kernels' rate), head dims `problem.FP8_GRAD_HEAD_DIMS`. Every bad input
    raises `ProblemError`."""
    from fusedattn.api import _as_4d, _flash_bwd, _flash_fwd, _prepare
    from fusedattn.dispatch import use_backend

    if not isinstance(q, torch.Tensor) or q.dtype != FP8:
        raise ProblemError("q.dtype", getattr(q, "dtype", type(q).__name__),
                           "float8_e4m3fn (other dtypes take their gradients through "
                           "autograd: attention(...).backward())")
    with torch.no_grad():  # (the checks' "requires grad" is the forward's, not this call's)
        call = _prepare(q, k, v, is_causal, scale, enable_gqa, None, window, softcap, sinks,
                        True, (descale_q, descale_k, descale_v))
    check_grad_inputs(q, v, dout, descale_do)
    if precision not in ("fp32", "bf16"):
        raise ProblemError("precision", precision, '"fp32" (the fp32 formulas, O recomputed '
                           'in fp32: exact to bf16 storage) or "bf16" (the bf16 kernels on '
                           "the dequantised values: bf16 training's error)")
    factors = (descale_q, descale_k, descale_v)
    def values(t, descale, dtype):  # what a float8 tensor stands for, in dtype
        return dequantize_as(t, descale, dtype) if t.dtype == FP8 else t.to(dtype)

    if precision == "bf16":
        return _bf16_grads(values(dout, descale_do, torch.bfloat16), q, k, v, factors, call,
                           enable_gqa, window, softcap, sinks)
    if q.shape[-1] not in FP8_GRAD_HEAD_DIMS or v.shape[-1] not in FP8_GRAD_HEAD_DIMS:
        raise ProblemError("head_dim", (q.shape[-1], v.shape[-1]), 'for precision="fp32", '
                           f"{', '.join(map(str, FP8_GRAD_HEAD_DIMS))} for q/k and for v "
                           '(precision="bf16" takes every head dim of the FP8 forward)')
    qf, kf, vf = (dequantize_as(t, f, torch.float32) for t, f in zip((q, k, v), factors,
                                                                      strict=True))
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    is_causal, scale_, _, *options = call.options
    q4, k4, v4, do4 = _as_4d(qf, kf, vf, values(dout, descale_do, torch.float32))
    # O and the LSE in fp32 for delta = rowsum(dO * O) (the module docstring: why not the
    # FP8 forward's)
    with use_backend("portable"):  # (fp32: the portable kernels, whatever is forced)
        out, lse = _flash_fwd(q4, k4, v4, sinks, is_causal, scale_, "tf32x3", *options)
    grads = _flash_bwd(do4, q4, k4, v4, out, lse, None, sinks, is_causal, scale_, "tf32x3",
                       *options[:3], True, "portable")
    dq, dk, dv = (g.reshape(t.shape).to(torch.bfloat16) for g, t in zip(grads[:3], (q, k, v),
                                                                         strict=True))
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, grads[3])


def _bf16_grads(do, q, k, v, factors, call, enable_gqa, window, softcap, sinks):
    """`attention_fp8_backward(precision="bf16")`: autograd of `attention` on the
    dequantised values in bfloat16 (its forward recomputes O and the LSE, its backward
    takes the bf16 kernels: the Hopper ones where the dispatch sends bf16)."""
    from fusedattn.api import attention

    leaves = [dequantize_as(t, f, torch.bfloat16).requires_grad_() for t, f in
              zip((q, k, v), factors, strict=True)]
    if sinks is not None:
        leaves.append(sinks.detach().to(torch.float32).requires_grad_())
    is_causal, scale = call.options[:2]
    with torch.enable_grad():
        out = attention(*leaves[:3], is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                        window=window, softcap=softcap,
                        sinks=leaves[3] if sinks is not None else None)
        grads = torch.autograd.grad(out, leaves, do)
    return tuple(grads)
