"""FP8 (e4m3) inputs on `attention` (issue 34.3, the forward on the portable path) and their
gradients (`attention_fp8_backward`): q, k, v in float8_e4m3fn with FlashAttention-3's
descale factors (None, per tensor or per head), O and the gradients in bfloat16. Each
result is judged against the float64 reference of the dequantised inputs
(`reference.dequantize`; the gradients: its autograd), bounded by the bfloat16 row of the
tolerance table: twice the error of the same formula done by torch
(`fusedattn_lab.peers.fp8_peer`: products of the float8 values in fp32, P rounded to e4m3,
O in bf16; `fp8_backward_peer`: today's backward formulas in fp32, delta from that O) plus
a floor. The interpreter runs float8 (CPU); the same tests run on the GPU tier, where the
forward's cases run on both paths: the portable kernel and the Hopper Gluon kernel (forced,
so a fallback fails them). Every bad combination is a `ProblemError` at the call."""

import pytest
import torch
import triton
import triton.language as tl

from fusedattn import (
    attention,
    attention_fp8_backward,
    attention_varlen,
    attention_varlen_fp8_backward,
    attention_with_kvcache,
)
from fusedattn.dispatch import hopper_refusal, use_backend
from fusedattn.mode import DEVICE, EMULATION
from fusedattn.problem import FP8, ProblemError
from fusedattn.reference import (
    attention_ref,
    attention_ref_grads,
    dequantize,
    paged_to_dense,
    varlen_ref,
    varlen_ref_grads,
)
from fusedattn.tiles.common import Mask
from fusedattn.tiles.fp8_decode import _widen_e4m3
from fusedattn_lab.peers import fp8_backward_peer, fp8_peer
from inputs import RAGGED_K, RAGGED_Q, SHORT_K, SHORT_Q, i32, offsets, paged, passes, ragged, rand

# the forward's paths: the portable kernel everywhere, the Hopper one on the GPU tier
PATHS = ["portable", pytest.param("hopper", marks=pytest.mark.gpu_only(
    "the Gluon kernel runs on an sm90 GPU only"))]


def _fp8(x, descale):
    """`x` quantised to e4m3 at `descale` (None, one element, or `[H]`): x / descale."""
    if descale is not None:
        x = x / (descale.reshape(-1, 1, 1) if descale.numel() > 1 else descale)
    return x.to(FP8)


def _factors(kind, heads, heads_kv):
    """Descale factors of `kind` for q, k, v: None, per tensor, or per head (unequal)."""
    if kind is None:
        return None, None, None
    if kind == "tensor":
        return (torch.tensor(v, device=DEVICE) for v in (0.5, 0.125, 2.0))
    return (torch.linspace(a, b, n, device=DEVICE) for a, b, n in
            ((0.25, 2.0, heads), (0.1, 0.4, heads_kv), (0.5, 3.0, heads_kv)))


