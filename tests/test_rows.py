"""The Triton row route (t0, t1) against the float64 reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedattn.reference import attention_ref
from fusedattn_lab.rows import rows_attention
from fusedattn_lab.verify import check, poison

SHAPES = [
    (1, 1),    # one key: the first tile holds one valid key, the rest masked
    (7, 13),   # S < BLOCK_K and D not a power of two (BLOCK_D=16 masks 3 lanes)
    (33, 31),  # S not a multiple of BLOCK_K: the last tile is mostly masked
    (65, 33),  # D just past a power of two: BLOCK_D=64 masks 31 lanes
]


def _run(q, k, v, block_k, protocol=None):
    from fusedattn.problem import Problem
    from fusedattn_lab.protocol import peer_error

    out = poison(torch.empty_like(q))
    rows_attention(q, k, v, block_k=block_k, out=out)
    ref = attention_ref(q, k, v)
    peer = peer_error(q, k, v, Problem(*q.shape, 32), ref, protocol)
    return check(out, ref, protocol=protocol, peer_error=peer)


@pytest.mark.parametrize("block_k", [16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_boundary_shapes(qkv, shape, block_k):
    result = _run(*qkv(*shape), block_k)
    assert result.ok, result.reasons


def test_s33_with_block_k16_three_iterations_last_masked(qkv):
    # ceil(33/16) = 3 tiles; the third holds key 32 and 15 masked keys. A mask that filled
    # 0 instead of -inf would add 15 * exp(0 - m) to l_i: the check would fail.
    result = _run(*qkv(33, 4), 16)
    assert result.ok, result.reasons


@pytest.mark.parametrize("inputs", ["normal", "stress"])
def test_rows_other_protocols(qkv, inputs):
    # stress: scores in the hundreds; without the running max exp() overflows to inf.
    result = _run(*qkv(20, 8, inputs=inputs), 16, inputs)
    assert result.ok, result.reasons


def test_block_k_is_a_parameter_for_sweeps(qkv):
    result = _run(*qkv(70, 8), 64)
    assert result.ok, result.reasons


@settings(max_examples=15, deadline=None)
@given(seq=st.integers(1, 40), dim=st.integers(1, 40), block_k=st.sampled_from([16, 32]),
       seed=st.integers(0, 2**16))
def test_rows_random_shapes(seq, dim, block_k, seed):
    from fusedattn.mode import DEVICE
    from fusedattn.problem import Problem
    from fusedattn_lab.inputs import make_inputs

    q, k, v = make_inputs(Problem(seq, dim, 32), "normal", seed, DEVICE)
    result = _run(q, k, v, block_k)
    assert result.ok, (seq, dim, block_k, result.reasons)
