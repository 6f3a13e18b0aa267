"""The thread-level versions' time model against Nsight Compute (issue 16):

    time ~ barrier steps x barrier cost + DRAM bytes / bandwidth + FLOPs / FP32 rate

per kernel, from `fusedattn profile --ncu` folders (ncu.csv beside resources.csv, whose
grid and barriers per block come from the registry). Constants, stated rather than fitted
per row: 35 ns per block-barrier step per SM (online's, fitted once on S = 512..16384 in
the earlier model), 4.8 TB/s of HBM3e and 67 TFLOP/s of FP32 FMA (the H200 datasheet's),
132 SMs. Beside the model, the issue term the model leaves out: warp instructions / (132
SMs x 4 schedulers x 1.98 GHz), the time if every scheduler issued every cycle.

    python3 scripts/time_model.py OUT_DIR PROFILE_DIR...   (writes time-model.csv and .md)
"""

import csv
import json
import sys
from pathlib import Path

SMS, BAR_NS, HBM_BPS, FP32_FLOPS, ISSUE_PER_S = 132, 35.0, 4.8e12, 67e12, 132 * 4 * 1.98e9


def rows_of(folder: Path) -> list[dict]:
    seq = json.loads((folder / "environment.json").read_text())["problem"]["seq"]
    res = list(csv.DictReader((folder / "resources.csv").open()))
    ncu = list(csv.DictReader((folder / "ncu.csv").open()))
    out = []
    for version in dict.fromkeys(r["version"] for r in res):
        mine_res = [r for r in res if r["version"] == version]
        mine_ncu = [r for r in ncu if r["version"] == version]
        for r, n in zip(mine_res, mine_ncu, strict=True):  # one ncu row per launch, in order
            barrier_steps = int(r["grid"]) * int(r["barriers_per_block"] or 0) / SMS
            terms = {"barrier_us": barrier_steps * BAR_NS * 1e-3,
                     "dram_us": (float(n["dram_read"]) + float(n["dram_write"])) / HBM_BPS * 1e6,
                     "flop_us": 2 * float(n["ffma_thread_ops"]) / FP32_FLOPS * 1e6}
            measured = float(n["duration"]) * 1e-3
            model = sum(terms.values())
            out.append(dict(seq=seq, version=version, kernel=r["kernel"], grid=int(r["grid"]),
                            measured_us=measured, model_us=model, **terms,
                            issue_us=float(n["warp_instructions"]) / ISSUE_PER_S * 1e6,
                            model_over_measured=model / measured,
                            barrier_stall_pct=float(n["barrier_stall_pct"]),
                            shared_wait_stall_pct=float(n["shared_wait_stall_pct"]),
                            occupancy_pct=float(n["achieved_occupancy_pct"]),
                            bank_conflicts=float(n["shared_bank_conflicts"] or 0)))
    return out


def main(out_dir: str, folders: list[str]) -> None:
    rows = sorted((r for f in folders for r in rows_of(Path(f))),
                  key=lambda r: (r["seq"], r["version"]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "time-model.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| S | version | kernel | ncu µs | model µs (barrier + DRAM + FLOP) | model / ncu "
          "| issue-bound µs | barrier stall % | smem-wait stall % | occupancy % |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq']} | {r['version']} | {r['kernel']} | {r['measured_us']:.1f} | "
              f"{r['model_us']:.1f} ({r['barrier_us']:.1f} + {r['dram_us']:.1f} + "
              f"{r['flop_us']:.1f}) | {r['model_over_measured']:.2f} | {r['issue_us']:.1f} | "
              f"{r['barrier_stall_pct']:.1f} | {r['shared_wait_stall_pct']:.1f} | "
              f"{r['occupancy_pct']:.1f} |")
    sources = ", ".join(Path(f).name for f in folders)
    text = "\n".join([f"Time model against ncu, from {sources}.", "", *lines, ""])
    (out / "time-model.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