CASES = [  # (B, H, H_kv, Sq, Sk, D, options, descale kind): what each exercises
    (1, 1, 1, 1, 1, 64, {}, None),                              # 1x1: one key, P = 1
    (2, 2, 2, 33, 31, 64, {}, "tensor"),                        # ragged tiles
    (1, 4, 2, 70, 75, 64, dict(is_causal=True), "head"),        # GQA, causal, per head
    (1, 2, 1, 40, 100, 128, dict(is_causal=True), "head"),      # MQA, Sq < Sk
    (1, 2, 2, 100, 40, 64, dict(is_causal=True), "tensor"),     # rows that see no key
    (1, 2, 2, 64, 64, 64, dict(window=(8, 4), softcap=5.0), "head"),
    (1, 2, 2, 48, 48, 256, {}, "tensor"),                       # the widest head dim
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_fp8_forward_against_the_reference_of_the_dequantised_inputs(case, path):
    b, h, hk, sq, sk, d, options, kind = case
    descales = list(_factors(kind, h, hk))
    q8, k8, v8 = (_fp8(rand(b, n, s, d, seed=i) * 2, f) for i, (n, s, f) in
                  enumerate(((h, sq, descales[0]), (hk, sk, descales[1]), (hk, sk, descales[2]))))
    if path == "hopper" and sq > 1:  # V as a strided view (`[B, S, H, D]` transposed)
        v8 = v8.transpose(1, 2).contiguous().transpose(1, 2)
    with use_backend(path):
        out, lse = attention(q8, k8, v8, enable_gqa=h != hk, return_lse=True,
                             descale_q=descales[0], descale_k=descales[1],
                             descale_v=descales[2], **options)
    assert out.dtype == torch.bfloat16 and out.shape == (b, h, sq, d)
    ref_kw = dict(causal=options.get("is_causal", False), window=options.get("window"),
                  softcap=options.get("softcap"))
    ref, ref_lse = attention_ref(*(dequantize(t, f) for t, f in zip((q8, k8, v8), descales,
                                                                    strict=True)),
                                 return_lse=True, **ref_kw)
    passes(out, ref, str(case), peer=fp8_peer(q8, k8, v8, *descales, **ref_kw))
    # the LSE comes from the scores, the float8 values' products: fp32-close on the
    # portable path; the Hopper kernel's e4m3 wgmma accumulates them in less than fp32
    # (Triton's sm90 default keeps the tensor core's fast accumulation, as FA3's and
    # cuDNN's FP8 do; one case read 1.7e-3 on the H200), so there the bound is relative to
    # the sum of |products| a score adds up: 2^-11 of the largest such sum
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen)
    bound = 1e-3
    if path == "hopper":
        q, k = (dequantize(t, f).abs() for t, f in zip((q8, k8), descales[:2], strict=True))
        k = k.repeat_interleave(h // hk, dim=1)
        bound = max(bound, 2**-11 * d**-0.5 * (q @ k.transpose(-1, -2)).max().item())
    assert (lse.double().cpu() - ref_lse)[seen].abs().max().item() < bound


@pytest.mark.parametrize("path", PATHS)
def test_fp8_takes_sinks_and_the_factors_matter(path):
    q8, k8, v8 = (_fp8(rand(1, 2, 50, 64, seed=i), None) for i in range(3))
    sinks = torch.tensor([1.0, -2.0], device=DEVICE)
    dv = torch.tensor([1.0, 4.0], device=DEVICE)
    with use_backend(path):
        out = attention(q8, k8, v8, sinks=sinks, descale_v=dv)
        plain = attention(q8, k8, v8, sinks=sinks)
    ref = attention_ref(q8, k8, dequantize(v8, dv), sinks=sinks)
    passes(out, ref, "sinks", peer=fp8_peer(q8, k8, v8, descale_v=dv, sinks=sinks))
    # head 1's O is 4x head 0's scale: the factor is applied per head, not dropped
    assert torch.allclose(out[:, 1].float(), 4 * plain[:, 1].float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out[:, 0], plain[:, 0])


def test_fp8_runs_three_consumer_warpgroups_at_d64_from_2048_rows_unmasked():
    # the rule `hopper.forward` launches by (`FP8_WARPGROUPS`, as bf16's `WARPGROUPS`)
    from fusedattn.hopper.forward import consumer_warpgroups

    assert consumer_warpgroups((64, 64), True, False, 2048, False) == 3
    assert consumer_warpgroups((64, 64), True, False, 2047, False) == 2
    assert consumer_warpgroups((64, 64), True, False, 4096, True) == 2  # causal lost
    assert consumer_warpgroups((64, 64), True, True, 4096, False) == 2  # softcap: two
    assert consumer_warpgroups((128, 128), True, False, 4096, False) == 2  # would serialise
    assert consumer_warpgroups((64, 64), False, False, 8192, True) == 3  # bf16 causal won
    assert consumer_warpgroups((64, 64), False, False, 4096, True) == 2  # (from 8192 rows)
    assert consumer_warpgroups((64, 64), False, False, 4096, True, varlen=True) == 3
    # varlen causal: three from 4096 rows in the longest document (two won at 1024-2048)
    assert consumer_warpgroups((64, 64), False, False, 4095, True, varlen=True) == 2
    assert consumer_warpgroups((64, 64), False, False, 2048, False, varlen=True) == 3


def test_fp8_launches_release_q_slots_late_only_where_they_claim(monkeypatch):
    # the rule `hopper.forward` launches by (`releases_late`, `LATE_Q_FREE`): two slots,
    # O by TMA stores; FP8 non-causal launches lost with it (H100, 1127Z), causal ones gained
    from fusedattn.hopper import forward

    assert forward.releases_late(2, False, False, False)
    assert forward.releases_late(2, False, True, False)
    assert not forward.releases_late(1, False, False, False)  # one slot: it would deadlock
    assert not forward.releases_late(2, True, False, False)  # FP8 unclaimed: lost
    assert forward.releases_late(2, True, True, False)  # FP8 causal, claimed: gained
    assert forward.releases_late(2, False, True, True)  # varlen's O by TMA stores
    monkeypatch.setattr(forward, "VARLEN_TMA_STORE", False)
    assert not forward.releases_late(2, False, True, True)  # masked stores: nothing to defer
    assert forward.releases_late(2, False, False, False)
    monkeypatch.setattr(forward, "LATE_Q_FREE", False)
    assert not forward.releases_late(2, False, True, False)


def test_fp8_releases_its_q_slot_early_only_with_one_slot(monkeypatch):
    # the rule `hopper.forward` launches by (`releases_early`): FP8 with one Q slot (D256's
    # tile at either warpgroup count) gained with it, FP8 D64 and D128 (two slots) lost
    # (H100, 1332Z); bf16's O goes out through Q's tiles, which an early release would hand
    # to the loader while the store still reads them
    from fusedattn.hopper import forward

    for pair, slots in (((64, 64), 2), ((128, 128), 2), ((256, 256), 1)):
        for consumers in (2, 3):
            got = forward.q_slots(forward.tile_entry(pair, True, False), consumers, True)
            assert got == slots, (pair, consumers, got)
            assert forward.releases_early(got, True) == (slots == 1)
            assert not forward.releases_early(got, False)
    monkeypatch.setattr(forward, "FP8_EARLY_Q_FREE", False)
    assert not forward.releases_early(1, True)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_d64_from_2048_rows_against_the_reference(causal):
    # 2100 rows: three warpgroups unmasked (192-row items, the last one ragged), two under
    # the causal mask; GQA 3/1, factors per head
    b, h, hk, s = 1, 3, 1, 2100
    descales = list(_factors("head", h, hk))
    q8, k8, v8 = (_fp8(rand(b, n, s, 64, seed=i) * 2, f) for i, (n, f) in
                  enumerate(((h, descales[0]), (hk, descales[1]), (hk, descales[2]))))
    with use_backend("hopper"):
        out = attention(q8, k8, v8, is_causal=causal, enable_gqa=True, descale_q=descales[0],
                        descale_k=descales[1], descale_v=descales[2])
    ref = attention_ref(*(dequantize(t, f) for t, f in zip((q8, k8, v8), descales,
                                                           strict=True)), causal=causal)
    passes(out, ref, f"2100 rows, causal={causal}",
           peer=fp8_peer(q8, k8, v8, *descales, causal=causal))


def _fp8_inputs(h=2, d=64):
    return tuple(_fp8(rand(1, h, 16, d, seed=i), None) for i in range(3))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_with_empty_and_one_token_sequences(causal, path):
    # each sequence its own keys, bottom-right aligned; empty ones on either side; GQA 4/2
    _check_fp8_varlen((SHORT_Q, SHORT_K) if EMULATION else (RAGGED_Q, RAGGED_K), causal, path)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_with_a_sequence_past_2048_rows(causal):
    # the longest sequence from 2048 rows: three consumer warpgroups without a mask
    # (`hopper.forward.FP8_WARPGROUPS`), two under the causal mask
    _check_fp8_varlen(([2100, 5, 0, 700], [2100, 9, 3, 700]), causal, "hopper")


def _check_fp8_varlen(lengths, causal, path):
    """`attention_varlen` on e4m3 packed sequences of `lengths` (q's, k's), factors per
    head, GQA 4/2, against the float64 reference, bounded by the FP8 peer."""
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(64, lengths=lengths)
    dq, dk, dv = (torch.linspace(a, b, n, device=DEVICE) for a, b, n in
                  ((0.5, 1.0, 4), (0.25, 0.5, 2), (1.0, 2.0, 2)))
    q8, k8, v8 = (_fp8(t.float().transpose(0, 1), f).transpose(0, 1) for t, f in
                  ((q, dq), (k, dk), (v, dv)))
    with use_backend(path):
        out = attention_varlen(q8, k8, v8, cu_q, cu_k, max_q, max_k, is_causal=causal,
                               descale_q=dq, descale_k=dk, descale_v=dv)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    deq = [dequantize(t.transpose(0, 1), f).transpose(0, 1) for t, f in
           ((q8, dq), (k8, dk), (v8, dv))]
    ref = varlen_ref(*deq, cu_q, cu_k, causal=causal)
    # the peer, sequence by sequence (bottom-right, as the packed batch aligns)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    peer = torch.cat([fp8_peer(*(t[a:z].transpose(0, 1) for t, a, z in
                                 ((q8, bq[i], bq[i + 1]), (k8, bk[i], bk[i + 1]),
                                  (v8, bk[i], bk[i + 1]))), dq, dk, dv, causal=causal,
                               align="bottom-right").transpose(0, 1)
                      for i in range(len(bq) - 1)])
    passes(out, ref, f"varlen causal={causal}", peer=peer)


