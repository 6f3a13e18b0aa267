"""Plans (issue 31): a call whose metadata was seen skips its checks and decisions, and its
launches are replayed (`fusedattn.launch`) on the new call's tensors. What a replay passes
must be exactly what a fresh call passes: these tests compare replays with the float64
reference and, bit for bit, with the same call made with no plan; and check that what the
keys leave out (tensor contents, varlen offsets) stays out, and what they must hold (the
options' types, strides, alignment) is in them."""

import math
import sys

import pytest
import torch

from fusedattn import attention, attention_varlen, dispatch, launch
from fusedattn.api import _CALLS
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref, attention_ref_grads, varlen_ref, varlen_ref_grads
from fusedattn.tiles import flash_bwd
from fusedattn_lab.verify import check
from inputs import background_done, forget_plans, i32, passes, rand, script


def _fresh(fn):
    """`fn()` with every plan forgotten first: the full path's result."""
    forget_plans()
    return fn()


CASES = [  # (dtype, B, H, H_kv, S, D, options)
    (torch.float32, 2, 2, 2, 37, 16, dict(is_causal=True)),
    (torch.float16, 1, 4, 2, 29, 32, dict(enable_gqa=True, window=(5, 3), softcap=20.0)),
    (torch.float32, 1, 2, 1, 18, 24, dict(enable_gqa=True, scale=0.3)),
]


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_call_matches_the_reference_and_the_fresh_call(case):
    dtype, b, h, hkv, s, d, options = case
    for seed in range(3):  # the first call makes the plan, the others replay it
        q, k, v = (rand(b, n, s, d, dtype=dtype, seed=seed * 3 + i)
                   for i, n in enumerate((h, hkv, hkv)))
        plans = len(dispatch._PLANS)
        out, lse = attention(q, k, v, return_lse=True, **options)
        if seed:
            assert len(dispatch._PLANS) == plans, "a replayable call made a new plan"
        ref, ref_lse = attention_ref(q, k, v, causal=options.get("is_causal", False),
                                     scale=options.get("scale"), window=options.get("window"),
                                     softcap=options.get("softcap"), return_lse=True)
        # fp16: the bound of an fp16 peer's error on these inputs (as test_flash's)
        result = check(out, ref, peer_error=1e-3 if dtype == torch.float16 else None)
        assert result.ok, result.reasons
        assert torch.allclose(lse.double().cpu(), ref_lse, atol=1e-3, rtol=1e-3)
        fresh, fresh_lse = _fresh(lambda q=q, k=k, v=v: attention(q, k, v, return_lse=True,
                                                                  **options))
        replayed, replayed_lse = attention(q, k, v, return_lse=True, **options)
        assert torch.equal(fresh, replayed) and torch.equal(fresh_lse, replayed_lse)


@pytest.mark.parametrize("entry", ["attention", "varlen"])
def test_an_inference_call_without_return_lse_makes_and_writes_no_lse(entry, monkeypatch):
    # issue 31: a call that neither returns the LSE nor keeps it for a backward allocates
    # O alone (one allocation fewer a call) and launches with no LSE (WRITE_LSE off); O is
    # the same bits as the call that returns the LSE, and both match the reference
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "empty" in func.__name__:
                self.made.append(func.__name__)
            return func(*args, **(kwargs or {}))

    if entry == "attention":
        q, k, v = (rand(1, 2, 37, 16, dtype=torch.float32, seed=i) for i in range(3))
        ref = attention_ref(q, k, v, causal=True)

        def call(return_lse):
            return attention(q, k, v, is_causal=True, return_lse=return_lse)
    else:
        q, k, v = (rand(50, 2, 16, dtype=torch.float32, seed=i) for i in range(3))
        cu = i32([0, 13, 50])
        ref = varlen_ref(q, k, v, cu, cu, causal=True)

        def call(return_lse):
            return attention_varlen(q, k, v, cu, cu, 37, 37, is_causal=True,
                                    return_lse=return_lse)
    outs = {}
    for return_lse in (False, True):
        result = _fresh(lambda r=return_lse: call(r))  # records the plan
        outs[return_lse] = result[0] if return_lse else result
        passes(outs[return_lse], ref)
    assert torch.equal(outs[False], outs[True])
    counts = {}
    with monkeypatch.context() as patch:  # the replays' host path alone, no kernel run
        patch.setattr(launch.Replay, "__call__", lambda self, inputs: None)
        for return_lse in (False, True):
            call(return_lse)  # (its plan, recorded with no plan for the other)
            with Allocations() as seen:
                call(return_lse)
            counts[return_lse] = len(seen.made)
    assert counts == {False: 1, True: 2}, counts


def test_strides_and_alignment_are_in_the_key():
    """A transposed layout and a view one element off its alignment are other plans, each
    right; the first layout's plan is not replayed on them."""
    q, k, v = (rand(1, 2, 24, 16, seed=i) for i in range(3))
    passes(attention(q, k, v), attention_ref(q, k, v))
    t = [rand(1, 24, 2, 16, seed=i).transpose(1, 2) for i in range(3)]
    passes(attention(*t), attention_ref(*t))
    flat = [rand(1 + 2 * 24 * 16, seed=i) for i in range(3)]
    off = [f[1:].view(1, 2, 24, 16) for f in flat]  # 4 bytes past the allocation's start
    passes(attention(*off), attention_ref(*off))


def test_the_call_cache_keeps_refusing_what_it_refused():
    """A cached key must not let in an option that hashes like an allowed one."""
    q, k, v = (rand(1, 1, 8, 16, seed=i) for i in range(3))
    attention(q, k, v, scale=1.0, is_causal=True, window=(1, 0))
    with pytest.raises(ProblemError, match="scale"):
        attention(q, k, v, scale=True, is_causal=True, window=(1, 0))
    with pytest.raises(ProblemError, match="is_causal"):
        attention(q, k, v, scale=1.0, is_causal=1, window=(1, 0))
    with pytest.raises(ProblemError, match="window"):
        attention(q, k, v, scale=1.0, is_causal=True, window=(True, 0))
    with pytest.raises(ProblemError, match="window"):
        attention(q, k, v, scale=1.0, is_causal=True, window=[1, [0]])


def test_a_replayed_backward_matches_the_reference():
    for seed in range(3):
        q, k, v = (rand(1, 2, 21, 16, seed=seed * 3 + i, grad=True) for i in range(3))
        dout = rand(1, 2, 21, 16, seed=99 + seed)
        plans = len(flash_bwd._PLANS)
        got = torch.autograd.grad(attention(q, k, v, is_causal=True), (q, k, v), dout)
        if seed:
            assert len(flash_bwd._PLANS) == plans
        want = attention_ref_grads(q, k, v, dout, causal=True)
        for g, w in zip(got, want, strict=True):
            passes(g, w)


def test_varlen_offsets_are_read_per_call_not_kept_in_the_plan():
    """Two packed batches with the same totals and max lengths but other offsets: one
    plan, each call its own sequences."""
    q, k, v = (rand(30, 2, 16, seed=i) for i in range(3))
    for bounds in ([0, 10, 30], [0, 20, 30], [0, 5, 30]):
        cu = i32(bounds)
        out = attention_varlen(q, k, v, cu, cu, 25, 25, is_causal=True)
        passes(out, varlen_ref(q, k, v, cu, cu, causal=True))
        unchecked = attention_varlen(q, k, v, cu, cu, 25, 25, is_causal=True,
                                     check_lengths=False)
        assert torch.equal(out, unchecked)


def test_varlen_reads_an_offsets_tensor_once_until_it_changes(monkeypatch):
    """check_lengths=True reads an offsets tensor's values once (a device-to-host copy that
    waits for the GPU) and keeps the verdict for that tensor at that version: the same
    tensor again is not read; written in place (its version moves, a view's too) it is read
    again and refused; a new tensor with the same values is read; another max_seqlen is
    checked anew; an inference tensor (no version counter) is read every call."""
    from fusedattn import varlen

    reads = []
    monkeypatch.setattr(varlen, "read_offsets", lambda cu: reads.append(1) or cu.tolist())
    q, k, v = (rand(30, 2, 16, seed=i) for i in range(3))
    cu = i32([0, 10, 30])
    first = attention_varlen(q, k, v, cu, cu, 25, 25, is_causal=True)
    assert len(reads) == 1  # q's and k's: one tensor, one total, one max_seqlen
    again = attention_varlen(q, k, v, cu, cu, 25, 25, is_causal=True)
    assert len(reads) == 1 and torch.equal(first, again)
    with pytest.raises(ProblemError, match="max_seqlen_q"):
        attention_varlen(q, k, v, cu, cu, 15, 25, is_causal=True)  # 20 > 15: read, refused
    cu[1:][0] = 40  # through a view: the base's version moves
    with pytest.raises(ProblemError, match="cu_seqlens_q"):
        attention_varlen(q, k, v, cu, cu, 25, 25, is_causal=True)
    cu[1] = 10
    before = len(reads)
    attention_varlen(q, k, v, i32([0, 10, 30]), cu, 25, 25, is_causal=True)
    assert len(reads) == before + 2  # a new tensor, and cu at its new version
    before = len(reads)
    with torch.inference_mode():  # no version counter: read every call
        fresh = i32([0, 10, 30])
        for _ in range(2):
            attention_varlen(q, k, v, fresh, fresh, 25, 25, is_causal=True)
    # (the key is cu's: kept calls, each reading its one tensor for q and k once)
    assert len(reads) == before + 2


