"""A version registered from this test module, and nowhere else, is picked up by `list`,
`run`, `profile` and `check-races`' kernel mapping with no other edit: the registry is the
only list of version and kernel names."""

import pytest
import torch

from fusedattn.problem import Problem
from fusedattn_lab import registry
from fusedattn_lab.cli import main
from fusedattn_lab.profile import (
    SanitizerReport,
    kernel_verdicts,
    resource_rows,
    sanitizer_kernels,
)

TOY = "toy-ref"


def _prepare_toy(q, k, v, problem: Problem) -> registry.Prepared:
    """The plain formula in torch (float32): exact enough for the chapter's bound."""
    out = torch.empty_like(q)

    def call():
        p = torch.softmax(q @ k.T * problem.scale, dim=-1)
        out.copy_(p @ v)

    return registry.Prepared(call, out, {"out": out}, lambda: [])


@pytest.fixture
def toy(monkeypatch):
    version = registry.Version(
        TOY, "tiles", "a toy declared in a test module",
        (registry.Kernel("toy_kernel", ("Q", "K", "V"), ("O",), lambda p: 2,
                         "two per block, by declaration", "_toy_kernel"),),
        __name__, _prepare_toy)
    monkeypatch.setitem(registry.VERSIONS, TOY, version)
    return version


def test_list_run_and_profile_pick_up_a_version_declared_here(toy, capsys, tmp_path):
    assert main(["list"]) == 0
    assert TOY in capsys.readouterr().out
    assert main(["run", "--version", TOY, "--seq", "6", "--dim", "4", "--block", "32"]) == 0
    out = capsys.readouterr().out
    assert TOY in out and "PASS" in out
    assert main(["profile", "--version", TOY, "--seq", "6", "--dim", "4", "--block", "32",
                 "--out", str(tmp_path)]) == 0
    (row,) = resource_rows(TOY, Problem(6, 4, 32))
    assert row["kernel"] == "toy_kernel" and row["barriers_per_block"] == 2
    assert TOY in [v.name for v in registry.select("all")]


def test_check_races_maps_and_judges_its_kernel(toy):
    assert sanitizer_kernels([TOY, "t0"]) == {"_toy_kernel": [TOY],
                                              "_rows_fwd_kernel": ["t0"]}
    report = SanitizerReport("synccheck", errors=1, hazards=0,
                             kernels={"_toy_kernel": 1}, other=0)
    assert kernel_verdicts({"_toy_kernel": toy.route}, report) == {"_toy_kernel": "FOUND"}
