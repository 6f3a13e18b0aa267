"""Inputs that once returned a silently wrong number or a raw error (issue 28): windows at
the int limit, large and tiny softcaps, ranks that disagree, errors that came out raw,
context managers across threads, and threads in emulation."""

import json
import math
import threading

import pytest
import torch

import fusedattn
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref
from inputs import forget_plans
from inputs import i32 as _i32
from inputs import passes as _passes
from inputs import rand as _rand

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


def test_flashattentions_none_values_are_refused_with_ours():
    """FlashAttention says "none" with window (-1, -1) and softcap 0.0; here that is None,
    and the refusals say so (a tensor softcap is refused as any other non-number)."""
    q = _rand(1, 1, 8, 16)
    for options, field in ((dict(window=(-1, -1)), "window"), (dict(softcap=0.0), "softcap"),
                           (dict(window=(-1, 0)), "window")):
        with pytest.raises(ProblemError, match=rf"^{field}=.*FlashAttention's .* is None"):
            fusedattn.attention(q, q, q, **options)
    with pytest.raises(ProblemError, match=r"^softcap=.*a number in [^(]*$"):
        fusedattn.attention(q, q, q, softcap=torch.zeros(2))
    for flag in (False, True):  # (bools are numbers to Python; False == 0.0)
        with pytest.raises(ProblemError, match=r"^softcap=.*a flag is not a softcap"):
            fusedattn.attention(q, q, q, softcap=flag)


def test_scales_whose_scores_overflow_fp32_are_refused_and_large_ones_stay_right():
    q = _rand(1, 1, 8, 16)
    for scale in (1e31, 3e38, 1e300):  # 3e38 was NaN in every row, silently
        with pytest.raises(ProblemError, match="scale"):
            fusedattn.attention(q, q, q, scale=scale)
    out = fusedattn.attention(q, q, q, scale=1e30, precision="ieee")  # a hard argmax
    assert torch.isfinite(out).all()
    _passes(out, attention_ref(q, q, q, scale=1e30))


# --- 9. errors that came out raw ---------------------------------------------------------------

def test_nested_and_sparse_tensors_are_refused_by_every_entry_point():
    x, packed = _rand(1, 2, 8, 16), _rand(10, 2, 16)
    nested = torch.nested.nested_tensor([_rand(2, 8, 16), _rand(2, 4, 16)])
    jagged = torch.nested.nested_tensor([_rand(2, 8, 16), _rand(2, 4, 16)],
                                        layout=torch.jagged)
    cu, lens = _i32([0, 4, 10]), _i32([3, 5])
    cache = _rand(2, 2, 8, 16)
    calls = [lambda: fusedattn.attention(nested, x, x),
             lambda: fusedattn.attention(jagged, x, x),
             lambda: fusedattn.attention(x, x.to_sparse(), x.to_sparse()),
             lambda: fusedattn.attention_varlen(packed.to_sparse(), packed, packed, cu, cu,
                                                6, 6),
             lambda: fusedattn.attention_with_kvcache(
                 _rand(2, 2, 1, 16), cache.to_sparse(), cache, cache_seqlens=lens,
                 check_lengths=False)]
    for call in calls:  # (a nested tensor's strides raised from torch's internals)
        with pytest.raises(ProblemError, match=r"\.layout=.*a dense \(strided\) tensor"):
            call()


