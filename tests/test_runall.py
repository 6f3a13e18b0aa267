"""run-all: summary arithmetic, CSV schema, atomic writing, resume."""

import csv
import io
import json
import os
from dataclasses import fields

import pytest

from fusedattn import runall
from fusedattn.evidence import write_atomic
from fusedattn.runall import Plan, SummaryRow, execute, summarize, summary_csv

SETTINGS = {"inputs": "uniform", "seed": 0, "warmup": 10, "repeat": 50, "timing": "events"}
ENV = {"git_commit": "abc", "git_dirty": False, "gpu": "NVIDIA H200", "driver": "580",
       "torch": "2.11", "triton": "3.6", "numba": "0.68", "numba_cuda": "0.30.4",
       "date": "2026-11-30T00:00:00+00:00"}


def _timing_record(version, process, median, host, max_abs=1e-8, verdict="PASS"):
    check = {"max_abs": max_abs, "ok": verdict == "PASS"}
    return {"unit": f"main-128x64-p{process}", "kind": "timing", "suite": "main",
            "process": process, "version": version, "seq": 128, "dim": 64, "block": 256,
            "before": check, "after": check, "verdict": verdict,
            "timing": {"median_ms": median, "host_us_median": host}}


def _plan(**kw):
    return Plan(("t0",), (128,), 64, 256, 3, SETTINGS, **kw)


def _rows(records):
    return {(r.version, r.metric): r for r in summarize(records, ENV, _plan(), {"t0": "h",
                                                                                 "online": "h2"})}


def test_median_of_process_medians_with_their_range():
    recs = [_timing_record("t0", p, m, h) for p, (m, h) in
            enumerate([(0.012, 20.0), (0.010, 30.0), (0.011, 10.0)])]
    recs.append({"unit": "memory-128x64-t0", "kind": "memory", "suite": "main", "version": "t0",
                 "seq": 128, "dim": 64, "block": 256, "peak_bytes": 4096})
    rows = _rows(recs)
    gpu = rows[("t0", "gpu_ms")]
    assert (gpu.median, gpu.range_low, gpu.range_high) == (0.011, 0.010, 0.012)
    assert gpu.processes == 3 and gpu.verdict == "PASS" and gpu.peak_bytes == 4096
    host = rows[("t0", "host_us")]
    assert (host.median, host.range_low, host.range_high) == (20.0, 10.0, 30.0)
    assert rows[("t0", "peak_bytes")].median == 4096
    assert rows[("t0", "capacity_model_bytes")].median == 0  # t0 keeps no S x S array


def test_one_failing_process_fails_the_version_and_keeps_the_worst_error():
    recs = [_timing_record("t0", 0, 0.01, 1.0),
            _timing_record("t0", 1, 0.01, 1.0, max_abs=3e-4, verdict="FAIL")]
    row = _rows(recs)[("t0", "max_abs_error")]
    assert row.verdict == "FAIL" and row.max_abs_error == 3e-4


def test_error_record_gives_error_verdict():
    recs = [_timing_record("t0", 0, 0.01, 1.0),
            {"unit": "main-128x64-p1", "kind": "timing", "suite": "main", "version": "t0",
             "seq": 128, "dim": 64, "block": 256, "error": "boom"}]
    assert _rows(recs)[("t0", "max_abs_error")].verdict == "ERROR"


def test_materialized_models_are_the_chapters():
    from fusedattn.versions import VERSIONS

    models = VERSIONS["materialized"].intermediate_models(128)
    assert models == {"capacity_bytes": 2 * 128 * 128 * 4, "traffic_bytes": 16 * 128 * 128}
    assert 16 * 128 * 128 == 256 * 1024  # the chapter: S=128 -> 256 KiB


