"""float64 references, beside the kernels: the plain formula and the online recurrence.

Both take the same arguments in the same order as the kernels (`q, k, v`, then options).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def causal_mask(seq_q: int, seq_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[seq_q, seq_k] bool`, True where query i may see key j: j <= i (top-left aligned, as
    torch's scaled_dot_product_attention(is_causal=True)). Row i always keeps key 0."""
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()


ALIGNMENTS = ("top-left", "bottom-right")


def visible(seq_q: int, seq_k: int, *, causal: bool = False, align: str = "top-left",
            window: tuple[int | None, int | None] | None = None,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """`[seq_q, seq_k] bool`: which keys each query sees.

    Query i sits at position p = i (top-left, SDPA's `is_causal`) or p = i + seq_k - seq_q
    (bottom-right: queries that follow a cache, FlashAttention's causal). Causal: keys
    j <= p. A window (left, right), None for an unbounded side: keys in [p - left,
    p + right], on top of causal. A row may see no key at all (bottom-right with
    seq_q > seq_k, or a window past the keys): its output is 0 and its LSE -inf.
    """
    if align not in ALIGNMENTS:
        raise ValueError(f"align={align!r}: one of {ALIGNMENTS}")
    pos = torch.arange(seq_q, device=device)[:, None]
    if align == "bottom-right":
        pos = pos + (seq_k - seq_q)
    keys = torch.arange(seq_k, device=device)[None, :]
    seen = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal:
        seen &= keys <= pos
    if window is not None:
        left, right = window
        if left is not None:
            seen &= keys >= pos - left
        if right is not None:
            seen &= keys <= pos + right
    return seen


def _scores(q, k, scale, causal, align="top-left", window=None, softcap=None):
    """Scaled scores `[..., Sq, Sk]` with GQA (k's heads repeated to q's), softcap
    (s -> c * tanh(s / c)) and the visibility mask as -inf; float64 in, float64 out."""
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or window is not None or align != "top-left":
        mask = visible(q.shape[-2], k.shape[-2], causal=causal, align=align, window=window,
                       device=scores.device)
        scores = scores.masked_fill(~mask, -math.inf)
    return scores


def _gqa(v, heads):
    return v.repeat_interleave(heads // v.shape[-3], -3) if v.dim() >= 3 else v


def _forward(q, k, v, scores, sinks=None, round_p=None):
    """Softmax rows (a row that sees no key gives 0, not NaN) times V; and the LSE. `sinks`
    (`[H]`, one logit per query head): each joins its head's rows' denominators and the LSE,
    carrying no value (gpt-oss's attention sinks). `round_p`: P as a low-precision peer
    rounds it before its product with V (`fusedattn_lab.peers.fp8_peer`)."""
    if sinks is not None:
        heads = q.shape[-3] if q.dim() >= 3 else 1
        column = sinks.to(scores).reshape(heads, 1, 1).expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    if round_p is not None:
        p = round_p(p)
    return p @ _gqa(v, q.shape[-3] if q.dim() >= 3 else 1), lse


def dequantize(t: torch.Tensor, descale: torch.Tensor | None = None) -> torch.Tensor:
    """A float8 tensor `[..., H, S, D]` as the values it stands for, in float64: times
    `descale` (None: 1; one element: per tensor; `[H]`: per head), FlashAttention-3's
    descale_q/k/v. The reference of FP8 attention is `attention_ref` on these."""
    x = t.detach().to(torch.float64)
    if descale is None:
        return x
    d = descale.detach().to(x.device, torch.float64)
    return x * (d.reshape(-1, 1, 1) if d.numel() > 1 else d.reshape(()))


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  causal: bool = False, device: torch.device | str = "cpu",
                  return_lse: bool = False, align: str = "top-left",
                  window: tuple[int | None, int | None] | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None):
    """`O = softmax(mask(softcap(Q K^T * scale))) V` in float64.

    `q: [..., H, Sq, D]`, `k, v: [..., H_kv, Sk, D]` (GQA/MQA: query head h reads K/V head
    h // (H / H_kv)), or `[Sq, D]`/`[Sk, D]`; any float dtype; returns `[..., Sq, D] float64`
    on `device` (the CPU by default; the benchmark passes the GPU for large slices), and with
    `return_lse` also the natural-log LSE of the scaled scores, `[..., Sq] float64`. scale
    defaults to 1/sqrt(D). Causal, `align` and `window` as `visible` says (default: causal
    top-left, key j > i gets -inf before the softmax); `softcap` c maps each scaled score s
    to c * tanh(s / c) before the mask. `sinks` (`[H]`): attention sinks, a logit per query
    head in every row's denominator (and LSE) that carries no value:
    O_i = sum_j exp(s_ij) V_j / (exp(sink_h) + sum_j exp(s_ij)).
    """
    q, k, v = (t.detach().to(device, torch.float64) for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach().to(device, torch.float64)
    out, lse = _forward(q, k, v, _scores(q, k, scale, causal, align, window, softcap), sinks)
    return (out, lse) if return_lse else out


def attention_ref_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                        *, scale: float | None = None, causal: bool = False,
                        dlse: torch.Tensor | None = None, device: torch.device | str = "cpu",
                        align: str = "top-left",
                        window: tuple[int | None, int | None] | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, ...]:
    """float64 `(dq, dk, dv)` of `attention_ref` (same options) by autograd, for the
    upstream gradient `dout` (shaped like O) and optionally `dlse` (shaped like the LSE);
    dk and dv summed over the query heads of each GQA group, shaped like k and v. With
    `sinks`, `(dq, dk, dv, dsinks)`."""
    q, k, v = (t.detach().to(device, torch.float64).requires_grad_() for t in (q, k, v))
    leaves = (q, k, v)
    if sinks is not None:
        sinks = sinks.detach().to(device, torch.float64).requires_grad_()
        leaves += (sinks,)
    out, lse = _forward(q, k, v, _scores(q, k, scale, causal, align, window, softcap), sinks)
    outputs, grads = [out], [dout.detach().to(device, torch.float64)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.detach().to(device, torch.float64))
    return torch.autograd.grad(outputs, leaves, grads)


def varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, *, causal: bool = False, **options) -> torch.Tensor:
    """Packed variable-length batches: `q: [total_q, H, D]`, `k, v: [total_k, H_kv, D]`,
    sequence b spanning rows cu_seqlens[b]:cu_seqlens[b+1]. Each sequence on its own, causal
    aligned bottom-right within it (FlashAttention's varlen convention); returns
    `[total_q, H, D] float64`. `options`: `attention_ref`'s (scale, window, softcap)."""
    outs = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    spans_q = zip(bounds_q[:-1], bounds_q[1:], strict=True)
    spans_k = zip(bounds_k[:-1], bounds_k[1:], strict=True)
    for (q0, q1), (k0, k1) in zip(spans_q, spans_k, strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t, a, b in ((q, q0, q1), (k, k0, k1),
                                                               (v, k0, k1)))
        outs.append(attention_ref(qs, ks, vs, causal=causal, align="bottom-right",
                                  **options).transpose(0, 1))
    return torch.cat(outs, dim=0)


