"""`fusedattn masks`: exercise 3, the per-iteration key masks of a row kernel."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from fusedattn_lab.cli.shared import int_arg


def add(sub) -> None:
    p = sub.add_parser("masks", help="exercise 3: the per-iteration key masks of a row kernel")
    p.add_argument("--seq", type=int_arg, default=33)
    p.add_argument("--block-k", type=int_arg, default=16)
    p.add_argument("--figure", type=Path, help="the masks as a picture (.png or .svg)")


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab import walkthrough as wt

    if args.figure:
        wt.figure_path(args.figure)  # before any work
    masks = wt.key_masks(args.seq, args.block_k)
    console.print(f"S={args.seq}, BLOCK_K={args.block_k}: {len(masks)} iterations "
                  f"(ceil(S/BLOCK_K)); '#' a key, '.' a masked slot (score set to -inf)")
    console.print(wt.mask_grid(masks), highlight=False)
    demo = wt.wrong_fill(args.seq, args.block_k)
    console.print(f"\nwhy -inf and not 0 (one random row, float64, the kernel's tile "
                  f"recurrence): {demo['masked_slots']} masked slots")
    console.print(f"  fill -inf: max abs error {demo['right_err']:.2e} against the reference")
    console.print(f"  fill 0   : max abs error {demo['wrong_err']:.2e}: each masked slot adds "
                  "exp(0 - m) to l_i (its V row is 0), so every output shrinks; and a 0 can "
                  "even become the running max when all real scores are negative")
    if args.figure:
        console.print(f"figure: {wt.draw_masks(masks, args.figure)}")
    return 0
