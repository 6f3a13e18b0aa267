import pytest
import torch

from fusedattn.problem import Problem, ProblemError
from fusedattn_lab.inputs import PROTOCOLS, make_inputs


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_inputs_are_deterministic_and_float32(protocol):
    p = Problem(9, 5, 32)
    a = make_inputs(p, protocol, seed=3)
    b = make_inputs(p, protocol, seed=3)
    c = make_inputs(p, protocol, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    assert all(t.shape == (9, 5) and t.dtype == torch.float32 for t in a)
    assert not torch.equal(a[0], a[1])  # q, k, v are distinct draws


def test_uniform_is_in_the_chapters_range():
    q, _, _ = make_inputs(Problem(64, 64, 32), "uniform", 0)
    assert q.min() >= -0.5 and q.max() <= 0.5 and q.std() > 0.2


@pytest.mark.parametrize("protocol, seed", [("gauss", 0), ("uniform", -1), ("normal", 1.5)])
def test_bad_protocol_or_seed(protocol, seed):
    with pytest.raises(ProblemError):
        make_inputs(Problem(2, 2, 32), protocol, seed)