def test_switches_take_true_or_false_only_even_after_a_call_passed():
    q, packed, cu = _rand(1, 2, 8, 16), _rand(10, 2, 16), _i32([0, 4, 10])
    cache, lens = _rand(2, 2, 8, 16), _i32([3, 5])
    fusedattn.attention(q, q, q)  # the same call's metadata seen and kept first
    fusedattn.attention_varlen(packed, packed, packed, cu, cu, 6, 6)
    calls = {"enable_gqa": lambda: fusedattn.attention(q, q, q, enable_gqa="no"),
             "return_lse": lambda: fusedattn.attention(q, q, q, return_lse=1),
             "return_lse ": lambda: fusedattn.attention_varlen(packed, packed, packed, cu, cu,
                                                               6, 6, return_lse="yes"),
             "check_lengths": lambda: fusedattn.attention_with_kvcache(
                 _rand(2, 2, 1, 16), cache, cache, cache_seqlens=lens, check_lengths=0),
             " return_lse": lambda: fusedattn.attention_with_kvcache(
                 _rand(2, 2, 1, 16), cache, cache, cache_seqlens=lens, return_lse=1)}
    for field, call in calls.items():
        with pytest.raises(ProblemError, match=f"^{field.strip()}=.*True or False"):
            call()

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
    from dataclasses import replace

    monkeypatch.setattr(configs, "EMULATION", False)
    monkeypatch.setattr(configs, "OVERRIDES", replace(configs.OVERRIDES,
                                                      table=tmp_path / "t2.json"))
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
    from fusedattn_lab.cli import main

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


@pytest.mark.emulation_only("Triton's interpreter's options")
def test_launches_skip_the_interpreters_unread_overflow_checks_then_put_them_back():
    # `mode.kernel_launches` in emulation: inside, the interpreter's `sanitize_overflow` is
    # off (without `debug` its checks end in a `device_assert` that checks nothing), nested
    # launches too, and a kernel with `@triton.jit` helpers gives the reference's numbers;
    # after, the options and the interpreter's builtin walk are the ones before; with
    # `debug` on, the checks stay
    import dataclasses

    from triton.runtime import interpreter

    from fusedattn.mode import kernel_launches

    builder = interpreter.interpreter_builder
    before, walk = builder.options, interpreter._patch_builtin
    assert before.sanitize_overflow and not before.debug
    with kernel_launches():
        # (and the language's builtins found by name: `mode._language_patched_by_name`)
        assert builder.options.sanitize_overflow is False
        assert interpreter._patch_builtin is not walk
        with kernel_launches():
            assert builder.options.sanitize_overflow is False
        assert builder.options.sanitize_overflow is False
        q, k, v = (_rand(1, 2, 19, 16, seed=s) for s in range(3))
        _passes(fusedattn.attention(q, k, v, is_causal=True),
                attention_ref(q, k, v, causal=True))
    assert builder.options is before and interpreter._patch_builtin is walk
    builder.options = dataclasses.replace(before, debug=True)
    try:
        with kernel_launches():
            assert builder.options.sanitize_overflow is True
    finally:
        builder.options = before


def test_tf32_setting_is_restored_whatever_threads_interleave():
    from fusedattn_lab.verify import tf32_matmuls

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


