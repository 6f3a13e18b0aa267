"""`fusedattn.warmup` (issue 31): the calls it makes, the specs it refuses, and on the GPU
that a new length or batch after it compiles nothing."""

import pytest
import torch

import fusedattn
from fusedattn import ahead_of_time
from fusedattn.ahead_of_time import _batches, _lengths, _listen
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError


def test_lengths_cover_every_bucket_on_and_off_multiples_of_16():
    lengths = _lengths(1024)
    assert lengths[0] == 1 and max(lengths) == 1024
    for b in (16, 32, 64, 128, 256, 512, 1024):
        assert b in lengths and b - 1 in lengths
    assert _batches(1, 16) == [1, 132] and _batches(64, 4096) == [1]


def test_warmup_shapes_reach_every_table_key_a_length_and_batch_take():
    # the table's key (`configs.table_key`: the length's bucket, "fills" or "few" SMs by
    # the programs, B x H for the forward, B x H_kv for the backward) with Triton's
    # specialisation of the length (1, a multiple of 16 or not): every length up to
    # max_len at any batch (varlen: any count of documents) takes a pair that one of
    # warmup's calls took (H40 at 129 keys
    # was "few" where 255 and 256 were "fills": a compile after warmup on a GPU whose table
    # has the one and not the other)
    from fusedattn.ahead_of_time import _shapes
    from fusedattn.configs import table_key

    def pair(kind, programs, length):
        return (table_key(kind, precision=None, dim=128, causal=True, seq=length,
                          programs=programs), length == 1, length % 16 == 0)

    for heads, heads_kv in ((8, 8), (12, 12), (20, 4), (32, 8), (40, 40), (48, 8), (64, 1)):
        calls = [call for seq in _lengths(4096) for call in _shapes(heads, heads_kv, seq)]
        for kind, n in (("fwd", heads), ("bwd", heads_kv)):
            warmed = {pair(kind, b * n, length) for length, b in calls}
            for length in range(1, 4097):
                for batch in (1, 2, 3, 5, 8, 33):
                    assert pair(kind, batch * n, length) in warmed, \
                        (heads, heads_kv, kind, length, batch)
        # varlen: the documents x H programs, its longest document's length and tiles
        pairs = [p for seq in _lengths(4096) for p in _shapes(heads, heads, seq)]
        warmed = {pair("fwd", docs * heads, length) for length, docs in pairs}
        for length in range(1, 4097):
            for docs in (1, 2, 3, 5, 24, 200):
                assert pair("fwd", docs * heads, length) in warmed, (heads, length, docs)
    assert _shapes(40, 40, 256) == [(256, 1), (129, 1), (144, 1)]
    assert _shapes(32, 8, 1024) == [(1024, 1), (1024, 2)]


def test_warmup_makes_its_calls_and_returns_what_it_did(monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "SMS", 4)  # a 4-SM GPU: the batch that fills it is small
    done = fusedattn.warmup(head_dims=(16,), heads=(2,), heads_kv=(1,), dtypes=("fp32",),
                            causal=(True, False), training=True, varlen=True, max_len=16)
    # 2 masks x lengths (1, 15, 16) x batches (1, 2: the forward's 2 programs a batch fill
    # the SMs, 4: the backward's 1, a K/V head's), each with gradients and without (an
    # evaluation's forward, no LSE), the causal ones once more each in a CUDA graph
    # capture's form; and varlen's the same, at 1, 2 and 4 documents a length
    assert done["calls"] == 2 * (2 * 3 * 3 * 2 + 3 * 3 * 2)
    assert done["compiled"] >= 0 and done["seconds"] > 0


def test_warmup_takes_head_dim_pairs_and_sinks(monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "SMS", 4)
    done = fusedattn.warmup(head_dims=((24, 16),), heads=(2,), dtypes=("fp32",),
                            causal=(True,), sinks=True, varlen=True, max_len=16)
    # lengths (1, 15, 16) x batches (1, 2), varlen's at 1 and 2 documents, each in a
    # capture's form too (causal)
    assert done["calls"] == 2 * (3 * 2 + 3 * 2)


def test_warmup_takes_fp8_and_its_backward(monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "SMS", 4)
    done = fusedattn.warmup(head_dims=(64,), heads=(2,), heads_kv=(1,), dtypes=("fp8",),
                            causal=(True,), training=True, sinks=True, varlen=True,
                            max_len=16)
    # lengths (1, 15, 16) x batches (1, 2 and 4: the forward's and the backward's filling
    # batches, as in bf16) and varlen's at 1, 2 and 4 documents (its forward: FP8 takes its
    # gradients apart), each in a capture's form too (causal)
    assert done["calls"] == 2 * (3 * 3 + 3 * 3)