def test_csv_schema_is_the_dataclass_long_format():
    rows = summarize([_timing_record("t0", 0, 0.01, 1.0)], ENV, _plan(), {"t0": "h"})
    text = summary_csv(rows)
    reader = csv.DictReader(io.StringIO(text))
    assert reader.fieldnames == [f.name for f in fields(SummaryRow)]
    parsed = list(reader)
    assert {r["metric"] for r in parsed} >= {"gpu_ms", "host_us", "max_abs_error"}
    assert all(r["gpu"] == "NVIDIA H200" and r["git_commit"] == "abc" for r in parsed)
    for required in ("version", "route", "seq", "dim", "block", "inputs", "seed", "warmup",
                     "repeat", "processes", "timing_mode", "median", "range_low", "range_high",
                     "max_abs_error", "verdict", "peak_bytes", "source_sha256", "git_dirty",
                     "driver", "torch", "triton", "numba", "date"):
        assert required in reader.fieldnames


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "summary.csv"
    write_atomic(target, "old\n")

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "new, half written\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.csv"]  # no temp file left


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass


class _Console:
    def print(self, *a, **k):
        pass


def test_interrupted_run_resumes_without_redoing_units(tmp_path, monkeypatch):
    # the resume logic is device-independent: the worker processes run in emulation on
    # either side (on the GPU they would compile and time real kernels per unit; there this
    # test failed after 45 s in the tier of c387465)
    monkeypatch.setenv("FUSEDATTN_EMULATE", "1")
    plan = Plan(("t0", "t1"), (128,), 64, 32, 1, SETTINGS, boundary=((1, 1), (3, 2), (4, 5)))
    calls = []
    real = runall.run_unit_process

    def interrupted(unit):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is killed during its third unit
        calls.append(unit["unit"])
        return real(unit)

    monkeypatch.setattr(runall, "run_unit_process", interrupted)
    with pytest.raises(KeyboardInterrupt):
        execute(plan, tmp_path, _Console(), _NoProgress)
    on_disk = runall.read_records(tmp_path / "records.jsonl")
    assert {r["unit"] for r in on_disk} == {"boundary-1x1", "boundary-3x2"}
    assert not (tmp_path / "summary.csv").exists()

    calls.clear()
    monkeypatch.setattr(runall, "run_unit_process", lambda u: calls.append(u["unit"]) or real(u))
    records, rows = execute(plan, tmp_path, _Console(), _NoProgress)
    assert calls == ["boundary-4x5"]  # only what was missing
    assert len(records) == 3 * 2 and all(r.verdict == "PASS" for r in rows)
    assert (tmp_path / "summary.csv").is_file()


def test_resume_refuses_another_plan(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"versions": ["other"]}))
    with pytest.raises(ValueError, match="another plan"):
        execute(_plan(), tmp_path, _Console(), _NoProgress)


@pytest.mark.emulation_only("the GPU protocol runs on the H200 as evidence, minutes long")
def test_run_all_cli_in_emulation_writes_evidence(tmp_path, capsys):
    from fusedattn.cli import main
    rc = main(["run-all", "--version", "t0,online", "--boundary", "1x1,3x5",
               "--out", str(tmp_path)])
    assert rc == 0
    (run_dir,) = (tmp_path / "emulation").iterdir()
    assert {p.name for p in run_dir.iterdir()} == {"plan.json", "environment.json",
                                                    "records.jsonl", "summary.csv"}
    rows = runall.read_summary(run_dir / "summary.csv")
    assert {(r["version"], r["seq"], r["verdict"]) for r in rows} == {
        ("t0", "1", "PASS"), ("t0", "3", "PASS"), ("online", "1", "PASS"),
        ("online", "3", "PASS")}
    assert "no times" in capsys.readouterr().out


def test_sender_named_commit_wins_over_the_copys_git(monkeypatch):
    from fusedattn.evidence import environment

    monkeypatch.setenv("FUSEDATTN_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("FUSEDATTN_GIT_DIRTY", "0")
    env = environment()
    assert env["git_commit"] == "0123abc" and env["git_dirty"] is False
    monkeypatch.delenv("FUSEDATTN_GIT_COMMIT")
    assert environment()["git_commit"] != "0123abc"  # this checkout's own git, or None
