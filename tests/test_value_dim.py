"""A V head dim unlike Q's and K's (issue 34, DeepSeek's MLA: 192 and 128): O takes V's
head dim, dV too, dQ and dK Q's; forward, backward, varlen and decode (its append too)
against the float64 reference. The portable path runs everywhere (fp32, and fp16's
head-dim pieces, in emulation); the Hopper path's pairs (`hopper.forward.TILES`: 192/128,
128/64) are `gpu_only`, bounded by twice the portable kernel's error plus a floor."""

import pytest
import torch

from fusedattn import attention, attention_varlen, attention_with_kvcache
from fusedattn.dispatch import forward_path, hopper_refusal, use_backend
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import (
    attention_ref,
    attention_ref_grads,
    varlen_ref,
    varlen_ref_grads,
)
from fusedattn.tiles.common import Mask
from inputs import ON_HOPPER, both_paths, i32, offsets, ragged, rand, within_portable
from inputs import passes as _passes

CASES = [  # (B, H, H_kv, Sq, Sk, D_qk, D_v, causal, dtype)
    (1, 4, 2, 33, 45, 24, 40, True, torch.float32),    # V wider, both padded, GQA
    (2, 2, 2, 17, 9, 40, 16, False, torch.float32),    # V narrower, Sq > Sk
    (1, 2, 1, 20, 31, 80, 48, True, torch.float16),    # Q/K in pieces (64 + 16), V padded
    (1, 2, 2, 19, 19, 192, 128, False, torch.float16),  # MLA's pair: 128 + 64 against 128
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}/{}_{}x{}_D{}/{}_c{}_{}"
                         .format(*c[:-1], str(c[-1])[6:]))
def test_forward_and_gradients_with_their_own_v_head_dim(case):
    b, h, hk, sq, sk, d, dv, causal, dtype = case
    q = rand(b, h, sq, d, dtype=dtype, grad=True)
    k = rand(b, hk, sk, d, dtype=dtype, seed=1, grad=True)
    v = rand(b, hk, sk, dv, dtype=dtype, seed=2, grad=True)
    out, lse = attention(q, k, v, is_causal=causal, enable_gqa=hk != h, return_lse=True)
    assert out.shape == (b, h, sq, dv)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    dout = rand(*out.shape, dtype=dtype, seed=3)
    peer = peer_grads = (None,) * 4
    if dtype != torch.float32:  # the peer: SDPA in the same dtype, top-left causal as ours
        peer = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=hk != h)
        peer_grads = torch.autograd.grad(peer, (q, k, v), dout)
    _passes(out, ref, "out", peer if dtype != torch.float32 else None)
    assert (lse.double().cpu() - ref_lse).abs().max().item() < 1e-3
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    for name, g, r, p in zip(("dq", "dk", "dv"), got,
                             attention_ref_grads(q, k, v, dout, causal=causal), peer_grads,
                             strict=False):
        _passes(g, r, name, p)


def test_its_own_v_head_dim_traces_inside_torch_compile():
    # the ops' fake implementations give O (and dV) V's head dim
    q, k = (rand(1, 2, 12, 24, seed=s, grad=True) for s in range(2))
    v = rand(1, 2, 12, 40, seed=2, grad=True)

    def step(q, k, v):
        return attention(q, k, v, is_causal=True).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fails on a break
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = attention_ref_grads(q, k, v, torch.ones(1, 2, 12, 40), causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), got, want, strict=True):
        _passes(g, r, name)