def test_warmup_takes_decode_at_every_split_count(monkeypatch):
    from fusedattn import configs, kvcache

    # splits: the largest power of two <= min(16 / programs, keys / 256)
    monkeypatch.setattr(configs, "SMS", 16)
    # (prefill at one length: its calls are the tests' above; the interpreter is slow, so
    # only batch 1's decode calls run, and the others are recorded)
    monkeypatch.setattr(ahead_of_time, "_lengths", lambda max_len: [1])
    made, real, run = [], kvcache.attention_with_kvcache, True

    def recorded(q, k_cache, v_cache, **kw):
        made.append((q.shape[0], kw["block_table"] is not None, kw["cache_seqlens"][0].item()))
        return real(q, k_cache, v_cache, **kw) if q.shape[0] == 1 and run else None
    monkeypatch.setattr(kvcache, "attention_with_kvcache", recorded)
    done = fusedattn.warmup(head_dims=(16,), heads=(4,), heads_kv=(2,), dtypes=("fp32",),
                            causal=(True,), decode=True, max_len=1024)
    # prefill's two calls (one length: batch 1 and the batch that fills the 16 SMs), then
    # decode: one capacity (1024 <= ONE_LOOP_MAX_KEYS: each call appends at 1023), batches
    # 1, 2, 4, 8 (splits 4, 4, 2, 1: 16 programs fill the 16 SMs), contiguous and paged;
    # prefill's two again in a capture's form
    assert done["calls"] == 2 * 2 + 4 * 2
    assert made == [(b, paged, 1023) for b in (1, 2, 4, 8) for paged in (False, True)]
    from fusedattn.ahead_of_time import _decode_batches

    # a program a GQA group (e4m3 too), so a batch's programs are its K/V heads: H_kv 4
    # takes one doubling fewer than H_kv 2, H_kv 1 one more (whatever the dtype)
    assert _decode_batches(4, 4, 1024) == [1, 2, 4]
    assert _decode_batches(4, 1, 1024) == [1, 2, 4, 8, 16]
    # past ONE_LOOP_MAX_KEYS keys a second capacity (the two-loop kernel), in whole pages
    made.clear()
    run = False  # (recorded alone)
    fusedattn.warmup(head_dims=(16,), heads=(4,), heads_kv=(4,), dtypes=("fp32",),
                     causal=(True,), decode=True, max_len=3000)
    assert sorted({n + 1 for _, _, n in made}) == [2048, 3008]


