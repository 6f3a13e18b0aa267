"""Windows, softcap, packed variable-length batches and the KV cache, against the float64
reference (`reference.visible`, `varlen_ref`, `paged_to_dense`), in emulation and on the
GPU (the same tests). Awkward shapes: ragged tiles, empty and one-token sequences, a window
of 0, caches empty and full, blocks partly filled, rows that see no key."""

import math

import pytest
import torch

import fusedattn
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import (
    attention_ref,
    attention_ref_grads,
    paged_to_dense,
    varlen_ref,
    varlen_ref_grads,
    visible,
)
from fusedattn_lab.verify import check
from inputs import offsets, paged

LOW = (torch.float16, torch.bfloat16)


def _rand(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return t.requires_grad_() if grad else t


def _peer(q, k, v, *, causal=False, align="top-left", window=None, softcap=None):
    """PyTorch's own attention in the inputs' dtype (plain ops on the CPU, the reference's
    formula without float64): the max error a low-precision result is allowed to double."""
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], -3) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = visible(q.shape[-2], k.shape[-2], causal=causal, align=align, window=window)
    p = torch.softmax(s.float().masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)
    return p.to(q.dtype) @ v


def _passes(got, ref, peer=None):
    err = None if peer is None else float((peer.double() - ref.cpu()).abs().max())
    result = check(got, ref, peer_error=err)
    assert result.ok, result.reasons


# --- windows and softcap on attention() -------------------------------------------------

MASKS = [
    # (Sq, Sk, causal, window, softcap)
    (37, 29, False, (5, 3), None),     # both sides, ragged tiles; rows past Sk see no key
    (37, 29, True, (7, None), None),   # causal sliding window (Mistral's)
    (40, 40, False, None, 2.0),        # softcap alone, whole tiles
    (33, 50, True, (0, 0), None),      # a window of 0: each row sees one key
    (20, 64, False, (3, 2), 5.0),      # window and softcap; most key tiles skipped
    (50, 33, False, (None, 0), None),  # right side only: causal by another name
]


@pytest.mark.parametrize("case", MASKS)
def test_window_and_softcap_forward_and_grads(case):
    sq, sk, causal, window, softcap = case
    q, k, v = (_rand(2, 4, sq, 24, seed=0, grad=True), _rand(2, 2, sk, 24, seed=1, grad=True),
               _rand(2, 2, sk, 24, seed=2, grad=True))
    out, lse = fusedattn.attention(q, k, v, is_causal=causal, window=window, softcap=softcap,
                                   enable_gqa=True, return_lse=True)
    opts = dict(causal=causal, window=window, softcap=softcap)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **opts)
    _passes(out, ref)
    empty = torch.isinf(ref_lse)  # rows that see no key: O = 0, LSE = -inf
    assert torch.equal(torch.isinf(lse).cpu(), empty)
    assert torch.all(out.detach().cpu()[empty] == 0)
    _passes(lse[~empty.to(lse.device)], ref_lse[~empty])
    dout = _rand(2, 4, sq, 24, seed=3)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, r in zip(got, attention_ref_grads(q, k, v, dout, **opts), strict=True):
        _passes(g, r)


@pytest.mark.parametrize("dtype", LOW)
def test_window_and_softcap_low_precision(dtype):
    q, k, v = (_rand(1, 2, 70, 64, dtype=dtype, seed=s) for s in range(3))
    opts = dict(causal=True, window=(16, None), softcap=8.0)
    out = fusedattn.attention(q, k, v, is_causal=True, window=(16, None), softcap=8.0)
    _passes(out, attention_ref(q, k, v, **opts), _peer(q, k, v, **opts))


# --- varlen ------------------------------------------------------------------------------

VARLEN = [
    # (query lengths, key lengths, causal, window, softcap)
    ([1, 17, 0, 33, 5], [3, 17, 4, 20, 40], False, None, None),  # empty and 1-token sequences
    ([1, 17, 0, 33, 5], [3, 17, 4, 20, 40], True, None, None),   # bottom-right per sequence
    ([9, 40], [9, 40], True, (4, None), 3.0),                    # window and softcap
    ([1, 1, 1], [30, 1, 17], False, (2, 1), None),               # one query each (decode)
]


