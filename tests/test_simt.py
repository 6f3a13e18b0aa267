"""Thread-level kernels (numba.cuda) against the float64 reference.

In emulation numba's simulator runs every CUDA thread as an OS thread, so shapes stay tiny
and blocks 32-64 threads.
"""

import pytest
import torch

from fusedattn.lab.verify import check, poison
from fusedattn.reference import attention_ref
from fusedattn.simt import materialized, online

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
    # 33 keys per row with 32 threads: the longest online scan of the suite (~20 s in the
    # simulator: 33 rows x 33 keys x 8 barriers).
    q, k, v = qkv(33, 4)
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
    from fusedattn.lab.registry import VERSIONS
    from fusedattn.problem import Problem

    p = Problem(128, 64, 256)
    (online_rows,) = VERSIONS["online"].launches
    # 1 init + per key: 1 after partials, log2(256)=8 tree levels, 1 publish, 1 before reuse
    assert online_rows.barriers(p) == 1 + 128 * 11
    scores, softmax, pv = VERSIONS["materialized"].launches
    assert (scores.barriers(p), softmax.barriers(p), pv.barriers(p)) == (0, 19, 0)
    assert softmax.barriers(Problem(128, 64, 32)) == 3 + 2 * 5


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape, block, causal", [
    ((1, 1), 32, False),    # one key in a 32-key tile: 31 masked slots
    ((7, 13), 32, True),    # causal, S < TILE, D odd
    ((33, 5), 32, False),   # S = TILE + 1: a second tile with one key
    ((40, 16), 64, True),   # two warps, causal rows spanning two tiles
    ((6, 3), 32, False),    # rows=4: the last block holds 2 rows
])
def test_online_tiled_shapes(qkv, rows, shape, block, causal):
    from fusedattn.simt import online_tiled

    q, k, v = qkv(*shape)
    bufs = online_tiled.allocate(q)
    poison(bufs["out"])
    online_tiled.online_tiled_attention(q, k, v, bufs, block=block, rows=rows, causal=causal)
    result = check(bufs["out"], attention_ref(q, k, v, causal=causal))
    assert result.ok, result.reasons


def test_online_tiled_barriers_shared_memory_and_registry():
    from fusedattn.lab.registry import VERSIONS, planted_symbol, planted_versions
    from fusedattn.problem import Problem
    from fusedattn.simt import online_tiled, tiled_plan

    p = Problem(128, 64, 256)
    (kernel,) = VERSIONS["online-tiled"].launches
    # 1 init + 4 per tile (load, scores, statistics, accumulate): 17 against online's 1409
    assert kernel.barriers(p) == 1 + 4 * 4
    assert VERSIONS["online"].launches[0].barriers(p) == 1409
    assert tiled_plan.shared_bytes(4, 256) > tiled_plan.SHARED_LIMIT  # refused
    assert VERSIONS["online-tiled-4"].limits.max_dim < VERSIONS["online-tiled"].limits.max_dim
    assert {"materialized", "online-tiled", "online-tiled-4"} <= set(planted_versions())
    assert planted_symbol("online-tiled") == "_online_tiled_kernel"
    assert planted_symbol("materialized") == "_softmax_rows_kernel"
    q = torch.zeros(4, 256)
    with pytest.raises(ValueError, match="shared memory"):
        online_tiled.online_tiled_attention(q, q, q, online_tiled.allocate(q), block=32, rows=4)
