"""`fusedattn warmup`: compile ahead of time the kernels a model's calls need
(`fusedattn.warmup`), into Triton's cache ($TRITON_CACHE_DIR, default ~/.triton/cache),
for a deployment to ship with its image."""

from __future__ import annotations

import argparse

from rich.console import Console

from fusedattn_lab.cli.shared import int_arg


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int_arg(x) for x in text.split(",") if x.strip())


def _dims(text: str) -> tuple:
    """Head dims, "128,64" or with V's own, "192/128"."""
    return tuple(tuple(int_arg(y) for y in x.split("/")) if "/" in x else int_arg(x)
                 for x in text.split(",") if x.strip())


def add(sub) -> None:
    p = sub.add_parser("warmup", help="compile the kernels a model needs, ahead of time")
    p.add_argument("--head-dims", type=_dims, required=True,
                   help="e.g. 128 or 64,128; Q/K's and V's: 192/128")
    p.add_argument("--heads", type=_ints, required=True, help="query heads, e.g. 32")
    p.add_argument("--heads-kv", type=_ints, default=None,
                   help="K/V heads, one per --heads entry (GQA); default: the same")
    p.add_argument("--dtypes", default="bf16", help="bf16,fp16,fp32,fp8 (e4m3)")
    p.add_argument("--masks", default="causal", help="causal,full")
    p.add_argument("--train", action="store_true", help="the backward's kernels too")
    p.add_argument("--varlen", action="store_true", help="attention_varlen's too")
    p.add_argument("--sinks", action="store_true", help="with attention sinks (gpt-oss)")
    p.add_argument("--decode", action="store_true",
                   help="attention_with_kvcache's decode steps too (caches of --max-len)")
    p.add_argument("--max-len", type=int_arg, default=4096,
                   help="the longest sequence to expect (16..16384)")


def run(args: argparse.Namespace, console: Console) -> int:
    import os

    from fusedattn.ahead_of_time import warmup
    from fusedattn.problem import ProblemError

    masks = [m.strip() for m in args.masks.split(",") if m.strip()]
    if not masks or any(m not in ("causal", "full") for m in masks):
        raise ProblemError("masks", args.masks, "a comma-separated list of causal, full")
    done = warmup(head_dims=args.head_dims, heads=args.heads, heads_kv=args.heads_kv,
                  dtypes=[d.strip() for d in args.dtypes.split(",") if d.strip()],
                  causal=[m == "causal" for m in masks], training=args.train,
                  varlen=args.varlen, sinks=args.sinks, max_len=args.max_len,
                  decode=args.decode)
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    console.print(f"warmup: {done['calls']} calls, {done['compiled']} kernels compiled in "
                  f"{done['seconds']:.1f} s, into {cache}")
    return 0
