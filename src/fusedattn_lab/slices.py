"""The bench's verification on a slice of heads (float64 over a whole batch is costly):
outputs of batch 0 on the first and last head, gradients of batch 0 on every query head of
the first and last K/V heads, each against the float64 reference and judged by the one
tolerance table, with PyTorch's own error in the same precision where the bound is
relative to it (the registry's tolerance peer)."""

from __future__ import annotations

import torch

from fusedattn.reference import attention_ref
from fusedattn_lab.verify import tf32_matmuls


def kv_heads(q, k, heads: list[int]) -> list[int]:
    """The K/V head each query head reads (GQA: `H / H_kv` query heads share one)."""
    group = q.shape[1] // k.shape[1]
    return [h // group for h in heads]


def reference_slice(q, k, v, causal: bool, heads: list[int]) -> torch.Tensor:
    """float64 attention of batch 0, the given query heads, on the inputs' device."""
    kv = kv_heads(q, k, heads)
    return attention_ref(q[0, heads], k[0, kv], v[0, kv], causal=causal, device=q.device)


def peer_error(q, k, v, p, heads, ref) -> float:
    """PyTorch's own attention in the same precision, on the verified slice."""
    from fusedattn_lab.registry import VERSIONS, tolerance_peer
    from fusedattn_lab.verify import precision_key

    peer = tolerance_peer(precision_key(q.dtype, p.precision))
    kv = kv_heads(q, k, heads)
    with tf32_matmuls(p.resolved().peer_tf32):
        out = VERSIONS[peer].batched(q[:1, heads], k[:1, kv], v[:1, kv], p.causal,
                                     p.precision)()
    return float((out[0].double() - ref).abs().max())


def grad_slice(q, k) -> tuple[list[int], list[int]]:
    """The query heads whose gradients are verified (batch 0): every query head of the first
    and last K/V heads, so dK and dV of those K/V heads are complete sums."""
    group = q.shape[1] // k.shape[1]
    kv = sorted({0, k.shape[1] - 1})
    return [h for j in kv for h in range(j * group, (j + 1) * group)], kv


class GradCheck:
    """Gradients of batch 0 on `grad_slice` against the float64 reference's autograd
    gradients, each judged by the tolerance table (low precision: against PyTorch's own
    gradients in the same precision, the math backend)."""

    def __init__(self, q, k, v, dout, p):
        from fusedattn.reference import attention_ref_grads
        from fusedattn_lab.verify import needs_peer

        self.p, (self.heads, self.kv) = p, grad_slice(q, k)
        self.slice = [t.detach()[:1, idx] for t, idx in
                      ((q, self.heads), (k, self.kv), (v, self.kv), (dout, self.heads))]
        self.ref = attention_ref_grads(*self.slice, causal=p.causal, device=q.device)
        self.peer = [None] * 3
        if needs_peer(q.dtype, p.precision):
            self.peer = [float((g.double() - r).abs().max())
                         for g, r in zip(self._peer_grads(), self.ref, strict=True)]

    def _peer_grads(self):
        from fusedattn_lab.registry import VERSIONS, tolerance_peer
        from fusedattn_lab.verify import precision_key

        peer = tolerance_peer(precision_key(self.slice[0].dtype, self.p.precision))
        leaves = [t.clone().requires_grad_() for t in self.slice[:3]]
        with tf32_matmuls(self.p.resolved().peer_tf32):
            out = VERSIONS[peer].batched(*leaves, self.p.causal, self.p.precision)()
            return torch.autograd.grad(out, leaves, self.slice[3])

    def __call__(self, grads):
        from fusedattn_lab.verify import check

        got = (grads[0][:1, self.heads], grads[1][:1, self.kv], grads[2][:1, self.kv])
        results = [check(g, r, precision=self.p.precision, peer_error=e)
                   for g, r, e in zip(got, self.ref, self.peer, strict=True)]
        worst = max(results, key=lambda r: (not r.ok, r.max_abs / r.tolerance))
        reasons = [f"d{n}: {x}" for n, r in zip("qkv", results, strict=True)
                   for x in r.reasons]
        return all(r.ok for r in results), worst.max_abs, worst.tolerance, reasons
