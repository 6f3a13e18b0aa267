"""One markdown table per `ncu --csv --page details` file (ncu run over `fusedattn bench
--suite prefill --match ROW`): per kernel of at least 20 us, its duration, SM and
issue-slot busy %, the busiest pipe (ncu's own rule) with its share, registers, occupancy,
block, grid and dynamic shared memory; where the run also collected them (the stall and
tensor-pipe `--metrics` that the ncu-stalls evidence folders' command.txt lists), the
tensor pipes' busy % and the three largest stall reasons, in cycles per issued
instruction, of the total cycles between a warp's issues ("selected", the issue itself,
is 1 of them).

    python3 scripts/ncu_details.py FOLDER     # writes FOLDER/summary.md from FOLDER/*.csv
"""

import csv
import io
import re
import sys
from pathlib import Path

COLUMNS = [("Duration", "us"), ("SM Busy", "SM busy %"), ("Issue Slots Busy", "issue busy %"),
           ("Registers Per Thread", "regs"), ("Achieved Occupancy", "occupancy %"),
           ("Block Size", "block"), ("Grid Size", "grid"),
           ("Dynamic Shared Memory Per Block", "smem B"), ("DRAM Throughput", "DRAM %"),
           ("SM Frequency", "SM GHz")]
MIN_NS = 20_000


def kernels(text: str) -> list[dict]:
    """Kernels in launch order, each with its details metrics and busiest pipe."""
    body = text[text.index('"ID"'):]
    found: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO(body)):
        k = found.setdefault(int(row["ID"]), {"name": row["Kernel Name"]})
        if row["Metric Name"]:
            k[row["Metric Name"]] = row["Metric Value"]
        if row["Rule Name"] == "HighPipeUtilization" and "highest-utilized" in row.get(
                "Rule Description", ""):
            desc = row["Rule Description"]
            share = re.search(r"\(([\d.]+%)\)", desc)
            k["pipe"] = desc.split(" is the highest")[0] + (f" {share[1]}" if share else "")
    return [found[i] for i in sorted(found)]


def cell(k: dict, metric: str) -> str:
    value = k.get(metric, "")
    number = float(value.replace(",", "")) if value else None
    if metric == "Duration" and number is not None:
        return f"{number / 1e3:.1f}"
    if metric == "SM Frequency" and number is not None:
        return f"{number / 1e9:.2f}"
    return value


STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")
TENSOR = re.compile(r"sm__pipe_tensor_op_(\w+)_cycles_active\.avg\.pct_of_peak_sustained_active")


def extras(k: dict) -> str:
    """'tensor % | top stalls |' cells (the busiest tensor pipe: hmma counts wgmma too), or
    '' where the run did not collect them."""
    stalls = sorted(((float(v.replace(",", "")), m[1]) for name, v in k.items()
                     if (m := STALL.fullmatch(name)) and v), reverse=True)
    total = sum(c for c, _ in stalls)  # cycles between a warp's issues ("selected": 1)
    stalls = [(c, r) for c, r in stalls if r != "selected"]
    tensor = [float(v.replace(",", "")) for name, v in k.items()
              if TENSOR.fullmatch(name) and v]
    if not stalls and not tensor:
        return ""
    return (f" {max(tensor):.1f} |" if tensor else " |") + \
        " " + ", ".join(f"{r} {c:.2f}" for c, r in stalls[:3]) + f" (of {total:.2f}) |"


def main(folder: Path) -> None:
    parts = [f"# ncu details: {folder.name}\n",
             "Kernels of at least 20 us, in launch order (fusedattn's forward, its backward, "
             "then the peer's). `--clock-control none`: clocks as the card ran them.\n"]
    for path in sorted(folder.glob("*.csv")):
        ks = [k for k in kernels(path.read_text())
              if float(k.get("Duration", "0").replace(",", "")) >= MIN_NS]
        more = any(extras(k) for k in ks)
        parts.append(f"\n## {path.stem}\n\n| kernel | " + " | ".join(c for _, c in COLUMNS)
                     + " | busiest pipe |"
                     + (" tensor pipe % | top stalls (cycles/issue) |" if more else "")
                     + "\n|" + "---|" * (len(COLUMNS) + 2 + 2 * more))
        for k in ks:
            parts.append(f"| `{k['name'][:60]}` | " + " | ".join(cell(k, m) for m, _ in COLUMNS)
                         + f" | {k.get('pipe', '')} |" + (extras(k) or " | |" if more else ""))
    (folder / "summary.md").write_text("\n".join(parts) + "\n")
    print(f"written: {folder / 'summary.md'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