FP8_KV = [  # (cache_seqlens, S_new, Sq, splits, page or None, D, options, descale kind)
    ([30, 0, 49], 1, 1, 3, None, 64, {}, "head"),    # decode, 3 splits; an empty cache, one
                                                     # ending full
    ([20, 7, 33], 2, 2, 4, 16, 128, dict(window=(6, None), softcap=5.0), "tensor"),  # paged
    ([0, 10, 40], 5, 5, 2, None, 64, dict(sinks=True), "head"),  # chunked prefill (a
    # packed tile's rows are 5 queries of 2 heads, each row its head's q factor); sinks
    # added by the merge
    ([0, 0, 0], 0, 1, 2, 16, 64, {}, "tensor"),      # no keys at all: O = 0, LSE = -inf
    ([9, 50, 31], 0, 1, 2, None, 256, {}, "head"),   # the widest head dim, no append
    ([16, 3, 30], 5, 5, 1, None, 64, dict(window=(2, None), sinks=True), "head"),  # a
    # window of 3 keys: the last rows see none of the first key tile the first rows see
    # (16-key tiles in emulation): m stays -inf there, and no -inf - -inf may turn into
    # NaN; one split, so the kernel adds the sinks itself
]


# e4m3 decode's kernels: `tiles.fp8_decode` (few rows a K/V head, FUSEDATTN_FP8_DECODE=1),
# and `_flash_fwd` (the default until the GPU has timed the first, and every call the
# first refuses)
KERNELS = ["fp8_decode", "flash_fwd"]


def _kernel(monkeypatch, kernel):
    from dataclasses import replace

    from fusedattn import configs

    monkeypatch.setattr(configs, "OVERRIDES", replace(configs.OVERRIDES,
                                                      fp8_decode=kernel == "fp8_decode"))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", FP8_KV)
def test_fp8_kvcache_appends_the_bytes_and_attends(case, kernel, monkeypatch):
    # e4m3 q, caches and new keys (FlashAttention-3's form), GQA 4/2: the append copies
    # the bytes; O against the float64 reference of the dequantised values, bounded by
    # the FP8 peer, sequence by sequence (the queries aligned bottom-right), on each kernel
    _kernel(monkeypatch, kernel)
    lengths, s_new, sq, splits, page, d, options, kind = case
    b, h, hk, s_max = 3, 4, 2, 50
    dq, dk, dv = _factors(kind, h, hk)
    dense = [rand(b, hk, s_max, d, seed=i) * 2 for i in (0, 1)]  # K, V before quantising
    k8, v8 = _fp8(dense[0], dk), _fp8(dense[1], dv)
    q8 = _fp8(rand(b, h, sq, d, seed=2) * 2, dq)
    new = [_fp8(rand(b, hk, s_new, d, seed=s) * 2, f) for s, f in ((3, dk), (4, dv))] \
        if s_new else [None, None]
    table = None
    if page:  # the pages quantised as the dense cache was (elementwise: the same bytes)
        (kc, table), (vc, _) = (paged(t, page, 3, 7) for t in dense)
        kc, vc = _fp8(kc, dk), _fp8(vc, dv)
    else:
        kc, vc = k8.clone(), v8.clone()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE) if options.get("sinks") \
        else None
    mask = {n: options[n] for n in ("window", "softcap") if n in options}
    seqlens = i32(lengths)
    out, lse = attention_with_kvcache(q8, kc, vc, cache_seqlens=seqlens, k_new=new[0],
                                      v_new=new[1], block_table=table, splits=splits,
                                      sinks=sinks, descale_q=dq, descale_k=dk, descale_v=dv,
                                      return_lse=True, **mask)
    assert out.dtype == torch.bfloat16 and out.shape == (b, h, sq, d)
    after = seqlens + s_new
    if page:
        keys, values = (paged_to_dense(t, table, after) for t in (kc, vc))
    else:
        keys, values = ([t[i, :, :n] for i, n in enumerate(after.tolist())] for t in (kc, vc))
    for i, n in enumerate(lengths):
        want = [torch.cat([t[i, :, :n]] + ([t_new[i]] if s_new else []), 1)
                for t, t_new in ((k8, new[0]), (v8, new[1]))]
        for got, w in zip((keys[i], values[i]), want, strict=True):
            assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))  # appended
        kw = dict(causal=True, align="bottom-right", sinks=sinks, **mask)
        ref, ref_lse = attention_ref(dequantize(q8[i], dq), dequantize(want[0], dk),
                                     dequantize(want[1], dv), return_lse=True, **kw)
        peer = fp8_peer(q8[i], *want, dq, dk, dv, **kw)
        passes(out[i], ref, f"{case} sequence {i}", peer=peer)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[i]).cpu(), seen)
        if seen.any():
            off = (lse[i].double().cpu() - ref_lse)[seen]
            bound = _lse_bound(dequantize(q8[i], dq), dequantize(want[0], dk))[seen]
            assert (off.abs() <= bound).all(), \
                f"{case} sequence {i}: the LSE is off by {off.abs().max():.2e}"
        else:
            assert torch.all(out[i] == 0)


