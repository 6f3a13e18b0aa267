"""`fusedattn bench --ab FIELD=A,B`: an A/B of one of the library's overrides
(`fusedattn.configs.Overrides`: `one_loop`, `split_d`, `index64`), in one process on the
same inputs. Each problem of the suite (for a forward suite that is not an A/B suite of
its own, also a few ragged and windowed ones) runs under A and under B, alternately, each
verified against the float64 reference before and after timing, with its first call's
time (the compile) beside the kernels'. Backward suites (`train-*`, `ab-train`) time the
backward ("bwd") or forward and backward ("fwd+bwd") and check the gradients. The suites
are data (`suites.AB_SUITES` beside the bench suites); the speedup is A's time over B's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import fields, replace

import torch

from fusedattn import configs
from fusedattn.problem import ProblemError
from fusedattn_lab.suites import BenchProblem, _grad_call, _inputs

# forward rows past a suite's own: ragged lengths, fp16 causal, fp32, a window
EXTRA = [(BenchProblem(2, 8, 1000, 128, "bf16", False), None),
         (BenchProblem(2, 8, 1000, 128, "bf16", True), None),
         (BenchProblem(2, 8, 3000, 64, "fp16", True), None),
         (BenchProblem(1, 4, 700, 96, "fp32", False), None),
         (BenchProblem(2, 16, 4096, 128, "bf16", True), (1000, 0))]


def parse_ab(text: str) -> tuple[str, tuple]:
    """`FIELD=A,B` -> (field, (A, B)), the values as the field takes them (0/1 for bools)."""
    kinds = {f.name: f for f in fields(configs.Overrides) if f.name != "table"}
    name, _, values = text.partition("=")
    parts = values.split(",")
    if name not in kinds or len(parts) != 2 or parts[0] == parts[1] \
            or any(v not in ("0", "1") for v in parts):
        raise ProblemError("ab", text, f"FIELD=A,B with FIELD one of {', '.join(kinds)} "
                           "and A, B two of 0 and 1")
    return name, tuple(v == "1" for v in parts)


def _verified(out, q, k, v, p, window) -> bool:
    """The first and the last (batch, head) against the float64 reference, within the
    tolerance table's bound (which scales with SDPA's error on the same slice, in the
    inputs' dtype). GQA: the last query head reads the last K/V head."""
    from fusedattn.reference import attention_ref, visible
    from fusedattn_lab.verify import check

    mask = None
    if window is not None:
        mask = visible(q.shape[-2], k.shape[-2], window=window, device=q.device)
    ok = True
    for b, h, hk in ((0, 0, 0), (-1, q.shape[1] - 1, k.shape[1] - 1)):
        q1, k1, v1 = q[b, h:h + 1].detach(), k[b, hk:hk + 1].detach(), v[b, hk:hk + 1].detach()
        ref = attention_ref(q1, k1, v1, causal=p.causal, window=window, device=q1.device)
        peer = torch.nn.functional.scaled_dot_product_attention(
            q1, k1, v1, attn_mask=mask, is_causal=p.causal and window is None)
        peer_error = float((peer.double() - ref.to(peer.device)).abs().max())
        ok &= check(out[b, h:h + 1], ref, precision=p.precision, peer_error=peer_error).ok
    return ok


def run_ab(field: str, values: tuple, problems: list, *, extra: bool, repeat: int,
           progress=lambda label: None) -> list[dict]:
    """One row per problem: first-call seconds, verified, median and spread ms under each
    value, and the speedup of A over B. `configs.OVERRIDES` is restored after."""
    from fusedattn.api import attention
    from fusedattn_lab.slices import GradCheck
    from fusedattn_lab.timing import time_gpu

    before = configs.OVERRIDES
    a, b = values

    def under(value):
        configs.OVERRIDES = replace(before, **{field: value})

    cases = [(p, None) for p in problems]
    if extra and all(p.mode == "fwd" for p in problems):
        cases += EXTRA
    rows = []
    try:
        for p, window in cases:
            label = p.label() + (f" window {window}" if window else "")
            progress(label)
            inputs = _inputs(p, 0)
            q, k, v = inputs[:3]
            kw = {"is_causal": p.causal and window is None, "precision": p.precision,
                  "enable_gqa": (p.heads_kv or p.heads) != p.heads, "window": window}

            def forward(q=q, k=k, v=v, kw=kw):  # the override, read at each call
                return attention(q, k, v, **kw)

            if p.mode == "fwd":
                calls = {value: forward for value in values}

                def verified(out, p=p, window=window, q=q, k=k, v=v):
                    return _verified(out, q, k, v, p, window)
            else:  # "bwd" times the backward of one kept forward, run under its own value
                calls = {}
                for value in values:
                    under(value)
                    calls[value] = _grad_call(forward, *inputs, p.mode)
                grad_check = GradCheck(*inputs, p)

                def verified(grads, grad_check=grad_check):
                    return grad_check(grads)[0]
            row = {"problem": label, "field": field}
            for value in values:
                under(value)
                t0 = time.perf_counter()
                out = calls[value]()
                torch.cuda.synchronize()
                row[f"first_call_s_{int(value)}"] = round(time.perf_counter() - t0, 3)
                row[f"verified_{int(value)}"] = verified(out)
                del out
            times = {value: [] for value in values}
            for _ in range(4):  # alternate, so that drift of clocks or heat hits both
                for value in values:
                    under(value)
                    times[value] += time_gpu(calls[value], warmup=3,
                                             repeat=max(1, repeat // 4)).times_ms
            for value in values:
                under(value)
                row[f"verified_{int(value)}"] &= verified(calls[value]())
                row[f"median_ms_{int(value)}"] = statistics.median(times[value])
                row[f"spread_ms_{int(value)}"] = max(times[value]) - min(times[value])
            row[f"speedup_{int(a)}_over_{int(b)}"] = (row[f"median_ms_{int(b)}"]
                                                      / row[f"median_ms_{int(a)}"])
            rows.append(row)
    finally:
        configs.OVERRIDES = before
    return rows
