"""`fusedattn list`: the registry, one row per version."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def add(sub) -> None:
    sub.add_parser("list", help="the registry: every version, its route, launches, limits")


def run(args: argparse.Namespace, console: Console) -> int:
    from fusedattn.lab.registry import ROUTES, VERSIONS

    table = Table(title="versions (the registry: src/fusedattn/lab/registry.py, peers.py)")
    for c in ("version", "route", "timed launches", "limits", "in `all`", "description"):
        table.add_column(c)
    for v in VERSIONS.values():
        table.add_row(v.name, v.route, " → ".join(k.name for k in v.launches),
                      f"D ≤ {v.limits.max_dim}" if v.limits.max_dim else "—",
                      "yes" if v.in_all else "bench", v.description)
    console.print(table)
    for route, what in ROUTES.items():
        console.print(f"{route}: {what}")
    return 0
