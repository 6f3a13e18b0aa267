"""Host µs a call, this tree's fusedattn against an older commit's, in one process (issue 31).

    git archive REV src | tar -x -C .hostab-base        # an ignored folder, carried
    python3 scripts/host_ab.py --base .hostab-base [--loops 15] --out DIR

Runs on alternating processes could not resolve a host change: the H200's host moved
one commit's figures by up to 70% from run to run (evidence/nvidia-h200/
20261202T1519Z-host-ab). Here both libraries run in one process, on the same inputs, their
loops taking turns with SDPA's (`fusedattn_lab.host.measure`). The older one is a copy of
its `src/fusedattn` renamed `fusedattn_base` (every `fusedattn` name in its sources, its
custom ops' namespace with them), so that the two import side by side; each is verified
against the float64 reference before and after its loops, as the host suite does.
Writes host_ab.json (every row) and prints the table."""

import argparse
import hashlib
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

NAME = "fusedattn_base"
_WORD = re.compile(r"\bfusedattn\b(?!_)")  # the package's name, not fusedattn_lab's


def renamed_copy(src: Path, into: Path) -> Path:
    """`src` (a `fusedattn` package folder) copied to `into`/fusedattn_base with every
    `fusedattn` in its Python sources renamed; its other files (the prebuilt entries, the
    tuned table) as they are."""
    dest = into / NAME
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dest.rglob("*.py"):
        path.write_text(_WORD.sub(NAME, path.read_text()))
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True,
                        help="a folder holding an older commit's src/fusedattn")
    parser.add_argument("--loops", type=int, default=15, help="loops a provider (turns)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    package = args.base / "src" / "fusedattn"
    if not (package / "__init__.py").is_file():
        parser.error(f"--base {args.base}: no src/fusedattn/__init__.py there (make it with "
                     "`git archive REV src | tar -x -C DIR`)")
    import fusedattn
    from fusedattn_lab import host
    from fusedattn_lab.evidence import environment

    folder = Path(tempfile.mkdtemp(prefix="host-ab-"))
    renamed_copy(package, folder)
    sys.path.insert(0, str(folder))
    base = importlib.import_module(NAME)
    host.LOOPS = args.loops
    libraries = {"fusedattn": fusedattn, "base": base}
    rows = []
    print(f"{'problem':42s} {'provider':30s} {'host us':>8s} {'min-max':>14s} {'x SDPA':>7s}")
    for problem in host.problems():
        for row in host.measure(problem, libraries=libraries):
            rows.append(row)
            if "host_us" not in row:
                print(f"{row['problem']:42s} {row['provider']:30s} {row['status']}: "
                      f"{row.get('reason', '')}")
                continue
            print(f"{row['problem']:42s} {row['provider']:30s} {row['host_us']:8.1f} "
                  f"{row['host_us_min']:6.1f}-{row['host_us_max']:<7.1f} "
                  f"{row['over_sdpa'] or float('nan'):7.2f} {row['status']}")
    pairs = {}
    for row in rows:
        if "host_us" in row:
            side = "base" if row["provider"].startswith("base") else "new"
            label = row["provider"].replace("base", "fusedattn", 1)
            pairs.setdefault((row["problem"], label), {})[side] = row["host_us"]
    ratios = {f"{p} | {label}": got["new"] / got["base"]
              for (p, label), got in pairs.items() if len(got) == 2}
    for name, ratio in ratios.items():
        print(f"new/base {ratio:5.3f}  {name}")
    if ratios:
        print(f"median new/base {statistics.median(ratios.values()):.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_ab.json").write_text(json.dumps(
        {"environment": environment(), "base": str(args.base),
         "base_sources": sources(package), "new_sources": sources(Path(fusedattn.__file__)
                                                                   .parent),
         "command": " ".join(sys.argv), "loops": args.loops, "calls": host.CALLS,
         "rows": rows, "new_over_base": ratios}, indent=1))


def sources(package: Path) -> str:
    """One sha256 over a package's Python sources (names and contents, in order): which
    library a figure belongs to, where the base folder names no commit."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
