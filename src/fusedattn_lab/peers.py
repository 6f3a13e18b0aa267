"""The peers: PyTorch's attention, run on the same inputs as ours, for comparison.

`torch-eager` (addmm + softmax + mm, float32 with TF32 off) and SDPA's four backends. They
register in the same registry as our versions (route "peer"), from this module, so the
source hash in a peer's evidence is this file's.
"""

from __future__ import annotations

import torch

from fusedattn.problem import FP8, Problem
from fusedattn.reference import _forward, _scores, causal_mask, dequantize
from fusedattn.tiles.common import FP8_P_SCALE
from fusedattn_lab.registry import Kernel, Prepared, Version, register
from fusedattn_lab.verify import tf32_matmuls


def _prepare_eager(q, k, v, problem: Problem) -> Prepared:
    seq = q.shape[0]
    scores = torch.empty((seq, seq), dtype=q.dtype, device=q.device)
    out = torch.empty_like(q)
    future = None
    if problem.causal:  # True above the diagonal: key j > i, masked with -inf
        future = ~causal_mask(seq, seq, q.device)

    def call():
        with tf32_matmuls(False):  # float32 GEMMs, so the peer computes what ours compute
            torch.addmm(scores, q, k.T, beta=0.0, alpha=problem.scale, out=scores)  # fused
            if future is not None:
                scores.masked_fill_(future, float("-inf"))
            torch.mm(torch.softmax(scores, dim=-1), v, out=out)  # softmax allocates P [S, S]

    return Prepared(call, out, {"scores": scores, "out": out}, lambda: [])


def _eager_batched(q, k, v, causal: bool, precision: str | None):
    """torch-eager on `[B, H, S, D]` (equal heads): matmul + softmax + matmul, with TF32
    matmuls only for `precision="tf32"`."""
    scale = q.shape[-1] ** -0.5
    future = None
    if causal:
        future = ~causal_mask(q.shape[-2], k.shape[-2], q.device)

    def call():
        with tf32_matmuls(precision == "tf32"):
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            if future is not None:
                s = s.masked_fill(future, float("-inf"))
            return torch.matmul(torch.softmax(s, dim=-1), v)

    return call


register(Version(
    "torch-eager", "peer",
    "PyTorch: addmm (scaled QK^T) [+ masked_fill if causal] + softmax + mm, float32, TF32 off",
    (Kernel("addmm", ("Q", "K"), ("Scores",)),
     Kernel("masked_fill", ("Scores",), ("Scores",), None, "causal only"),
     Kernel("softmax", ("Scores",), ("P",)), Kernel("mm", ("P", "V"), ("O",))),
    "fusedattn_lab.peers", _prepare_eager, intermediates=2, batched=_eager_batched,
    judges=("tf32", "float32-wide"),  # honours TF32 when asked; plain fp32 otherwise
))



def _sdpa_batched(backend: str):
    def make(q, k, v, causal: bool, precision: str | None):
        # `precision` is unused: SDPA's kernels choose their own products (fp32 "efficient"
        # runs on tensor cores, see evidence/README.md); TF32 state does not reach them
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = getattr(SDPBackend, backend)
        gqa = q.shape[-3] != k.shape[-3]

        def call():
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=gqa)

        return call

    return make


def _sdpa_prepare(backend: str):
    def prepare(q, k, v, problem: Problem) -> Prepared:
        call4 = _sdpa_batched(backend)(q[None, None], k[None, None], v[None, None],
                                       problem.causal, None)
        out = torch.empty_like(q)
        return Prepared(lambda: out.copy_(call4()[0, 0]), out, {"out": out}, lambda: [])

    return prepare


# (name, backend, what, S x S arrays it holds, tolerance keys it is the peer for)
for _name, _backend, _what, _inter, _judges in (
    ("sdpa-flash", "FLASH_ATTENTION", "FlashAttention-2 (fp16/bf16 only)", 0, ()),
    ("sdpa-cudnn", "CUDNN_ATTENTION", "cuDNN's fused attention", 0, ()),
    ("sdpa-efficient", "EFFICIENT_ATTENTION", "memory-efficient (xFormers) kernel", 0, ()),
    ("sdpa-math", "MATH", "the math fallback: matmuls and softmax", 2,
     ("float16", "bfloat16")),
):
    register(Version(
        _name, "peer", f"PyTorch scaled_dot_product_attention, {_what}",
        (Kernel(_backend.lower(), ("Q", "K", "V"), ("O",)),), "fusedattn_lab.peers",
        _sdpa_prepare(_backend), in_all=False, batched=_sdpa_batched(_backend),
        intermediates=_inter, judges=_judges,
    ))


