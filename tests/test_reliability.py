"""Inputs that once corrupted a cache or returned a silently wrong number (issue 28), each
a test: strided index tensors, duplicate blocks, windows at the int limit, large and tiny
softcaps, caches that alias, `check_lengths=False`, ranks that disagree, context managers
across threads, errors that came out raw, and threads in emulation. The property test at
the end draws random paged layouts and checks the cache byte for byte."""

import json
import math
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedattn
from fusedattn.lab.verify import check
from fusedattn.mode import DEVICE, EMULATION
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref, paged_to_dense, varlen_ref


def _rand(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return t.requires_grad_() if grad else t


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _passes(got, ref):
    result = check(got, ref)
    assert result.ok, result.reasons


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


# --- 3. windows at and past the int32 limit ------------------------------------------------

HUGE = [2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**30]


def test_a_window_past_every_key_is_no_window():
    q, k, v = (_rand(1, 2, 37, 16, seed=s) for s in range(3))
    for causal in (False, True):
        unbounded = fusedattn.attention(q, k, v, is_causal=causal)
        for big in HUGE:
            for window in ((None, big), (big, None), (big, big)):
                assert torch.equal(fusedattn.attention(q, k, v, is_causal=causal,
                                                       window=window), unbounded), window
        left = fusedattn.attention(q, k, v, is_causal=causal, window=(5, None))
        assert torch.equal(fusedattn.attention(q, k, v, is_causal=causal,
                                               window=(5, 2**31 - 1)), left)
    x = _rand(9, 2, 16, seed=4)
    cu = _i32([0, 4, 9])
    assert torch.equal(fusedattn.attention_varlen(x, x, x, cu, cu, 5, 5, window=(1, 2**31 - 1)),
                       fusedattn.attention_varlen(x, x, x, cu, cu, 5, 5, window=(1, None)))
    kc, vc = _rand(2, 1, 8, 16, seed=5), _rand(2, 1, 8, 16, seed=6)
    cache = dict(cache_seqlens=_i32([5, 8]), is_causal=False)
    qd = _rand(2, 2, 1, 16, seed=7)
    assert torch.equal(
        fusedattn.attention_with_kvcache(qd, kc, vc, window=(2, 2**31 - 1), **cache),
        fusedattn.attention_with_kvcache(qd, kc, vc, window=(2, None), **cache))


@pytest.mark.gpu_only("S >= 4096 is a GPU-sized problem")
def test_a_window_of_the_int_limit_at_s4096():
    q, k, v = (_rand(1, 4, 4096, 64, dtype=torch.bfloat16, seed=s) for s in range(3))
    for causal in (False, True):
        assert torch.equal(
            fusedattn.attention(q, k, v, is_causal=causal, window=(2**31 - 1, 2**31 - 1)),
            fusedattn.attention(q, k, v, is_causal=causal))


# --- 6. softcaps large and small -------------------------------------------------------------

@pytest.mark.parametrize("cap", [1e4, 1e6, 1e8, 1e30])
def test_a_large_softcap_keeps_fp32_accuracy(cap):
    q, k, v = (_rand(1, 2, 40, 32, seed=s, grad=True) for s in range(3))
    out = fusedattn.attention(q, k, v, softcap=cap, precision="ieee")
    _passes(out, attention_ref(q, k, v, softcap=cap))
    # the forward and backward share the scores: the gradient too, against float64's
    dout = _rand(1, 2, 40, 32, seed=3)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(32)
    ref = torch.softmax(cap * torch.tanh(s / cap), -1) @ v64
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double().cpu())
    for g, w in zip(got, want, strict=True):
        _passes(g, w)


