import json

import pytest

from fusedattn_lab.cli import main
from fusedattn_lab.registry import VERSIONS


@pytest.mark.parametrize("argv, field", [
    (["run", "--seq", "0"], "seq"),
    (["run", "--dim", "-2"], "dim"),
    (["run", "--block", "100"], "block"),
    (["run", "--block", "2048"], "block"),
    (["run", "--version", "t9"], "version"),
    (["run", "--version", ","], "version"),
    (["run", "--dim", "300", "--seq", "2"], "dim"),
    (["run", "--inputs", "gauss", "--seq", "2", "--dim", "2"], "inputs"),
    (["run", "--repeat", "0", "--seq", "2", "--dim", "2"], "repeat"),
    (["run", "--timing", "wall", "--seq", "2", "--dim", "2"], "timing"),
])
def test_bad_input_is_one_line_and_nonzero(capsys, argv, field):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"fusedattn: error: {field}=")


def test_bad_json_target_writes_nothing(tmp_path, capsys):
    assert main(["run", "--seq", "2", "--dim", "2", "--json", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_run_all_versions_writes_records(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main(["run", "--version", "all", "--seq", "5", "--dim", "3", "--block", "32",
               "--inputs", "normal", "--seed", "7", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(path.read_text())
    assert [r["version"] for r in data["records"]] == [n for n, v in VERSIONS.items()
                                                        if v.in_all]
    for r in data["records"]:
        assert r["verdict"] == "PASS" and r["settings"]["inputs"] == "normal"
        assert r["settings"]["seed"] == 7 and r["before"]["max_abs"] < 2e-4
    assert data["environment"]["torch"]
    for name, v in VERSIONS.items():
        assert (name in out) == v.in_all
    if data["environment"]["mode"] == "emulation":
        assert "no times" in out
        assert all(r["timing"] is None for r in data["records"])


@pytest.mark.emulation_only("the small default problem applies to emulation only")
def test_emulation_default_problem_is_announced(capsys):
    assert main(["run", "--version", "t0,t1"]) == 0
    assert "small default 16x8" in capsys.readouterr().out