def _fa4_batched(q, k, v, causal: bool, precision: str | None):
    """FlashAttention-4 (`flash_attn.cute`, staged by `peers/stage-fa4.sh`; its sm90 kernels
    run on Hopper) on `[B, S, H, D]` copies made here, outside the timed call; its output
    comes back as a `[B, H, S, D]` view. ImportError where it is not installed: the bench
    records the row as skipped."""
    from flash_attn.cute import flash_attn_func

    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def call():
        out = flash_attn_func(qs, ks, vs, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return call


register(Version(
    "fa4", "peer", "FlashAttention-4 (flash-attn-4, CuTe DSL kernels; sm90 on Hopper)",
    (Kernel("flash_attn_func", ("Q", "K", "V"), ("O",)),), "fusedattn_lab.peers",
    _sdpa_prepare("FLASH_ATTENTION"), in_all=False, batched=_fa4_batched,
))


def fp8_peer(q8, k8, v8, descale_q=None, descale_k=None, descale_v=None, *, scale=None,
             causal=False, align="top-left", window=None, softcap=None, sinks=None):
    """The FP8 formula done by torch, the peer whose error bounds FP8 outputs (issue 34):
    the float8 values' products in float32 times the factors (`reference.dequantize`),
    the softmax in float32, P rounded to e4m3 at the kernel's scale
    (`tiles.common.FP8_P_SCALE`), its product with V in float32, O in bfloat16.
    `[..., H, S, D]` float8_e4m3fn q, k, v; the options as `reference.attention_ref`'s."""
    def round_p(p):
        return (p * FP8_P_SCALE).to(FP8).to(p.dtype) / FP8_P_SCALE

    q, k, v = (dequantize(t, d).to(torch.float32) for t, d in
               ((q8, descale_q), (k8, descale_k), (v8, descale_v)))
    scores = _scores(q, k, scale, causal, align, window, softcap)
    sinks = None if sinks is None else sinks.detach().to(torch.float32)
    return _forward(q, k, v, scores, sinks, round_p)[0].to(torch.bfloat16)


def fp8_backward_peer(dout, q8, k8, v8, descale_q=None, descale_k=None, descale_v=None, *,
                      scale=None, causal=False, align="top-left", window=None, softcap=None,
                      dtype=torch.float32):
    """The FP8 backward's formula done by torch, the peer whose error bounds
    `fusedattn.attention_fp8_backward`'s gradients: today's formulas (dV = P^T dO,
    dS = P (dP - delta), dK = dS^T Q, dQ = dS K, times the softcap's derivative) in float32
    on the dequantised values, delta = rowsum(dO * O) from O in float32 (not the FP8
    forward's: `scripts/fp8_backward_error.py`); (dq, dk, dv) in bfloat16, GQA summed.
    `dtype=torch.bfloat16`: the same formulas with every tensor in bfloat16 (the values,
    dO, the scores, P, O, dS), the peer of `precision="bf16"`."""
    from fusedattn.reference import visible

    q, k, v = (dequantize(t, d).to(dtype) for t, d in
               ((q8, descale_q), (k8, descale_k), (v8, descale_v)))
    group = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    kr, vr = (t.repeat_interleave(group, -3) if group > 1 else t for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    raw = (q @ kr.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
    if causal or window is not None or align != "top-left":
        s = s.masked_fill(~visible(q.shape[-2], k.shape[-2], causal=causal, align=align,
                                   window=window, device=s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0))
    do = dout.to(dtype)
    ds = p * (do @ vr.transpose(-1, -2) - (do * (p @ vr)).sum(-1, keepdim=True))
    if softcap is not None:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = ds @ kr * scale
    dk, dv = ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do
    if group > 1:  # each K/V head's gradient: the sum over the query heads that read it
        dk, dv = (t.unflatten(-3, (-1, group)).sum(-3) for t in (dk, dv))
    return tuple(t.to(torch.bfloat16) for t in (dq, dk, dv))
