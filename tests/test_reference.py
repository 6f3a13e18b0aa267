import math

import pytest
import torch

from fusedattn.reference import attention_ref, online_ref, online_trace

# The chapter's hand example (12.1 / 12.3): one query row, scores [2, 1, 4].
SCORES = [2.0, 1.0, 4.0]
VALUES = [[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]]


def test_hand_example_probabilities_and_output():
    p = torch.softmax(torch.tensor(SCORES, dtype=torch.float64), dim=0)
    assert p.tolist() == pytest.approx([0.1142, 0.0420, 0.8438], abs=5e-5)
    out = p @ torch.tensor(VALUES, dtype=torch.float64)
    assert out.tolist() == pytest.approx([2.6456, 0.9278], abs=5e-5)


def test_hand_example_online_steps_match_the_chapter():
    steps = online_trace(SCORES, VALUES)
    assert [s.m_i for s in steps] == [2.0, 2.0, 4.0]
    # after key 0: alpha = exp(-inf - 2) = 0 (empty history), beta = 1
    assert (steps[0].alpha, steps[0].beta, steps[0].l_i) == (0.0, 1.0, 1.0)
    assert steps[0].acc == (1.0, 0.0)
    # after key 1: the max stays, alpha = 1, beta = e^-1 (figure 12.3: l=1.3679, a=[1, 0.7358])
    assert steps[1].alpha == 1.0
    assert steps[1].l_i == pytest.approx(1.3679, abs=5e-5)
    assert steps[1].acc == pytest.approx((1.0, 0.7358), abs=5e-5)
    # after key 2: new max 4, history rescaled by e^-2 (l=1.1851, a=[3.1353, 1.0995])
    assert steps[2].alpha == pytest.approx(math.exp(-2))
    assert steps[2].beta == 1.0
    assert steps[2].l_i == pytest.approx(1.1851, abs=5e-5)
    # 1.09957: the chapter truncates to 1.0995
    assert steps[2].acc == pytest.approx((3.1353, 1.0995), abs=1e-4)
    final = [a / steps[-1].l_i for a in steps[-1].acc]
    assert final == pytest.approx([2.6456, 0.9278], abs=5e-5)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 4)])
def test_online_reference_equals_plain_reference(qkv, shape):
    q, k, v = qkv(*shape, inputs="stress")  # large scores: the max subtraction matters
    assert torch.allclose(online_ref(q, k, v), attention_ref(q, k, v), atol=1e-12, rtol=1e-12)


def test_reference_is_float64_and_uses_one_over_sqrt_d(qkv):
    q, k, v = qkv(5, 4)
    ref = attention_ref(q, k, v)
    assert ref.dtype == torch.float64
    q, k, v = (t.cpu() for t in (q, k, v))  # the reference returns CPU tensors
    manual = torch.softmax(q.double() @ k.double().T / 2.0, -1) @ v.double()
    assert torch.allclose(ref, manual)
