"""Tests run wherever they are started: in emulation on a CPU (CI), on the GPU otherwise.

Importing fusedattn fixes the mode before any kernel module is imported.
"""

import pytest
import torch

import fusedattn  # noqa: F401
from fusedattn.inputs import make_inputs
from fusedattn.mode import DEVICE
from fusedattn.problem import Problem


@pytest.fixture
def qkv():
    """`qkv(S, D, inputs="uniform", seed=0)` -> q, k, v on the mode's device."""

    def make(seq: int, dim: int, inputs: str = "uniform", seed: int = 0):
        return make_inputs(Problem(seq, dim, 32), inputs, seed, DEVICE)

    return make


def assert_passes(out: torch.Tensor, ref: torch.Tensor) -> None:
    from fusedattn.verify import check

    result = check(out, ref)
    assert result.ok, result.reasons
