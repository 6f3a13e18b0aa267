"""run-all and its records: summary arithmetic, CSV schema, atomic writing, resume."""

import csv
import io
import json
import os
from dataclasses import fields

import pytest

from fusedattn_lab import records as run_records
from fusedattn_lab import runall
from fusedattn_lab.evidence import write_atomic
from fusedattn_lab.records import SummaryRow, summarize, summary_csv
from fusedattn_lab.runall import Plan, execute

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
    from fusedattn_lab.registry import VERSIONS

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


def _boundary_records(unit):
    """What a worker writes for a boundary unit that passed (the record shape of
    `fusedattn_lab.worker` in emulation), without starting a process."""
    check = {"ok": True, "max_abs": 0.0, "where": [0, 0], "max_rel": 0.0, "n_nan": 0,
             "n_inf": 0, "n_unwritten": 0, "tolerance": 2e-4, "reasons": []}
    return [{"unit": unit["unit"], "kind": unit["kind"], "suite": "boundary", "process": 0,
             "seq": unit["seq"], "dim": unit["dim"], "block": unit["block"], "causal": False,
             "version": v, "route": "tiles", "settings": unit["settings"], "before": check,
             "after": None, "timing": None, "resources": [], "verdict": "PASS"}
            for v in unit["versions"]]


def test_interrupted_run_resumes_without_redoing_units(tmp_path, monkeypatch):
    # the resume logic alone: units "run" without worker processes (real workers are
    # test_cli's; an emulated worker on the H200 hit Triton 3.6's interpreter there)
    monkeypatch.setattr(runall.mode, "EMULATION", True)  # the boundary units only
    plan = Plan(("t0", "t1"), (128,), 64, 32, 1, SETTINGS, boundary=((1, 1), (3, 2), (4, 5)))
    calls = []

    def interrupted(unit):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is killed during its third unit
        calls.append(unit["unit"])
        return _boundary_records(unit)

    monkeypatch.setattr(runall, "run_unit_process", interrupted)
    with pytest.raises(KeyboardInterrupt):
        execute(plan, tmp_path, _Console(), _NoProgress)
    on_disk = run_records.read_records(tmp_path / "records.jsonl")
    assert {r["unit"] for r in on_disk} == {"boundary-1x1", "boundary-3x2"}
    assert not (tmp_path / "summary.csv").exists()

    calls.clear()
    monkeypatch.setattr(runall, "run_unit_process",
                        lambda u: calls.append(u["unit"]) or _boundary_records(u))
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
    from fusedattn_lab.cli import main
    rc = main(["run-all", "--version", "t0,online", "--boundary", "1x1,3x5",
               "--out", str(tmp_path)])
    assert rc == 0
    (run_dir,) = (tmp_path / "emulation").iterdir()
    dirty = json.loads((run_dir / "environment.json").read_text())["git_dirty"]
    assert {p.name for p in run_dir.iterdir()} == {
        "plan.json", "environment.json", "records.jsonl", "summary.csv",
        *(["uncommitted.diff"] if dirty else [])}
    rows = run_records.read_summary(run_dir / "summary.csv")
    assert {(r["version"], r["seq"], r["verdict"]) for r in rows} == {
        ("t0", "1", "PASS"), ("t0", "3", "PASS"), ("online", "1", "PASS"),
        ("online", "3", "PASS")}
    assert "no times" in capsys.readouterr().out


