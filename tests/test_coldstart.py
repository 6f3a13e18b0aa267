"""`fusedattn bench --suite coldstart`: a first call in a fresh process, verified."""

import pytest

from fusedattn.cli import main
from fusedattn.lab.suites import BenchProblem


@pytest.mark.gpu_only("nothing is compiled in emulation")
def test_a_fresh_process_first_call_is_verified_and_timed():
    from fusedattn.lab.coldstart import run_fresh

    row = run_fresh(BenchProblem(1, 2, 100, 64, "bf16", True))
    assert "error" not in row, row
    assert row["verified"] and row["first_call_s"] > row["second_call_s"] > 0


@pytest.mark.emulation_only("on a GPU the suite runs")
def test_coldstart_is_refused_in_emulation(capsys):
    assert main(["bench", "--suite", "coldstart"]) == 2
    assert "in emulation nothing is compiled" in capsys.readouterr().err
