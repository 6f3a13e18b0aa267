import matplotlib.image as mpimg

from fusedattn_lab.plots import draw
from fusedattn_lab.records import summarize, summary_csv
from fusedattn_lab.runall import Plan

SETTINGS = {"inputs": "uniform", "seed": 0, "warmup": 10, "repeat": 50, "timing": "events"}
ENV = {"gpu": "NVIDIA H200", "driver": "580", "torch": "2.11", "triton": "3.6",
       "date": "2026-11-30T00:00:00+00:00", "git_commit": "abc"}


def _records():
    recs = []
    for seq in (128, 1024):
        for name, ms in (("materialized", 0.03), ("t0", 0.01)):
            for p in range(2):
                check = {"max_abs": 1e-8}
                recs.append({"unit": f"main-{seq}-p{p}", "kind": "timing", "suite": "main",
                             "version": name, "seq": seq, "dim": 64, "block": 256,
                             "before": check, "after": check, "verdict": "PASS",
                             "timing": {"median_ms": ms * seq / 128 * (1 + p / 10),
                                        "host_us_median": 5.0}})
            recs.append({"unit": f"memory-{seq}-{name}", "kind": "memory", "suite": "main",
                         "version": name, "seq": seq, "dim": 64, "block": 256,
                         "peak_bytes": seq * seq * 8 + 100_000})
    return recs


def test_figures_are_drawn_from_the_csv_alone(tmp_path):
    plan = Plan(("materialized", "t0"), (128, 1024), 64, 256, 2, SETTINGS)
    rows = summarize(_records(), ENV, plan, {"materialized": "a", "t0": "b"})
    summary = tmp_path / "summary.csv"
    summary.write_text(summary_csv(rows))
    written = draw(summary)
    assert sorted(p.name for p in written) == ["bars.png", "bars.svg", "sweep.png", "sweep.svg"]
    for p in written:
        assert p.stat().st_size > 1000
        if p.suffix == ".png":
            assert mpimg.imread(p).shape[0] > 100


def test_no_timed_rows_no_figures(tmp_path):
    plan = Plan(("t0",), (128,), 64, 256, 1, SETTINGS)
    recs = [r | {"suite": "boundary", "timing": None} for r in _records()
            if r["kind"] == "timing" and r["version"] == "t0"]
    summary = tmp_path / "summary.csv"
    summary.write_text(summary_csv(summarize(recs, ENV, plan, {"t0": "b"})))
    assert draw(summary) == []


def test_plot_command_draws_a_bench_folder(tmp_path):
    import csv

    from fusedattn_lab.cli import main

    fields = ["problem", "provider", "batch", "heads", "seq", "dim", "dtype", "causal",
              "precision", "mode", "status", "tflops"]
    with open(tmp_path / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for prov, tf in (("flash", 300.0), ("sdpa-flash", 250.0)):
            w.writerow(dict(problem="bwd bf16 B4 H32 S4096 D64", provider=prov, batch=4,
                            heads=32, seq=4096, dim=64, dtype="bf16", causal=False,
                            precision="", mode="bwd", status="ok", tflops=tf))
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "bench_tflops.png").stat().st_size > 1000
    assert main(["plot", str(tmp_path / "nothing")]) == 2
