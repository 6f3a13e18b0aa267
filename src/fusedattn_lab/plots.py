"""Figures, drawn only from a run's summary.csv (never from memory of the run).

- `bars.{png,svg}`: the chapter's bar chart, one bar per version at the main shape, the
  median of per-process medians with the process range as an error bar;
- `sweep.{png,svg}`: for a `--seq` sweep, GPU time and peak memory against S, log axes,
  with the chapter's intermediate-capacity model beside the measured peaks.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no screen needed
import matplotlib.pyplot as plt  # noqa: E402

from fusedattn_lab.evidence import caption  # noqa: E402
from fusedattn_lab.records import read_summary  # noqa: E402
from fusedattn_lab.registry import bench_subject  # noqa: E402


def _caption(rows: list[dict]) -> str:
    r = rows[0]
    return (f"{caption(r)} · inputs {r['inputs']} seed {r['seed']} · "
            f"{r['timing_mode']} timing, warmup {r['warmup']}, repeat {r['repeat']}")


def _save(fig, out_dir: Path, stem: str) -> list[Path]:
    paths = [out_dir / f"{stem}.{ext}" for ext in ("png", "svg")]
    for p in paths:
        fig.savefig(p, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return paths


def draw(summary: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw every figure the summary supports; returns the files written. A run over several
    input protocols is drawn for its first (the others stay in summary.csv)."""
    rows = read_summary(summary)
    rows = [r for r in rows if r["inputs"] == rows[0]["inputs"]] if rows else rows
    out_dir = out_dir or summary.parent
    timed = [r for r in rows if r["suite"] == "main" and r["metric"] == "gpu_ms"]
    if not timed:
        return []  # emulation: nothing was timed, so there is nothing to draw
    written = []
    seqs = sorted({int(r["seq"]) for r in timed})
    main_seq = 128 if 128 in seqs else seqs[0]
    bars = [r for r in timed if int(r["seq"]) == main_seq]
    fig, ax = plt.subplots(figsize=(7, 4))
    med = [float(r["median"]) for r in bars]
    err = [[m - float(r["range_low"]) for m, r in zip(med, bars, strict=True)],
           [float(r["range_high"]) - m for m, r in zip(med, bars, strict=True)]]
    ax.bar([r["version"] for r in bars], med, yerr=err, capsize=4,
           color=["C0" if r["route"] == "simt" else "C1" if r["route"] == "tiles" else "C7"
                  for r in bars])
    for i, m in enumerate(med):
        ax.annotate(f"{m:.4f}", (i, m), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel("GPU ms (median of per-process medians)")
    ax.set_title(f"attention forward, S={main_seq}, D={bars[0]['dim']}, float32 — "
                 f"{bars[0]['processes']} processes, bar = process range")
    fig.text(0.01, -0.04, _caption(bars), fontsize=6)
    written += _save(fig, out_dir, "bars")

    if len(seqs) > 1:
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        peaks = [r for r in rows if r["suite"] == "main" and r["metric"] == "peak_bytes"]
        model = [r for r in rows if r["suite"] == "main" and r["metric"] == "capacity_model_bytes"
                 and float(r["median"]) > 0]
        for name in dict.fromkeys(r["version"] for r in timed):
            mine = sorted((int(r["seq"]), float(r["median"])) for r in timed
                          if r["version"] == name)
            ax_t.plot(*zip(*mine, strict=True), marker="o", label=name)
            mem = sorted((int(r["seq"]), float(r["median"]) / 2**20) for r in peaks
                         if r["version"] == name)
            if mem:
                ax_m.plot(*zip(*mem, strict=True), marker="o", label=name)
        if model:
            first = model[0]["version"]
            cap = sorted((int(r["seq"]), float(r["median"]) / 2**20) for r in model
                         if r["version"] == first)
            ax_m.plot(*zip(*cap, strict=True), "k--", label="model 2·S²·4 B (Scores+P)")
        for ax, label in ((ax_t, "GPU ms"), (ax_m, "peak device memory of one call, MiB")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("S (sequence length)")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
        ax_m.legend(fontsize=7)
        fig.text(0.01, -0.04, _caption(timed), fontsize=6)
        written += _save(fig, out_dir, "sweep")
    return written


def draw_sweep(sweep_csv: Path) -> list[Path]:
    """Exercise 4: GPU time against BLOCK_K, with the loop count on each point."""
    import csv

    with open(sweep_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["median_ms"]]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["version"].split("[")[0] for r in rows):
        mine = [r for r in rows if r["version"].split("[")[0] == name]
        bk = [int(r["block_k"]) for r in mine]
        med = [float(r["median_ms"]) for r in mine]
        err = [[m - float(r["min_ms"]) for m, r in zip(med, mine, strict=True)],
               [float(r["max_ms"]) - m for m, r in zip(med, mine, strict=True)]]
        ax.errorbar(bk, med, yerr=err, marker="o", capsize=3, label=name)
        for x, y, r in zip(bk, med, mine, strict=True):
            ax.annotate(f"{r['iterations']} iters, {r['regs_per_thread']} regs", (x, y),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("BLOCK_K (keys per iteration)")
    ax.set_ylabel("GPU ms (median, bar = min–max)")
    r = rows[0]
    ax.set_title(f"row kernel BLOCK_K sweep, S={r['seq']}, D={r['dim']}")
    ax.legend(fontsize=7)
    fig.text(0.01, -0.04, f"{caption(r)} · warmup {r['warmup']}, repeat {r['repeat']}",
             fontsize=6)
    return _save(fig, sweep_csv.parent, "sweep_block_k")


def _bench_mode(r: dict) -> str:
    """A bench row's timed pass; CSVs written before the `mode` column were forward only,
    except the training suites' first runs, whose labels start with it."""
    return r.get("mode") or (r["problem"].split()[0] if r["problem"].startswith(
        ("bwd ", "fwd+bwd ")) else "fwd")


def draw_bench(bench_csv: Path) -> list[Path]:
    """TFLOP/s against S, one line per provider, one panel per (pass, dtype, D, causal);
    where every panel has one S, one group of bars per problem instead."""
    import csv

    with open(bench_csv, newline="") as f:
        # one line per provider; the one-config tuning rows (flash@...) stay in the CSV
        rows = [r for r in csv.DictReader(f) if r["tflops"] and "@" not in r["provider"]]
    if not rows:
        return []

    def key(r):
        return (_bench_mode(r), r["dtype"], r["precision"], int(r["dim"]), r["causal"])

    subject = bench_subject()
    panels = sorted({key(r) for r in rows})
    if not any(len({r["seq"] for r in rows if key(r) == k}) > 1 for k in panels):
        return _draw_bench_bars(rows, bench_csv)
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, k in zip(axes.flat, panels, strict=False):
        mine = [r for r in rows if key(r) == k]
        for name in dict.fromkeys(r["provider"] for r in mine):
            pts = sorted((int(r["seq"]), float(r["tflops"])) for r in mine
                         if r["provider"] == name)
            ax.plot(*zip(*pts, strict=True), marker="o", label=name,
                    linewidth=2.5 if name == subject else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{'' if k[0] == 'fwd' else k[0] + ' '}{k[1]}{' ' + k[2] if k[2] else ''}"
                     f" D={k[3]}{' causal' if k[4] == 'True' else ''}", fontsize=9)
        ax.set_xlabel("S")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    r = rows[0]
    fig.text(0.01, -0.02, f"B={r['batch']} H={r['heads']}; {BENCH_FLOPS}", fontsize=7)
    fig.tight_layout()
    return _save(fig, bench_csv.parent, "bench_tflops")


BENCH_FLOPS = ("TFLOP/s = 4·B·H·S²·D / time (half when causal; the backward 2.5×, forward + "
               "backward 3.5×); primed CUDA events, median")


def _draw_bench_bars(rows: list[dict], bench_csv: Path) -> list[Path]:
    """One group of bars per problem (its label), one bar per provider."""
    import numpy as np

    subject = bench_subject()
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    names = list(dict.fromkeys(r["provider"] for r in rows))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(problems)), 4.2))
    x = np.arange(len(problems))
    for i, name in enumerate(names):
        vals = [next((float(r["tflops"]) for r in rows
                      if r["problem"] == p and r["provider"] == name), 0.0) for p in problems]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, vals, width, label=name,
               edgecolor="black" if name == subject else None)
    ax.set_xticks(x)
    ax.set_xticklabels(problems, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.text(0.01, -0.02, BENCH_FLOPS, fontsize=7)
    fig.tight_layout()
    return _save(fig, bench_csv.parent, "bench_tflops")