def test_varlen_keeps_its_plan_per_key_and_context(monkeypatch):
    """An untracked varlen call replays the plan its key keeps (check_lengths either way),
    right on new offsets and tensors, after a call on `(x, x, x)` (the kernels get packed
    views, distinct objects either way); a changed `dispatch.plan_context` goes through the
    dispatch again."""
    from fusedattn import varlen
    from fusedattn.hopper import forward as knobs

    dispatch._PLANS.clear()
    varlen._DECIDED.clear()
    x = rand(30, 2, 16, seed=9)
    cu = i32([0, 12, 30])
    passes(attention_varlen(x, x, x, cu, cu, 27, 27, is_causal=True),
           varlen_ref(x, x, x, cu, cu, causal=True))
    for seed, bounds in enumerate(([0, 10, 30], [0, 20, 30], [0, 3, 30])):
        q, k, v = (rand(30, 2, 16, seed=3 * seed + i) for i in range(3))
        cu = i32(bounds)
        for checked in (True, False):
            passes(attention_varlen(q, k, v, cu, cu, 27, 27, is_causal=True,
                                    check_lengths=checked),
                   varlen_ref(q, k, v, cu, cu, causal=True))
    assert len(dispatch._PLANS) == 1  # recorded by the first call, replayed since
    monkeypatch.setattr(knobs, "THREAD_ARRIVES", not knobs.THREAD_ARRIVES)
    attention_varlen(q, k, v, cu, cu, 27, 27, is_causal=True)
    assert len(dispatch._PLANS) == 2


def test_varlen_check_lengths_false_still_checks_what_needs_no_copy():
    q, k, v = (rand(30, 2, 16, seed=i) for i in range(3))
    cu = i32([0, 10, 30])
    with pytest.raises(ProblemError, match="max_seqlen_q"):
        attention_varlen(q, k, v, cu, cu, 0, 25, check_lengths=False)
    with pytest.raises(ProblemError, match="cu_seqlens_k"):
        attention_varlen(q, k, v, cu, i32([0, 30]), 25, 25, check_lengths=False)
    with pytest.raises(ProblemError, match="check_lengths"):
        attention_varlen(q, k, v, cu, cu, 25, 25, check_lengths=1)


def test_split_kv_decode_replays_with_its_partials_made_anew():
    """Split-KV decode's plan: the partials are scratch, made per call; two calls with other
    caches and lengths (same shapes) each read their own."""
    from fusedattn import attention_with_kvcache

    for seed, lengths in ((0, [40, 7]), (1, [13, 50]), (2, [50, 1])):
        q = rand(2, 4, 1, 16, seed=seed)
        kc, vc = (rand(2, 2, 50, 16, seed=10 + seed + i) for i in range(2))
        plans = len(dispatch._PLANS)
        out = attention_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), splits=3)
        if seed:
            assert len(dispatch._PLANS) == plans
        for b, n in enumerate(lengths):
            passes(out[b], attention_ref(q[b], kc[b, :, :n], vc[b, :, :n]))


def test_decode_keeps_its_plan_per_key_and_context(monkeypatch):
    """A check_lengths=False decode call replays the plan its key keeps, right on new
    lengths and caches; a plan recorded with one cache passed as both K and V does not serve
    two caches (the key holds the caches' addresses, and which tensors are one object); a
    changed `dispatch.plan_context` (here a Hopper switch) goes through the
    dispatch again, which records a plan of its own."""
    from fusedattn import attention_with_kvcache
    from fusedattn.hopper import forward as knobs

    def call(q, kc, vc, lengths):
        return attention_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), splits=2,
                                      check_lengths=False)

    dispatch._PLANS.clear()
    for seed, lengths in ((0, [40, 7]), (1, [13, 50]), (2, [50, 1])):
        q = rand(2, 4, 1, 16, seed=seed)
        kc, vc = (rand(2, 2, 50, 16, seed=10 + seed + i) for i in range(2))
        out = call(q, kc, vc, lengths)
        for b, n in enumerate(lengths):
            passes(out[b], attention_ref(q[b], kc[b, :, :n], vc[b, :, :n]))
    assert len(dispatch._PLANS) == 1  # recorded once, then replayed from the call's key
    _CALLS.clear()
    dispatch._PLANS.clear()
    from fusedattn import kvcache

    kvcache._DECIDED.clear()
    call(q, kc, kc, [50, 1])  # K's cache as V too: recorded with V at K's position
    apart = call(q, kc, vc, [50, 1])  # must not replay that
    for b, n in enumerate([50, 1]):
        passes(apart[b], attention_ref(q[b], kc[b, :, :n], vc[b, :, :n]))
    plans = len(dispatch._PLANS)
    monkeypatch.setattr(knobs, "THREAD_ARRIVES", not knobs.THREAD_ARRIVES)
    call(q, kc, vc, [3, 4])
    assert len(dispatch._PLANS) == plans + 1


