"""float64 references, beside the kernels: the plain formula and the online recurrence.

Both take the same arguments in the same order as the kernels (`q, k, v`, then options).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
                  ) -> torch.Tensor:
    """`O = softmax(Q K^T * scale) V` in float64 on the CPU.

    `q, k, v: [S, D]` any float dtype; returns `[S, D] float64`. scale defaults to 1/sqrt(D).
    """
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.T) * scale
    return torch.softmax(scores, dim=-1) @ v


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


def online_trace(scores, values) -> list[Step]:
    """Run the online-softmax recurrence over one query row in float64, key by key.

    `scores: [S]` (already scaled), `values: [S, D]`. Returns the state after every key;
    the output is `steps[-1].acc / steps[-1].l_i`.
    Start: m = -inf, l = 0, acc = 0; per key: m' = max(m, s), alpha = exp(m - m'),
    beta = exp(s - m'), l' = alpha*l + beta, acc' = alpha*acc + beta*V_j.
    """
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    vals = torch.as_tensor(values, dtype=torch.float64).reshape(s.numel(), -1)
    m_i, l_i = -math.inf, 0.0
    acc = torch.zeros(vals.shape[1], dtype=torch.float64)
    steps = []
    for j, sj in enumerate(s.tolist()):
        m_new = max(m_i, sj)
        alpha = math.exp(m_i - m_new)  # exp(-inf) = 0 at the first key: history is empty
        beta = math.exp(sj - m_new)
        l_i = alpha * l_i + beta
        acc = alpha * acc + beta * vals[j]
        m_i = m_new
        steps.append(Step(j, sj, m_i, l_i, alpha, beta, tuple(acc.tolist())))
    return steps


def online_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
               ) -> torch.Tensor:
    """The same attention as `attention_ref`, computed row by row with `online_trace`."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rows = []
    for i in range(q.shape[0]):
        last = online_trace((k @ q[i]) * scale, v)[-1]
        rows.append(torch.tensor(last.acc, dtype=torch.float64) / last.l_i)
    return torch.stack(rows)