def test_softcaps_outside_fp32s_range_are_refused_and_tiny_ones_stay_finite():
    q = _rand(1, 1, 8, 16)
    for cap in (1e-40, 1e-31, 1e31, 1e300):
        with pytest.raises(ProblemError, match="softcap"):
            fusedattn.attention(q, q, q, softcap=cap)
    q = q.clone()
    q[..., 3, :] = 0.0  # a row of zero scores: 0 * (scale / cap) must not be 0 * inf
    out = fusedattn.attention(q, q, q, softcap=1e-30, precision="ieee")
    assert torch.isfinite(out).all()
    _passes(out, attention_ref(q, q, q, softcap=1e-30))


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


# --- 9. errors that came out raw ---------------------------------------------------------------

def test_clear_errors_where_raw_ones_came_out(tmp_path, monkeypatch):
    with pytest.raises(ProblemError, match="^q="):
        fusedattn.attention_with_kvcache(None, _rand(1, 1, 4, 16), _rand(1, 1, 4, 16),
                                         cache_seqlens=_i32([1]))
    q = _rand(1, 1, 4, 16)
    with pytest.raises(ProblemError, match="scale"):
        fusedattn.attention(q, q, q, scale=True)
    with pytest.raises(ProblemError, match="precision"):
        fusedattn.attention(q.half(), q.half(), q.half(), precision="ieee")
    # double backward: one clear error
    x = _rand(1, 1, 4, 16, grad=True)
    out = fusedattn.attention(x, x, x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(ProblemError, match="double backward"):
        g.sum().backward()
    # ring attention without a process group
    from fusedattn.distributed import ring_attention
    with pytest.raises(ProblemError, match="init_process_group"):
        ring_attention(q, q, q)


def test_documented_shapes_and_integers_are_taken():
    q5 = _rand(2, 3, 2, 5, 16, seed=0)  # [..., H, S, D] with two leading dims
    out = fusedattn.attention(q5, q5, q5, is_causal=True)
    _passes(out, attention_ref(q5, q5, q5, causal=True))
    import numpy as np

    x = _rand(7, 2, 16, seed=1)
    cu = _i32([0, 3, 7])
    got = fusedattn.attention_varlen(x, x, x, cu, cu, np.int64(4), np.int32(4))
    assert torch.equal(got, fusedattn.attention_varlen(x, x, x, cu, cu, 4, 4))


def test_a_malformed_tuned_table_is_refused_naming_the_file(tmp_path, monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "_LOADED", {})
    bad = [("not json {", "unreadable"),
           (json.dumps({"rows": {}}), "unreadable"),
           (json.dumps({"entries": {"fwd 16bit d64 full s4096 fills": [0, 0, 0, 0]}}),
            "BLOCK_M"),
           (json.dumps({"entries": {"bwd 16bit d64 full s4096 fills": [64, 64, 4, 2]}}),
            "two of them"),
           (json.dumps({"entries": {"fwd oops": [64, 64, 4, 2]}}), "keys as")]
    for n, (text, why) in enumerate(bad):
        path = tmp_path / f"t{n}.json"
        path.write_text(text)
        with pytest.raises(ProblemError, match=why) as err:
            configs.load_table(path)
        assert str(path) in str(err.value)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ProblemError, match="unreadable"):
        configs.load_table(tmp_path / "dir.json")
    # through the environment, the error comes at the call (before a cache is written)
    monkeypatch.setattr(configs, "EMULATION", False)
    monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / "t2.json"))
    with pytest.raises(ProblemError, match="t2.json"):
        configs.forward_config(dim=64, seq_q=4096, programs_per_tile_row=128, causal=False,
                               precision=None)


def test_compiled_fullgraph_keeps_the_message():
    f = torch.compile(lambda t: fusedattn.attention(t, t, t), fullgraph=True, backend="eager")
    with pytest.raises(Exception) as err:  # fullgraph lets no exception out as itself
        f(torch.randn(1, 1, 4, 16, dtype=torch.float64))
    assert "ProblemError" in str(err.value) and "q.dtype" in str(err.value)
    g = torch.compile(lambda t: fusedattn.attention(t, t, t), backend="eager")
    with pytest.raises(ProblemError, match="q.dtype"):  # without fullgraph: itself
        g(torch.randn(1, 1, 4, 16, dtype=torch.float64))