@pytest.mark.parametrize("page", [None, 8])
def test_a_decode_loop_replays_its_append(page, monkeypatch):
    """A check_lengths=False decode loop that appends a key a step (a server's step) keeps
    the append's launch with its call key and replays it (`append.append_to_cache`'s
    `kept`): Triton's launch path runs at the first step only, and every step writes its
    own new keys at its own lengths (paged too), the attention reading them."""
    from fusedattn import attention_with_kvcache
    from fusedattn.tiles import append

    forget_plans()
    launched, real = [], append.Recording.launch
    monkeypatch.setattr(append.Recording, "launch",
                        lambda self, kernel, *a, **kw: launched.append(kernel) or
                        real(self, kernel, *a, **kw))
    b, h, hk, d, cap = 2, 4, 2, 16, 24
    kc, vc = (torch.zeros(b, hk, cap, d, device=DEVICE) for _ in range(2))
    table = None
    if page:  # the blocks of sequence 1 first, then of 0, backwards
        table = i32([[5, 4, 3], [2, 1, 0]])
        kc, vc = (torch.zeros(b * cap // page, hk, page, d, device=DEVICE) for _ in range(2))
    for step in range(4):
        lengths = [3 + step, 9 + 2 * step]  # each step's own; a gap in sequence 1
        new = [rand(b, hk, 1, d, seed=20 + 2 * step + i) for i in range(2)]
        q = rand(b, h, 1, d, seed=step)
        out = attention_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), k_new=new[0],
                                     v_new=new[1], block_table=table, check_lengths=False)
        for i, n in enumerate(lengths):
            rows = range(n + 1)
            dense = [torch.stack([c[table[i, r // page], :, r % page] if page else c[i, :, r]
                                  for r in rows], 1) for c in (kc, vc)]
            assert torch.equal(dense[0][:, n], new[0][i, :, 0])  # this step's key, here
            assert torch.equal(dense[1][:, n], new[1][i, :, 0])
            passes(out[i], attention_ref(q[i], dense[0], dense[1], causal=True,
                                         align="bottom-right"), f"step {step} seq {i}")
    assert launched.count(append._append_rows) == 1


@pytest.mark.parametrize("page", [None, 8])
def test_a_checked_decode_call_keeps_its_decisions_and_checks_the_values_each_call(
        page, monkeypatch):
    """The default decode call (`check_lengths=True`) keeps its metadata's checks and its
    plan per call key, as `check_lengths=False` does, and checks the lengths' and block
    table's values every call: a kept call whose values went bad (written in place) is
    refused before its append writes anything."""
    from fusedattn import attention_with_kvcache, kvcache

    forget_plans()
    full, values = [], []
    real_validate, real_lengths = kvcache._validate, kvcache._check_lengths
    monkeypatch.setattr(kvcache, "_validate",
                        lambda *a, **kw: full.append(1) or real_validate(*a, **kw))
    monkeypatch.setattr(kvcache, "_check_lengths",
                        lambda *a, **kw: values.append(1) or real_lengths(*a, **kw))
    b, h, hk, d, cap = 2, 4, 2, 16, 24
    kc, vc = (rand(b, hk, cap, d, seed=30 + i) for i in range(2))
    table = None
    if page:  # the blocks of sequence 1 first, then of 0, backwards
        table = i32([[5, 4, 3], [2, 1, 0]])
        kc, vc = (rand(b * cap // page, hk, page, d, seed=30 + i) for i in range(2))

    def dense(i, n):  # sequence i's first n rows of K and V
        return [torch.stack([c[table[i, r // page], :, r % page] if page else c[i, :, r]
                             for r in range(n)], 1) for c in (kc, vc)]

    for step, lengths in enumerate(([3, 9], [10, 1], [23, 17])):
        q = rand(b, h, 1, d, seed=step)
        new = [rand(b, hk, 1, d, seed=40 + 2 * step + i) for i in range(2)]
        out = attention_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), k_new=new[0],
                                     v_new=new[1], block_table=table)
        for i, n in enumerate(lengths):
            keys, vals = dense(i, n + 1)
            passes(out[i], attention_ref(q[i], keys, vals, causal=True,
                                         align="bottom-right"), f"step {step} seq {i}")
    assert len(full) == 1 and len(values) == 3  # the metadata checked once, values always
    plans = len(dispatch._PLANS)
    lens = i32([3, 9])
    attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=new[0], v_new=new[1],
                           block_table=table)
    before = (kc.clone(), vc.clone())
    lens[1] = cap  # in place: no room for the appended row; refused, nothing written
    with pytest.raises(ProblemError, match="cache_seqlens"):
        attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=new[0], v_new=new[1],
                               block_table=table)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    if page:
        lens[1] = 9
        table[0, 0] = 99  # a block out of range, in place
        with pytest.raises(ProblemError, match="block_table"):
            attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=new[0],
                                   v_new=new[1], block_table=table)
        table[0, 0] = 2  # sequence 1's block: 0 appends into a block 1 reads
        with pytest.raises(ProblemError, match="block_table"):
            attention_with_kvcache(q, kc, vc, cache_seqlens=i32([0, 9]), k_new=new[0],
                                   v_new=new[1], block_table=table)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert len(full) == 1 and len(dispatch._PLANS) == plans  # every call above was kept


def test_decode_checks_kept_per_key_still_refuse_what_they_refused():
    """`check_lengths=False` calls keep their checks per key; the key holds the caches'
    addresses, so one cache passed as both K and V is checked (and refused) again."""
    from fusedattn import attention_with_kvcache

    q = rand(2, 4, 1, 16)
    kc, vc = (rand(2, 2, 50, 16, seed=1 + i) for i in range(2))
    lens = i32([50, 3])
    out = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, check_lengths=False)
    again = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, check_lengths=False)
    assert torch.equal(out, again)
    with pytest.raises(ProblemError, match="k_cache/v_cache"):
        attention_with_kvcache(q, kc, kc, cache_seqlens=lens, k_new=rand(2, 2, 1, 16),
                               v_new=rand(2, 2, 1, 16), check_lengths=False)
    with pytest.raises(ProblemError, match="softcap"):
        attention_with_kvcache(q, kc, vc, cache_seqlens=lens, softcap=True,
                               check_lengths=False)


def test_a_plan_recorded_on_one_tensor_passed_thrice_does_not_serve_three():
    """`attention(x, x, x)` records q, k and v at one position; a later call with three
    tensors of the same shapes must not replay it (the key holds which are one object)."""
    x = rand(1, 2, 19, 16, seed=7)
    passes(attention(x, x, x), attention_ref(x, x, x))
    q, k, v = (rand(1, 2, 19, 16, seed=i) for i in range(3))
    passes(attention(q, k, v), attention_ref(q, k, v))
    g = [rand(1, 2, 19, 16, seed=9, grad=True)] * 3  # one leaf as q, k and v
    dout = rand(1, 2, 19, 16, seed=10)
    torch.autograd.grad(attention(*g[:1] * 3), g[:1], dout)
    q, k, v = (rand(1, 2, 19, 16, seed=20 + i, grad=True) for i in range(3))
    got = torch.autograd.grad(attention(q, k, v), (q, k, v), dout)
    for a, b in zip(got, attention_ref_grads(q, k, v, dout), strict=True):
        passes(a, b)


@pytest.mark.parametrize("name, value", [("PINGPONG", False), ("SHARED_KV", True),
                                         ("THREAD_ARRIVES", True), ("LANE_SUM", False),
                                         ("WARPGROUPS", {}), ("FP8_WARPGROUPS", {}),
                                         ("WARPGROUPS_MIN_ROWS", 1),
                                         ("VARLEN_DYNAMIC", False), ("MAX_SPLIT", 1),
                                         ("FP8_PACK", False), ("MASK_FORM", 0),
                                         ("MASK_FORM_EDGE", 2), ("KERNEL_DIMS", (64, 96)),
                                         ("TILES", {}), ("FP8_TILES", {}),
                                         ("WARPGROUPS_MIN_ROWS_BOUNDED", 1),
                                         ("WARPGROUPS_MIN_ROWS_VARLEN_BOUNDED", 1),
                                         ("PERSISTENT_TILES", {}), ("LPT_SECTIONS", False),
                                         ("LPT_L2_BYTES", 1), ("CAUSAL_CLAIMS", False),
                                         ("VARLEN_CLAIMS", False), ("DOC_ROWS", False),
                                         ("LATE_Q_FREE", False),
                                         ("VARLEN_TMA_STORE", False),
                                         ("FP8_EARLY_Q_FREE", False)])
def test_each_hopper_switch_is_in_the_forward_plan_key(name, value, monkeypatch):
    """An A/B switch of `hopper.forward` changed after a call makes the next call record a
    plan of its own: a plan replays the kernel it recorded, so a switch outside the key
    would time the default twice (`scripts/hopper_check.py`'s A/Bs did, for two switches)."""
    from fusedattn.hopper import forward as knobs

    q, k, v = (rand(1, 2, 33, 16, dtype=torch.float32, seed=i) for i in range(3))
    dispatch._PLANS.clear()
    _CALLS.clear()
    attention(q, k, v)
    plans = len(dispatch._PLANS)
    attention(q, k, v)
    assert len(dispatch._PLANS) == plans
    monkeypatch.setattr(knobs, name, value)
    attention(q, k, v)
    assert len(dispatch._PLANS) == plans + 1, f"{name} is not in the plan key"


def test_a_forward_plan_is_one_streams_and_a_capture_records_its_own(monkeypatch):
    """A causal Hopper launch claims its items from a counter its plan holds
    (`hopper.forward.CAUSAL_CLAIMS`), so two launches of one plan must never overlap: the
    plan key holds the current stream (a call on another stream records a plan of its
    own, with its own counter) and whether the stream is capturing a CUDA graph (a capture
    records a launch without a counter). Without the claims neither is in the key."""
    from fusedattn import launch
    from fusedattn.hopper import forward as knobs

    stream, capturing = [7], [False]
    monkeypatch.setattr(dispatch, "EMULATION", False)  # (the GPU's context, with a fake
    monkeypatch.setattr(dispatch, "current_stream", lambda: stream[0])  # stream)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing[0])
    q, k, v = (rand(1, 2, 33, 16, dtype=torch.float32, seed=60 + i) for i in range(3))
    dispatch._PLANS.clear()
    _CALLS.clear()
    want = attention(q, k, v, is_causal=True)
    plans = len(dispatch._PLANS)
    assert torch.equal(attention(q, k, v, is_causal=True), want)
    assert len(dispatch._PLANS) == plans  # the same stream replays
    stream[0] = 9
    assert torch.equal(attention(q, k, v, is_causal=True), want)
    assert len(dispatch._PLANS) == plans + 1, "a plan replayed on another stream"
    capturing[0] = True
    assert torch.equal(attention(q, k, v, is_causal=True), want)
    assert len(dispatch._PLANS) == plans + 2, "a capture replayed a plan of no capture"
    capturing[0] = False
    with knobs.as_captured():  # warmup's capture form with no capture: a capture's plan
        assert torch.equal(attention(q, k, v, is_causal=True), want)
        assert len(dispatch._PLANS) == plans + 2, "as_captured took another form's plan"
        stream[0] = 7
        assert torch.equal(attention(q, k, v, is_causal=True), want)
        assert len(dispatch._PLANS) == plans + 3
    assert torch.equal(attention(q, k, v, is_causal=True), want)
    assert len(dispatch._PLANS) == plans + 3, "the plain form's plan not replayed after it"
    monkeypatch.setattr(knobs, "CAUSAL_CLAIMS", False)
    assert dispatch._stream_context() is None
    assert launch.hashable(dispatch.plan_context())[-1] is None


