"""KV-cache and index-tensor inputs that once corrupted a cache or returned a silently
wrong number (issue 28): strided index tensors, duplicate blocks, caches that alias or come
from inference mode, `check_lengths=False`'s documented failure modes, and a property test
over random paged layouts that checks the cache byte for byte."""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedattn
from fusedattn.mode import DEVICE, EMULATION
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref, paged_to_dense, varlen_ref
from inputs import i32 as _i32
from inputs import passes as _passes
from inputs import rand as _rand

# --- 1. index tensors are read as they were checked ----------------------------------------

def _paged_case():
    kc, vc = _rand(4, 1, 4, 16, seed=0), _rand(4, 1, 4, 16, seed=1)
    return _rand(2, 1, 1, 16, seed=2), kc, vc, _i32([6, 6])


def test_a_strided_block_table_reads_the_blocks_it_names():
    q, kc, vc, lengths = _paged_case()
    good = _i32([[1, 3], [0, 2]])
    want = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=good)
    for view in (_i32([[1, 0], [3, 2]]).t(),                                # transposed
                 _i32([[1, 10**7, 3, 10**7], [0, 10**7, 2, 10**7]])[:, ::2],  # once a crash
                 _i32([[1, 9, 3, 9], [0, 9, 2, 9]])[:, ::2]):               # once 1e33s
        assert torch.equal(view.cpu(), good.cpu()) and not view.is_contiguous()
        got = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths,
                                               block_table=view)
        assert torch.equal(got, want)
    for b in range(2):  # and it is right, not just the same
        keys, values = (paged_to_dense(c, good, lengths)[b] for c in (kc, vc))
        _passes(want[b], attention_ref(q[b], keys, values, causal=True, align="bottom-right"))


def test_strided_lengths_and_offsets_are_read_as_checked():
    q, kc, vc, _ = _paged_case()
    table = _i32([[1, 3], [0, 2]])
    lengths = _i32([6, 99, 2, 99])[::2]  # values [6, 2], every other int in memory
    got = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table)
    want = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths.contiguous(),
                                            block_table=table)
    assert torch.equal(got, want)
    # varlen: cu_seqlens as a strided view of [0, 3, 7]
    x = _rand(7, 2, 16, seed=3)
    cu = _i32([0, 50, 3, 50, 7])[::2]
    out = fusedattn.attention_varlen(x, x, x, cu, cu, 4, 4, is_causal=True)
    ref = varlen_ref(x, x, x, cu.contiguous().cpu(), cu.contiguous().cpu(), causal=True)
    _passes(out, ref)


# --- 2. duplicate blocks ----------------------------------------------------------------------

def _append(table, lengths, **over):
    kc, vc = _rand(4, 1, 4, 16, seed=0), _rand(4, 1, 4, 16, seed=1)
    args = dict(q=_rand(2, 1, 1, 16, seed=2), k_cache=kc, v_cache=vc,
                cache_seqlens=_i32(lengths), k_new=_rand(2, 1, 1, 16, seed=3),
                v_new=_rand(2, 1, 1, 16, seed=4), block_table=_i32(table))
    args.update(over)
    return args


@pytest.mark.parametrize("table, lengths", [
    ([[0, 1], [0, 2]], [2, 2]),  # both sequences append into block 0
    ([[0, 0], [1, 2]], [5, 2]),  # sequence 0 appends into block 0, which it also reads
    ([[0, 1], [2, 1]], [4, 5]),  # 0 appends into block 1, which 1 reads
])
def test_an_append_into_a_block_mapped_twice_is_refused_before_any_write(table, lengths):
    args = _append(table, lengths)
    before = [args[c].clone() for c in ("k_cache", "v_cache")]
    with pytest.raises(ProblemError, match="block_table"):
        fusedattn.attention_with_kvcache(**args)
    assert all(torch.equal(args[c], b) for c, b in zip(("k_cache", "v_cache"), before,
                                                       strict=True))


def test_a_shared_prefix_block_may_be_read():
    # prefix caching: both sequences read block 0 (a full 4-row prompt) and append elsewhere
    args = _append([[0, 1], [0, 2]], [4, 4])
    prefix = args["k_cache"][0].clone()
    out = fusedattn.attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"][0], prefix)
    after = args["cache_seqlens"] + 1
    for b in range(2):
        keys, values = (paged_to_dense(args[c], args["block_table"], after)[b]
                        for c in ("k_cache", "v_cache"))
        assert torch.equal(keys[:, 4], args["k_new"][b, :, 0])
        _passes(out[b], attention_ref(args["q"][b], keys, values, causal=True,
                                      align="bottom-right"))


# --- 7. caches that alias, and caches from inference mode --------------------------------

def _decode(**over):
    args = dict(q=_rand(2, 2, 1, 16, seed=0), k_cache=_rand(2, 1, 8, 16, seed=1),
                v_cache=_rand(2, 1, 8, 16, seed=2), cache_seqlens=_i32([3, 5]),
                k_new=_rand(2, 1, 1, 16, seed=3), v_new=_rand(2, 1, 1, 16, seed=4))
    args.update(over)
    return args