@pytest.mark.parametrize("case", VARLEN)
def test_varlen_forward_and_grads(case):
    lens_q, lens_k, causal, window, softcap = case
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = _rand(sum(lens_q), 4, 24, seed=0, grad=True)
    k, v = (_rand(sum(lens_k), 2, 24, seed=s, grad=True) for s in (1, 2))
    out, lse = fusedattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          is_causal=causal, window=window, softcap=softcap,
                                          return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    opts = dict(causal=causal, window=window, softcap=softcap)
    _passes(out, varlen_ref(q, k, v, cu_q.cpu(), cu_k.cpu(), **opts))
    dout = _rand(*q.shape, seed=3)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = varlen_ref_grads(q, k, v, dout, cu_q.cpu(), cu_k.cpu(), **opts)
    for g, r in zip(got, refs, strict=True):
        assert g.shape == r.shape
        _passes(g, r)


def test_varlen_equals_each_sequence_alone():
    # the packed batch gives each sequence what attention() with bottom-right alignment
    # would: no row reads another sequence's keys
    lens = [5, 31, 2]
    cu = offsets(lens)
    q, k, v = (_rand(sum(lens), 2, 16, seed=s) for s in range(3))
    out = fusedattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True)
    for (a, b) in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = fusedattn.attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                    is_causal=True).transpose(0, 1)
        assert torch.allclose(out[a:b], alone, atol=1e-6, rtol=0)


# --- KV cache ----------------------------------------------------------------------------

KV = [
    # (cache_seqlens, S_new, Sq, splits, page size or None, window, softcap)
    ([0, 10, 45], 5, 5, 1, None, None, None),    # an empty cache; chunked prefill of 5
    ([3, 0, 49], 1, 1, 3, None, None, None),     # decode, 3 splits; one cache ends full
    ([20, 7, 33], 2, 2, 4, 16, None, None),      # paged, blocks partly filled, speculative 2
    ([0, 0, 0], 0, 1, 1, None, None, None),      # no keys at all: O = 0, LSE = -inf
    ([50, 1, 30], 0, 3, 2, 16, (4, None), 5.0),  # paged, full, window and softcap
]


@pytest.mark.parametrize("case", KV)
def test_kvcache_appends_and_attends(case):
    lengths, s_new, sq, splits, page, window, softcap = case
    batch, heads, heads_kv, dim, s_max = 3, 4, 2, 24, 50
    k_dense, v_dense = (_rand(batch, heads_kv, s_max, dim, seed=s) for s in (0, 1))
    q = _rand(batch, heads, sq, dim, seed=2)
    k_new, v_new = ((_rand(batch, heads_kv, s_new, dim, seed=s) for s in (3, 4)) if s_new
                    else (None, None))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = None
    if page:
        (k_cache, table), (v_cache, _) = (paged(t, page, 3, 7) for t in (k_dense, v_dense))
    else:
        k_cache, v_cache = k_dense.clone(), v_dense.clone()
    out, lse = fusedattn.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new,
        block_table=table, splits=splits, window=window, softcap=softcap, return_lse=True)
    assert torch.equal(seqlens.cpu(), torch.tensor(lengths, dtype=torch.int32))  # untouched
    after = seqlens + s_new
    keys = paged_to_dense(k_cache, table, after) if page else \
        [k_cache[b, :, :n] for b, n in enumerate(after.tolist())]
    values = paged_to_dense(v_cache, table, after) if page else \
        [v_cache[b, :, :n] for b, n in enumerate(after.tolist())]
    for b, n in enumerate(lengths):
        want_k = torch.cat([k_dense[b, :, :n]] + ([k_new[b]] if s_new else []), 1)
        want_v = torch.cat([v_dense[b, :, :n]] + ([v_new[b]] if s_new else []), 1)
        assert torch.equal(keys[b], want_k) and torch.equal(values[b], want_v)  # appended
        ref, ref_lse = attention_ref(q[b], want_k, want_v, causal=True, align="bottom-right",
                                     window=window, softcap=softcap, return_lse=True)
        _passes(out[b], ref)
        assert torch.equal(torch.isinf(lse[b]).cpu(), torch.isinf(ref_lse))
        assert torch.all(out[b].cpu()[torch.isinf(ref_lse)] == 0)


def test_kvcache_splits_agree():
    # the split count changes the order of the sums only
    k, v = (_rand(2, 1, 64, 32, seed=s) for s in (0, 1))
    q = _rand(2, 4, 1, 32, seed=2)
    seqlens = torch.tensor([64, 37], dtype=torch.int32, device=DEVICE)
    outs = [fusedattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, splits=n)
            for n in (1, 2, 4)]
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("splits, dim, sinks", [(2, 24, False), (3, 80, True),
                                                 (64, 256, False), (64, 32, True)])