@pytest.mark.parametrize("module, table, entry", [("forward", "TILES", (64, 64)),
                                                  ("forward", "WARPGROUPS", 64),
                                                  ("backward", "TILES", 64)])
def test_a_switch_table_changed_in_place_is_a_changed_plan_key(module, table, entry,
                                                               monkeypatch):
    """A call's context holds the switch tables themselves (taking it costs nothing a
    call) and a kept plan a copy of them: a table changed in place, as
    `scripts/hopper_fp8_check.py` changes FP8_TILES, must send the next call, forward or
    backward, to a plan of its own, not replay the kept one."""
    import importlib

    knobs = importlib.import_module(f"fusedattn.hopper.{module}")
    plans = dispatch._PLANS if module == "forward" else flash_bwd._PLANS
    q, k, v = (rand(1, 2, 21, 16, dtype=torch.float32, seed=40 + i, grad=True)
               for i in range(3))
    dout = rand(1, 2, 21, 16, dtype=torch.float32, seed=45)
    plans.clear()
    _CALLS.clear()

    def step():
        return torch.autograd.grad(attention(q, k, v, is_causal=True), (q, k, v), dout)
    want = step()
    before = len(plans)
    step()
    assert len(plans) == before, "a repeated call recorded a plan"
    monkeypatch.setitem(getattr(knobs, table), entry, ("changed",))
    got = step()
    assert len(plans) == before + 1, f"{module}.{table} changed in place was replayed past"
    for a, b in zip(got, want, strict=True):  # (emulation: the portable kernels read no
        assert torch.equal(a, b)              # Hopper table, so the same bits)


def test_the_ab_scripts_set_a_switch_while_the_call_runs_and_restore_it():
    # `scripts/hopper_check.py`'s `switched` (hopper_fp8_check.py's A/Bs use it too)
    from fusedattn.hopper import forward as knobs

    switched = script("hopper_check").switched
    seen = []
    switched(lambda: seen.append(knobs.MAX_SPLIT), "MAX_SPLIT", 1)()
    assert seen == [1] and knobs.MAX_SPLIT == 4

    def fails():
        raise RuntimeError("refused")
    with pytest.raises(RuntimeError):
        switched(fails, "MAX_SPLIT", 2)()
    assert knobs.MAX_SPLIT == 4


def test_switches_from_the_command_line_by_name_and_literal_and_the_rest_refused():
    # `scripts/switch_ab.py --set` (hopper.forward's, the switch under A/B excluded) and
    # `scripts/hang_repro.py --switch` (hopper.backward's): NAME=LITERAL pairs
    import argparse

    from fusedattn.hopper import backward
    from fusedattn.hopper import forward as knobs
    from fusedattn_lab.switches import literal_switches

    def parse(pairs, module, exclude=()):
        return literal_switches(argparse.ArgumentParser().error, "--set", pairs, module,
                                exclude)

    assert parse(["THREAD_ARRIVES=True", "MAX_SPLIT=1"], knobs, ("PINGPONG",)) == {
        "THREAD_ARRIVES": True, "MAX_SPLIT": 1}
    assert parse(["NAMED_HANDOFF=False", "ORDER='down'", "UP_MIN_WAVES=4"], backward) == {
        "NAMED_HANDOFF": False, "ORDER": "down", "UP_MIN_WAVES": 4}
    for bad in ("THREAD_ARRIVES", "NO_SUCH=1", "PINGPONG=True", "MAX_SPLIT=one",
                "launch=1"):
        with pytest.raises(SystemExit):
            parse([bad], knobs, ("PINGPONG",))
    for bad in ("NAMED_HANDOFF", "named=1", "ORDER=down", "X-Y=1", "NAMED_HANDOF=False"):
        with pytest.raises(SystemExit):
            parse([bad], backward)


def test_a_replay_passes_empty_launch_hooks_as_none_and_registered_ones_as_they_are():
    # Triton 3.6 keeps its launch hooks in chains that are never None: a replay hands its
    # launcher None for an empty chain (no metadata built, no empty chain called), and a
    # registered hook (a profiler's, the GPU tests' `Launches`) as it is
    from triton import knobs

    from fusedattn.launch import _hooks

    assert _hooks() == (None, None)
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert _hooks() == (knobs.runtime.launch_enter_hook, None)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert _hooks() == (None, None)


@pytest.mark.parametrize("entry, bad", [
    ("attention", dict(scale=[1.0])), ("attention", dict(window=([1], 0))),
    ("attention", dict(softcap={})), ("varlen", dict(max_seqlen_q=[8])),
])
def test_an_unhashable_option_gets_the_full_paths_error_not_the_caches(entry, bad):
    # the call key hashes the options alone (the tensors' parts always hash); one that
    # cannot be hashed takes the full path, whose checks say what is wrong with it
    q = rand(1, 2, 8, 16, dtype=torch.float32)
    with pytest.raises(ProblemError, match=next(iter(bad))):
        if entry == "attention":
            attention(q, q, q, **bad)
        else:
            packed, cu = q[0].transpose(0, 1), i32([0, 8])
            attention_varlen(packed, packed, packed, cu, cu, bad["max_seqlen_q"], 8)


def test_plans_held_by_hash_never_serve_another_key_of_the_same_hash():
    """`Plans` holds each plan by its key's hash beside the key (one hash a lookup): two
    keys of one hash (CPython hashes -1 as -2) each get their own plan or none."""
    plans, one, other = launch.Plans(size=4), (-1, "k"), (-2, "k")
    assert hash(one) == hash(other)
    plans.put(one, "one's")
    assert plans.get(one) == "one's" and plans.get(other) is None
    plans.put(other, "other's")  # the same slot: the last one put holds it
    assert plans.get(other) == "other's" and plans.get(one) is None
    for n in range(5):  # least recently used first out
        plans.put((n,), n)
    assert plans.get(other) is None and plans.get((0,)) is None and plans.get((4,)) == 4
    assert len(plans) == 4


def test_a_seen_untracked_call_replays_its_kept_plan_without_the_dispatch(monkeypatch):
    """`dispatch.kept_forward`: the entry points' untracked calls of a seen key replay the
    plan their key keeps and never reach `dispatch.forward`; a new key, or a changed
    `plan_context`, does reach it."""
    from fusedattn import attention_with_kvcache, kvcache, varlen
    from fusedattn.hopper import forward as knobs

    _CALLS.clear()
    varlen._DECIDED.clear()
    kvcache._DECIDED.clear()
    reached = []
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda *a, **kw: reached.append(1) or real(
        *a, **kw))
    q, k, v = (rand(1, 2, 21, 16, seed=i) for i in range(3))
    x = rand(21, 2, 16, seed=4)
    cu = i32([0, 8, 21])
    kc, vc = (rand(1, 2, 30, 16, seed=5 + i) for i in range(2))
    calls = [
        lambda: attention(q, k, v, is_causal=True),
        lambda: attention_varlen(x, x, x, cu, cu, 13, 13, is_causal=True),
        lambda: attention_with_kvcache(q[:, :, :1], kc, vc, cache_seqlens=i32([17]),
                                       check_lengths=False),
    ]
    for call in calls:
        before = len(reached)
        first = call()
        assert len(reached) == before + 1  # a new key: dispatched, its plan kept
        before = len(reached)
        for _ in range(2):
            assert torch.equal(call(), first)
        assert len(reached) == before, "a seen key went through the dispatch again"
    monkeypatch.setattr(knobs, "THREAD_ARRIVES", not knobs.THREAD_ARRIVES)
    for call in calls:
        before = len(reached)
        call()
        assert len(reached) == before + 1, "a changed plan_context was not dispatched"


def _dispatch_counter(monkeypatch):
    """Counts the calls of `dispatch.forward` and `dispatch.backward_path` from here on:
    returns a function giving (forwards, backward paths) so far."""
    reached = {"forward": [], "backward_path": []}
    for name in reached:
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _real=real, _seen=reached[name], **kw:
                            _seen.append(1) or _real(*a, **kw))
    return lambda: (len(reached["forward"]), len(reached["backward_path"]))