def test_a_cache_made_in_inference_mode_is_written_and_read():
    with torch.inference_mode():
        v_cache = _rand(2, 1, 8, 16, seed=2)
    args = _decode(v_cache=v_cache)
    out = fusedattn.attention_with_kvcache(**args)
    assert torch.equal(args["v_cache"][:, :, 3][0], args["v_new"][0, :, 0])
    assert torch.equal(args["k_cache"][1, :, 5], args["k_new"][1, :, 0])
    for b, n in enumerate((4, 6)):
        _passes(out[b], attention_ref(args["q"][b], args["k_cache"][b, :, :n],
                                      args["v_cache"][b, :, :n], causal=True,
                                      align="bottom-right"))


@pytest.mark.parametrize("alias", ["expanded", "same", "overlapping"])
def test_caches_that_share_memory_are_refused_before_any_write(alias):
    args = _decode()
    if alias == "expanded":  # one head's storage shown as two: a write to one is lost
        args.update(q=_rand(2, 4, 1, 16), k_cache=_rand(2, 2, 8, 16),
                    v_cache=_rand(2, 1, 8, 16).expand(2, 2, 8, 16),
                    k_new=_rand(2, 2, 1, 16), v_new=_rand(2, 2, 1, 16))
    elif alias == "same":
        args["v_cache"] = args["k_cache"]
    else:
        buf = _rand(2, 1, 9, 16)
        args.update(k_cache=buf[:, :, :8], v_cache=buf[:, :, 1:])
    before = [args[c].clone() for c in ("k_cache", "v_cache")]
    with pytest.raises(ProblemError, match="cache"):
        fusedattn.attention_with_kvcache(**args)
    assert all(torch.equal(args[c], b) for c, b in zip(("k_cache", "v_cache"), before,
                                                       strict=True))


def test_interleaved_views_of_one_buffer_are_separate_caches():
    kv = _rand(2, 2, 1, 8, 16, seed=9)  # [B, 2 (K and V), H_kv, S_max, D]
    args = _decode(k_cache=kv[:, 0], v_cache=kv[:, 1])
    fusedattn.attention_with_kvcache(**args)
    assert torch.equal(kv[0, 0, :, 3], args["k_new"][0, :, 0])
    assert torch.equal(kv[0, 1, :, 3], args["v_new"][0, :, 0])


# --- 8. check_lengths=False: the documented failure modes ------------------------------------

def test_unchecked_lengths_never_half_append_or_write_outside_a_sequence():
    args = _decode(cache_seqlens=_i32([3, 7]), k_new=_rand(2, 1, 2, 16, seed=3),
                   v_new=_rand(2, 1, 2, 16, seed=4))
    before = [args[c].clone() for c in ("k_cache", "v_cache")]
    fusedattn.attention_with_kvcache(**args, check_lengths=False)
    for c, new, old in zip(("k_cache", "v_cache"), ("k_new", "v_new"), before, strict=True):
        want = old.clone()
        want[0, :, 3:5] = args[new][0]  # sequence 0 fits: appended
        assert torch.equal(args[c], want)  # sequence 1 (7 + 2 > 8): not at all, K nor V
    # a negative length and a block index of -1 (or past the cache): nothing written
    # anywhere, and the reads stay in the cache (finite output)
    kc, vc = _rand(4, 1, 4, 16, seed=0), _rand(4, 1, 4, 16, seed=1)
    snapshot = (kc.clone(), vc.clone())
    out = fusedattn.attention_with_kvcache(
        _rand(3, 1, 1, 16), kc, vc, cache_seqlens=_i32([-1, 2, 4]),
        k_new=_rand(3, 1, 1, 16), v_new=_rand(3, 1, 1, 16),
        block_table=_i32([[0, 1], [-1, 3], [2, 9]]), check_lengths=False)
    assert torch.equal(kc, snapshot[0]) and torch.equal(vc, snapshot[1])
    assert torch.isfinite(out).all()


def test_unchecked_lengths_read_exactly_the_clamped_keys():
    # the kernel reads clamp(cache_seqlens + S_new, 0, capacity) keys, through block
    # indices clamped to the cache: the same bits as a checked call on those lengths and
    # that table, paged and not, with and without appended keys
    kc, vc = _rand(3, 2, 8, 16, seed=1), _rand(3, 2, 8, 16, seed=2)
    q = _rand(3, 4, 2, 16, seed=0)
    for s_new in (0, 1):
        new = (dict(k_new=_rand(3, 2, 1, 16, seed=3), v_new=_rand(3, 2, 1, 16, seed=4))
               if s_new else {})
        wild, fair = _i32([-5, 6, 40]), _i32([0, 6, 8 - s_new])
        got = fusedattn.attention_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=wild,
                                               check_lengths=False, **new)
        caches = (kc.clone(), vc.clone())
        if s_new:  # only sequence 1 fits its append: the others' caches stay as they were
            caches[0][1, :, 6], caches[1][1, :, 6] = new["k_new"][1, :, 0], new["v_new"][1, :, 0]
        want = fusedattn.attention_with_kvcache(q, *caches, cache_seqlens=fair + _i32(
            [0, s_new, s_new]))
        assert torch.equal(got[1:], want[1:]) and torch.equal(got[0], torch.zeros_like(got[0]))
    pages_k, pages_v = _rand(4, 2, 4, 16, seed=5), _rand(4, 2, 4, 16, seed=6)
    got = fusedattn.attention_with_kvcache(q, pages_k, pages_v, cache_seqlens=_i32([8, 5, 3]),
                                           block_table=_i32([[-1, 7], [2, 1], [3, 0]]),
                                           check_lengths=False)
    want = fusedattn.attention_with_kvcache(q, pages_k, pages_v, cache_seqlens=_i32([8, 5, 3]),
                                            block_table=_i32([[0, 3], [2, 1], [3, 0]]))
    assert torch.equal(got, want)


