"""A module's switches set from a command line, for A/Bs and repros
(`scripts/switch_ab.py --set`, `scripts/hang_repro.py --switch`)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from types import ModuleType


def literal_switches(error: Callable[[str], object], flag: str, pairs: list[str],
                     module: ModuleType, exclude: tuple[str, ...] = ()) -> dict:
    """`pairs` "NAME=LITERAL" as {NAME: value}: NAME one of `module`'s switches (a
    constant in capitals, not in `exclude`: a misspelt one would change nothing, silently),
    the value a Python literal. A bad pair goes to `error` (argparse's `ap.error`), with
    `flag`, the option that gave it."""
    where = module.__name__.removeprefix("fusedattn.")
    switches = {}
    for pair in pairs:
        name, eq, text = pair.partition("=")
        if not eq or not name.isupper() or not hasattr(module, name) or name in exclude:
            other = f" other than {', '.join(exclude)}" if exclude else ""
            error(f"{flag} {pair!r}: NAME=LITERAL, NAME one of {where}'s switches{other}")
        try:
            switches[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError) as e:
            error(f"{flag} {pair!r}: the value must be a Python literal ({e})")
    return switches