def test_lazy_negative_views_are_refused_by_every_entry_point_even_after_a_kept_call():
    """A lazy negative view (`x.conj().imag`, `_neg_view`) holds -t as t's bytes and a bit:
    the kernels read the bytes, so attention(q, k._neg_view(), v) returned attention(q, k,
    v) (the end of this test shows it). Each is refused, naming the field,
    after a call of the same metadata but the bit was kept (its plan must not serve it)."""
    x, packed, cu = _rand(1, 2, 8, 16), _rand(10, 2, 16), _i32([0, 4, 10])
    cache, lens, table = _rand(2, 2, 8, 16), _i32([3, 5]), _i32([[0], [1]])
    one, sinks = _rand(2, 2, 1, 16), _rand(2)
    x64 = _rand(1, 2, 8, 64)
    f8 = x64.to(torch.float8_e4m3fn)  # (FP8 takes head dims 64, 128 and 256)
    factor = torch.ones(1, device=x.device)

    def neg(t):
        return t._neg_view()

    calls = {  # field named -> the call, given a function applied to that field's tensor
        "q": lambda f: fusedattn.attention(f(x), x, x),
        "sinks": lambda f: fusedattn.attention(x, x, x, sinks=f(sinks)),
        "descale_k": lambda f: fusedattn.attention(f8, f8, f8, descale_k=f(factor)),
        "v": lambda f: fusedattn.attention_varlen(packed, packed, f(packed), cu, cu, 6, 6),
        "cu_seqlens_q": lambda f: fusedattn.attention_varlen(packed, packed, packed, f(cu),
                                                             cu, 6, 6),
        "k": lambda f: fusedattn.attention_with_kvcache(  # (the cache, named k as q's peer)
            one, f(cache), cache, cache_seqlens=lens, check_lengths=False),
        "cache_seqlens": lambda f: fusedattn.attention_with_kvcache(
            one, cache, cache, cache_seqlens=f(lens), check_lengths=False),
        "block_table": lambda f: fusedattn.attention_with_kvcache(
            one, cache, cache, cache_seqlens=lens, block_table=f(table)),
        "v_new": lambda f: fusedattn.attention_with_kvcache(
            one, cache.clone(), cache.clone(), cache_seqlens=lens, k_new=one,
            v_new=f(one)),
        "dout": lambda f: fusedattn.attention_fp8_backward(f(x64), f8, f8, f8),
    }
    for field, call in calls.items():
        call(lambda t: t)  # the same metadata, the bit clear: checked and kept
        with pytest.raises(ProblemError, match=rf"^{field}\.is_neg\(\)=.*resolve_neg"):
            call(neg)
    # what the refusal guards against: the bytes read as they are
    k = _rand(1, 2, 8, 16, seed=1)
    assert not torch.allclose(fusedattn.attention(x, k, x).cpu(),
                              attention_ref(x, -k, x).float(), atol=1e-2)


def test_torch_func_transforms_are_refused_by_every_entry_point_even_after_a_kept_call():
    """`torch.func.vmap` and `torch.func.grad` around a call gave raw errors ("Cannot
    access data pointer of Tensor that doesn't have storage", one about autograd's
    `setup_context`): a `ProblemError` names them now, and says what does the same, after a
    plain call of the same shapes was kept (its plan must not serve wrapped tensors)."""
    x, packed, cu = _rand(2, 2, 8, 16), _rand(10, 2, 16), _i32([0, 4, 10])
    cache, lens, one = _rand(2, 2, 8, 16), _i32([3, 5]), _rand(2, 2, 1, 16)
    calls = {  # each: a plain input, and the call as a function of it
        "attention": (x, lambda t: fusedattn.attention(t, t, t, is_causal=True)),
        "attention_varlen": (packed, lambda t: fusedattn.attention_varlen(
            t, t, t, cu, cu, 6, 6)),
        "attention_with_kvcache": (one, lambda t: fusedattn.attention_with_kvcache(
            t, cache, cache, cache_seqlens=lens, check_lengths=False)),
    }
    refused = r"^torch\.func=.*torch\.autograd"
    for name, (plain, call) in calls.items():
        want = call(plain)  # kept
        with pytest.raises(ProblemError, match=refused):
            torch.func.vmap(call)(plain[None])
        with pytest.raises(ProblemError, match=refused):
            torch.func.grad(lambda t, call=call: call(t).sum())(plain)
        assert torch.equal(call(plain), want), name  # and the plain call still runs