@pytest.mark.parametrize("internals", [True, False])
def test_recorded_calls_take_the_c_apply_and_give_the_functions_gradients(monkeypatch,
                                                                          internals):
    """`api.recorded_apply`: a call autograd records (`attention`, `attention_varlen`)
    enters its Function through the C `apply` under torch's Python `Function.apply` (made
    to raise here: it is not reached), with the same gradients; where torch lacks the
    internals it reads (`internals=False`), through `Function.apply` as before."""
    from fusedattn import api, varlen

    entered = []
    if internals:
        def refuse(*args):
            raise AssertionError("Function.apply's Python layer was reached")
    else:
        monkeypatch.setattr(api, "_UNWRAP", None)

        def refuse(*args, apply=torch.autograd.Function.apply.__func__):
            entered.append(1)
            return apply(*args)
    for function in (api._FlashCall, varlen._VarlenCall):
        monkeypatch.setattr(function, "apply", classmethod(refuse))
    q, k, v = (rand(1, 2, 19, 16, seed=i, grad=True) for i in range(3))
    dout = rand(1, 2, 19, 16, seed=3)
    out = attention(q, k, v, is_causal=True)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout),
                    attention_ref_grads(q, k, v, dout, causal=True), strict=True):
        passes(g, w)
    x = [rand(19, 2, 16, seed=4 + i, grad=True) for i in range(3)]
    cu = i32([0, 8, 19])
    out = attention_varlen(*x, cu, cu, 11, 11, is_causal=True)
    dout = dout[0].transpose(0, 1)
    for g, w in zip(torch.autograd.grad(out, x, dout),
                    varlen_ref_grads(*x, dout, cu, cu, causal=True), strict=True):
        passes(g, w)
    assert len(entered) == (0 if internals else 2)


def test_a_recorded_call_keeps_its_forward_and_backward_plans(monkeypatch):
    """A call autograd records (`api._FlashCall`) replays the forward plan its key keeps
    and, in its backward, the plan kept beside it: neither reaches the dispatch again
    while dO's layout, which of the tensors are one object, and the context stay the
    same. Each of those changing is dispatched anew, and every gradient matches the
    float64 reference and, bit for bit, the full path's."""
    from fusedattn.hopper import backward as bwd_knobs

    _CALLS.clear()
    counts = _dispatch_counter(monkeypatch)

    def step(seed, dout=None):
        q, k, v = (rand(1, 2, 21, 16, seed=seed + i, grad=True) for i in range(3))
        out = attention(q, k, v, is_causal=True)
        dout = rand(1, 2, 21, 16, seed=seed + 3) if dout is None else dout(out)
        got = torch.autograd.grad(out, (q, k, v), dout)
        want = attention_ref_grads(q, k, v, dout.detach(), causal=True)
        for g, w in zip(got, want, strict=True):
            passes(g, w)
        return got

    step(0)
    first = counts()  # (on a GPU `precompile_backward` asks for the backward's path too)
    assert first[0] == 1 and first[1] >= 1
    for seed in (10, 20):  # new values, the same metadata: both plans replayed
        got = step(seed)
        assert counts() == first, "a seen call went through the dispatch again"
    full = _fresh(lambda: step(20))  # every plan forgotten: the full path
    for a, b in zip(got, full, strict=True):
        assert torch.equal(a, b)
    # dO in another layout (a transposed view): the backward is decided again
    before = counts()
    step(30, lambda out: rand(1, 2, 16, 21, seed=33).transpose(-1, -2))
    assert counts()[1] == before[1] + 1
    # dO as O itself, then apart again (the plans find their tensors by position: one
    # recorded where dO is O must not serve a call where it is not)
    step(40, lambda out: out)
    step(50)
    # a changed backward switch (part of the kept key's context)
    before = counts()
    monkeypatch.setattr(bwd_knobs, "UP_MIN_WAVES", bwd_knobs.UP_MIN_WAVES + 1)
    step(60)
    assert counts() == (before[0], before[1] + 1)


def test_a_kept_backward_plan_recorded_with_do_as_o_does_not_serve_them_apart():
    """`flash_backward(kept=)` keys its kept plan by which tensors are one object: a plan
    recorded with dO passed as O itself (one position) must not replay for a dO of its
    own, nor the other way round."""
    from fusedattn.launch import KeptPlan
    from fusedattn.precision import resolve

    q, k, v = (rand(1, 2, 19, 16, seed=70 + i) for i in range(3))
    out, lse = attention(q, k, v, return_lse=True)
    kept = KeptPlan()
    opts = dict(is_causal=False, scale=0.25, precision=resolve(q.dtype, None).op, kept=kept)
    for dout in (out, rand(1, 2, 19, 16, seed=80), out):
        got = flash_bwd.flash_backward(dout, q, k, v, out, lse, None, **opts)
        for g, w in zip(got, attention_ref_grads(q, k, v, dout, scale=0.25), strict=True):
            passes(g, w)


def test_keep_recorded_off_takes_the_dispatch_every_call_and_the_same_gradients(monkeypatch):
    """`api.KEEP_RECORDED = False` (the A/B switch) sends a recorded call through `_Flash`
    and `dispatch.forward` each time; its gradients are the kept plans' bit for bit."""
    import fusedattn.api as api

    q, k, v = (rand(1, 2, 23, 16, seed=90 + i, grad=True) for i in range(3))
    dout = rand(1, 2, 23, 16, seed=95)
    kept = torch.autograd.grad(attention(q, k, v, is_causal=True), (q, k, v), dout)
    monkeypatch.setattr(api, "KEEP_RECORDED", False)
    reached = []
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda *a, **kw: reached.append(1) or real(
        *a, **kw))
    for _ in range(2):
        got = torch.autograd.grad(attention(q, k, v, is_causal=True), (q, k, v), dout)
        for a, b in zip(got, kept, strict=True):
            assert torch.equal(a, b)
    assert len(reached) == 2


def test_a_recorded_varlen_call_keeps_its_forward_and_backward_plans(monkeypatch):
    """`attention_varlen` on a call autograd records (`varlen._VarlenCall`): as
    `attention`'s, a seen call reaches neither dispatch, another dO layout is decided
    anew, and the gradients match the float64 reference and the full path's bit for bit."""
    from fusedattn import varlen
    from fusedattn.reference import varlen_ref_grads

    varlen._DECIDED.clear()
    counts = _dispatch_counter(monkeypatch)
    cu = i32([0, 7, 7, 26])

    def step(seed, transposed=False):
        q, k, v = (rand(26, 2, 16, seed=seed + i, grad=True) for i in range(3))
        dout = (rand(2, 26, 16, seed=seed + 3).transpose(0, 1) if transposed
                else rand(26, 2, 16, seed=seed + 3))
        out = attention_varlen(q, k, v, cu, cu, 19, 19, is_causal=True)
        got = torch.autograd.grad(out, (q, k, v), dout)
        want = varlen_ref_grads(q, k, v, dout, cu, cu, causal=True)
        for g, w in zip(got, want, strict=True):
            passes(g, w)
        return got

    step(0)
    first = counts()
    assert first[0] == 1 and first[1] >= 1
    for seed in (10, 20):
        got = step(seed)
        assert counts() == first, "a seen call went through the dispatch again"
    varlen._DECIDED.clear()
    dispatch._PLANS.clear()
    flash_bwd._PLANS.clear()
    full = step(20)
    for a, b in zip(got, full, strict=True):
        assert torch.equal(a, b)
    before = counts()
    step(30, transposed=True)
    assert counts() == (before[0], before[1] + 1)


def _triton36_launcher(signature: list, metas: list, calls: list, real: bool):
    """Triton 3.6's `CudaLauncher` as `backends/nvidia/driver.py` builds it (a stand-in):
    `launch` is a closure over the compiled launcher (`launcher`, which records what it
    gets), the descriptors' positions (`tensordesc_indices`) and metadata
    (`tensordesc_meta`), and turns each descriptor into its CUtensorMap (the driver's
    `fill_tma_descriptor`), shape and strides; `__call__` allocates no scratch."""
    from triton.backends.nvidia import driver as nvidia
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    from triton.runtime.driver import driver

    tensordesc_indices = {i for i, sig in enumerate(signature) if sig.startswith("tensordesc")}
    tensordesc_meta = metas

    def launcher(*args):
        calls.append(args)

    def inner(*args):  # (3.6's own instead where `real`: this Triton is 3.6, the GPU's)
        head, rest, kept = list(args[:13]), args[13:], iter(tensordesc_meta)
        for i, arg in enumerate(rest):
            if i not in tensordesc_indices:
                head.append(arg)
                continue
            meta = next(kept)
            head += [driver.active.utils.fill_tma_descriptor(
                arg.base.data_ptr(), meta["swizzle"], meta["elem_size"],
                TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"], arg.shape,
                arg.strides, 1 if arg.padding == "nan" else 0), *arg.shape, *arg.strides]
        return launcher(*head)

    if not tensordesc_indices:  # (3.6 wraps no launcher that takes no descriptor)
        inner = launcher
    if real:
        inner = nvidia.wrap_handle_tensordesc(launcher, dict(enumerate(signature)), metas)

    class CudaLauncher:
        launch = staticmethod(inner)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid,
                        self.launch_pdl, None, None, *args)

    return CudaLauncher()