def test_cli_errors_name_the_right_option(tmp_path, capsys):
    from fusedattn.cli import main

    assert main(["bench", "--suite", "tiny", "--warmup", "-1"]) == 2
    assert "warmup=-1" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text("{}")
    (run / "records.jsonl").mkdir()
    assert main(["run-all", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "records.jsonl" in err and "Traceback" not in err


# --- 4. ranks that disagree --------------------------------------------------------------

def _disagreeing_body(rank: int, world: int, device, results: str) -> list[str]:
    """Each rank: three calls whose inputs disagree across the ranks, one line each."""
    from fusedattn.distributed import ring_attention

    lines = []
    x = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(rank))
    cases = {"dtype": dict(q=x.to(torch.float16 if rank == 0 else torch.bfloat16)),
             "scale": dict(q=x, scale=0.25 if rank == 0 else 0.5),
             "local": dict(q=x.double() if rank == 1 else x)}  # rank 1 refuses its own
    for name, case in cases.items():
        q = case.pop("q").to(device)
        try:
            ring_attention(q, q, q, **case)
            lines.append(f"{name} not-refused")
        except ProblemError as err:
            lines.append(f"{name} refused {err.field} {err.value}")
    return lines


def test_ranks_that_disagree_are_all_refused(tmp_path):
    from ranks import need_gpus, spawn

    need_gpus(2)
    for rank, lines in enumerate(spawn(_disagreeing_body, 2, tmp_path)):
        assert not any(line.startswith("ERROR") for line in lines), lines
        dtype, scale, local = lines
        assert dtype.startswith("dtype refused shards") and "dtype" in dtype, lines
        assert scale.startswith("scale refused shards") and "scale" in scale, lines
        assert local.startswith("local refused " + ("q.dtype" if rank == 1 else "shards")), \
            lines


# --- 5 and 10. threads -----------------------------------------------------------------------

def _in_threads(fn, n=4):
    errors, results = [], [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as err:  # noqa: BLE001  (collected, asserted below)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_threads_calling_attention_at_once_all_get_right_results():
    inputs = [tuple(_rand(1, 2, 19, 16, seed=10 * i + s) for s in range(3)) for i in range(4)]

    def call(i):
        return [fusedattn.attention(*inputs[i], is_causal=True) for _ in range(5)]

    for i, outs in enumerate(_in_threads(call)):
        ref = attention_ref(*inputs[i], causal=True)
        for out in outs:
            _passes(out, ref)


def test_tf32_setting_is_restored_whatever_threads_interleave():
    from fusedattn.lab.verify import tf32_matmuls

    torch.backends.cuda.matmul.allow_tf32 = False
    inside = threading.Barrier(2, timeout=2)

    def block(i):
        with tf32_matmuls(i == 0):
            try:  # with the lock, the second thread is not inside while the first is
                inside.wait()
                return "together"
            except threading.BrokenBarrierError:
                return "alone"

    assert sorted(_in_threads(block, 2)) == ["alone", "alone"]
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_sequence_parallel_holds_for_its_own_thread_only():
    pytest.importorskip("transformers")
    from fusedattn.integrations.transformers import (
        fusedattn_attention_forward,
        sequence_parallel,
    )

    entered, done = threading.Event(), threading.Event()

    class Layer:
        is_causal = True

    q = _rand(1, 2, 6, 16)

    def a(_):
        with sequence_parallel(None):
            entered.set()
            done.wait(5)

    def b(_):
        entered.wait(5)
        try:  # a plain forward here, while thread a is inside sequence_parallel
            out, _ = fusedattn_attention_forward(Layer(), q, q, q, None)
        finally:
            done.set()
        return out

    out = _in_threads(lambda i: (a, b)[i](i), 2)[1]
    _passes(out.transpose(1, 2), attention_ref(q, q, q, causal=True))


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