def test_a_call_on_another_device_than_the_current_runs_again_under_its_device(monkeypatch):
    """Triton launches on the current device, so a call whose tensors are elsewhere (a
    model spread over GPUs by `device_map`) makes itself again under `torch.cuda.device`
    of q's device, with every argument as given. In emulation there is one device: the
    check (`elsewhere`) and `torch.cuda.device` are stood in for; the same calls on two
    GPUs are `test_tensors_on_another_gpu_than_the_current_one`'s."""
    from fusedattn import api, kvcache, varlen

    x, packed, cu = _rand(1, 2, 8, 16), _rand(10, 2, 16), _i32([0, 4, 10])
    cache, lens, one, sinks = _rand(2, 2, 8, 16), _i32([3, 5]), _rand(2, 2, 1, 16), _rand(2)
    options = dict(is_causal=True, window=(3, 0), softcap=5.0, scale=0.3, return_lse=True,
                   sinks=sinks)
    calls = [lambda: fusedattn.attention(x, x, x, **options),
             lambda: fusedattn.attention_varlen(packed, packed, packed, cu, cu, 6, 6,
                                                **options),
             lambda: fusedattn.attention_with_kvcache(one, cache, cache, cache_seqlens=lens,
                                                      **options)]
    wanted = [call() for call in calls]
    current, entered = ["cuda:0"], []

    class Device:  # torch.cuda.device, as far as the entry points use it
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    def elsewhere(t):
        return current[-1] != t.device

    for module in (api, varlen, kvcache):
        monkeypatch.setattr(module, "elsewhere", elsewhere)
    monkeypatch.setattr(torch.cuda, "device", Device)
    for call, want in zip(calls, wanted, strict=True):
        got = call()
        assert entered == [x.device] and current == ["cuda:0"]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        entered.clear()


@pytest.mark.gpu_only("two GPUs")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU: no other device")
def test_tensors_on_another_gpu_than_the_current_one():
    """Each entry point, and a backward, on cuda:1's tensors while cuda:0 is current give
    the bits the same calls give on cuda:0 (without the device guard: cuda:1's tensors
    launched on cuda:0)."""
    torch.cuda.set_device(0)

    def run(device):
        x = _rand(2, 4, 300, 128, dtype=torch.bfloat16).to(device).requires_grad_()
        packed, cu = _rand(300, 4, 64, dtype=torch.bfloat16).to(device), _i32([0, 100, 300])
        cache, one = _rand(2, 2, 512, 128, dtype=torch.bfloat16).to(device), x[:, :, :1]
        out = fusedattn.attention(x, x, x, is_causal=True)
        out.sum().backward()
        return (out, x.grad,
                fusedattn.attention_varlen(packed, packed, packed, cu.to(device),
                                           cu.to(device), 200, 200, is_causal=True),
                fusedattn.attention_with_kvcache(one.detach(), cache, cache.clone(),
                                                 cache_seqlens=_i32([5, 500]).to(device)))

    here, there = run("cuda:0"), run("cuda:1")
    assert torch.cuda.current_device() == 0
    for a, b in zip(here, there, strict=True):
        assert b.device == torch.device("cuda:1") and torch.equal(a, b.to("cuda:0"))