def _direct_setup(monkeypatch, signature, metas, slots, values):
    """A `launch.Replay` over a launcher built as Triton 3.6's (`_triton36_launcher`),
    with DIRECT_LAUNCH on and a fake driver whose encoder records what it encoded: (the
    replay, the launcher's calls, the encodings)."""
    import types

    import triton
    from triton.runtime.driver import driver

    from fusedattn import launch

    background_done()  # (a compile on a thread would meet the fake driver)
    encoded = []

    def fill(*args):  # a CUtensorMap stand-in: what it was encoded from
        encoded.append(args)
        return ("map", *args)

    real = triton.__version__.startswith("3.6.")
    fake = types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill),
                                 get_current_device=lambda: 0,
                                 get_current_stream=lambda device: 77)
    monkeypatch.setattr(driver, "_active", fake)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(launch, "EMULATION", False)
    monkeypatch.setattr(launch, "TMA_MAPS", 2)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    calls = []
    compiled = types.SimpleNamespace(
        run=_triton36_launcher(signature, metas, calls, real), function=5,
        packed_metadata=(4, 1, 1000), metadata=types.SimpleNamespace(tensordesc_meta=metas))
    replay = launch.Replay(None, compiled, (132, 1, 1), list("abcdef")[:len(values)],
                           values, slots)
    return replay, calls, encoded


def _both(replay, calls, inputs) -> list:
    """The launcher's arguments by Triton's own path, then by the `DirectLaunch`, each
    tensor as its address (what the compiled launcher reads of it)."""
    got = []
    for direct in (False, None):
        replay.direct = direct
        replay(inputs)
        got.append(_addresses(calls.pop()))
    return got


def _addresses(args) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


SHAPE, STRIDES = [1, 2, 64, 128], [16384, 8192, 128, 1]


def _tensors():
    return [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(3)]


def test_a_direct_replay_passes_what_tritons_launcher_would_and_encodes_an_address_once(
        monkeypatch):
    # `launch.DirectLaunch` calls Triton 3.6's compiled launcher itself, with each
    # descriptor's CUtensorMap kept per base address: against a launcher built as 3.6's
    # is, the same arguments as Triton's own path, one encoding per new address, none for
    # one seen
    import triton

    from fusedattn import launch

    meta = dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 1, 64, 64],
                fp4_padded=False)
    # a kernel of (q_desc, p_o, n, q2_desc (None: constexpr), k_desc, BLOCK)
    replay, calls, encoded = _direct_setup(
        monkeypatch, ["tensordesc<bf16[1, 1, 64, 128]>", "*bf16", "i32", "constexpr",
                      "tensordesc<bf16[1, 1, 128, 128]>", "constexpr"],
        [meta, dict(meta, block_size=[1, 1, 128, 64])],
        ((0, 0, (SHAPE, STRIDES, "zero")), (1, 2, None), (4, 1, (SHAPE, STRIDES, "nan"))),
        [None, None, 99, None, None, 64])
    first = _tensors()
    own, ours = _both(replay, calls, first)
    assert isinstance(replay.direct, launch.DirectLaunch)
    assert ours == own and len(own) == 13 + 9 + 1 + 1 + 1 + 9 + 1
    assert own[:4] == (132, 1, 1, 77) and own[13][1] == first[0].data_ptr()
    assert own[14:22] == (*SHAPE, *STRIDES) and own[22] == first[2].data_ptr()
    assert own[23] == 99 and own[25][1] == first[1].data_ptr()
    assert own[25][5] == [1, 1, 128, 64]
    assert own[13][-1] == 0 and own[25][-1] == 1  # padding: zeros, NaNs
    assert len(encoded) == 4  # two descriptors, each encoded by both paths
    encoded.clear()
    replay(first)  # the same addresses: the maps kept
    assert _addresses(calls.pop()) == own and encoded == []
    second = _tensors()  # new addresses: encoded once, then kept too
    replay(second)
    replay(second)
    assert len(encoded) == 2 and calls[0] == calls[1]
    direct_second = _addresses(calls[0])
    replay(_tensors())  # a third address past TMA_MAPS: every map dropped, none stale
    encoded.clear()
    replay(first)
    assert len(encoded) == 2 and _addresses(calls[-1]) == own
    calls.clear()
    assert _both(replay, calls, second) == [direct_second] * 2
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)  # the switch off: Triton's launch
    encoded.clear()
    replay(first)
    assert len(encoded) == 2 and _addresses(calls.pop()) == own
    # a Triton other than 3.6, or a launcher unlike 3.6's: Triton's own path
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert launch.DirectLaunch.of(replay) is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    replay.compiled.run.launch = staticmethod(lambda *args: None)
    assert launch.DirectLaunch.of(replay) is None


def test_a_direct_replay_without_descriptors_passes_its_tensors_as_addresses(monkeypatch):
    # the portable kernels' replays: Triton's wrapper is the compiled launcher itself (no
    # descriptors), each tensor passed as its int address
    from fusedattn import launch

    replay, calls, encoded = _direct_setup(
        monkeypatch, ["*bf16", "*fp32", "i32", "constexpr"], [],
        ((0, 2, None), (1, 0, None)), [None, None, 7, 128])
    inputs = _tensors()
    own, ours = _both(replay, calls, inputs)
    assert isinstance(replay.direct, launch.DirectLaunch)
    assert ours == own == (132, 1, 1, 77, 5, False, True, None, None, (4, 1, 1000), None,
                           None, None, inputs[2].data_ptr(), inputs[0].data_ptr(), 7, 128)
    replay(inputs)
    assert all(isinstance(a, int) for a in calls.pop()[13:15]) and encoded == []


def test_the_launcher_hook_builds_fusedattns_kernels_ahead_and_answers_as_before(
        monkeypatch):
    # `launch.launcher_ahead`: Triton's jit_cache_hook starts a fusedattn kernel's
    # launcher build and nothing else's, answers as the hook it wraps, and never raises
    import threading
    import types

    from fusedattn import launch

    background_done()
    started, answers = [], []

    def previous(**kwargs):
        answers.append(kwargs["key"])
        return kwargs["key"] == "skip"

    monkeypatch.setattr(launch, "ahead", lambda fn, *args: started.append((fn, *args)))
    hook = launch.launcher_ahead(previous)
    signature = {"q_desc": "tensordesc<bf16[1, 1, 64, 128],x>", "n": "i32"}

    def kwargs(module, key="k"):
        return dict(key=key, repr="r", fn=types.SimpleNamespace(module=module),
                    compile={"signature": signature}, is_manual_warmup=False,
                    already_compiled=False)

    assert hook(**kwargs("fusedattn.hopper.forward_kernel")) is False
    assert started == [(launch.build_launcher, signature)]
    assert hook(**kwargs("someone.else", key="skip")) is True and len(started) == 1
    assert answers == ["k", "skip"]
    assert launch.launcher_ahead(None)(**kwargs("someone.else")) is None

    def broken(fn, *args):
        raise RuntimeError("no thread")

    monkeypatch.setattr(launch, "ahead", broken)  # a start that fails: it still answers
    assert hook(**kwargs("fusedattn.tiles.flash_kernels")) is False
    launch._quietly(launch.build_launcher, {"p": object()})  # a build that fails: quiet
    # installed once a process, around the hook that was there, Triton's key started
    from triton import knobs

    monkeypatch.setattr(launch, "ahead", lambda fn, *args: started.append((fn, *args)))
    monkeypatch.setattr(launch, "_AHEAD", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", previous)
    launch.build_launchers_ahead()
    installed = knobs.runtime.jit_cache_hook
    launch.build_launchers_ahead()
    assert installed is knobs.runtime.jit_cache_hook is not previous
    assert installed(**kwargs("x", key="skip")) is True
    assert started[1:] == [(launch._triton_key,)]
    # `ahead`'s thread ends with its work, its errors dropped
    monkeypatch.undo()
    done = threading.Event()
    before = threading.active_count()

    def work(x):
        done.set()
        raise ValueError(x)

    launch.ahead(work, 1)
    assert done.wait(5)
    for t in threading.enumerate():
        if t.name == "fusedattn-ahead":
            t.join(5)
    assert threading.active_count() <= before


@pytest.mark.parametrize("kernel", ["hopper forward", "hopper backward", "portable"])
def test_the_launcher_built_ahead_has_the_source_triton_builds_after_the_compile(kernel):
    # `launch.launcher_source` from the signature alone (what the hook gets) equals what
    # Triton 3.6's `CudaLauncher` builds from the compiled kernel (its signature and
    # descriptors' metadata): the launch then finds the module in the cache
    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"Triton 3.6's launcher (this Triton is {triton.__version__}); the GPU "
                    "tier and a CPU venv of triton==3.6.0 run it")
    from triton.backends.nvidia import driver as nvidia

    from fusedattn import launch

    if kernel == "portable":
        from fusedattn.mode import EMULATION

        if EMULATION:  # (Gluon kernels compile here all the same: no interpreter for them)
            pytest.skip("the portable kernel is the interpreter's here: the GPU tier's case")
        compiled = script("portable_compile_report").compile_row("bf16", 64, True)
    else:
        report = script("gluon_compile_report")
        backward = kernel == "hopper backward"
        module = report._load("k", report.BACKWARD if backward else report.KERNEL)
        fn = module._flash_bwd_sm90 if backward else module._flash_fwd_sm90
        config = dict(name="D128", D=128) if backward else report.CONFIGS[0]
        compiled = report.compile_config(fn, config, backward=backward)
    metas = compiled.metadata.tensordesc_meta
    assert bool(metas) == (kernel != "portable")
    assert launch.launcher_source(compiled.src.signature) == nvidia.make_launcher(
        compiled.src.constants, compiled.src.signature, metas)