def test_varlen_with_its_own_v_head_dim():
    lens_q, lens_k = [0, 5, 17, 1], [3, 5, 20, 0]
    cu_q, cu_k = (offsets(n) for n in (lens_q, lens_k))
    q = rand(sum(lens_q), 4, 24, grad=True)
    k = rand(sum(lens_k), 2, 24, seed=1, grad=True)
    v = rand(sum(lens_k), 2, 40, seed=2, grad=True)
    out = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True)
    assert out.shape == (sum(lens_q), 4, 40)
    _passes(out, varlen_ref(q, k, v, cu_q, cu_k, causal=True))
    dout = rand(*out.shape, seed=3)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), got,
                          varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=True),
                          strict=True):
        _passes(g, r, name)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_appends_and_attends_with_its_own_v_head_dim(splits):
    batch, heads, heads_kv, cap, d, dv = 2, 4, 2, 40, 32, 16
    k_cache, v_cache = rand(batch, heads_kv, cap, d, seed=1), rand(batch, heads_kv, cap, dv,
                                                                   seed=2)
    lens = i32([7, 30])
    q, k_new, v_new = rand(batch, heads, 3, d), rand(batch, heads_kv, 3, d, seed=4), \
        rand(batch, heads_kv, 3, dv, seed=5)
    out = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new,
                                 v_new=v_new, splits=splits)
    assert out.shape == (batch, heads, 3, dv)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(v_cache[b, :, n:n + 3], v_new[b])  # the append wrote V's columns
        ref = attention_ref(q[b], k_cache[b, :, :n + 3], v_cache[b, :, :n + 3], causal=True,
                            align="bottom-right")
        _passes(out[b], ref, f"sequence {b}")


def test_head_dims_that_do_not_fit_are_refused():
    q = rand(1, 2, 8, 32)
    with pytest.raises(ProblemError, match="one head dim for q and k"):
        attention(q, rand(1, 2, 8, 16), rand(1, 2, 8, 32))
    with pytest.raises(ProblemError, match="for q/k and for v"):
        attention(q, q, rand(1, 2, 8, 300))
    with pytest.raises(ProblemError, match="but for the head dim"):
        attention(q, q, rand(1, 2, 9, 16))
    cache = torch.zeros(1, 2, 16, 32, device=DEVICE)
    with pytest.raises(ProblemError, match=r"v_new\.shape"):  # V's new rows take V's dim
        attention_with_kvcache(q[:, :, :1], cache, torch.zeros(1, 2, 16, 16, device=DEVICE),
                               cache_seqlens=i32([0]), k_new=q[:, :, :1], v_new=q[:, :, :1])
    assert cache.abs().max().item() == 0  # refused before the append


def test_the_hopper_path_takes_its_pairs_only():
    q, v = rand(1, 2, 16, 128, dtype=torch.bfloat16), rand(1, 2, 16, 96, dtype=torch.bfloat16)
    why = hopper_refusal(q, q, v, mask=Mask())
    assert why is not None and "192/128" in why and "128/64" in why


HOPPER = [  # (B, H, Hkv, Sq, Sk, D_qk, D_v, causal, window)
    (1, 4, 2, 1000, 1000, 192, 128, True, None), (2, 2, 2, 333, 1500, 192, 128, False, None),
    (1, 4, 1, 1025, 1025, 128, 64, True, (100, 0)), (1, 2, 2, 700, 300, 128, 64, True, None),
    # V's head dim padded (128/112 as 128/128), and both (160/120 as 192/128)
    (1, 2, 1, 600, 600, 128, 112, True, None), (1, 2, 2, 333, 400, 160, 120, False, None),
]


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("case", HOPPER, ids=lambda c: "B{}H{}/{}_{}x{}_D{}/{}_c{}_w{}"
                         .format(*c))
def test_hopper_takes_mlas_head_dims(case):
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    b, h, hk, sq, sk, d, dv, causal, window = case
    q = rand(b, h, sq, d, dtype=torch.bfloat16)
    k = rand(b, hk, sk, d, dtype=torch.bfloat16, seed=1)
    v = rand(b, hk, sk, dv, dtype=torch.bfloat16, seed=2)
    with use_backend("hopper"):  # raises where the Hopper kernel cannot serve the call
        forward_path(q, k, v, mask=Mask(causal=causal, window=window))
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window=window, return_lse=True,
                                 device=DEVICE)
    (out, lse), (out_p, _) = both_paths(lambda: attention(
        q, k, v, is_causal=causal, enable_gqa=hk != h, window=window, return_lse=True))
    within_portable(out, out_p, ref)
    seen = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[seen].abs().max().item() < 1e-3


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
def test_hopper_varlen_takes_mlas_head_dims():
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(192, 128)
    ref = varlen_ref(q, k, v, cu_q, cu_k, causal=True, device=DEVICE)
    within_portable(*both_paths(lambda: attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True)), ref)