def test_more_program_rows_than_a_grid_takes_are_made_in_batches(monkeypatch):
    """The portable kernels put a program row per (batch entry, head) on a grid's y axis,
    which CUDA caps at 65535 (`api.GRID_ROWS`); a call with more is made in batches. Here
    the cap is 5, so each entry point splits its batch (counted), and the outputs, LSEs,
    gradients and appended caches are the whole call's."""
    from fusedattn import api, kvcache, varlen

    g = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    q, k, v = rand(3, 4, 20, 16), rand(3, 2, 24, 16), rand(3, 2, 24, 16)
    q5 = rand(2, 3, 2, 9, 16)  # [..., H, S, D]: 6 entries of 2 heads
    packed_q, packed_kv = rand(40, 2, 16), rand(45, 2, 16)
    cu_q, cu_k = _i32([0, 7, 7, 20, 33, 40]), _i32([0, 9, 12, 12, 30, 45])
    cache, lens, new = rand(4, 2, 16, 16), _i32([3, 0, 9, 12]), rand(4, 2, 2, 16)
    pages, table = rand(9, 2, 8, 16), _i32([[4, 0], [8, 1], [2, 7], [5, 6]])
    one = rand(4, 4, 2, 16)

    def grads(call, *tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out, lse = call(*leaves)
        (out.square().sum() + lse.sum()).backward()
        return out, lse, *(t.grad for t in leaves)

    def calls():
        c1, c2, p1, p2 = cache.clone(), cache.clone(), pages.clone(), pages.clone()
        return {
            "attention": grads(lambda *t: fusedattn.attention(
                *t, is_causal=True, enable_gqa=True, return_lse=True), q, k, v),
            "attention [..., H, S, D]": fusedattn.attention(q5, q5, q5, return_lse=True),
            "varlen": grads(lambda *t: fusedattn.attention_varlen(
                *t, cu_q, cu_k, 13, 18, is_causal=True, return_lse=True,
                check_lengths=False), packed_q, packed_kv, packed_kv),
            "decode": (*fusedattn.attention_with_kvcache(
                one, c1, c2, cache_seqlens=lens, k_new=new, v_new=new, return_lse=True),
                c1, c2),
            "paged": (*fusedattn.attention_with_kvcache(
                one, p1, p2, cache_seqlens=lens, k_new=new, v_new=new, block_table=table,
                return_lse=True), p1, p2),
        }

    whole = calls()
    made = []

    def counted(entry, name):
        def call(*args, **kwargs):
            made.append(name)
            return entry(*args, **kwargs)
        return call

    for module, name in ((api, "attention"), (varlen, "attention_varlen"),
                         (kvcache, "attention_with_kvcache")):
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    monkeypatch.setattr(api, "GRID_ROWS", 5)
    forget_plans()  # (the calls above kept their keys: under the real cap, rightly)
    assert api.batches(3, 4) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert api.batches(2, 2) is None
    assert api.batches(2, 2, 1) == [slice(0, 1), slice(1, 2)]  # (2 + 1 spare) x 2 > 5
    parts = calls()
    # 3 x 4 heads: 3 parts; 6 x 2: 3; 5 sequences (+1) x 2: 5; 4 x 2 K/V heads: 2, twice
    assert made == ["attention"] * 6 + ["attention_varlen"] * 5 + \
        ["attention_with_kvcache"] * 4
    for name, got in parts.items():
        for a, b in zip(got, whole[name], strict=True):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5), name
    _passes(parts["attention"][0], attention_ref(q, k, v, causal=True))


@pytest.mark.gpu_only("CUDA's grid limit")
def test_a_grid_of_more_rows_than_cuda_takes():
    """Calls of more than 65535 (batch entries x heads): fp32 forward and backward (the
    portable kernels) and bf16 decode, each made in batches (`api.batches`), against the
    float64 reference (`passes`: the dtype's bound)."""
    from fusedattn.reference import attention_ref_grads

    q = _rand(4100, 16, 8, 16, seed=4, grad=True)  # 65600 rows
    dout = _rand(4100, 16, 8, 16, seed=7)
    out = fusedattn.attention(q, q, q, is_causal=True)
    out.backward(dout)
    _passes(out, attention_ref(q.detach(), q.detach(), q.detach(), causal=True), "out")
    want = attention_ref_grads(q.detach(), q.detach(), q.detach(), dout, causal=True)
    _passes(q.grad, sum(want), "dq + dk + dv")  # (q is k and v: its gradient is the sum)
    one = _rand(8200, 16, 1, 64, seed=5, dtype=torch.bfloat16)  # 8200 x 8 K/V heads
    cache = _rand(8200, 8, 32, 64, seed=6, dtype=torch.bfloat16)
    lens = torch.full((8200,), 20, dtype=torch.int32, device=cache.device)
    got = fusedattn.attention_with_kvcache(one, cache, cache, cache_seqlens=lens)
    kv = cache[:, :, :20]  # (the reference pairs query head h with K/V head h // 2)
    peer = torch.nn.functional.scaled_dot_product_attention(one, kv, kv, enable_gqa=True)
    _passes(got, attention_ref(one, kv, kv), "decode", peer=peer)
