import pytest

from fusedattn.problem import Problem, ProblemError
from fusedattn_lab.registry import ROUTES, VERSIONS, select


def test_registry_entries_are_complete():
    assert {"materialized", "online", "t0", "t1", "torch-eager"} <= set(VERSIONS)
    for v in VERSIONS.values():
        assert v.route in ROUTES and v.description and v.launches
        assert all(k.reads and k.writes for k in v.launches)
        assert v.source_file().is_file()


def test_select_keeps_order_and_drops_duplicates():
    assert [v.name for v in select("t1, t0,t1")] == ["t1", "t0"]
    assert [v.name for v in select("all")] == [n for n, v in VERSIONS.items() if v.in_all]


def test_select_rejects_unknown():
    with pytest.raises(ProblemError, match="comma-separated"):
        select("t0,nope")


def test_materialized_launches_three_kernels_online_one():
    assert len(VERSIONS["materialized"].launches) == 3
    assert len(VERSIONS["online"].launches) == 1


def test_prepare_checks_limits_before_allocating(qkv):
    q, k, v = qkv(2, 2)
    with pytest.raises(ProblemError):
        VERSIONS["t0"].prepare(q, k, v, Problem(2, 300, 32))


def test_prepare_validates_the_tensors(qkv):
    import torch

    q, k, v = qkv(4, 3)
    with pytest.raises(ProblemError, match="q.dtype"):
        VERSIONS["online"].prepare(q.double(), k, v, Problem(4, 3, 32))
    with pytest.raises(ProblemError, match="as the problem says"):
        VERSIONS["t0"].prepare(q, k, v, Problem(5, 3, 32))
    with pytest.raises(ProblemError, match="strides"):
        t = torch.empty(3, 4, device=q.device).T
        VERSIONS["materialized"].prepare(t, t, t, Problem(4, 3, 32))


def test_list_command_shows_every_version(capsys):
    from fusedattn_lab.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in VERSIONS)