# --- the property test: random paged layouts ------------------------------------------------

@st.composite
def layouts(draw):
    page = draw(st.sampled_from([1, 3, 4, 8]))
    batch, heads_kv = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    group, max_blocks = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    s_new = draw(st.integers(0, 3))
    n_blocks = draw(st.integers(1, batch * max_blocks + 2))
    capacity = page * max_blocks
    lengths = [draw(st.integers(0, max(capacity - s_new, 0) + 1)) for _ in range(batch)]
    # block ids from a small pool: sharing and out-of-range ids both happen
    table = [[draw(st.integers(-1, n_blocks)) if draw(st.booleans()) and draw(st.booleans())
              else draw(st.integers(0, n_blocks - 1)) for _ in range(max_blocks)]
             for _ in range(batch)]
    strided = draw(st.sampled_from(["contiguous", "transposed", "every-other"]))
    return dict(page=page, batch=batch, heads_kv=heads_kv, group=group, s_new=s_new,
                n_blocks=n_blocks, lengths=lengths, table=table, strided=strided,
                sq=draw(st.integers(1, 3)), seed=draw(st.integers(0, 1000)))


def _expected(c):
    """(refused, new K rows, new V rows): what the call must do, by the documented rules."""
    page, s_new, n_blocks = c["page"], c["s_new"], c["n_blocks"]
    capacity = page * len(c["table"][0])
    if any(n < 0 or n + s_new > capacity for n in c["lengths"]):
        return True
    used = [row[: -(-(n + s_new) // page)] for row, n in zip(c["table"], c["lengths"],
                                                            strict=True)]
    if any(not 0 <= b < n_blocks for row in used for b in row):
        return True
    if s_new:
        counts = {}
        for row in used:
            for b in row:
                counts[b] = counts.get(b, 0) + 1
        for row, n in zip(c["table"], c["lengths"], strict=True):
            written = row[n // page: -(-(n + s_new) // page)]
            if any(counts[b] > 1 for b in written):
                return True
    return False


def _table(c):
    rows = torch.tensor(c["table"], dtype=torch.int32)
    if c["strided"] == "transposed":
        rows = rows.t().contiguous().t()
    elif c["strided"] == "every-other":
        wide = torch.full((rows.shape[0], 2 * rows.shape[1]), 10**7, dtype=torch.int32)
        wide[:, ::2] = rows
        rows = wide[:, ::2]
    return rows.to(DEVICE)


@settings(max_examples=30 if EMULATION else 60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_paged_layouts_against_the_reference(c):
    dim, heads = 16, c["heads_kv"] * c["group"]
    g = torch.Generator().manual_seed(c["seed"])

    def rand(*shape):
        return torch.randn(shape, generator=g).to(DEVICE)

    kc, vc = rand(c["n_blocks"], c["heads_kv"], c["page"], dim), \
        rand(c["n_blocks"], c["heads_kv"], c["page"], dim)
    q = rand(c["batch"], heads, c["sq"], dim)
    k_new = v_new = None
    if c["s_new"]:
        k_new, v_new = (rand(c["batch"], c["heads_kv"], c["s_new"], dim) for _ in range(2))
    lengths, table = _i32(c["lengths"]), _table(c)
    before = kc.clone(), vc.clone()
    call = dict(cache_seqlens=lengths, k_new=k_new, v_new=v_new, block_table=table)
    if _expected(c):
        with pytest.raises(ProblemError):
            fusedattn.attention_with_kvcache(q, kc, vc, **call)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # byte-identical
        return
    out = fusedattn.attention_with_kvcache(q, kc, vc, **call)
    want_k, want_v = before[0].clone(), before[1].clone()
    for b, n in enumerate(c["lengths"]):  # the old contents plus exactly the new rows
        for i in range(c["s_new"]):
            blk, row = c["table"][b][(n + i) // c["page"]], (n + i) % c["page"]
            want_k[blk, :, row], want_v[blk, :, row] = k_new[b, :, i], v_new[b, :, i]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    after = lengths + c["s_new"]
    for b in range(c["batch"]):
        keys, values = (paged_to_dense(t, table, after)[b] for t in (kc, vc))
        _passes(out[b], attention_ref(q[b], keys, values, causal=True, align="bottom-right"))
