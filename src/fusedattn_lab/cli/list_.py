"""`fusedattn list`: the registry, one row per version."""

from __future__ import annotations

import argparse

from rich.console import Console

from fusedattn_lab.cli.shared import render_table


def add(sub) -> None:
    sub.add_parser("list", help="the registry: every version, its route, launches, limits")


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn_lab.registry import ROUTES, VERSIONS

    render_table(console, "versions (the registry: src/fusedattn_lab/versions.py, peers.py)",
                 VERSIONS.values(), [
                     ("version", lambda v: v.name), ("route", lambda v: v.route),
                     ("timed launches", lambda v: " → ".join(k.name for k in v.launches)),
                     ("limits", lambda v: f"D ≤ {v.limits.max_dim}" if v.limits.max_dim
                      else "—"),
                     ("in `all`", lambda v: "yes" if v.in_all else "bench" if v.route == "peer"
                      else "no"),
                     ("description", lambda v: v.description)],
                 wrap=("timed launches", "limits", "description"))
    for route, what in ROUTES.items():
        console.print(f"{route}: {what}")
    return 0