def test_sender_named_commit_wins_over_the_copys_git(monkeypatch):
    from fusedattn_lab.evidence import environment

    monkeypatch.setenv("FUSEDATTN_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("FUSEDATTN_GIT_DIRTY", "0")
    env = environment()
    assert env["git_commit"] == "0123abc" and env["git_dirty"] is False
    monkeypatch.delenv("FUSEDATTN_GIT_COMMIT")
    assert environment()["git_commit"] != "0123abc"  # this checkout's own git, or None


def _boundary_plan():
    return Plan(("t0", "t1"), (128,), 64, 32, 1, SETTINGS, boundary=((1, 1), (3, 2)))


def _fake_unit(unit, error=None):
    """A worker's records for `unit`, made up: one per version, passing (or an error)."""
    check = {"max_abs": 1e-8, "ok": True, "reasons": []}
    return [{"unit": unit["unit"], "kind": unit["kind"], "suite": unit["suite"],
             "version": v, "seq": unit["seq"], "dim": unit["dim"], "block": unit["block"],
             "process": unit.get("process", 0),
             **({"error": error} if error else {"before": check, "after": None,
                                                 "verdict": "PASS", "timing": None})}
            for v in unit["versions"]]


@pytest.fixture
def boundary_only(monkeypatch):
    """Plans of boundary units only on either side (the GPU adds main/memory units)."""
    monkeypatch.setattr(runall.mode, "EMULATION", True)


@pytest.mark.parametrize("line, why", [
    ("{}", "a record is a JSON object"),
    ("not json", "not JSON"),
    (json.dumps(_fake_unit({"unit": "boundary-9x9", "kind": "timing", "suite": "boundary",
                            "versions": ["t0"], "seq": 9, "dim": 9, "block": 32})[0]),
     "unit 'boundary-9x9' is not in this run's plan"),
    (json.dumps({**_fake_unit({"unit": "boundary-1x1", "kind": "timing", "suite": "boundary",
                               "versions": ["t0"], "seq": 1, "dim": 1, "block": 32})[0],
                 "version": "nope"}), "version 'nope' is not in unit"),
])
def test_bad_records_are_errors_naming_their_line(tmp_path, line, why, boundary_only):
    plan = _boundary_plan()
    good = _fake_unit(plan.units()[0])
    (tmp_path / "records.jsonl").write_text(json.dumps(good[0]) + "\n" + line + "\n")
    with pytest.raises(run_records.RecordError, match=f"line 2: {why}"):
        run_records.read_records(tmp_path / "records.jsonl", plan)


def test_a_duplicated_record_is_not_another_process(tmp_path, boundary_only):
    plan = _boundary_plan()
    rec = json.dumps(_fake_unit(plan.units()[0])[0])
    (tmp_path / "records.jsonl").write_text(rec + "\n" + rec + "\n")
    with pytest.raises(run_records.RecordError, match="line 2: repeats line 1"):
        run_records.read_records(tmp_path / "records.jsonl", plan)


def test_resume_keeps_failed_attempts_marked_superseded(tmp_path, monkeypatch, boundary_only):
    plan = _boundary_plan()
    attempts = []

    def flaky(unit):  # the second unit fails the first time it runs
        attempts.append(unit["unit"])
        first_try = attempts.count(unit["unit"]) == 1
        return _fake_unit(unit, "worker exited 1: boom"
                          if unit["unit"] == "boundary-3x2" and first_try else None)

    monkeypatch.setattr(runall, "run_unit_process", flaky)
    execute(plan, tmp_path, _Console(), _NoProgress)
    first = run_records.read_records(tmp_path / "records.jsonl", plan)
    assert (tmp_path / "summary.csv").is_file()
    assert {r["verdict"] for r in run_records.read_summary(tmp_path / "summary.csv")} >= {"ERROR"}
    records, rows = execute(plan, tmp_path, _Console(), _NoProgress)  # --resume
    assert attempts == ["boundary-1x1", "boundary-3x2", "boundary-3x2"]
    on_disk = run_records.read_records(tmp_path / "records.jsonl", plan)
    assert len(on_disk) == len(first) + 2  # the failed attempt is still there
    old = [r for r in on_disk if r.get("superseded")]
    assert len(old) == 2 and all("error" in r for r in old)
    assert all(r.verdict == "PASS" for r in rows)


def test_an_interrupted_resume_leaves_no_stale_summary(tmp_path, monkeypatch, boundary_only):
    plan = _boundary_plan()
    monkeypatch.setattr(runall, "run_unit_process",
                        lambda u: _fake_unit(u, "boom" if u["unit"] == "boundary-3x2" else None))
    execute(plan, tmp_path, _Console(), _NoProgress)
    assert (tmp_path / "summary.csv").is_file()

    def killed(unit):
        raise KeyboardInterrupt

    monkeypatch.setattr(runall, "run_unit_process", killed)
    with pytest.raises(KeyboardInterrupt):
        execute(plan, tmp_path, _Console(), _NoProgress)
    assert not (tmp_path / "summary.csv").exists()  # not the old one, which said ERROR


def test_summary_rows_say_whether_the_run_was_causal():
    rec = _timing_record("t0", 0, 1.0, 2.0)
    causal = Plan(("t0",), (128,), 64, 256, 1, SETTINGS, causal=True)
    rows = summarize([rec], ENV, causal, {"t0": "h"})
    assert rows and all(r.causal for r in rows)
    assert "causal" in summary_csv(rows).splitlines()[0].split(",")


def test_two_input_protocols_in_one_run_are_kept_apart(tmp_path, monkeypatch):
    # the chapter's two drivers (uniform, normal) in one run folder: every unit twice, named
    # by its protocol and drawn with it; the summary keeps a row per protocol
    monkeypatch.setattr(runall.mode, "EMULATION", True)
    plan = Plan(("t0",), (128,), 64, 32, 1, dict(SETTINGS, inputs="uniform,normal"),
                boundary=((1, 1), (3, 2)))
    units = plan.units()
    assert [u["unit"] for u in units] == ["boundary-1x1-uniform", "boundary-3x2-uniform",
                                          "boundary-1x1-normal", "boundary-3x2-normal"]
    assert [u["settings"]["inputs"] for u in units] == ["uniform"] * 2 + ["normal"] * 2

    def fake(unit):  # a worker's records carry the unit's protocol; normal's are worse
        bad = unit["settings"]["inputs"] == "normal"
        return [dict(r, inputs=unit["settings"]["inputs"],
                     before={"max_abs": 2e-7 if bad else 1e-8, "ok": True})
                for r in _boundary_records(unit)]

    monkeypatch.setattr(runall, "run_unit_process", fake)
    _, rows = execute(plan, tmp_path, _Console(), _NoProgress)
    errors = {(r.inputs, r.seq): r.max_abs_error for r in rows if r.metric == "max_abs_error"}
    assert errors == {("uniform", 1): 1e-8, ("uniform", 3): 1e-8, ("normal", 1): 2e-7,
                      ("normal", 3): 2e-7}


def test_run_all_refuses_an_unknown_or_repeated_protocol(tmp_path, capsys):
    from fusedattn_lab.cli import main

    for bad in ("uniform,gauss", "normal,normal"):
        assert main(["run-all", "--version", "t0", "--inputs", bad,
                     "--out", str(tmp_path)]) == 2
        assert "comma-separated subset of uniform" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any folder was made