def test_a_launcher_in_the_cache_is_not_built_again_and_one_missing_is(tmp_path,
                                                                        monkeypatch):
    # `launch.build_launcher` under Triton 3.6: a launcher module already in Triton's
    # cache (as after `warmup`) is neither built nor loaded; a missing one is built from
    # `launcher_source`
    import hashlib
    import sysconfig

    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"Triton 3.6's launcher (this Triton is {triton.__version__})")
    from triton import knobs
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime import build
    from triton.runtime.cache import get_cache_manager

    from fusedattn import launch

    background_done()
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(nvidia, "library_dirs", lambda: [])  # (no libcuda on a CPU)
    built = []
    monkeypatch.setattr(build, "compile_module_from_src",
                        lambda src, name, **kw: built.append((src, name)))
    signature = {"q_desc": "tensordesc<bf16[1, 1, 64, 128],x>", "p": "*bf16", "n": "i32"}
    monkeypatch.setattr(nvidia, "PyCUtensorMap", None)  # Triton's driver not made yet:
    launch.build_launcher(signature)  # nothing built (nor loaded, keeping a None type)
    assert built == []
    monkeypatch.setattr(nvidia, "PyCUtensorMap", type("PyCUtensorMap", (), {}))
    launch.build_launcher(signature)
    assert built == [(launch.launcher_source(signature), "__triton_launcher")]
    source = launch.launcher_source(signature)
    key = hashlib.sha256((source + build.platform_key()).encode("utf-8")).hexdigest()
    get_cache_manager(key).put(b"\0", "__triton_launcher"
                               + sysconfig.get_config_var("EXT_SUFFIX"), binary=True)
    launch.build_launcher(signature)
    assert len(built) == 1


def _c_module(folder, says):
    """A single-phase C module named as every launcher of one name is (one name, many
    files), whose `launch()` returns `says`; None where no C compiler is at hand."""
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if cc is None or not (Path(include) / "Python.h").exists():
        return None
    folder.mkdir()
    name = "__fusedattn_one_name"
    (folder / "m.c").write_text(
        "#include <Python.h>\n"
        "static PyObject* launch(PyObject* s, PyObject* a)"
        f' {{ return PyUnicode_FromString("{says}"); }}\n'
        'static PyMethodDef M[] = {{"launch", launch, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};\n'
        f'static struct PyModuleDef D = {{PyModuleDef_HEAD_INIT, "{name}", NULL, -1, M}};\n'
        f"PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&D); }}\n")
    so = folder / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-shared", "-fPIC", f"-I{include}", str(folder / "m.c"), "-o", str(so)],
                   check=True, capture_output=True)
    return name, str(so)


def test_each_c_module_file_loads_once_and_keeps_its_own_launch(monkeypatch, tmp_path):
    # the LauncherMismatch of three GPU tiers: CPython's second load of a single-phase
    # module's file hands back the module `sys.modules` holds under its name, with that
    # file's dict copied into it, so a load of launcher A, then B, then A again returns B's
    # object saying A, and until the caller reads `launch` another thread's second load can
    # overwrite it. `launch.load_modules_once` loads each file once: every later load
    # returns the first module, and no module's `launch` changes
    from triton.runtime import build

    a, b = _c_module(tmp_path / "a", "a"), _c_module(tmp_path / "b", "b")
    if a is None:
        pytest.skip("no C compiler or Python headers here")
    triton_load = _triton_loader(monkeypatch)
    launch.load_modules_once()
    load = build._load_module_from_path
    assert load is not triton_load and load.__wrapped__ is triton_load
    launch.load_modules_once()  # (once: not wrapped twice)
    assert build._load_module_from_path is load
    first_a, first_b = load(*a), load(*b)
    assert (first_a.launch(), first_b.launch()) == ("a", "b")
    assert load(*a) is first_a and load(*b) is first_b
    assert (first_a.launch(), first_b.launch()) == ("a", "b")
    # what Triton's own loader does with the same files (a third file, as their names are
    # taken by the loads above): the second load of c returns d's object, saying c
    c, d = _c_module(tmp_path / "c", "c"), _c_module(tmp_path / "d", "d")
    triton_load(*c)
    first_d = triton_load(*d)
    again_c = triton_load(*c)
    assert (again_c is first_d, first_d.launch()) == (True, "c")


def _triton_loader(monkeypatch):
    """Triton's own `_load_module_from_path`, put back in its place (none of ours around
    it) for the test, with `launch.load_modules_once` remembering no loads."""
    from triton.runtime import build

    triton_load = getattr(build._load_module_from_path, "__wrapped__",
                          build._load_module_from_path)
    monkeypatch.setattr(build, "_load_module_from_path", triton_load)
    monkeypatch.setattr(launch, "_LOADED", {})
    return triton_load


def test_a_file_triton_loaded_before_ours_loads_again_into_a_module_of_its_own(
        monkeypatch, tmp_path):
    # the fourth LauncherMismatch (evidence/nvidia-h100/20261207T161043Z-gpu-tier), with
    # each file loaded once by ours: a file Triton had loaded before fusedattn's first
    # launch installed ours was loaded again through ours, into the module another file's
    # load had just handed out. Ours takes the name out of `sys.modules` around each load
    from triton.runtime import build

    a, b = _c_module(tmp_path / "a", "a"), _c_module(tmp_path / "b", "b")
    if a is None:
        pytest.skip("no C compiler or Python headers here")
    _triton_loader(monkeypatch)(*a)  # (a kernel Triton launched before fusedattn's first)
    launch.load_modules_once()
    load = build._load_module_from_path
    first_b = load(*b)
    again_a = load(*a)
    assert (first_b.launch(), again_a.launch()) == ("b", "a")
    assert again_a is not first_b and a[0] not in sys.modules


def test_loads_of_one_file_from_many_threads_make_one_module(monkeypatch):
    import threading

    from triton.runtime import build

    made, start = [], threading.Barrier(8)

    def triton_load(name, path):  # (a stand-in that counts the loads)
        made.append(path)
        return object()

    monkeypatch.setattr(build, "_load_module_from_path", triton_load)
    monkeypatch.setattr(launch, "_LOADED", {})
    launch.load_modules_once()
    got = []

    def worker(i):
        start.wait()
        got.append((i % 2, build._load_module_from_path("m", f"/f{i % 2}")))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(made) == ["/f0", "/f1"]
    assert len({id(m) for file, m in got if file == 0}) == 1
    assert len({id(m) for file, m in got if file == 1}) == 1


