"""`fusedattn walkthrough`: the online recurrence on one row, key by key."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusedattn.problem import ProblemError


def add(sub) -> None:
    p = sub.add_parser("walkthrough", help="the online recurrence on one row, key by key")
    p.add_argument("--scores", default="2,1,4", help="one query row's scores (default: the "
                    "chapter's 2,1,4)")
    p.add_argument("--values", default="1,0;0,2;3,1",
                    help="V rows, ';' between rows (default: the chapter's 1,0;0,2;3,1)")
    p.add_argument("--order", help="exercise 2: the same scores in another order, e.g. 4,2,1")
    p.add_argument("--forget-rescale", action="store_true",
                    help="exercise 1: do not rescale the old accumulator")
    p.add_argument("--figure", type=Path, help="small multiples of the steps (.png or .svg)")


def _floats(field: str, text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ProblemError(field, text, "comma-separated numbers") from None


def run(args: argparse.Namespace, console: Console) -> int:
    import torch

    from fusedattn_lab import walkthrough as wt

    if args.figure:
        wt.figure_path(args.figure)  # before any work
    scores = _floats("scores", args.scores)
    values = [_floats("values", row) for row in args.values.split(";")]
    if len({len(r) for r in values}) > 1:
        raise ProblemError("values", args.values, "rows of one length, ';' between rows")
    w = wt.walk(scores, values)
    steps = w.steps
    title = "online softmax, key by key (float64)"
    if args.forget_rescale:
        fr = wt.forget_rescale(scores, values)
        steps, title = fr["steps"], "WITHOUT rescaling the old accumulator (exercise 1)"
    table = Table(title=title)
    for c in ("key", "score", "m_i", "l_i", "α = exp(m_old − m_new)", "β = exp(s − m_new)",
              "acc"):
        table.add_column(c, justify="right", no_wrap=True)
    for st in steps:
        grew = st.key > 0 and st.alpha < 1.0
        table.add_row(str(st.key), f"{st.score:g}", f"{st.m_i:g}", f"{st.l_i:.4f}",
                      f"{st.alpha:.4f}" + (" ← max grew" if grew else ""), f"{st.beta:.4f}",
                      "[" + ", ".join(f"{a:.4f}" for a in st.acc) + "]")
    console.print(table)
    fmt = ", ".join
    console.print("probabilities softmax(s):   [" + fmt(f"{p:.4f}" for p in w.probabilities) + "]")
    console.print("acc / l_i (online):         [" + fmt(f"{x:.4f}" for x in w.online) + "]")
    console.print("softmax · V (materialized): [" + fmt(f"{x:.4f}" for x in w.materialized)
                  + "]")
    if args.forget_rescale:
        console.print("without rescaling:          [" + fmt(f"{x:.4f}" for x in fr["wrong"])
                      + "]  error [" + fmt(f"{x:+.4f}" for x in fr["error"]) + "]; worst: "
                      f"component {fr['worst_component']}. Every key read before the max "
                      "grew keeps its old, larger scale in acc, but not in l.")
    if args.order:
        order = wt.parse_order(args.order, len(scores))
        for dtype in (torch.float32, torch.float64):
            ex = wt.order_experiment(scores, values, order, dtype)
            console.print(f"order {args.order} ({ex['dtype']}): original ["
                          + fmt(f"{x!r}" for x in ex["original"].tolist()) + "], reordered ["
                          + fmt(f"{x!r}" for x in ex["reordered"].tolist()) + "], ULPs "
                          + str(ex["ulps"]) + (" — bit for bit equal" if ex["bitwise_equal"]
                                               else " — equal mathematically, not bit for bit"))
    if args.figure:
        console.print(f"figure: {wt.draw_steps(w, args.figure)}")
    return 0