def test_the_merge_of_split_partials_against_float64(splits, dim, sinks):
    # `splitkv.merge_splits` alone on random partials: some splits saw no key (LSE -inf,
    # O 0), one row none at all; 64 splits (a long sequence's), head dims cut into
    # several column programs (80: a ragged last one), rows not a multiple of a
    # program's, the LSE written once
    from fusedattn.tiles.splitkv import merge_splits

    g = torch.Generator().manual_seed(splits * dim)
    b, h, sq = 2, 3, 5
    part = torch.randn(splits, b, h, sq, dim, generator=g, dtype=torch.float64)
    lse = torch.randn(splits, b, h, sq, generator=g, dtype=torch.float64) * 4
    empty = torch.rand(splits, b, h, sq, generator=g) < 0.3
    empty[:, 1, 2, 4] = True  # a row no split saw
    lse[empty], part[empty] = float("-inf"), 0.0
    sink = torch.randn(h, generator=g, dtype=torch.float64) if sinks else None
    out = torch.full((b, h, sq, dim), float("nan"), device=DEVICE)  # poisoned
    got_lse = torch.full((b, h, sq), float("nan"), device=DEVICE)
    merge_splits(part.float().to(DEVICE), lse.float().to(DEVICE), out, got_lse,
                 sinks=sink.float().to(DEVICE) if sinks else None)
    terms = lse if sink is None else torch.cat([lse, sink[None, None, :, None].expand(
        1, b, h, sq)])
    m = terms.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(terms - m)
    total = w.sum(0)
    want = (w[:splits, ..., None] * part).sum(0) / torch.where(total == 0, 1, total)[..., None]
    want_lse = m + torch.log(total)
    assert torch.allclose(out.double().cpu(), want, atol=1e-5, rtol=1e-5)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse).cpu(), seen) and (sinks or not seen[1, 2, 4])
    assert torch.allclose(got_lse.double().cpu()[seen], want_lse[seen], atol=1e-5, rtol=1e-5)


def test_the_device_calls_decode_scripts_run_in_emulation():
    # what the next device call runs, checked here first (a broken script costs device
    # time): `decode_tiles.py` checks both FP8 decode kernels and bf16 decode at two tiles
    # each on its tiny problem; `merge_ab.py` loads an older tree's merge beside this one
    # (here this tree's own, from the repository root) and its float64 merge agrees
    from pathlib import Path

    from fusedattn.tiles import splitkv
    from inputs import script

    rows = script("decode_tiles").run(64, 0, tiny=True)
    assert {(r["dtype"], r["kernel"]) for r in rows} == {
        ("e4m3", "fp8_decode"), ("e4m3", "flash_fwd"), ("bf16", "flash_fwd")}
    assert len(rows) == 6 and all(r["ok"] for r in rows)
    merge_ab = script("merge_ab")
    base = merge_ab._base(Path(__file__).resolve().parents[1])
    assert base is not splitkv and base.merge_splits is not splitkv.merge_splits
    g = torch.Generator().manual_seed(0)
    part = torch.randn(5, 1, 3, 1, 40, generator=g)
    lse = torch.randn(5, 1, 3, 1, generator=g)
    lse[1] = float("-inf")
    outs = []
    for module in (splitkv, base):
        out = torch.empty(1, 3, 1, 40, device=DEVICE)
        module.merge_splits(part.to(DEVICE), lse.to(DEVICE), out, None)
        outs.append(out.double().cpu())
    want = merge_ab._reference(part, lse)
    assert all(torch.allclose(o, want, atol=1e-5) for o in outs)


@pytest.mark.parametrize("dtype", LOW)
def test_kvcache_low_precision(dtype):
    k, v = (_rand(2, 2, 80, 64, dtype=dtype, seed=s) for s in (0, 1))
    q = _rand(2, 8, 1, 64, dtype=dtype, seed=2)
    seqlens = torch.tensor([80, 13], dtype=torch.int32, device=DEVICE)
    out = fusedattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, splits=3)
    for b, n in enumerate((80, 13)):
        opts = dict(causal=True, align="bottom-right")
        _passes(out[b], attention_ref(q[b], k[b, :, :n], v[b, :, :n], **opts),
                _peer(q[b], k[b, :, :n], v[b, :, :n], **opts))


# --- bad input: a ProblemError, and the cache untouched -----------------------------------