def test_a_launcher_taking_other_arguments_is_reported_by_its_module_and_key(monkeypatch,
                                                                              tmp_path):
    # Triton's "function takes exactly 139 arguments (136 given)" at a D72 forward's launch
    # (a GPU tier on a warm cache, 155218Z): `launch.launch` raises `LauncherMismatch` naming the
    # kernel, its descriptors, the module's file and whether its folder is the key of the
    # launcher source Triton makes from the kernel's metadata; other TypeErrors stand
    import base64
    from types import SimpleNamespace

    key = "ab" * 32
    folder = base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")

    class Module:  # a launcher module: its `launch` builtin's __self__
        __file__ = str(tmp_path / folder / "__triton_launcher.so")

        def launch(self, *args):
            raise TypeError(f"function takes exactly {len(args) + 3} arguments "
                            f"({len(args)} given)")

    def wrapped(launcher):  # Triton's `wrap_handle_tensordesc` closure
        def inner(*args):
            return launcher(*args)
        return inner

    compiled = SimpleNamespace(name="_flash_fwd_sm90", src=SimpleNamespace(),
                               metadata=SimpleNamespace(tensordesc_meta=[{"swizzle": 128},
                                                                         None]),
                               run=SimpleNamespace(launch=wrapped(Module().launch)))

    class Kernel:  # `kernel[grid](...)` as `JITFunction.run` makes it, the compiled kernel
        def __getitem__(self, grid):  # a local of the frame that launches it
            def run(*args):
                kernel = compiled
                kernel.run.launch(*grid, *args)
            return run

    monkeypatch.setattr(launch, "_launcher_key", lambda src, meta: key)
    with pytest.raises(launch.LauncherMismatch) as same:
        launch.launch(Kernel(), (2, 1, 1), 7)
    assert isinstance(same.value.__cause__, TypeError)
    message = str(same.value)
    assert message.startswith("function takes exactly 7 arguments (4 given): ")
    for part in ("_flash_fwd_sm90", "descriptors: TMA, pointer", Module.__file__,
                 "built from another source", "TRITON_CACHE_DIR"):
        assert part in message, part
    monkeypatch.setattr(launch, "_launcher_key", lambda src, meta: "cd" * 32)
    with pytest.raises(launch.LauncherMismatch, match="another kernel's launcher"):
        launch.launch(Kernel(), (2, 1, 1), 7)

    def broken(src, meta):
        raise ImportError("no make_launcher in this Triton")

    monkeypatch.setattr(launch, "_launcher_key", broken)
    with pytest.raises(launch.LauncherMismatch, match="its report failed: ImportError"):
        launch.launch(Kernel(), (2, 1, 1), 7)

    class Plain:  # a TypeError with no compiled kernel under it: as it was
        def __getitem__(self, grid):
            def run(*args):
                raise TypeError("run() takes 2 positional arguments but 3 were given")
            return run

    with pytest.raises(TypeError, match="positional arguments") as plain:
        launch.launch(Plain(), (1,), 1, 2)
    assert not isinstance(plain.value, launch.LauncherMismatch)


def test_a_call_key_lays_out_each_tensors_plan_key_parts():
    # `api.call_key` inlines `launch.tensor_key`'s parts (one flat tuple a call): a part
    # added to one and not the other would let a call key serve a call whose plan key
    # differs. Each tensor's stretch of the call key is its `tensor_key` and whether it
    # requires grad (the checks refuse that for some tensors alone), None as None.
    from fusedattn import launch
    from fusedattn.api import call_key

    q = rand(1, 2, 9, 16)
    k = rand(1, 2, 11, 16)[..., ::1].transpose(2, 3).contiguous().transpose(2, 3)
    k.requires_grad_()
    options = (True, 0.5)
    key = call_key((q, None, k), options, None)
    start = 2 * len(options) + 1  # the options, their types, the window
    parts = len(launch.tensor_key(q)) + 1
    assert key[start:start + parts] == (*launch.tensor_key(q), False)
    assert key[start + parts] is None
    assert key[start + parts + 1:start + 2 * parts + 1] == (*launch.tensor_key(k), True)
    assert launch.tensor_key(k) != launch.tensor_key(rand(1, 2, 11, 16))  # (its strides)


def test_a_call_key_tells_one_object_passed_twice_from_two_alike():
    # A tensor passed again stands in the key as its first place (its metadata is not read
    # twice), so every arrangement of one object and equal twins keys apart, and a plan
    # recorded on one object (replays find tensors by position) serves no call of two.
    from fusedattn.api import call_key

    a = rand(4, 8)
    twin = a.clone()
    b = rand(4, 8, seed=1)
    calls = [(a, a, b), (a, twin, b), (a, b, b), (a, b, a), (a, None, a), (a, None, twin),
             (a, a, a)]
    keys = [call_key(t, (True,), None) for t in calls]
    assert None not in keys and len(set(keys)) == len(calls)
    # the same arrangement of objects alike keys alike
    assert call_key((a, a, b), (True,), None) == call_key((twin, twin, b), (True,), None)
    assert call_key((a, b, b), (True,), None) == call_key((a, twin, twin), (True,), None)


def test_host_ab_imports_an_older_library_renamed_beside_this_one(tmp_path):
    """`scripts/host_ab.py` times an older commit's library in this process as
    `fusedattn_base`: its copy must import beside fusedattn (its own modules, its own
    custom ops) and compute what fusedattn computes, forward and backward."""
    import importlib
    import shutil
    import sys
    from pathlib import Path

    import fusedattn

    host_ab = script("host_ab")
    package = host_ab.renamed_copy(Path(fusedattn.__file__).parent, tmp_path)
    assert "fusedattn." not in (package / "api.py").read_text().replace("fusedattn_base.", "")
    sys.path.insert(0, str(tmp_path))
    try:
        base = importlib.import_module(host_ab.NAME)
        assert Path(base.__file__).parent == package
        q, k, v = (rand(1, 2, 27, 16, seed=60 + i, grad=True) for i in range(3))
        dout = rand(1, 2, 27, 16, seed=65)
        got = [torch.autograd.grad(lib.attention(q, k, v, is_causal=True), (q, k, v), dout)
               for lib in (fusedattn, base)]
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b)
        assert base.attention_varlen is not fusedattn.attention_varlen
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] == host_ab.NAME]:
            del sys.modules[name]
        shutil.rmtree(tmp_path / host_ab.NAME, ignore_errors=True)


@pytest.mark.parametrize("emulated", [True, False])
def test_a_plans_scratch_is_one_allocation_laid_out_apart(emulated, monkeypatch):
    """A replayed call makes its scratch as one allocation (`launch.Plan.made`): each
    buffer at its own `SCRATCH_ALIGN`-aligned offset, none overlapping the next; the GPU's
    replays get addresses (what a launch reads of a pointer), emulation's views of each
    buffer's dtype and shape."""
    from fusedattn import launch

    monkeypatch.setattr(launch, "EMULATION", emulated)
    seen = []

    class Stub:
        def __call__(self, inputs):
            seen.append(inputs)

    scratch = [((3, 5, 7), torch.float32, torch.device("cpu")),
               ((2, 9), torch.int32, torch.device("cpu")),
               ((1,), torch.bfloat16, torch.device("cpu"))]
    plan = launch.Plan([Stub(), Stub()], scratch)
    given = torch.zeros(4)
    plan((given,))
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0][0] is given
    made = seen[0][1:]
    addresses = [m.data_ptr() for m in made]
    base = addresses[0]
    ends = [a + math.prod(shape) * dtype.itemsize
            for a, (shape, dtype, _) in zip(addresses, scratch, strict=True)]
    for a, end, later in zip(addresses, ends, addresses[1:], strict=False):
        assert a < end <= later, "scratch buffers overlap"
    assert all((a - base) % launch.SCRATCH_ALIGN == 0 and a % 16 == 0 for a in addresses)
    if emulated:
        for m, (shape, dtype, _) in zip(made, scratch, strict=True):
            assert isinstance(m, torch.Tensor) and m.shape == shape and m.dtype == dtype
    else:
        assert all(isinstance(m, launch.Address) for m in made)
        assert made[0].owner is made[-1].owner  # one allocation, alive while they are


def test_a_plan_passes_the_buffers_it_owns_to_every_replay_and_refuses_others():
    """`launch.Recording.own`: a buffer the call makes for its plan to keep (the Hopper
    forward's claim counter) is passed, the same buffer, to every replay, while a buffer
    the call made without declaring it leaves the call without a plan (a replay would pass
    the recorded call's, freed or reused)."""
    import triton
    import triton.language as tl

    @triton.jit
    def bump(x, counter, out):
        n = tl.load(counter)
        tl.store(out, tl.load(x) + n)
        tl.store(counter, n + 1)

    def record(owned: bool):
        x, out = torch.full((1,), 10, dtype=torch.int32, device=DEVICE), \
            torch.zeros(1, dtype=torch.int32, device=DEVICE)
        counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        recording = launch.Recording((x, out))
        if owned:
            recording.own(counter)
        recording.launch(bump, (1,), x, counter, out)
        return recording.plan(), x, out, counter

    plan, x, out, counter = record(owned=True)
    assert plan is not None and out.item() == 10
    other = torch.full((1,), 20, dtype=torch.int32, device=DEVICE)
    got = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for n in (1, 2):
        plan((other, got))
        assert got.item() == 20 + n and counter.item() == n + 1
    assert record(owned=False)[0] is None
