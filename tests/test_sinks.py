"""Attention sinks (issue 34, gpt-oss): `sinks=` on `attention`, `attention_varlen` and
`attention_with_kvcache`, a `[H]` logit per query head in every row's denominator that
carries no value; forward, LSE and gradients (d sinks included) against the float64
reference's autograd. The portable path runs everywhere (fp32 in emulation); the Hopper
path's cases are `gpu_only` (bf16 against the float64 reference, bounded by twice the
portable kernel's error on the same inputs plus a floor)."""

import pytest
import torch

from fusedattn import attention, attention_varlen, attention_with_kvcache
from fusedattn.dispatch import forward_path, use_backend
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import (
    attention_ref,
    attention_ref_grads,
    paged_to_dense,
    varlen_ref,
    varlen_ref_grads,
)
from fusedattn.tiles.common import Mask
from inputs import ON_HOPPER, both_paths, i32, offsets, ragged, rand, within_portable
from inputs import passes as _passes


def _sinks(heads, seed=9, grad=False):
    """Sinks of a few units: large enough to take most of some rows' weight."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(heads, generator=g) * 3).to(DEVICE)
    return t.requires_grad_() if grad else t


CASES = [  # (B, H, H_kv, Sq, Sk, D, causal, window, softcap)
    (1, 2, 2, 1, 1, 16, False, None, None),     # one key: the sink is the other term
    (2, 4, 2, 33, 31, 24, True, None, None),    # ragged tiles, GQA, Sq > Sk causal
    (1, 2, 1, 17, 40, 32, False, (3, 0), 5.0),  # a window (rows of few keys) and softcap
    (1, 2, 2, 20, 9, 16, True, None, None),     # bottom rows past Sk, top-left: all keys
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}/{}_{}x{}_D{}_c{}_w{}_cap{}"
                         .format(*c))
def test_sinks_forward_lse_and_gradients_match_the_reference(case):
    b, h, hk, sq, sk, d, causal, window, softcap = case
    q = rand(b, h, sq, d, grad=True)
    k, v = rand(b, hk, sk, d, seed=1, grad=True), rand(b, hk, sk, d, seed=2, grad=True)
    sinks = _sinks(h, grad=True)
    opts = dict(window=window, softcap=softcap)
    out, lse = attention(q, k, v, is_causal=causal, enable_gqa=hk != h, return_lse=True,
                         sinks=sinks, **opts)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True, sinks=sinks,
                                 **opts)
    _passes(out, ref, "out")
    # the LSE is over the scores and the sink: finite in every row, even one of no key
    assert torch.isfinite(lse).all()
    assert (lse.double().cpu() - ref_lse).abs().max().item() < 1e-5
    dout, dlse = rand(*out.shape, seed=3), rand(*lse.shape, seed=4)
    got = torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))
    want = attention_ref_grads(q, k, v, dout, causal=causal, dlse=dlse, sinks=sinks, **opts)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        _passes(g, r, name)


def test_sinks_change_the_output_and_minus_inf_is_no_sink():
    q, k, v = (rand(1, 2, 12, 16, seed=s) for s in range(3))
    plain = attention(q, k, v)
    none = attention(q, k, v, sinks=torch.full((2,), float("-inf"), device=DEVICE))
    assert torch.allclose(none, plain, atol=1e-6)
    sunk = attention(q, k, v, sinks=torch.full((2,), 4.0, device=DEVICE))
    assert (sunk - plain).abs().max().item() > 0.1  # a sink of 4 takes most of the weight
    # a row of no key (bottom-right, Sq > Sk) with its sink: O = 0, LSE = the sink
    out, lse = attention_varlen(q[0].transpose(0, 1), k[0, :, :3].transpose(0, 1),
                                v[0, :, :3].transpose(0, 1), i32([0, 12]), i32([0, 3]), 12, 3,
                                is_causal=True, return_lse=True,
                                sinks=torch.tensor([1.5, -2.0], device=DEVICE))
    assert out[:9].abs().max().item() == 0.0
    assert torch.equal(lse[:, :9].cpu(), torch.tensor([[1.5], [-2.0]]).expand(2, 9))


def test_a_bf16_parameter_gets_its_gradient_in_bf16():
    q, k, v = (rand(1, 2, 10, 16, seed=s, grad=True) for s in range(3))
    sinks = torch.nn.Parameter(_sinks(2).to(torch.bfloat16))
    attention(q, k, v, is_causal=True, sinks=sinks).sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
    # sinks alone asking for grad still record the call
    sinks.grad = None
    attention(q.detach(), k.detach(), v.detach(), sinks=sinks).sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().max().item() > 0


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sinks_with_empty_and_one_token_sequences(causal):
    lens_q, lens_k = [0, 5, 17, 1, 9], [3, 5, 20, 0, 9]
    cu_q, cu_k = (offsets(n) for n in (lens_q, lens_k))
    q = rand(sum(lens_q), 4, 16, grad=True)
    k, v = (rand(sum(lens_k), 2, 16, seed=s, grad=True) for s in (1, 2))
    sinks = _sinks(4, grad=True)
    out = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=causal,
                           sinks=sinks)
    _passes(out, varlen_ref(q, k, v, cu_q, cu_k, causal=causal, sinks=sinks))
    dout = rand(*out.shape, seed=3)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=causal, sinks=sinks)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        _passes(g, r, name)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_sinks_split_or_not_paged_or_not(splits, paged):
    batch, heads, heads_kv, cap, d = 3, 4, 2, 48, 16
    lens = i32([10, 0, 41])
    sinks = _sinks(heads)
    q = rand(batch, heads, 2, d)
    k_cache, v_cache = (rand(batch, heads_kv, cap, d, seed=s) for s in (1, 2))
    table = None
    if paged:  # blocks of 16 rows, in reverse order
        k_cache, v_cache = (c.reshape(batch, heads_kv, 3, 16, d).permute(0, 2, 1, 3, 4)
                            .reshape(-1, heads_kv, 16, d).flip(0).contiguous()
                            for c in (k_cache, v_cache))
        table = i32([[8 - 3 * b - j for j in range(3)] for b in range(batch)])
    out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                      block_table=table, splits=splits, sinks=sinks,
                                      return_lse=True)
    dense = (paged_to_dense(k_cache, table, lens), paged_to_dense(v_cache, table, lens)) \
        if paged else ([k_cache[b, :, :n] for b, n in enumerate(lens.tolist())],
                       [v_cache[b, :, :n] for b, n in enumerate(lens.tolist())])
    for b in range(batch):
        ref, ref_lse = attention_ref(q[b], dense[0][b], dense[1][b], causal=True,
                                     align="bottom-right", sinks=sinks, return_lse=True)
        _passes(out[b], ref, f"sequence {b}")
        assert (lse[b].double().cpu() - ref_lse).abs().max().item() < 1e-5


def test_sinks_trace_inside_torch_compile():
    q, k, v = (rand(1, 2, 16, 16, seed=s, grad=True) for s in range(3))
    sinks = _sinks(2, grad=True)

    def step(q, k, v, sinks):
        return attention(q, k, v, is_causal=True, sinks=sinks).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fails on a break
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    want = attention_ref_grads(q, k, v, torch.ones(1, 2, 16, 16), causal=True, sinks=sinks)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        _passes(g, r, name)


@pytest.mark.parametrize("sinks, field", [
    ([1.0, 2.0], "sinks"),                                     # not a tensor
    (torch.zeros(3), "sinks.shape"),                           # not one per query head
    (torch.zeros(1, 2), "sinks.shape"),                        # not 1-D
    (torch.zeros(2, dtype=torch.int32), "sinks.dtype"),        # not floating
    (torch.zeros(2, device="meta"), "sinks.device"),           # not q's device
])
def test_bad_sinks_are_refused_at_every_entry_point(sinks, field):
    if isinstance(sinks, torch.Tensor) and sinks.device.type != "meta":
        sinks = sinks.to(DEVICE)
    q = rand(1, 2, 4, 16)
    with pytest.raises(ProblemError, match=field.replace(".", r"\.")):
        attention(q, q, q, sinks=sinks)
    packed = q[0].transpose(0, 1)
    with pytest.raises(ProblemError, match=field.replace(".", r"\.")):
        attention_varlen(packed, packed, packed, i32([0, 4]), i32([0, 4]), 4, 4, sinks=sinks)
    k_cache = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ProblemError, match=field.replace(".", r"\.")):
        attention_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=i32([0]),
                               k_new=q, v_new=q, sinks=sinks)
    assert k_cache.abs().max().item() == 0  # refused before the append wrote the cache


# --- the Hopper path ----------------------------------------------------------------------

HOPPER = [  # (B, H, Hkv, Sq, Sk, D, causal, window)
    (1, 4, 2, 1000, 1000, 64, True, None), (2, 2, 2, 333, 1500, 128, False, None),
    (1, 4, 1, 1025, 1025, 192, True, (128, 0)), (1, 2, 2, 700, 300, 96, True, None),
]


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("case", HOPPER, ids=lambda c: "B{}H{}/{}_{}x{}_D{}_c{}_w{}"
                         .format(*c))
def test_hopper_sinks_match_the_reference(case):
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    b, h, hk, sq, sk, d, causal, window = case
    q = rand(b, h, sq, d, dtype=torch.bfloat16)
    k, v = (rand(b, hk, sk, d, dtype=torch.bfloat16, seed=s) for s in (1, 2))
    sinks = _sinks(h)
    with use_backend("hopper"):  # raises where the Hopper kernel cannot serve the call
        forward_path(q, k, v, mask=Mask(causal=causal, window=window))
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window=window, sinks=sinks,
                                 return_lse=True, device=DEVICE)
    (out, lse), (out_p, _) = both_paths(lambda: attention(
        q, k, v, is_causal=causal, enable_gqa=hk != h, window=window, sinks=sinks,
        return_lse=True))
    within_portable(out, out_p, ref)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
def test_hopper_varlen_sinks_with_empty_sequences():
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(128)
    sinks = _sinks(4)
    ref = varlen_ref(q, k, v, cu_q, cu_k, causal=True, sinks=sinks, device=DEVICE)
    within_portable(*both_paths(lambda: attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, sinks=sinks)), ref)
