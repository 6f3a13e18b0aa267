"""The backward of FP8 attention (issue 34.3): `attention_fp8_backward`, and
`attention_varlen_fp8_backward` for packed sequences.

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

from contextlib import nullcontext

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
    from fusedattn.api import _prepare, attention

    factors = (descale_q, descale_k, descale_v)
    _check_fp8_q(q, "attention(...).backward()")
    with torch.no_grad():  # (the checks' "requires grad" is the forward's, not this call's)
        _prepare(q, k, v, is_causal, scale, enable_gqa, None, window, softcap, sinks, True,
                 factors)
    return _gradients(attention, dout, descale_do, (q, k, v), factors, sinks, precision,
                      head_axis=-3, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                      window=window, softcap=softcap)


def attention_varlen_fp8_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                                  max_seqlen_k: int, *,
                                  descale_q: torch.Tensor | None = None,
                                  descale_k: torch.Tensor | None = None,
                                  descale_v: torch.Tensor | None = None,
                                  descale_do: torch.Tensor | None = None,
                                  is_causal: bool = False, scale: float | None = None,
                                  window: tuple[int | None, int | None] | None = None,
                                  softcap: float | None = None,
                                  sinks: torch.Tensor | None = None, precision: str = "bf16",
                                  check_lengths: bool = True):
    """`attention_fp8_backward` for packed sequences: the gradients of `out =
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...,
    descale_q=..., descale_k=..., descale_v=...)` (float8_e4m3fn `[total, H, D]` q, k, v)
    for `dout` (`[total_q, H, Dv]`; float8_e4m3fn with `descale_do` as there), `(dq, dk,
    dv)` in bfloat16 shaped as q, k, v (`dsinks` last with `sinks`). The offsets, the
    longest lengths, `check_lengths` and the options are `attention_varlen`'s (the offsets'
    values are checked once here, as the forward checks them); `precision` as in
    `attention_fp8_backward`. Every bad input raises `ProblemError`."""
    from fusedattn.problem import check_flag
    from fusedattn.varlen import _checked, attention_varlen

    factors = (descale_q, descale_k, descale_v)
    _check_fp8_q(q, "attention_varlen(...).backward()")
    check_flag("check_lengths", check_lengths)
    with torch.no_grad():
        _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                 window, softcap, scale, None, check_lengths, sinks, factors)

    def packed(q, k, v, **options):  # (the offsets' values checked above, once)
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, check_lengths=False, **options)

    return _gradients(packed, dout, descale_do, (q, k, v), factors, sinks, precision,
                      head_axis=-2, is_causal=is_causal, scale=scale, window=window,
                      softcap=softcap)


def _check_fp8_q(q, instead: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != FP8:
        raise ProblemError("q.dtype", getattr(q, "dtype", type(q).__name__),
                           f"float8_e4m3fn (other dtypes take their gradients through "
                           f"autograd: {instead})")


def _gradients(entry, dout, descale_do, qkv, factors, sinks, precision, head_axis,
               **options):
    """Both routes of the FP8 backward (the module docstring), for the forward `entry`
    (`attention` or varlen's, taking q, k, v, `sinks`, `precision` and `options`) on
    checked float8 `qkv` whose heads lie on `head_axis`: autograd of `entry` on the
    dequantised values, in bfloat16 ("bf16": the kernels bf16 training runs) or in
    float32 with 3xTF32 products on the portable kernels ("fp32": O and the LSE
    recomputed in fp32, so delta = rowsum(dO * O) is exact to fp32). The gradients in
    bfloat16, dsinks float32."""
    from fusedattn.dispatch import use_backend

    q, k, v = qkv
    check_grad_inputs(q, v, dout, descale_do,
                      q.shape[head_axis] if q.dim() >= -head_axis else 1)  # ([S, D]: one)
    if precision not in ("fp32", "bf16"):
        raise ProblemError("precision", precision, '"fp32" (the fp32 formulas, O recomputed '
                           'in fp32: exact to bf16 storage) or "bf16" (the bf16 kernels on '
                           "the dequantised values: bf16 training's error)")
    if precision == "fp32" and (q.shape[-1] not in FP8_GRAD_HEAD_DIMS
                                or v.shape[-1] not in FP8_GRAD_HEAD_DIMS):
        raise ProblemError("head_dim", (q.shape[-1], v.shape[-1]), 'for precision="fp32", '
                           f"{', '.join(map(str, FP8_GRAD_HEAD_DIMS))} for q/k and for v "
                           '(precision="bf16" takes every head dim of the FP8 forward)')
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [dequantize_as(t, f, dtype, head_axis).requires_grad_()
                  for t, f in zip(qkv, factors, strict=True)]
        if sinks is not None:
            leaves.append(sinks.detach().to(torch.float32).requires_grad_())
        do = (dequantize_as(dout, descale_do, dtype, head_axis) if dout.dtype == FP8
              else dout.to(dtype))
        with nullcontext() if precision == "bf16" else use_backend("portable"):
            out = entry(*leaves[:3], sinks=leaves[3] if sinks is not None else None,
                        precision=None if precision == "bf16" else "tf32x3", **options)
            grads = torch.autograd.grad(out, leaves, do)
    return (*(g.to(torch.bfloat16) for g in grads[:3]), *grads[3:])