def test_warmup_decode_batches_reach_every_decode_kernel_a_batch_takes():
    # a decode call's kernels follow its split count (the merge's power of two) and the
    # tuned table's tile ("few" or "fills" SMs); on 132 SMs a batch can take one split and
    # not fill them (8 K/V heads: batches 9-16), so warmup goes on to the batch that fills
    # them (the H200, whose table has a "fills" tile, compiled it after warmup: 17:53Z)
    from fusedattn.ahead_of_time import _decode_batches
    from fusedattn.configs import SMS, table_key
    from fusedattn.kvcache import chosen_splits

    assert SMS == 132

    def choice(batch, heads, heads_kv, capacity):
        return (chosen_splits(batch, heads, 1, heads_kv, capacity),
                table_key("decode", precision=None, dim=128, causal=False,
                          seq=heads // heads_kv, programs=batch * heads_kv))

    for heads, heads_kv in ((32, 8), (32, 32), (8, 1), (48, 8), (64, 4), (28, 4), (128, 1)):
        for capacity in (512, 2048, 4096, 8192):
            warmed = {choice(b, heads, heads_kv, capacity)
                      for b in _decode_batches(heads, heads_kv, capacity)}
            for batch in range(1, 600):
                assert choice(batch, heads, heads_kv, capacity) in warmed, \
                    (heads, heads_kv, capacity, batch)
    assert _decode_batches(32, 8, 4096) == [1, 2, 4, 8, 16, 32]


def test_warmup_calls_each_causal_forward_in_a_captures_form_too(monkeypatch):
    # `hopper.forward.as_captured`: a causal call's CUDA-graph capture launches one program
    # an item, not the claimed items, a kernel of its own; warmup makes each causal forward
    # once more in that form (and `prebuild` ships it), each non-causal one once
    from fusedattn import configs
    from fusedattn.hopper import forward as knobs

    monkeypatch.setattr(configs, "SMS", 4)
    made = []

    def recording(real):
        def call(q, *args, **kw):
            made.append((real.__name__, tuple(q.shape), kw["is_causal"], torch.is_grad_enabled(),
                         getattr(knobs._AS_CAPTURED, "on", False)))
            return real(q, *args, **kw)
        return call
    for name in ("attention", "attention_varlen"):
        monkeypatch.setattr(fusedattn, name, recording(getattr(fusedattn, name)))
    fusedattn.warmup(head_dims=(16,), heads=(2,), dtypes=("fp32",), causal=(True, False),
                     training=True, varlen=True, max_len=16)
    plain = [m[:4] for m in made if not m[4]]
    captured = [m[:4] for m in made if m[4]]
    assert len(set(plain)) == len(plain) and captured
    assert sorted(captured) == sorted(m for m in plain if m[2])  # each causal call, once
    assert not getattr(knobs._AS_CAPTURED, "on", False)  # (off again after warmup)
    with pytest.raises(RuntimeError), knobs.as_captured():  # and after an error inside
        with knobs.as_captured():
            assert knobs.capturing()
        assert knobs.capturing()  # (nested: the outer one holds)
        raise RuntimeError
    assert not getattr(knobs._AS_CAPTURED, "on", False)


@pytest.mark.parametrize("bad", [dict(head_dims=(0,)), dict(head_dims=()),
                                 dict(head_dims=(80,), dtypes=("bf16", "fp8")),
                                 dict(head_dims=((24, 300),)), dict(sinks=1),
                                 dict(heads_kv=(3,)), dict(dtypes=("int8",)),
                                 dict(causal=(1,)), dict(max_len=8), dict(training="yes")])
def test_warmup_refuses_a_bad_spec(bad):
    spec = dict(head_dims=(16,), heads=(2,), max_len=16) | bad
    with pytest.raises(ProblemError):
        fusedattn.warmup(**spec)


@pytest.mark.gpu_only("compiles happen on the GPU only (the interpreter compiles nothing)")
def test_after_warmup_a_new_length_or_batch_compiles_nothing():
    # training and evaluation calls alike
    fusedattn.warmup(head_dims=(64,), heads=(4,), dtypes=("bf16",), causal=(True,),
                     training=True, max_len=2048)
    compiled = []
    restore = _listen(compiled)
    try:
        for batch, seq in ((3, 1500), (2, 700), (5, 77), (1, 2000)):
            q, k, v = (torch.randn(batch, 4, seq, 64, device=DEVICE, dtype=torch.bfloat16)
                       .requires_grad_() for _ in range(3))
            out = fusedattn.attention(q, k, v, is_causal=True)
            # a contiguous upstream gradient, as warmup's (a loss's .sum() hands on a
            # stride-0 one, which specialises the backward anew)
            out.backward(torch.randn_like(out))
            with torch.no_grad():  # an evaluation step's forward (no LSE written)
                fusedattn.attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    finally:
        restore()
    assert compiled == [], compiled


@pytest.mark.gpu_only("compiles happen on the GPU only (the interpreter compiles nothing)")
def test_after_warmup_a_decode_step_compiles_nothing():
    # other batches and cache lengths than warmup's, GQA 32/8, contiguous and paged
    fusedattn.warmup(head_dims=(128,), heads=(32,), heads_kv=(8,), dtypes=("bf16",),
                     causal=(True,), decode=True, max_len=4096)
    compiled = []
    restore = _listen(compiled)
    try:
        for batch, capacity, page in ((3, 4096, None), (24, 4096, 256), (200, 4096, None),
                                      (5, 1024, 64)):
            rows = (batch * capacity // page, 8, page) if page else (batch, 8, capacity)
            k, v = (torch.randn(*rows, 128, device=DEVICE, dtype=torch.bfloat16)
                    for _ in range(2))
            table = (torch.randperm(batch * capacity // page, device=DEVICE)
                     .to(torch.int32).reshape(batch, -1)) if page else None
            q, k_new, v_new = (torch.randn(batch, n, 1, 128, device=DEVICE,
                                           dtype=torch.bfloat16) for n in (32, 8, 8))
            lengths = torch.randint(0, capacity - 1, (batch,), device=DEVICE,
                                    dtype=torch.int32)
            fusedattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths, k_new=k_new,
                                             v_new=v_new, block_table=table,
                                             check_lengths=False)
        torch.cuda.synchronize()
    finally:
        restore()
    assert compiled == [], compiled


def test_the_cli_reads_head_dim_pairs():
    from fusedattn_lab.cli.warmup import _dims

    assert _dims("128") == (128,) and _dims("64,192/128") == (64, (192, 128))
