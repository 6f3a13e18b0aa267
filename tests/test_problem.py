import pytest
import torch

from fusedattn.problem import Problem, ProblemError, check_block, check_tensors
from fusedattn_lab.registry import VERSIONS

CPU = torch.device("cpu")


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("kwargs, field", [
    ({"seq": 0, "dim": 4}, "seq"),
    ({"seq": 4, "dim": 0}, "dim"),
    ({"seq": -3, "dim": 4}, "seq"),
    ({"seq": 4.0, "dim": 4}, "seq"),
    ({"seq": 4, "dim": 4, "block": 48}, "block"),     # not a power of two
    ({"seq": 4, "dim": 4, "block": 16}, "block"),     # below one warp
    ({"seq": 4, "dim": 4, "block": 2048}, "block"),   # above the CUDA limit
    ({"seq": 4, "dim": 4, "block": True}, "block"),
])
def test_bad_problem_names_the_field(kwargs, field):
    with pytest.raises(ProblemError) as info:
        Problem(**kwargs)
    assert info.value.field == field
    assert "not allowed" in str(info.value) and str(info.value.value) in str(info.value)


@pytest.mark.parametrize("block", [32, 64, 128, 256, 512, 1024])
def test_every_allowed_block(block):
    assert check_block(block) == block


@pytest.mark.parametrize("name", ["materialized", "online", "t0", "t1"])
def test_row_versions_keep_the_chapters_dim_limit(name):
    VERSIONS[name].limits.check(name, Problem(3, 256, 32))
    with pytest.raises(ProblemError, match="1..256"):
        VERSIONS[name].limits.check(name, Problem(3, 257, 32))


def test_peer_has_no_dim_limit():
    VERSIONS["torch-eager"].limits.check("torch-eager", Problem(3, 1000, 32))


def test_good_tensors_describe_their_problem():
    p = check_tensors(_t(5, 3), _t(5, 3), _t(5, 3), CPU)
    assert (p.seq, p.dim) == (5, 3)


@pytest.mark.parametrize("q, k, v, field", [
    (_t(5, 3), _t(5, 4), _t(5, 3), "shapes"),
    (_t(5, 3), _t(6, 3), _t(5, 3), "shapes"),
    (_t(5, 3, dtype=torch.float64), _t(5, 3), _t(5, 3), "q.dtype"),
    (_t(5, 3), _t(5, 3, dtype=torch.float16), _t(5, 3), "k.dtype"),
    (_t(5, 3), _t(5, 3), _t(3, 5).T, "v.strides"),      # non-contiguous
    (_t(1, 5, 3), _t(5, 3), _t(5, 3), "q.shape"),
    (_t(5, 3), [[0.0]], _t(5, 3), "k"),
    (_t(0, 3), _t(0, 3), _t(0, 3), "S"),
])
def test_bad_tensors(q, k, v, field):
    with pytest.raises(ProblemError) as info:
        check_tensors(q, k, v, CPU)
    assert info.value.field == field


def test_wrong_device_is_named():
    with pytest.raises(ProblemError) as info:
        check_tensors(_t(2, 2), _t(2, 2), _t(2, 2), torch.device("cuda"))
    assert info.value.field == "q.device" and "cuda" in str(info.value)