def _lse_bound(q, k):
    """How far an e4m3 kernel's LSE may be from the float64 one, row by row, `q [H, Sq, D]`
    and `k [H_kv, Sk, D]` dequantised: the LSE moves by no more than the largest score's
    error, and a wgmma sums e4m3 products in the tensor cores' own accumulator (about 14
    bits kept, DeepSeek-V3's report; `fp8_decode` adds each instruction's sum in fp32, an
    mma's in `_flash_fwd`), so a score errs by up to about 2^-14 of its products'
    magnitudes; 1e-3 beside it for the rest of the sum (what `_flash_fwd` met alone). The
    tier found 1.1-1.5e-3 (fp8_decode, D64 with sinks, D256), so a wrong sink, scale or
    mask, which moves the LSE by far more, still fails it."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    mass = (q.abs().double() @ k.abs().double().transpose(-1, -2)).amax(-1)
    return 1e-3 + 2.0 ** -14 * mass.cpu() / q.shape[-1] ** 0.5


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_kvcache_replays_with_new_factors_and_lengths(kernel, monkeypatch):
    # a check_lengths=False decode loop keeps its plan (`dispatch.kept_forward`): the
    # factors and lengths of each step are read afresh, never the first step's
    _kernel(monkeypatch, kernel)
    b, h, hk, d = 2, 2, 1, 64
    kc, vc = (_fp8(rand(b, hk, 40, d, seed=i), None) for i in (0, 1))
    q8 = _fp8(rand(b, h, 1, d, seed=2), None)
    for step, (n, dv) in enumerate(((10, 1.0), (25, 3.0), (40, 0.5))):
        lens, dv = i32([n, n - 5]), torch.tensor(dv, device=DEVICE)
        out = attention_with_kvcache(q8, kc, vc, cache_seqlens=lens, descale_v=dv,
                                     check_lengths=False)
        for i, m in enumerate((n, n - 5)):
            kw = dict(causal=True, align="bottom-right")
            want = (kc[i, :, :m], vc[i, :, :m])
            passes(out[i], attention_ref(q8[i], want[0], dequantize(want[1], dv), **kw),
                   f"step {step} sequence {i}", peer=fp8_peer(q8[i], *want, None, None, dv,
                                                               **kw))


def test_fp8_decode_takes_its_own_kernel_and_tile(monkeypatch):
    # e4m3 decode of up to MAX_ROWS rows a K/V head runs `tiles.fp8_decode` at its tile
    # rule; past it, with the override off, or with V's rows off 4-byte words, `_flash_fwd`
    # at the e4m3 config rule (not the 16-bit table's entry: `configs.decode_config`); bf16
    # decode asks the table for its own. Each result against the reference
    from fusedattn.tiles import flash, fp8_decode
    from inputs import forget_plans

    forget_plans()
    asked, real = [], (flash.decode_config, flash.fp8_decode_config)
    monkeypatch.setattr(flash, "decode_config",
                        lambda **kw: asked.append(("flash_fwd", kw["fp8"])) or real[0](**kw))
    monkeypatch.setattr(flash, "fp8_decode_config",
                        lambda **kw: asked.append(("fp8_decode", kw["rows"])) or real[1](**kw))
    group = fp8_decode.MAX_ROWS // 2

    def call(sq, heads, dtype=FP8, offset=0, kernel="fp8_decode"):
        _kernel(monkeypatch, kernel)
        kc, vc = (_fp8(rand(1, 1, 20, 64 + offset, seed=i), None)[..., offset:]
                  for i in (0, 1))
        q8 = _fp8(rand(1, heads, sq, 64, seed=2), None)
        q, k, v = (t.to(dtype) for t in (q8, kc, vc))
        out = attention_with_kvcache(q, k, v, cache_seqlens=i32([20]), splits=2)
        kw = dict(causal=True, align="bottom-right")
        passes(out[0], attention_ref(q[0], k[0], v[0], **kw), f"sq={sq} heads={heads}",
               peer=fp8_peer(q8[0], kc[0], vc[0], None, None, None, **kw))

    call(2, group)                                  # 2 x 16 rows: MAX_ROWS
    call(3, group)                                  # 48 rows
    call(1, 2, kernel="flash_fwd")                  # the override off
    call(1, 2, offset=1)                            # V's rows on odd bytes
    call(1, 2, dtype=torch.bfloat16)
    assert asked == [("fp8_decode", fp8_decode.MAX_ROWS), ("flash_fwd", True),
                     ("flash_fwd", True), ("flash_fwd", True), ("flash_fwd", False)]


@triton.jit
def _widen(p_words, p_out, N: tl.constexpr, W: tl.constexpr):
    rows, cols = tl.arange(0, N), tl.arange(0, W)
    words = tl.load(p_words + rows[:, None] * W + cols[None, :])
    tl.store(p_out + rows[:, None] * 4 * W + tl.arange(0, 4 * W)[None, :],
             _widen_e4m3(words))


@pytest.mark.parametrize("shape", [(16, 4), (64, 16)])
def test_every_e4m3_byte_widens_to_its_fp16_value(shape):
    # `fp8_decode._widen_e4m3` (the GPU's PTX; the interpreter's byte ops) against torch's
    # e4m3 -> fp16 on every byte value at every position of a word, NaNs included
    n, w = shape
    values = torch.arange(n * w * 4, device=DEVICE) * 7 % 256  # each byte at each place
    data = values.to(torch.uint8).view(n, 4 * w)
    out = torch.empty(n, 4 * w, dtype=torch.float16, device=DEVICE)
    _widen[(1,)](data.view(torch.int32), out, N=n, W=w)
    want = data.view(FP8).to(torch.float16)
    nan = want.isnan()  # 0x7f and 0xff
    assert torch.equal(out[~nan], want[~nan])
    if not EMULATION:  # (the interpreter widens e4m3's NaN bytes to +-480)
        assert out[nan].isnan().all()


@pytest.mark.parametrize("call, field, allowed", [
    (lambda q, k, v: attention(q, k, v, precision="ieee"), "precision", "float8_e4m3fn"),
    (lambda q, k, v: attention(q, k, v, descale_q=torch.ones(3, device=DEVICE)),
     "descale_q.shape", "[2] (per head)"),
    (lambda q, k, v: attention(q, k, v, descale_k=torch.ones(1, dtype=torch.float16,
                                                             device=DEVICE)),
     "descale_k.dtype", "float32"),
    (lambda q, k, v: attention(q, k, v, descale_v=2.0), "descale_v", "torch.Tensor"),
    (lambda q, k, v: attention(q.to(torch.bfloat16), k.to(torch.bfloat16),
                               v.to(torch.bfloat16), descale_q=torch.ones(1, device=DEVICE)),
     "descale_q", "None for bfloat16"),
    (lambda q, k, v: attention(q, k.to(torch.bfloat16), v), "dtypes", "one dtype"),
    (lambda q, k, v: attention(q.to(torch.float8_e5m2), k.to(torch.float8_e5m2),
                               v.to(torch.float8_e5m2)), "q.dtype", "float8_e4m3fn"),
    (lambda q, k, v: attention(*_fp8_inputs(d=96)), "head_dim", "64, 128, 256"),
    (lambda q, k, v: attention(q, k, v, sinks=torch.zeros(2, device=DEVICE,
                                                          requires_grad=True)),
     "requires_grad", "train in bfloat16"),
    (lambda q, k, v: attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                      v[0].transpose(0, 1), i32([0, 16]), i32([0, 16]), 16,
                                      16, precision="tf32"), "precision", "float8_e4m3fn"),
    (lambda q, k, v: attention_with_kvcache(q, k, v, cache_seqlens=i32([16]),
                                            precision="ieee"), "precision", "float8_e4m3fn"),
    (lambda q, k, v: attention_with_kvcache(q, k, v, cache_seqlens=i32([16]),
                                            descale_k=torch.ones(2, 1, device=DEVICE)),
     "descale_k.shape", "[2] (per head)"),
    (lambda q, k, v: attention_with_kvcache(q, k, v, cache_seqlens=i32([4]),
                                            k_new=k[..., :2, :].to(torch.bfloat16),
                                            v_new=v[..., :2, :].to(torch.bfloat16)),
     "k_new.dtype", "torch.float8_e4m3fn"),
    (lambda q, k, v: attention_with_kvcache(q.to(torch.bfloat16), k.to(torch.bfloat16),
                                            v.to(torch.bfloat16), cache_seqlens=i32([16]),
                                            descale_v=torch.ones(1, device=DEVICE)),
     "descale_v", "None for bfloat16"),
])
def test_fp8_refuses_what_it_does_not_take(call, field, allowed):
    with pytest.raises(ProblemError) as e:
        call(*_fp8_inputs())
    assert e.value.field == field and allowed in str(e.value), str(e.value)


@pytest.mark.parametrize("entry", ["attention", "varlen"])
def test_a_float8_input_requiring_grad_is_refused_after_a_call_whose_factor_did(entry):
    # the call caches key each tensor's requires_grad, not only whether one tensor's is set:
    # a descale factor that requires grad is taken (factors get no gradient), and its
    # call's cached decisions must not let through a float8 q that requires grad, on the
    # same metadata otherwise (they had: the output came back with no graph). (The KV
    # cache's entry is inference only: it takes no gradient from any input.)
    def call(q, k, v, factor):
        if entry == "attention":
            return attention(q, k, v, descale_q=factor)
        return attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), i32([0, 16]),
                                i32([0, 16]), 16, 16, descale_q=factor, check_lengths=False)

    q, k, v = _fp8_inputs()
    factor = torch.full((1,), 0.5, device=DEVICE, requires_grad=True)
    assert call(q, k, v, factor).dtype == torch.bfloat16  # taken
    with pytest.raises(ProblemError) as e:
        call(q.detach().requires_grad_(), k, v, factor)
    assert e.value.field == "requires_grad", str(e.value)


def test_fp8_on_the_hopper_path_takes_its_head_dims_and_says_why_not_others():
    q8, k8, v8 = _fp8_inputs(d=64)
    assert "head dims" not in (hopper_refusal(q8, k8, v8, mask=Mask()) or "")
    # the portable kernel takes V's own head dim in FP8; the Hopper one takes equal pairs
    q8, k8, _ = _fp8_inputs(d=128)
    why = hopper_refusal(q8, k8, v8, mask=Mask())
    assert "head dims 128 (q, k) and 64 (v)" in why
    assert "64/64, 128/128, 256/256 in torch.float8_e4m3fn" in why
    with use_backend("hopper"), pytest.raises(ProblemError, match="and 64 .v."):
        attention(q8, k8, v8)
    with use_backend("portable"):
        assert attention(q8, k8, v8).shape == (1, 2, 16, 64)


def _kernel_order(keys: int) -> torch.Tensor:
    """Where V^T puts each of `keys` keys (a multiple of 16): key a0 + 2 a1 + 4 a2 + 8 a3
    of each 16 at column a0 + 2 a3 + 4 a1 + 8 a2 (`hopper/transpose.py`)."""
    k = torch.arange(keys)
    bit = [(k >> i) & 1 for i in range(4)]
    return (k - k % 16) + bit[0] + 2 * bit[3] + 4 * bit[1] + 8 * bit[2]


def _in_kernel_order(vt: torch.Tensor) -> torch.Tensor:
    """V^T's columns (keys) back in key order."""
    return vt[..., _kernel_order(vt.shape[-1])]


