"""Profiling: parsers of recorded H200 outputs, verdicts, resource rows, missing tools."""

import gzip
from pathlib import Path

import pytest

from fusedattn.problem import Problem, ProblemError
from fusedattn_lab import profile
from fusedattn_lab.profile import (
    SanitizerReport,
    kernel_verdicts,
    occupancy,
    parse_ncu_csv,
    parse_sanitizer,
    resource_rows,
)

FIX = Path(__file__).parent / "fixtures"
OURS = ["_scores_kernel", "_softmax_rows_kernel", "_pv_kernel", "_online_rows_kernel",
        "_rows_fwd_kernel"]
ROUTES = {"_scores_kernel": "simt", "_softmax_rows_kernel": "simt", "_pv_kernel": "simt",
          "_online_rows_kernel": "simt", "_rows_fwd_kernel": "tiles", "other": "peer"}


def test_ncu_raw_csv_gives_one_row_per_kernel_with_the_metric_set():
    (row,) = parse_ncu_csv((FIX / "ncu_t0_raw.txt").read_text())
    assert row["kernel"] == "_rows_fwd_kernel"
    assert row["duration"] > 0 and row["duration_unit"] in ("ns", "us", "usecond", "nsecond")
    assert row["dram_read"] > 0 and row["dram_read_unit"]
    for key in ("dram_write", "achieved_occupancy_pct", "sm_throughput_pct",
                "barrier_stall_pct"):
        assert row[key] is not None


def test_ncu_three_kernels_of_materialized_in_launch_order():
    rows = parse_ncu_csv((FIX / "ncu_materialized_raw.txt").read_text())
    names = [r["kernel"] for r in rows]
    assert len(rows) == 3
    assert "_scores_kernel" in names[0] and "_softmax_rows_kernel" in names[1]
    assert "_pv_kernel" in names[2]
    # the row softmax waits at its barriers; the two elementwise kernels have none
    assert rows[1]["barrier_stall_pct"] > 5 and rows[0]["barrier_stall_pct"] == 0


def test_ncu_parser_ignores_noise_and_empty_output():
    assert parse_ncu_csv("==PROF== nothing profiled\n") == []


def test_planted_race_is_attributed_to_the_row_softmax():
    rep = parse_sanitizer("racecheck", (FIX / "racecheck_planted.txt").read_text(), OURS)
    assert rep.hazards == 1 and rep.kernels["_softmax_rows_kernel"] == 1
    assert sum(rep.kernels.values()) == 1 and rep.other == 0
    caught = kernel_verdicts(ROUTES, rep, planted="materialized")
    assert caught == {"_softmax_rows_kernel": "caught"}


def test_clean_racecheck_and_synccheck():
    rep = parse_sanitizer("racecheck", (FIX / "racecheck_clean.txt").read_text(), OURS)
    assert rep.hazards == 0
    v = kernel_verdicts(ROUTES, rep)
    assert v["_online_rows_kernel"] == "clean"
    assert v["_rows_fwd_kernel"] == "advisory: clean"  # Triton racecheck does not gate
    missed = kernel_verdicts(ROUTES, rep, planted="materialized")
    assert missed == {"_softmax_rows_kernel": "MISSED"}
    rep = parse_sanitizer("synccheck", (FIX / "synccheck_clean.txt").read_text(), OURS)
    assert rep.errors == 0 and set(kernel_verdicts(ROUTES, rep).values()) >= {"clean"}


def test_host_api_errors_are_not_kernel_findings():
    text = gzip.decompress((FIX / "memcheck_api_errors.txt.gz").read_bytes()).decode()
    rep = parse_sanitizer("memcheck", text, OURS)
    assert rep.api_errors == 34 and rep.errors == 0
    assert set(kernel_verdicts(ROUTES, rep).values()) == {"clean"}


def test_a_kernel_finding_fails_its_kernel_only():
    text = ("========= Invalid __global__ read of size 4 bytes\n"
            "=========     at _pv_kernel+0x10 in materialized.py:99\n"
            "========= ERROR SUMMARY: 1 error\n")
    rep = parse_sanitizer("memcheck", text, OURS)
    v = kernel_verdicts(ROUTES, rep)
    assert v["_pv_kernel"] == "FOUND" and v["_scores_kernel"] == "clean"


def test_unattributable_errors_count_against_every_kernel():
    rep = SanitizerReport("memcheck", 3, None, {k: 0 for k in OURS}, 0)
    assert set(kernel_verdicts(ROUTES, rep).values()) == {"FOUND"}


def test_occupancy_estimate():
    h200 = {"threads_per_sm": 2048, "regs_per_sm": 65536, "shared_per_sm": 233472,
            "blocks_per_sm": 32, "sms": 132}
    assert occupancy(256, 30, 0, h200) == 1.0          # 8 blocks of 256 threads
    assert occupancy(256, 46, 2064, h200) == 0.625     # registers: 5 blocks (48 regs/thread)
    assert occupancy(128, 96, 1024, h200) == 0.3125    # 96 regs: 5 blocks of 4 warps
    assert occupancy(256, None, 0, h200) is None


def test_resource_rows_name_buffers_and_barriers():
    rows = resource_rows("materialized", Problem(9, 5, 32))
    assert [r["kernel"] for r in rows] == ["scores", "softmax_rows", "pv"]
    assert [(r["reads"], r["writes"]) for r in rows] == [
        ("Q+K", "Scores"), ("Scores", "P"), ("P+V", "O")]
    assert rows[1]["barriers_per_block"] == 3 + 2 * 5
    assert rows[1]["dynamic_shared_bytes"] == 32 * 4 and rows[1]["grid"] == 9
    (online,) = resource_rows("online", Problem(9, 5, 32))
    assert online["barriers_per_block"] == 1 + 9 * (3 + 5)


def test_missing_tools_give_clear_errors(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ProblemError, match="ncu=.*not found on PATH"):
        profile.run_ncu("t0", Problem(4, 4, 32))
    with pytest.raises(ProblemError, match="compute-sanitizer=.*not found"):
        profile.run_sanitizer("racecheck", ["online"], Problem(4, 4, 32))


@pytest.mark.emulation_only("what profile prints without a GPU")
def test_cli_profile_in_emulation_says_what_needs_a_gpu(tmp_path, capsys):
    from fusedattn_lab.cli import main
    assert main(["profile", "--version", "online,t0", "--seq", "4", "--dim", "3",
                 "--block", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "need a GPU" in out and "Q+K+V → O" in out
    (folder,) = (tmp_path / "emulation").iterdir()
    assert (folder / "resources.csv").read_text().count("\n") == 3
    assert main(["profile", "--ncu", "--out", str(tmp_path)]) == 2
    assert main(["check-races", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["fusedattn: error: ncu='emulation' is not allowed: a CUDA GPU: Nsight "
                   "Compute reads hardware counters of real kernels",
                   "fusedattn: error: check-races='emulation' is not allowed: a CUDA GPU: "
                   "compute-sanitizer checks real kernels"]