def varlen_ref_grads(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False,
                     **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 `(dq, dk, dv)` of `varlen_ref` for the upstream gradient `dout`
    `[total_q, H, D]`: each sequence's `attention_ref_grads`, bottom-right aligned. With
    `sinks` in the options, also dsinks (summed over the sequences)."""
    grads = ([], [], [], [])
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
        parts = [t[a:z].transpose(0, 1) for t, a, z in
                 ((q, q0, q1), (k, k0, k1), (v, k0, k1), (dout, q0, q1))]
        for acc, g in zip(grads, attention_ref_grads(*parts, causal=causal,
                                                     align="bottom-right", **options),
                          strict=False):
            acc.append(g.transpose(0, 1) if g.dim() == 3 else g)
    dq, dk, dv, dsinks = grads
    out = tuple(torch.cat(g, dim=0) for g in (dq, dk, dv))
    return out + (torch.stack(dsinks).sum(0),) if dsinks else out


def paged_to_dense(cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor
                   ) -> list[torch.Tensor]:
    """A paged cache `[num_blocks, H_kv, block_size, D]` read through `block_table
    [B, max_blocks]` as each sequence's dense `[H_kv, seqlens[b], D]` (what a kernel reading
    the pages must see)."""
    block = cache.shape[2]
    dense = []
    for b, n in enumerate(seqlens.tolist()):
        pages = block_table[b, : -(-n // block)] if n else block_table[b, :0]
        rows = cache[pages].permute(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])
        dense.append(rows[:, :n])
    return dense


@dataclass(frozen=True)
class Step:
    """The online state after reading one key (the chapter's 12.3 table)."""

    key: int
    score: float
    m_i: float        # running max of the scores seen so far
    l_i: float        # sum of exp(s - m_i) over the keys seen so far
    alpha: float      # exp(m_old - m_new): rescales the history
    beta: float       # exp(s - m_new): weight of the new key
    acc: tuple[float, ...]  # sum of exp(s - m_i) * V_j, unnormalised, [D]


def online_trace(scores, values, *, dtype: torch.dtype = torch.float64,
                 rescale_acc: bool = True) -> list[Step]:
    """Run the online-softmax recurrence over one query row, key by key.

    `scores: [S]` (already scaled), `values: [S, D]`. Returns the state after every key;
    the output is `steps[-1].acc / steps[-1].l_i`.
    Start: m = -inf, l = 0, acc = 0; per key: m' = max(m, s), alpha = exp(m - m'),
    beta = exp(s - m'), l' = alpha*l + beta, acc' = alpha*acc + beta*V_j.

    `dtype` is the arithmetic (float64 for the reference; float32 shows rounding);
    `rescale_acc=False` drops the alpha on acc: the chapter's exercise 1 bug, for the
    walkthrough only.
    """
    s = torch.as_tensor(scores, dtype=dtype).reshape(-1)
    vals = torch.as_tensor(values, dtype=dtype).reshape(s.numel(), -1)
    m_i = torch.tensor(-math.inf, dtype=dtype)
    l_i = torch.zeros((), dtype=dtype)
    acc = torch.zeros(vals.shape[1], dtype=dtype)
    steps = []
    for j in range(s.numel()):
        m_new = torch.maximum(m_i, s[j])
        alpha = torch.exp(m_i - m_new)  # exp(-inf) = 0 at the first key: history is empty
        beta = torch.exp(s[j] - m_new)
        l_i = alpha * l_i + beta
        acc = (alpha * acc if rescale_acc else acc) + beta * vals[j]
        m_i = m_new
        steps.append(Step(j, float(s[j]), float(m_i), float(l_i), float(alpha), float(beta),
                          tuple(acc.tolist())))
    return steps


def online_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
               causal: bool = False) -> torch.Tensor:
    """The same attention as `attention_ref`, computed row by row with `online_trace`
    (causal: row i reads keys 0..i only)."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rows = []
    for i in range(q.shape[0]):
        n = i + 1 if causal else k.shape[0]
        last = online_trace((k[:n] @ q[i]) * scale, v[:n])[-1]
        rows.append(torch.tensor(last.acc, dtype=torch.float64) / last.l_i)
    return torch.stack(rows)