@pytest.mark.parametrize("seq, dim", [(1, 64), (70, 128), (129, 256)])
def test_fp8_v_transposed_for_the_hopper_kernel(seq, dim):
    from fusedattn.hopper.transpose import v_transposed

    # a `[B, S, H, D]` layout seen as `[B, H, S, D]`: V's strides are not its shape's
    v8 = _fp8(rand(2, seq, 3, dim, seed=4), None).transpose(1, 2)
    vt, cu_t = v_transposed(v8)
    padded = -(-seq // 16) * 16
    assert cu_t is None and vt.shape == (2, 3, dim, padded) and vt.is_contiguous()
    keys = _in_kernel_order(vt.view(torch.uint8))
    assert torch.equal(keys[..., :seq], v8.transpose(2, 3).contiguous().view(torch.uint8))
    # the padding is zeros (the kernel's last key tile reads it: 0 * P, never a NaN)
    assert (keys[..., seq:] == 0).all()
    if seq > 8:  # the order is not the keys': key 8 of a tile is its column 2
        assert torch.equal(vt.view(torch.uint8)[..., 2], v8.view(torch.uint8)[:, :, 8])


def test_fp8_v_transposed_of_a_packed_batch_starts_each_sequence_on_16_columns():
    from fusedattn.hopper.transpose import v_transposed
    from fusedattn.tiles.common import Varlen

    lengths = [5, 0, 16, 1, 70]  # an empty one, one already aligned
    cu = offsets(lengths)
    v8 = _fp8(rand(1, sum(lengths), 2, 64, seed=5), None).transpose(1, 2)
    vt, cu_t = v_transposed(v8, varlen=Varlen(cu, cu, max(lengths), max(lengths)))
    starts = [0, 16, 16, 32, 48, 128]  # each length rounded up to 16, summed
    # V^T's width a multiple of 16 (its row stride in bytes, as TMA needs): 92 -> 96, + 16 B
    assert cu_t.tolist() == starts and vt.shape == (1, 2, 64, 96 + 16 * 5)
    bits, want = _in_kernel_order(vt.view(torch.uint8)), v8.transpose(2, 3).view(torch.uint8)
    written = torch.zeros(vt.shape[-1], dtype=torch.bool)
    for b, n in enumerate(lengths):
        first = cu[b].item()
        assert torch.equal(bits[..., starts[b]:starts[b] + n], want[..., first:first + n])
        written[starts[b]:starts[b] + n] = True
    # every other column, each sequence's padding and the slack after the last, is zero
    assert (bits[..., ~written] == 0).all()


BACKWARD_CASES = [  # (B, H, H_kv, Sq, Sk, D, options, descale kind, dO in fp8)
    (1, 1, 1, 1, 1, 64, {}, None, False),
    (2, 2, 2, 33, 31, 64, {}, "tensor", False),
    (1, 4, 2, 70, 75, 64, dict(is_causal=True), "head", True),      # GQA, dO in e4m3
    (1, 2, 1, 40, 100, 128, dict(is_causal=True), "head", False),   # MQA, Sq < Sk
    (1, 2, 2, 64, 64, 64, dict(window=(8, 4), softcap=5.0), "head", False),
]


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_fp8_backward_against_float64_autograd_of_the_dequantised_inputs(case):
    b, h, hk, sq, sk, d, options, kind, fp8_dout = case
    descales = list(_factors(kind, h, hk))
    q8, k8, v8 = (_fp8(rand(b, n, s, d, seed=i) * 2, f) for i, (n, s, f) in
                  enumerate(((h, sq, descales[0]), (hk, sk, descales[1]), (hk, sk, descales[2]))))
    factors = dict(descale_q=descales[0], descale_k=descales[1], descale_v=descales[2])
    dout = rand(b, h, sq, d, seed=7, dtype=torch.bfloat16)
    descale_do = None
    if fp8_dout:  # dO in e4m3 with a factor per head
        descale_do = torch.linspace(0.01, 0.02, h, device=DEVICE)
        dout = _fp8(dout.float(), descale_do)
    grads = attention_fp8_backward(dout, q8, k8, v8, descale_do=descale_do,
                                   enable_gqa=h != hk, precision="fp32", **options, **factors)
    ref_kw = dict(causal=options.get("is_causal", False), window=options.get("window"),
                  softcap=options.get("softcap"))
    deq = [dequantize(t, f) for t, f in zip((q8, k8, v8), descales, strict=True)]
    dout_ref = dequantize(dout, descale_do)
    refs = attention_ref_grads(*deq, dout_ref, device=DEVICE, **ref_kw)
    peers = fp8_backward_peer(dout_ref, q8, k8, v8, *descales, **ref_kw)
    for name, g, r, p, t in zip(("dq", "dk", "dv"), grads, refs, peers, (q8, k8, v8),
                                strict=True):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape, name
        passes(g, r, f"{name} {case}", peer=p)


@pytest.mark.parametrize("case", BACKWARD_CASES + [
    (1, 2, 2, 48, 48, 256, dict(is_causal=True), "tensor", False)])  # D256: bf16 takes it
def test_fp8_backward_in_bf16_within_twice_the_bf16_formulas_error(case):
    # precision="bf16": the bf16 kernels on the dequantised values rounded to bfloat16;
    # bounded by twice the same formulas' error done by torch in bfloat16
    b, h, hk, sq, sk, d, options, kind, fp8_dout = case
    descales = list(_factors(kind, h, hk))
    q8, k8, v8 = (_fp8(rand(b, n, s, d, seed=i) * 2, f) for i, (n, s, f) in
                  enumerate(((h, sq, descales[0]), (hk, sk, descales[1]), (hk, sk, descales[2]))))
    dout = rand(b, h, sq, d, seed=7, dtype=torch.bfloat16)
    descale_do = None
    if fp8_dout:
        descale_do = torch.linspace(0.01, 0.02, h, device=DEVICE)
        dout = _fp8(dout.float(), descale_do)
    grads = attention_fp8_backward(dout, q8, k8, v8, descale_do=descale_do,
                                   enable_gqa=h != hk, precision="bf16", **options,
                                   descale_q=descales[0], descale_k=descales[1],
                                   descale_v=descales[2])
    ref_kw = dict(causal=options.get("is_causal", False), window=options.get("window"),
                  softcap=options.get("softcap"))
    deq = [dequantize(t, f) for t, f in zip((q8, k8, v8), descales, strict=True)]
    dout_ref = dequantize(dout, descale_do)
    refs = attention_ref_grads(*deq, dout_ref, device=DEVICE, **ref_kw)
    peers = fp8_backward_peer(dout_ref, q8, k8, v8, *descales, dtype=torch.bfloat16, **ref_kw)
    for name, g, r, p, t in zip(("dq", "dk", "dv"), grads, refs, peers, (q8, k8, v8),
                                strict=True):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape, name
        passes(g, r, f"{name} {case}", peer=p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantised_in_one_launch_are_the_float64_routes_bits(dtype):
    # every one of the 256 codes (NaNs, subnormals, both zeros) and random ones, per
    # tensor, per head and without a factor, a non-contiguous tensor and an empty one:
    # the table's gather gives exactly what dequantize(...).to(dtype) gives
    from fusedattn.tiles.dequantize import dequantize_as

    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(FP8)
    every = codes.repeat(3 * 5).reshape(1, 3, 5, 256)
    noise = torch.randint(0, 256, (2, 3, 37, 24), dtype=torch.uint8, device=DEVICE).view(FP8)
    for t in (every, noise, noise.transpose(-1, -2), noise[:, :, :0]):
        for descale in (None, torch.tensor([0.37], device=DEVICE),
                        torch.tensor([3e-3, 1.7, 448.0], device=DEVICE)):
            got = dequantize_as(t, descale, dtype)
            want = dequantize(t, descale).to(dtype)
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert got.dtype == dtype and got.shape == t.shape
            assert torch.equal(got.view(bits), want.contiguous().view(bits)), descale


def test_fp8_backward_by_default_is_attentions_backward_on_the_dequantised_values():
    # the default route (precision "bf16") takes every option through: sinks (their
    # gradient too), a window, softcap, the scale, GQA: the same bits as autograd of
    # `attention` on the bf16 values
    q8, k8, v8 = (_fp8(rand(1, n, 40, 64, seed=i), None) for i, n in enumerate((4, 2, 2)))
    dq = torch.linspace(0.5, 2.0, 4, device=DEVICE)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=DEVICE)
    dout = rand(1, 4, 40, 64, seed=5, dtype=torch.bfloat16)
    options = dict(window=(9, 0), softcap=20.0, scale=0.2, enable_gqa=True)
    got = attention_fp8_backward(dout, q8, k8, v8, descale_q=dq, sinks=sinks, **options)
    leaves = [dequantize(q8, dq).to(torch.bfloat16).requires_grad_(),
              k8.to(torch.bfloat16).requires_grad_(), v8.to(torch.bfloat16).requires_grad_(),
              sinks.clone().requires_grad_()]
    out = attention(*leaves[:3], sinks=leaves[3], **options)
    want = torch.autograd.grad(out, leaves, dout)
    assert len(got) == 4 and got[3].dtype == torch.float32
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with torch.inference_mode():  # (autograd inside it refused inference tensors before)
        again = attention_fp8_backward(dout, q8, k8, v8, descale_q=dq, sinks=sinks, **options)
    for g, w in zip(again, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(ProblemError) as e:
        attention_fp8_backward(dout, q8, k8, v8, enable_gqa=True, precision="fp16")
    assert e.value.field == "precision" and "bf16" in str(e.value)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fp8_backward_of_one_head_without_its_axes(precision):
    # [S, D] inputs, as `attention` takes them: the gradients of [1, 1, S, D], reshaped
    q8, k8, v8 = (t[0, 0] for t in _fp8_inputs(h=1))
    dout = rand(16, 64, seed=5, dtype=torch.bfloat16)
    got = attention_fp8_backward(dout, q8, k8, v8, is_causal=True, precision=precision,
                                 descale_k=torch.tensor(0.5, device=DEVICE))
    want = attention_fp8_backward(dout[None, None], q8[None, None], k8[None, None],
                                  v8[None, None], is_causal=True, precision=precision,
                                  descale_k=torch.tensor(0.5, device=DEVICE))
    for g, w in zip(got, want, strict=True):
        assert g.shape == (16, 64) and torch.equal(g, w[0, 0])


def test_fp8_backward_gives_the_sinks_gradient_and_checks_its_inputs():
    q8, k8, v8 = _fp8_inputs()
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    dout = rand(1, 2, 16, 64, seed=5, dtype=torch.bfloat16)
    *_, dsinks = attention_fp8_backward(dout, q8, k8, v8, is_causal=True, sinks=sinks,
                                        precision="fp32")
    ref = attention_ref_grads(q8, k8, v8, dout, causal=True, sinks=sinks, device=DEVICE)[3]
    assert dsinks.dtype == torch.float32 and dsinks.shape == (2,)
    passes(dsinks, ref, "dsinks")  # fp32's bound: O and the LSE recomputed in fp32
    for bad, field in ((dict(dout=dout[..., :32]), "dout.shape"),
                       (dict(dout=dout.to(torch.float8_e5m2)), "dout.dtype"),
                       (dict(descale_do=torch.ones(1, device=DEVICE)), "descale_do"),
                       (dict(q=q8.to(torch.bfloat16), k=k8.to(torch.bfloat16),
                             v=v8.to(torch.bfloat16)), "q.dtype"),
                       (dict(q=_fp8_inputs(d=256)[0], k=_fp8_inputs(d=256)[1],
                             v=_fp8_inputs(d=256)[2], dout=rand(1, 2, 16, 256)), "head_dim")):
        args = dict(dout=dout, q=q8, k=k8, v=v8) | bad
        kw = {"descale_do": args.pop("descale_do")} if "descale_do" in args else {}
        with pytest.raises(ProblemError) as e:
            attention_fp8_backward(args["dout"], args["q"], args["k"], args["v"],
                                   is_causal=True, precision="fp32", **kw)
        assert e.value.field == field, (field, str(e.value))


# packed sequences for the varlen backward: an empty one with keys, one token, Sq < Sk, and
# queries with no key (their rows' gradients are 0)
VARLEN_BACKWARD_LENGTHS = ([5, 0, 1, 37, 20], [5, 3, 1, 50, 0])


def _fp8_packed(lengths=VARLEN_BACKWARD_LENGTHS, dim=64):
    """Packed e4m3 q, k, v (GQA 4/2) at factors per head, the factors, the offsets and the
    longest lengths."""
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(dim, lengths=lengths)
    factors = tuple(torch.linspace(a, b, n, device=DEVICE) for a, b, n in
                    ((0.5, 1.0, 4), (0.25, 0.5, 2), (1.0, 2.0, 2)))
    q8, k8, v8 = (_fp8((t.float() * 2).transpose(0, 1), f).transpose(0, 1)
                  for t, f in zip((q, k, v), factors, strict=True))
    return (q8, k8, v8), factors, (cu_q, cu_k, max_q, max_k)


def _packed_values(t, descale):
    """float64 values of a packed `[total, H, D]` float8 tensor (factors per head)."""
    return dequantize(t.transpose(0, 1), descale).transpose(0, 1)


@pytest.mark.parametrize("options", [
    dict(is_causal=True),
    dict(window=(6, 3), softcap=5.0, sinks=True),
])
def test_fp8_varlen_backward_against_float64_autograd_of_the_dequantised_inputs(options):
    # precision="fp32", dO in e4m3 with a factor per head; bounded sequence by sequence by
    # the FP8 backward's peer (bottom-right, as the packed batch aligns)
    (q8, k8, v8), factors, (cu_q, cu_k, max_q, max_k) = _fp8_packed()
    options = dict(options)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=DEVICE) if options.pop("sinks", 0) \
        else None
    descale_do = torch.linspace(0.01, 0.02, 4, device=DEVICE)
    dout = _fp8(rand(q8.shape[0], 4, 64, seed=7).transpose(0, 1), descale_do).transpose(0, 1)
    grads = attention_varlen_fp8_backward(
        dout, q8, k8, v8, cu_q, cu_k, max_q, max_k, descale_q=factors[0],
        descale_k=factors[1], descale_v=factors[2], descale_do=descale_do, sinks=sinks,
        precision="fp32", **options)
    assert len(grads) == (3 if sinks is None else 4)
    deq = [_packed_values(t, f) for t, f in zip((q8, k8, v8), factors, strict=True)]
    dout_ref = _packed_values(dout, descale_do)
    ref_kw = dict(window=options.get("window"), softcap=options.get("softcap"))
    refs = varlen_ref_grads(*deq, dout_ref, cu_q, cu_k, causal=options.get("is_causal", False),
                            sinks=sinks, **ref_kw)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    per_sequence = [fp8_backward_peer(
        *(t[a:z].transpose(0, 1) for t, a, z in ((dout_ref, bq[i], bq[i + 1]),
                                                 (q8, bq[i], bq[i + 1]), (k8, bk[i], bk[i + 1]),
                                                 (v8, bk[i], bk[i + 1]))),
        *factors, causal=options.get("is_causal", False), align="bottom-right", **ref_kw)
        for i in range(len(bq) - 1)]
    peers = [torch.cat([p[n].transpose(0, 1) for p in per_sequence]) for n in range(3)]
    for name, g, r, p, t in zip(("dq", "dk", "dv"), grads, refs, peers, (q8, k8, v8),
                                strict=False):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape, name
        passes(g, r, f"{name} {options}", peer=p)
    if sinks is not None:
        assert grads[3].dtype == torch.float32 and grads[3].shape == (4,)
        passes(grads[3], refs[3], "dsinks")


def test_fp8_varlen_backward_by_default_is_varlens_backward_on_the_dequantised_values():
    # precision "bf16": the same bits as autograd of `attention_varlen` on the values,
    # dequantised by the reference with each factor on its head (the packed layout's
    # axis), rounded to bfloat16; the options and sinks reach it
    (q8, k8, v8), factors, (cu_q, cu_k, max_q, max_k) = _fp8_packed()
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=DEVICE)
    dout = rand(q8.shape[0], 4, 64, seed=5, dtype=torch.bfloat16)
    options = dict(is_causal=True, window=(9, None), softcap=20.0, scale=0.2)
    got = attention_varlen_fp8_backward(dout, q8, k8, v8, cu_q, cu_k, max_q, max_k,
                                        descale_q=factors[0], descale_k=factors[1],
                                        descale_v=factors[2], sinks=sinks, **options)
    leaves = [_packed_values(t, f).to(torch.bfloat16).requires_grad_()
              for t, f in zip((q8, k8, v8), factors, strict=True)]
    leaves.append(sinks.clone().requires_grad_())
    out = attention_varlen(*leaves[:3], cu_q, cu_k, max_q, max_k, sinks=leaves[3], **options)
    want = torch.autograd.grad(out, leaves, dout)
    assert len(got) == 4
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_fp8_varlen_backward_refuses_what_it_does_not_take():
    (q8, k8, v8), factors, (cu_q, cu_k, max_q, max_k) = _fp8_packed()
    dout = rand(q8.shape[0], 4, 64, seed=5, dtype=torch.bfloat16)
    cases = [  # (argument changes, the field named)
        (dict(dout=dout[:-1]), "dout.shape"),
        (dict(dout=dout.to(torch.float8_e5m2)), "dout.dtype"),
        (dict(descale_do=torch.ones(4, device=DEVICE)), "descale_do"),  # dout not e4m3
        (dict(q=q8.to(torch.bfloat16)), "q.dtype"),
        (dict(max_seqlen_q=max_q - 1), "max_seqlen_q"),  # would skip rows
        (dict(cu_seqlens_k=cu_k[:-1]), "cu_seqlens_k"),  # one sequence fewer than q's
        (dict(precision="fp16"), "precision"),
        (dict(check_lengths=1), "check_lengths"),
    ]
    for changes, field in cases:
        args = dict(dout=dout, q=q8, k=k8, v=v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=max_q, max_seqlen_k=max_k) | changes
        positional = [args.pop(n) for n in ("dout", "q", "k", "v", "cu_seqlens_q",
                                            "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
        with pytest.raises(ProblemError) as e:
            attention_varlen_fp8_backward(*positional, is_causal=True, **args)
        assert e.value.field.startswith(field), (field, str(e.value))
    # descale_do of e4m3 dO: one factor per query head, on the packed layout's head axis
    dout8 = dout.to(FP8)
    with pytest.raises(ProblemError) as e:
        attention_varlen_fp8_backward(dout8, q8, k8, v8, cu_q, cu_k, max_q, max_k,
                                      descale_do=torch.ones(3, device=DEVICE))
    assert e.value.field == "descale_do.shape" and "[4]" in str(e.value), str(e.value)
    # precision="fp32" at D256 (the bf16 route takes it)
    (q8, k8, v8), _, (cu_q, cu_k, max_q, max_k) = _fp8_packed(([3, 4], [5, 2]), dim=256)
    with pytest.raises(ProblemError) as e:
        attention_varlen_fp8_backward(rand(7, 4, 256, seed=1), q8, k8, v8, cu_q, cu_k,
                                      max_q, max_k, precision="fp32")
    assert e.value.field == "head_dim"


def test_fp8_traces_under_torch_compile_without_a_graph_break():
    q8, k8, v8 = _fp8_inputs()
    dq = torch.tensor([0.5, 2.0], device=DEVICE)

    def f(q, k, v, d):
        return attention(q, k, v, is_causal=True, descale_q=d)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # fails on a break
    got = compiled(q8, k8, v8, dq)
    assert got.dtype == torch.bfloat16 and torch.equal(got, f(q8, k8, v8, dq))