def _cache_call(**over):
    k = torch.zeros(2, 1, 8, 16, device=DEVICE)
    args = dict(q=_rand(2, 2, 1, 16), k_cache=k, v_cache=k.clone(),
                cache_seqlens=torch.tensor([3, 8], dtype=torch.int32, device=DEVICE))
    args.update(over)
    before = args["k_cache"].clone()
    with pytest.raises(ProblemError) as err:
        fusedattn.attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)  # nothing written
    return err.value.field


def test_kvcache_bad_inputs_write_nothing():
    new = _rand(2, 1, 1, 16)
    assert _cache_call(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32,
                                                  device=DEVICE)) == "cache_seqlens"
    assert _cache_call(cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32,
                                                  device=DEVICE)) == "cache_seqlens"
    # the new key does not fit sequence 1 (8 rows held, 8 the capacity)
    assert _cache_call(k_new=new, v_new=new.clone()) == "cache_seqlens"
    assert _cache_call(k_new=new) == "k_new/v_new"
    assert _cache_call(cache_seqlens=torch.tensor([3, 8], device=DEVICE)) == \
        "cache_seqlens.dtype"
    pages = torch.zeros(4, 1, 4, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=DEVICE)
    assert _cache_call(k_cache=pages, v_cache=pages.clone(), block_table=table) == \
        "block_table"
    assert _cache_call(window=(-1, 0)) == "window"
    assert _cache_call(softcap=0.0) == "softcap"
    assert _cache_call(splits=0) == "splits"


def test_varlen_bad_inputs():
    q = _rand(10, 2, 16)
    good = offsets([4, 6])
    with pytest.raises(ProblemError, match="cu_seqlens_q"):
        fusedattn.attention_varlen(q, q, q, offsets([6, 4])[[0, 2, 1]], good, 6, 6)  # decreasing
    with pytest.raises(ProblemError, match="cu_seqlens_k"):
        fusedattn.attention_varlen(q, q, q, good, offsets([4, 5]), 6, 6)  # not ending at total
    with pytest.raises(ProblemError, match="max_seqlen_q"):
        fusedattn.attention_varlen(q, q, q, good, good, 5, 6)  # shorter than a sequence
    with pytest.raises(ProblemError, match="cu_seqlens_q.dtype"):
        fusedattn.attention_varlen(q, q, q, good.long(), good, 6, 6)
    with pytest.raises(ProblemError, match="window"):
        fusedattn.attention_varlen(q, q, q, good, good, 6, 6, window=(1, -2))


def test_attention_bad_window_and_softcap():
    q = _rand(1, 1, 4, 16)
    for window in [(1,), (1.5, 0), (True, 0), "left"]:
        with pytest.raises(ProblemError, match="window"):
            fusedattn.attention(q, q, q, window=window)
    for cap in [0, -1.0, math.inf, True]:
        with pytest.raises(ProblemError, match="softcap"):
            fusedattn.attention(q, q, q, softcap=cap)


@pytest.mark.emulation_only("the GPU-sized serving suites run on the H200 as evidence")
def test_serving_bench_verifies_every_kind(tmp_path):
    import csv

    from fusedattn_lab.cli import main
    assert main(["bench", "--suite", "tiny-serving", "--out", str(tmp_path)]) == 0
    (csv_path,) = tmp_path.rglob("bench.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert {r["problem"].split()[0] for r in rows} == {"decode", "varlen", "window", "sinks",
                                                        "mla", "mla-bwd", "fp8", "fp8-bwd",
                                                        "fp8-decode", "fp8-varlen-bwd"}
    # the backwards' rows say so (their FLOPs are 2.5 times their forwards')
    assert {r["problem"].split()[0] for r in rows if r["mode"] == "bwd"} == {
        "mla-bwd", "fp8-bwd", "fp8-varlen-bwd"}
    # the FP8 backward's row: both of `attention_fp8_backward`'s routes verified
    assert {r["provider"] for r in rows if r["problem"].startswith("fp8-bwd")} == {
        "fusedattn", "fusedattn-fp32"}
    # and of packed documents, beside the bf16 varlen step on the dequantised values
    assert {r["provider"] for r in rows if r["problem"].startswith("fp8-varlen-bwd")} == {
        "fusedattn", "fusedattn-fp32", "fusedattn-bf16"}
    # FP8 decode (both kernels) beside the same call on the values dequantised to bf16
    assert {r["provider"] for r in rows if r["problem"].startswith("fp8-decode")} == {
        "fusedattn", "fusedattn-fp8dec", "fusedattn-bf16"}
    assert all(r["status"] == "ok" and float(r["max_abs_error"]) <= float(r["tolerance"])
               for r in rows)
