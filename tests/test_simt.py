"""Thread-level kernels (numba.cuda) against the float64 reference.

In emulation numba's simulator runs every CUDA thread as an OS thread, so shapes stay tiny
and blocks 32-64 threads.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedattn.mode import DEVICE
from fusedattn.reference import attention_ref
from fusedattn_lab.simt import materialized, online
from fusedattn_lab.verify import check, poison

SHAPES = [
    ((1, 1), 32),   # one key, one component: 31 idle threads in every reduction
    ((7, 13), 32),  # block larger than D; S and D odd
    ((5, 3), 64),   # two warps, D=3: most threads only join the reductions
    ((5, 40), 32),  # block smaller than D: each thread owns d, d+32
]


def _materialized(q, k, v, block):
    bufs = materialized.allocate(q)
    for b in bufs.values():
        poison(b)
    materialized.materialized_attention(q, k, v, bufs, block=block)
    return bufs


def _online(q, k, v, block):
    bufs = online.allocate(q)
    poison(bufs["out"])
    online.online_attention(q, k, v, bufs, block=block)
    return bufs


@pytest.mark.parametrize("shape, block", SHAPES)
@pytest.mark.parametrize("run", [_materialized, _online], ids=["materialized", "online"])
def test_simt_shapes(qkv, run, shape, block):
    q, k, v = qkv(*shape)
    result = check(run(q, k, v, block)["out"], attention_ref(q, k, v))
    assert result.ok, result.reasons


def test_materialized_s33_d4(qkv):
    # S=33 with 32 threads: the row softmax strides over 2 keys in one thread.
    q, k, v = qkv(33, 4)
    bufs = _materialized(q, k, v, 32)
    ref_scores = (q.double() @ k.double().T) * 0.5
    assert torch.allclose(bufs["scores"].double(), ref_scores.to(bufs["scores"].device), atol=1e-6)
    assert torch.allclose(bufs["p"].sum(-1).double().cpu(), torch.ones(33, dtype=torch.float64),
                          atol=1e-6)
    result = check(bufs["out"], attention_ref(q, k, v))
    assert result.ok, result.reasons


def test_online_s33_d4(qkv):
    # 33 keys per row with 32 threads: the longest online scan of the suite. Three query
    # rows (the kernel's grid is q's rows, its scan k's keys): the same scan at 3 x 33
    # keys x 8 barriers in the simulator, not 33 x 33 (31 s on the 2-core CI machine)
    q, k, v = qkv(33, 4)
    q = q[[0, 16, 32]].contiguous()
    result = check(_online(q, k, v, 32)["out"], attention_ref(q, k, v))
    assert result.ok, result.reasons


def test_online_stable_under_large_scores(qkv):
    q, k, v = qkv(6, 8, inputs="stress")
    result = check(_online(q, k, v, 32)["out"], attention_ref(q, k, v))
    assert result.ok, result.reasons


def test_each_version_allocates_only_what_it_uses(qkv):
    q, _, _ = qkv(9, 4)
    assert set(online.allocate(q)) == {"out"}  # no S x S array
    mat = materialized.allocate(q)
    assert mat["scores"].shape == mat["p"].shape == (9, 9)


def test_barrier_counts_in_the_registry_match_the_kernels():
    from fusedattn.problem import Problem
    from fusedattn_lab.registry import VERSIONS

    p = Problem(128, 64, 256)
    (online_rows,) = VERSIONS["online"].launches
    # 1 init + per key: 1 after partials, log2(256)=8 tree levels, 1 publish, 1 before reuse
    assert online_rows.barriers(p) == 1 + 128 * 11
    scores, softmax, pv = VERSIONS["materialized"].launches
    assert (scores.barriers(p), softmax.barriers(p), pv.barriers(p)) == (0, 19, 0)
    assert softmax.barriers(Problem(128, 64, 32)) == 3 + 2 * 5


@pytest.mark.parametrize("shape, block, rows, causal", [
    ((1, 1), 32, 1, False),     # one key: every other split of the 32 sees none (weight 0)
    ((7, 13), 64, 2, True),     # causal, S < tile, D odd, 32 splits of which most see none
    ((33, 5), 64, 32, False),   # rows = 32: a warp of rows sharing each split's keys
    ((70, 16), 128, 8, True),   # causal rows spanning tiles, 4 splits per warp (padding)
    ((40, 3), 64, 64, True),    # one split: no merge; the last block holds 40 - 0 rows
    ((65, 33), 64, 4, False),   # S = 64 + 1: a second tile with one key; 16-split tree
    ((20, 7), 32, None, True),  # rows from tiled_plan.auto_rows
    ((100, 128), 256, 32, True),  # D=128: merge slots fit 2 at a time (chunked rounds)
])
def test_online_tiled_shapes(qkv, shape, block, rows, causal):
    from fusedattn_lab.simt import online_tiled

    q, k, v = qkv(*shape)
    bufs = online_tiled.allocate(q)
    poison(bufs["out"])
    online_tiled.online_tiled_attention(q, k, v, bufs, block=block, rows=rows, causal=causal)
    result = check(bufs["out"], attention_ref(q, k, v, causal=causal))
    assert result.ok, result.reasons


@pytest.mark.parametrize("rows, causal", [(4, False), (32, True)])
def test_online_tiled_stable_under_large_scores(qkv, rows, causal):
    # stress: scores in the hundreds, over 2 tiles and a merge tree: a running max that
    # stopped moving after the first tile would overflow exp() to inf
    from fusedattn_lab.simt import online_tiled

    q, k, v = qkv(70, 8, inputs="stress")
    bufs = online_tiled.allocate(q)
    poison(bufs["out"])
    online_tiled.online_tiled_attention(q, k, v, bufs, block=64, rows=rows, causal=causal)
    result = check(bufs["out"], attention_ref(q, k, v, causal=causal))
    assert result.ok, result.reasons


def test_online_tiled_plan_barriers_and_registry():
    from fusedattn.problem import Problem, ProblemError
    from fusedattn_lab.registry import VERSIONS, planted_symbol, planted_versions
    from fusedattn_lab.simt import online_tiled
    from fusedattn_lab.simt.tiled_plan import Plan, auto_rows

    # about one block per SM (132 on the H200): the sweep's fastest rows at each S
    assert [auto_rows(s, 256, 64, sms=132) for s in (128, 512, 2048, 8192, 16384)] == [
        4, 4, 16, 64, 128]
    plan = Plan(4, 256, 64)  # 64 splits of 1 key: a 64-key tile, a 6-level merge tree
    assert (plan.splits, plan.keys, plan.tile, plan.slots) == (64, 1, 64, 32)
    assert plan.merge_rounds() == [(32, 0, 32), (16, 0, 16), (8, 0, 8), (4, 0, 4),
                                   (2, 0, 2), (1, 0, 1)]
    p = Problem(128, 64, 256)
    # 2 per tile (2 tiles) + 2 per merge round (6): 16, against online's 1409 per row
    assert VERSIONS["online-tiled-4"].launches[0].barriers(p) == 2 * 2 + 2 * 6
    assert VERSIONS["online"].launches[0].barriers(p) == 1409
    chunked = Plan(32, 256, 128)  # 4 slots would overfill 48 KB: 2 at a time
    assert chunked.slots == 2 and chunked.merge_rounds()[:2] == [(4, 0, 2), (4, 2, 2)]
    assert not Plan(64, 256, 256).fits()
    assert {"materialized", "online-tiled", "online-tiled-4"} <= set(planted_versions())
    assert planted_symbol("online-tiled") == "_online_tiled_kernel"
    assert planted_symbol("materialized") == "_softmax_rows_kernel"
    with pytest.raises(ProblemError, match=r"dim=256 .*1\.\.95 .*online-tiled-4"):
        VERSIONS["online-tiled-4"].limits.check("online-tiled-4", Problem(128, 256, 256))
    q = torch.zeros(4, 256)
    with pytest.raises(ValueError, match="shared memory"):
        online_tiled.online_tiled_attention(q, q, q, online_tiled.allocate(q), block=256,
                                            rows=64)
    with pytest.raises(ValueError, match="power of two"):
        online_tiled.online_tiled_attention(q, q, q, online_tiled.allocate(q), block=256,
                                            rows=3)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seq=st.integers(1, 40), dim=st.integers(1, 9), block=st.sampled_from([32, 64]),
       rows_log2=st.integers(0, 6), causal=st.booleans(), scale=st.sampled_from([0.5, 3.0]))
def test_online_tiled_any_plan_matches_the_reference(seq, dim, block, rows_log2, causal, scale):
    """Any rows per block that divides the block (1 .. block): tiles, pads, merge rounds and
    masks together; at scale 3 the scores spread over tens, so a wrong running max shows."""
    from fusedattn_lab.simt import online_tiled

    rows = min(2 ** rows_log2, block)
    gen = torch.Generator().manual_seed(seq * 1000 + dim)
    q, k, v = (scale * torch.randn(seq, dim, generator=gen).to(DEVICE) for _ in range(3))
    bufs = online_tiled.allocate(q)
    poison(bufs["out"])
    online_tiled.online_tiled_attention(q, k, v, bufs, block=block, rows=rows, causal=causal)
    result = check(bufs["out"], attention_ref(q, k, v, causal=causal))
    assert result.ok, (rows, result.reasons)


@pytest.mark.emulation_only("numba's CUDA simulator")
def test_the_simulators_threads_share_one_shared_array_per_line():
    # numba's simulator makes a shared array on the first thread at its line, and had no
    # lock between looking it up and storing it: threads that looked it up together kept
    # arrays of their own (most likely the online version's one CI failure). Here every
    # store waits for the others (at most 0.2 s), so without the lab's lock all four find
    # none and keep four arrays.
    import threading

    from numba import float32
    from numba.cuda.simulator import kernelapi

    from fusedattn_lab.simt import _launch

    assert kernelapi.FakeCUDAShared.array is _launch._shared_array
    meeting = threading.Barrier(4, timeout=0.2)

    class Stores(dict):
        def __setitem__(self, key, value):
            try:
                meeting.wait()
            except threading.BrokenBarrierError:
                pass
            super().__setitem__(key, value)

    shared = kernelapi.FakeCUDAShared(0)
    shared._allocations = Stores()
    got = []

    def thread():
        got.append(shared.array(4, float32))

    threads = [threading.Thread(target=thread) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(a is got[0] for a in got)
    assert got[0].shape == (4,) and got[0].dtype == "float32"
    assert shared.array(0, float32).size == 0  # dynamic: numba's own buffer
