"""Outputs and arguments, checked before any work: fresh run folders, unwritable paths,
emulation output outside the repository, the diff beside a dirty tree's evidence, sizes
that cannot fit, and bad arguments as one-line errors (each a finding of the reliability
issue, reproduced on the code before it)."""

import json
from pathlib import Path

import pytest

from fusedattn.mode import EMULATION
from fusedattn.problem import ProblemError
from fusedattn_lab import outputs
from fusedattn_lab.cli import main

UNWRITABLE = Path("/proc/fusedattn-test")  # not writable, root included


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_two_runs_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    import datetime as dt
    import types

    from fusedattn_lab import runall

    # the clock held at one second, so the second run cannot fall into the next one
    now = dt.datetime(2026, 12, 3, 6, 29, 8, 999999, tzinfo=dt.UTC)
    frozen = types.SimpleNamespace(UTC=dt.UTC, datetime=types.SimpleNamespace(
        now=lambda tz=None: now))
    monkeypatch.setattr(runall, "_dt", frozen)
    env = {"gpu": "NVIDIA H200", "git_dirty": False}
    first = outputs.new_run_dir(tmp_path, env, "-bench")
    second = outputs.new_run_dir(tmp_path, env, "-bench")  # the same stamp
    assert first.name == "20261203T062908Z-bench"
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name.startswith(first.name) and second.name.endswith("-2")


@pytest.mark.parametrize("argv, field", [
    (["run", "--seq", "4", "--dim", "2", "--json", str(UNWRITABLE / "r.json")], "json"),
    (["run-all", "--boundary", "1x1", "--out", str(UNWRITABLE)], "out"),
    (["sweep", "--seq", "4", "--dim", "2", "--out", str(UNWRITABLE)], "out"),
    (["profile", "--seq", "4", "--dim", "2", "--block", "32", "--out", str(UNWRITABLE)],
     "out"),
    (["walkthrough", "--figure", "/proc/w.svg"], "figure"),
    (["masks", "--figure", "/proc/w.png"], "figure"),
    (["bench", "--suite", "tiny", "--out", str(UNWRITABLE)], "out"),
])
def test_unwritable_outputs_fail_before_the_work(argv, field, capsys, monkeypatch):
    from fusedattn_lab import protocol as bench

    ran = []
    monkeypatch.setattr(bench, "measure", lambda *a, **k: ran.append(a))
    assert main(argv) == 2
    (line,) = _err(capsys)
    assert line.startswith(f"fusedattn: error: {field}=") and "written" in line
    assert not ran


def test_plot_refuses_an_unwritable_or_malformed_folder(tmp_path, capsys):
    (tmp_path / "summary.csv").write_text("version,seq\nt0,not-a-number\n")
    assert main(["plot", str(tmp_path)]) == 2
    (line,) = _err(capsys)
    assert "summary.csv" in line and "reading it failed" in line


@pytest.mark.emulation_only("the default base folder in emulation")
def test_emulation_output_lands_outside_the_repository(capsys):
    base = outputs.default_base(None)
    assert base == outputs.emulation_base()
    # private: made by mkdtemp (a name nobody can guess), a real folder, only ours
    assert base.name.startswith("fusedattn-emulation-") and base.name != "fusedattn-emulation"
    assert base.is_dir() and not base.is_symlink() and base.stat().st_mode & 0o077 == 0
    assert outputs.default_base(Path("mine")) == Path("mine")
    assert main(["profile", "--version", "t0", "--seq", "4", "--dim", "3"]) == 0
    out = capsys.readouterr().out
    written = next(line for line in out.splitlines() if line.startswith("written:"))
    assert str(base) in written.replace("\n", "")


@pytest.mark.gpu_only("the default base folder on a GPU")
def test_gpu_output_defaults_to_evidence():
    assert outputs.default_base(None) == Path("evidence")


def test_a_dirty_tree_keeps_its_diff_beside_the_evidence(tmp_path, monkeypatch):
    monkeypatch.delenv("FUSEDATTN_GIT_COMMIT", raising=False)
    monkeypatch.setattr(outputs, "_git", lambda *a: "diff --git a/x b/x\n+changed\n"
                        if a[0] == "diff" else "")
    folder = outputs.new_run_dir(tmp_path, {"gpu": None, "git_dirty": True})
    assert "+changed" in (folder / "uncommitted.diff").read_text()
    clean = outputs.new_run_dir(tmp_path, {"gpu": None, "git_dirty": False})
    assert not (clean / "uncommitted.diff").exists()
    monkeypatch.setenv("FUSEDATTN_GIT_COMMIT", "abc")  # sent from another machine
    sent = outputs.new_run_dir(tmp_path, {"gpu": None, "git_dirty": True, "git_commit": "abc"})
    assert "not here" in (sent / "uncommitted.txt").read_text()


@pytest.mark.parametrize("argv", [
    ["run-all", "--boundary", "1x2x3"],
    ["run-all", "--boundary", "5"],
    ["run-all", "--boundary", "0x4"],
])
def test_bad_boundary_shapes_are_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "expected SxD" in capsys.readouterr().err


def test_sweep_defaults_to_a_version_with_a_block_k(tmp_path):
    from fusedattn_lab.cli import build_parser  # noqa: F401

    assert build_parser().parse_args(["sweep"]).version is None  # resolved from the registry
    if EMULATION:
        assert main(["sweep", "--block-k", "16", "--seq", "5", "--dim", "2",
                     "--out", str(tmp_path)]) == 0


def test_empty_plans_are_errors(tmp_path, capsys):
    assert main(["sweep", "--block-k", "", "--out", str(tmp_path)]) == 2
    assert "block_k=" in _err(capsys)[0]
    if EMULATION:  # in emulation run-all is the boundary suite alone
        assert main(["run-all", "--boundary", "none", "--out", str(tmp_path)]) == 2
        assert "boundary=" in _err(capsys)[0]
    assert not list(tmp_path.rglob("*.csv"))


def test_sizes_that_cannot_fit_are_refused_with_the_figure(capsys):
    assert main(["run", "--seq", "1000000000", "--dim", "64", "--version", "t0"]) == 2
    (line,) = _err(capsys)
    assert line.startswith("fusedattn: error: seq=1000000000") and "GiB" in line


def test_masks_refuses_an_unreadable_grid(capsys):
    assert main(["masks", "--seq", "100000000", "--block-k", "1"]) == 2
    assert "iterations" in _err(capsys)[0]
    with pytest.raises(ProblemError):
        from fusedattn_lab.walkthrough import key_masks

        key_masks(10, 4096)


@pytest.mark.emulation_only("the simulator's slowness")
def test_emulation_warns_when_a_run_will_take_long(capsys, monkeypatch):
    from fusedattn.problem import Problem
    from fusedattn_lab import protocol as bench
    from fusedattn_lab.registry import VERSIONS

    warned = []
    bench.check_resources(Problem(128, 64, 256), [VERSIONS["online"]], warned.append)
    assert warned and "take long" in warned[0]
    warned.clear()
    bench.check_resources(Problem(16, 8, 32), [VERSIONS["online"]], warned.append)
    assert not warned


def test_json_record_of_a_run_is_checked_before(tmp_path, capsys):
    target = tmp_path / "r.json"
    assert main(["run", "--seq", "4", "--dim", "2", "--block", "32", "--version", "t0",
                 "--json", str(target)]) == 0
    assert json.loads(target.read_text())["records"]
    assert main(["run", "--seq", "4", "--dim", "2", "--json", str(tmp_path)]) == 2
