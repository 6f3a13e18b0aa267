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


def _brute(q, k, v, seen, softcap=None):
    """Row by row, key by key, in Python floats: the definition, no tensor tricks."""
    out = torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64)
    for i in range(q.shape[0]):
        s = [float(q[i] @ k[j]) / math.sqrt(q.shape[1]) for j in range(k.shape[0])]
        if softcap is not None:
            s = [softcap * math.tanh(x / softcap) for x in s]
        w = [math.exp(x) if seen[i][j] else 0.0 for j, x in enumerate(s)]
        if sum(w):
            out[i] = sum(wj * v[j] for j, wj in enumerate(w)) / sum(w)
    return out


@pytest.mark.parametrize("sq, sk, causal, align, window, softcap", [
    (5, 9, True, "bottom-right", None, None),   # queries after a cache of 4
    (9, 5, True, "bottom-right", None, None),   # rows 0..3 see no key: output 0
    (7, 7, True, "top-left", (2, None), None),  # sliding window of 2 behind
    (6, 8, False, "top-left", (1, 1), None),    # a band, no causal
    (6, 6, True, "bottom-right", (0, 0), None),  # window of 0: each query sees its own key
    (4, 6, False, "top-left", None, 0.5),       # softcap squeezes scores into (-0.5, 0.5)
])
def test_alignment_window_and_softcap_follow_the_definition(sq, sk, causal, align, window,
                                                            softcap):
    from fusedattn.reference import visible

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (sq, sk, sk))
    seen = visible(sq, sk, causal=causal, align=align, window=window).tolist()
    got, lse = attention_ref(q, k, v, causal=causal, align=align, window=window,
                             softcap=softcap, return_lse=True)
    assert torch.allclose(got, _brute(q, k, v, seen, softcap), atol=1e-12)
    empty = [i for i in range(sq) if not any(seen[i])]
    assert all(torch.isinf(lse[i]) and lse[i] < 0 for i in empty)
    assert not torch.isnan(got).any()


def test_bottom_right_equals_top_left_when_square():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 4, generator=g) for _ in range(3))
    assert torch.equal(attention_ref(q, k, v, causal=True),
                       attention_ref(q, k, v, causal=True, align="bottom-right"))


def test_gradients_with_a_window_and_softcap_match_finite_differences():
    from fusedattn.reference import attention_ref_grads

    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 5, 3, generator=g, dtype=torch.float64) for _ in range(4))
    opts = dict(causal=True, window=(2, 0), softcap=1.5)
    dq, dk, dv = attention_ref_grads(q, k, v, dout, **opts)
    eps, i = 1e-6, (0, 3, 1)
    bumped = q.clone()
    bumped[i] += eps
    fd = ((attention_ref(bumped, k, v, **opts) - attention_ref(q, k, v, **opts)) * dout).sum()
    assert float(fd / eps) == pytest.approx(float(dq[i]), rel=1e-4)


def test_varlen_is_each_sequence_alone_bottom_right_and_paged_reads_the_pages():
    from fusedattn.reference import paged_to_dense, varlen_ref

    g = torch.Generator().manual_seed(3)
    cu_q, cu_k = torch.tensor([0, 1, 4, 9]), torch.tensor([0, 3, 4, 11])
    q = torch.randn(9, 2, 4, generator=g)
    k, v = (torch.randn(11, 1, 4, generator=g) for _ in range(2))
    out = varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    # sequence 2: 5 queries after 2 cached keys of its 7
    want = attention_ref(q[4:9].transpose(0, 1), k[4:11].transpose(0, 1),
                         v[4:11].transpose(0, 1), causal=True, align="bottom-right")
    assert torch.equal(out[4:9], want.transpose(0, 1))
    assert out.shape == (9, 2, 4)
    # a paged cache: 2 sequences of 5 and 0 keys in blocks of 2, pages out of order
    cache = torch.randn(6, 1, 2, 4, generator=g)
    table = torch.tensor([[4, 1, 5], [0, 0, 0]])
    first, empty = paged_to_dense(cache, table, torch.tensor([5, 0]))
    assert torch.equal(first[:, :2], cache[4, :, :2]) and torch.equal(first[:, 4], cache[5, :, 0])
    assert first.shape == (1, 5, 4) and empty.shape == (1, 0, 4)
