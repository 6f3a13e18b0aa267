"""The backward of `fusedattn.attention`: gradients against the float64 reference's autograd
gradients, in emulation (small shapes) and on the GPU (the same tests)."""

import pytest
import torch

from fusedattn.api import attention
from fusedattn.mode import DEVICE
from fusedattn.reference import attention_ref, attention_ref_grads
from fusedattn.tiles.common import Mask
from fusedattn.varlen import offsets_of
from fusedattn_lab.verify import check


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _leaves(b, h, hk, sq, sk, d, dtype=torch.float32):
    return tuple(t.requires_grad_() for t in (
        _rand(b, h, sq, d, dtype=dtype), _rand(b, hk, sk, d, dtype=dtype, seed=1),
        _rand(b, hk, sk, d, dtype=dtype, seed=2)))


def _grads(q, k, v, dout, **kwargs):
    out = attention(q, k, v, enable_gqa=q.dim() >= 3 and k.shape[-3] != q.shape[-3], **kwargs)
    return torch.autograd.grad(out, (q, k, v), dout)


def _peer_errors(q, k, v, dout, ref, causal):
    """PyTorch's own attention backward in the inputs' precision (SDPA math on the CPU):
    the max error of each gradient, for the low-precision bound."""
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *leaves, is_causal=causal, enable_gqa=k.shape[-3] != q.shape[-3])
    peer = torch.autograd.grad(out, leaves, dout.cpu())
    return [float((p.double() - r.cpu()).abs().max()) for p, r in zip(peer, ref, strict=True)]


def assert_grads_pass(got, ref, precision=None, peer=(None, None, None)):
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, peer, strict=True):
        result = check(g, r, precision=precision, peer_error=p)
        assert result.ok, (name, result.reasons)


CASES = [
    # (B, H, H_kv, Sq, Sk, D, causal): comment names the path
    (1, 1, 1, 1, 1, 1, False),      # 1x1, D=1 padded to 16: every tile ragged
    (1, 2, 2, 33, 31, 16, False),   # 33x31: ragged query and key tiles in both passes
    (1, 2, 2, 33, 31, 16, True),    # causal, diagonal tiles masked, tiles past it skipped
    (2, 4, 2, 17, 40, 24, False),   # Sq < Sk, GQA 2:1 (dK, dV summed over 2 query heads)
    (1, 4, 1, 40, 17, 65, True),    # Sq > Sk causal (rows past Sk see all keys), MQA, D=65
    (1, 2, 1, 12, 20, 128, True),   # Sq < Sk causal: keys past the last query get dK = dV = 0
    (1, 2, 2, 48, 48, 64, True),    # whole tiles: the unmasked loops of both passes
]


@pytest.mark.parametrize("case", CASES)
def test_fp32_gradients_match_the_float64_reference(case):
    b, h, hk, sq, sk, d, causal = case
    q, k, v = _leaves(b, h, hk, sq, sk, d)
    dout = _rand(b, h, sq, d, seed=3)
    got = _grads(q, k, v, dout, is_causal=causal)
    ref = attention_ref_grads(q, k, v, dout, causal=causal)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    if sk > sq and causal:  # the last keys are seen by no query
        assert torch.all(got[1][..., sq:, :] == 0) and torch.all(got[2][..., sq:, :] == 0)
    assert_grads_pass(got, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_gradients_within_twice_torchs_error(dtype, causal):
    # bf16 included: in emulation its products come from fp32 copies (the interpreter's bf16
    # tl.dot is broken upstream), so this is the CI check that bf16 is right
    q, k, v = _leaves(1, 4, 2, 37, 29, 32, dtype)
    dout = _rand(1, 4, 37, 32, dtype=dtype, seed=3)
    got = _grads(q, k, v, dout, is_causal=causal)
    ref = attention_ref_grads(q, k, v, dout, causal=causal)
    assert all(g.dtype == dtype for g in got)
    peer = _peer_errors(q, k, v, dout, ref, causal)
    assert_grads_pass(got, ref, peer=peer)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_200_low_precision(dtype):
    # D=200 padded to 256: the backward's largest tiles (fp32 stops at 128, below)
    q, k, v = _leaves(1, 2, 1, 12, 20, 200, dtype)
    dout = _rand(1, 2, 12, 200, dtype=dtype, seed=3)
    got = _grads(q, k, v, dout, is_causal=True)
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    assert_grads_pass(got, ref, peer=_peer_errors(q, k, v, dout, ref, True))


def test_fp32_past_the_backward_limit_is_refused_at_the_call():
    from fusedattn.problem import MAX_FP32_GRAD_DIM, ProblemError

    q, k, v = _leaves(1, 1, 1, 4, 4, MAX_FP32_GRAD_DIM + 1)
    with pytest.raises(ProblemError, match="require grad") as info:
        attention(q, k, v)
    assert info.value.field == "head_dim"
    with torch.no_grad():  # the forward alone still goes to 256
        assert attention(q, k, v).shape == q.shape
    assert attention(q.detach(), k.detach(), v.detach()).shape == q.shape


def test_bf16_forward_is_right_in_emulation_too():
    # the reproduction: values near 8e8 before products moved to fp32 copies
    q = _rand(1, 8, 16, dtype=torch.bfloat16)
    out = attention(q, q, q)
    ref = attention_ref(q, q, q)
    peer = torch.nn.functional.scaled_dot_product_attention(q.cpu(), q.cpu(), q.cpu())
    result = check(out, ref, peer_error=float((peer.double() - ref).abs().max()))
    assert result.ok, result.reasons


def test_lse_is_differentiable():
    q, k, v = _leaves(1, 2, 2, 21, 19, 16)
    dout, dlse = _rand(1, 2, 21, 16, seed=3), _rand(1, 2, 21, seed=4)
    out, lse = attention(q, k, v, is_causal=True, return_lse=True)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert_grads_pass(got, attention_ref_grads(q, k, v, dout, causal=True, dlse=dlse))
    # the LSE alone (no gradient reaches O)
    _, lse = attention(q, k, v, return_lse=True)
    got = torch.autograd.grad(lse, (q, k, v), dlse)
    zero = torch.zeros_like(dout)
    assert_grads_pass(got, attention_ref_grads(q, k, v, zero, dlse=dlse))


@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("case", [
    (1, 2, 2, 40, 72, 24, "causal"),      # ragged tiles both ways, diagonal tiles, padded D
    (1, 2, 1, 64, 48, 16, "window"),      # a window's left edge: masked tiles at both ends
    (2, 2, 2, 33, 50, 16, "full"),        # ragged last tiles only
])
def test_one_loop_and_three_give_the_reference_gradients(monkeypatch, one_loop, case):
    """Both structures of the backward's loops (`configs.backward_single_loop`: one loop masking
    its edge tiles by a branch, or masked, whole and masked tiles in three loops), in dK/dV
    and dQ alike, whatever the rule would pick, against float64 autograd."""
    import fusedattn.tiles.flash_bwd as fb

    b, h, hk, sq, sk, d, kind = case
    monkeypatch.setattr(fb, "backward_single_loop", lambda **_: one_loop)
    q, k, v = _leaves(b, h, hk, sq, sk, d)
    dout = _rand(b, h, sq, d, seed=3)
    window = (20, 0) if kind == "window" else None
    kwargs = {"window": window} if window else {"is_causal": kind == "causal"}
    got = _grads(q, k, v, dout, **kwargs)
    assert_grads_pass(got, attention_ref_grads(q, k, v, dout, causal=kind == "causal",
                                               window=window))


def test_an_unused_lse_reaches_the_backward_as_none(monkeypatch):
    """The loss uses O only: the backward gets dLSE = None, not a tensor of zeros, so it
    launches the preprocess without dLSE, as `precompile_backward` compiled it (with zeros
    the first backward on the H200 compiled the preprocess a second time)."""
    import fusedattn.api as api

    seen = []
    real = api._kept_backward  # the backward's body, which eager calls without the op

    def spy(kept, dout, q, k, v, out, lse, dlse, *options):
        seen.append((dout, dlse))
        return real(kept, dout, q, k, v, out, lse, dlse, *options)

    monkeypatch.setattr(api, "_kept_backward", spy)
    q, k, v = _leaves(1, 2, 2, 21, 19, 16)
    dout = _rand(1, 2, 21, 16, seed=3)
    out = attention(q, k, v, is_causal=True)
    got = torch.autograd.grad(out, (q, k, v), dout)
    out, _ = attention(q, k, v, is_causal=True, return_lse=True)  # the LSE left unused
    got2 = torch.autograd.grad(out, (q, k, v), dout)
    assert len(seen) == 2 and all(dlse is None and d is not None for d, dlse in seen)
    want = attention_ref_grads(q, k, v, dout, causal=True)
    assert_grads_pass(got, want)
    assert_grads_pass(got2, want)


def test_scale_and_strided_layouts():
    # [B, S, H, D] transposed to [B, H, S, D]: non-contiguous inputs and upstream gradient
    base = [_rand(2, 9, 2, 16, seed=s).requires_grad_() for s in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    dout = _rand(2, 9, 2, 16, seed=3).transpose(1, 2)
    assert not q.is_contiguous() and not dout.is_contiguous()
    out = attention(q, k, v, scale=0.3, is_causal=True)
    assert out.stride() == q.stride()  # O in q's memory (`api.new_out`): read by its strides
    got = torch.autograd.grad(out, base, dout)
    ref = attention_ref_grads(q, k, v, dout, scale=0.3, causal=True)
    assert_grads_pass([g.transpose(1, 2) for g in got], ref)


@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_two_and_three_dim_inputs(layout):
    shape = (13, 16) if layout == "2d" else (3, 13, 16)
    q, k, v = (_rand(*shape, seed=s).requires_grad_() for s in range(3))
    dout = _rand(*shape, seed=3)
    assert_grads_pass(_grads(q, k, v, dout), attention_ref_grads(q, k, v, dout))


def test_two_runs_give_the_same_bits():
    q, k, v = _leaves(2, 4, 2, 40, 40, 32, torch.float16)
    dout = _rand(2, 4, 40, 32, dtype=torch.float16, seed=3)
    first = _grads(q, k, v, dout, is_causal=True)
    second = _grads(q, k, v, dout, is_causal=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dim", [32, 64, 128])  # 64: its first tiles overran shared memory
def test_tf32x3_gradients_meet_fp32s_bound(dim):
    q, k, v = _leaves(1, 2, 2, 24, 24, dim)
    dout = _rand(1, 2, 24, dim, seed=3)
    got = _grads(q, k, v, dout, precision="tf32x3", is_causal=True)
    assert_grads_pass(got, attention_ref_grads(q, k, v, dout, causal=True),
                      precision="tf32x3")


@pytest.mark.gpu_only("long rows at fp32's default (tf32x3) and D=128: the 4-byte tiles")
def test_fp32_default_gradients_at_long_rows_meet_fp32s_bound():
    q, k, v = _leaves(1, 2, 1, 600, 600, 128)
    dout = _rand(1, 2, 600, 128, seed=3)
    got = _grads(q, k, v, dout, is_causal=True)
    assert_grads_pass(got, attention_ref_grads(q, k, v, dout, causal=True),
                      precision="tf32x3")


def test_forward_and_backward_trace_inside_torch_compile():
    q, k, v = _leaves(1, 2, 2, 16, 16, 16)
    dout = _rand(1, 2, 16, 16, seed=3)

    def step(q, k, v):
        return (attention(q, k, v, is_causal=True) * dout).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fails on a break
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    assert_grads_pass(got, attention_ref_grads(q, k, v, dout, causal=True))


def test_no_grad_inputs_build_no_graph():
    q, k, v = (_rand(1, 1, 8, 16, seed=s) for s in range(3))
    out = attention(q, k, v)
    assert out.grad_fn is None and not out.requires_grad


@pytest.mark.emulation_only("bench in emulation: no times; the GPU bench is evidence")
def test_bench_tiny_train_suite_verifies_gradients(tmp_path, monkeypatch):
    import csv

    from fusedattn_lab import suites as flashbench
    from fusedattn_lab.cli import main

    assert main(["bench", "--suite", "tiny-train", "--providers", "flash,sdpa-math",
                 "--match", "bwd bf16 B1 H2/1 S33 D16 causal,fwd+bwd fp32 B1 H2 S33 D16",
                 "--out", str(tmp_path)]) == 0
    (folder,) = (tmp_path / "emulation").iterdir()
    with open(folder / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows), rows
    # --match takes substrings: "bwd ..." also matches "fwd+bwd ...", "... D16" "... causal"
    assert {r["problem"] for r in rows} == {
        "bwd bf16 B1 H2/1 S33 D16 causal", "fwd+bwd bf16 B1 H2/1 S33 D16 causal",
        "fwd+bwd fp32 B1 H2 S33 D16", "fwd+bwd fp32 B1 H2 S33 D16 causal"}
    # a wrong gradient is caught: dK off by 1% fails the check
    real = flashbench._grad_call

    def wrong(forward, q, k, v, dout, mode):
        call = real(forward, q, k, v, dout, mode)
        return lambda: (lambda g: (g[0], g[1] * 1.01, g[2]))(call())

    monkeypatch.setattr(flashbench, "_grad_call", wrong)
    assert main(["bench", "--suite", "tiny-train", "--providers", "flash", "--match",
                 "bwd fp32 B1 H2 S33 D16 causal", "--out", str(tmp_path / "w")]) == 1


def test_bench_flops_convention():
    from fusedattn_lab.suites import BenchProblem

    fwd = BenchProblem(4, 32, 4096, 128, "bf16", True)
    assert fwd.flops() == 4 * 4 * 32 * 4096 * 4096 * 128 / 2
    assert BenchProblem(4, 32, 4096, 128, "bf16", True, mode="bwd").flops() == 2.5 * fwd.flops()
    assert BenchProblem(4, 32, 4096, 128, "bf16", True, mode="fwd+bwd").flops() == (
        3.5 * fwd.flops())


def _launch_preparation(monkeypatch, submitted: list) -> list:
    """`launch.build_launchers_ahead` stubbed (a GPU process's first launch preparation: the
    prebuilt kernels into Triton's cache, which the precompile must run before it submits
    anything): how many compiles `submitted` held at each of its calls."""
    from fusedattn import launch

    ahead = []
    monkeypatch.setattr(launch, "build_launchers_ahead", lambda: ahead.append(len(submitted)))
    return ahead


@pytest.mark.parametrize("case", [
    (2, 4, 2, 40, 40, 24, torch.bfloat16, "causal"),   # GQA, padded D, bf16
    (1, 2, 2, 33, 50, 16, torch.float32, "window"),    # Sq != Sk, fp32, a window
])
def test_backward_precompile_specialises_as_the_backward_does(monkeypatch, case):
    """The backward's kernels compile on background threads at the forward (cold start:
    three compiles overlapped instead of queued). What is compiled ahead must be what the
    backward then launches: per kernel the same grid, the same scalar arguments and
    constexprs, and tensors of the same dtypes (stand-ins for O, dO, dQ, dK, dV that the
    forward has not made yet). Also: once per shape, and nothing in emulation."""
    import fusedattn.tiles.flash_bwd as fb

    b, h, hk, sq, sk, d, dtype, kind = case
    q, k, v = _leaves(b, h, hk, sq, sk, d, dtype=dtype)
    mask = fb.Mask(causal=kind == "causal", window=(5, 7) if kind == "window" else None)
    submitted, launched = [], []

    class Recorder:
        """Stands for the pool: runs what is submitted, records the warmups."""
        def submit(self, fn, *args):
            from concurrent.futures import Future

            fn(*args)
            done = Future()
            done.set_result(None)
            return done

    real_launches = fb._launches

    def recording_launches(*args, **kwargs):
        launches = real_launches(*args, **kwargs)
        return [(_Probe(kernel, submitted, launched), grid, a, kw)
                for kernel, grid, a, kw in launches]

    monkeypatch.setattr(fb, "_launches", recording_launches)
    monkeypatch.setattr(fb, "_SUBMITTED", set())
    monkeypatch.setattr(fb, "EMULATION", True)
    fb.precompile_backward(q, k, v, is_causal=mask.causal, scale=0.3, precision="ieee",
                           mask=mask)
    assert submitted == []  # emulation: the interpreter compiles nothing

    monkeypatch.setattr(fb, "EMULATION", False)
    monkeypatch.setattr(fb, "_POOL", Recorder())
    ahead = _launch_preparation(monkeypatch, submitted)
    from fusedattn import configs

    configs.tuned_table()  # asks torch.cuda for the GPU's name, before `device` is stubbed
    monkeypatch.setattr(fb.torch.cuda, "device", lambda _: _NoDevice())
    # the operands as the GPU takes them (emulation makes fp32 copies of bf16 ones; the
    # interpreter's bf16 values are not looked at here)
    monkeypatch.setattr(fb, "emulation_operands", lambda *tensors: tensors)
    for _ in range(2):  # the second call of the same shape submits nothing
        fb.precompile_backward(q, k, v, is_causal=mask.causal, scale=0.3, precision="ieee",
                               mask=mask)
    assert len(submitted) == 3
    assert ahead == [0]
    with torch.no_grad():
        out, lse = torch.empty_like(q), torch.empty((b, h, sq), device=DEVICE)
    fb.flash_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                      None, is_causal=mask.causal, scale=0.3, precision="ieee", mask=mask)
    assert len(launched) == 3
    for (kernel, grid, args, kwargs), (kernel2, grid2, args2, kwargs2) in zip(
            submitted, launched, strict=True):
        assert kernel is kernel2 and grid == grid2 and kwargs == kwargs2
        assert len(args) == len(args2)
        for a, a2 in zip(args, args2, strict=True):
            if isinstance(a, torch.Tensor):
                assert a.dtype == a2.dtype and a.device == a2.device
            else:
                assert a == a2


class _NoDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Probe:
    """A kernel that records its warmups and launches (the real one still launches)."""
    def __init__(self, kernel, warmups, launches):
        self.kernel, self.warmups, self.launches = kernel, warmups, launches

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((self.kernel, grid, args, kwargs))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("b, h, s, d, dv, n_sem, heads_last", [
    (2, 3, 37, 16, 16, 2 * 3 * 1, False),  # a counter per query tile: fewer than programs
    (1, 2, 70, 32, 16, 500, False),        # varlen-like: more counters than programs
    (2, 3, 37, 16, 16, 6, True),           # the accumulator in [B, S, H, D] q's layout
])
def test_the_hopper_preprocess_zeros_the_accumulator_and_counters(b, h, s, d, dv, n_sem,
                                                                  heads_last):
    """With the Hopper backward's buffers (`flash_bwd._preprocess_launch(..., hopper=)`)
    the preprocess zeroes dQ's fp32 accumulator (contiguous, or in q's layout as the TMA
    adds take it) and the counters in place of two fills, and still writes delta:
    poisoned buffers come out zero, and nothing past them is touched (guards past
    each)."""
    import fusedattn.tiles.flash_bwd as fb

    out, dout = _rand(b, h, s, dv, seed=1), _rand(b, h, s, dv, seed=2)
    delta = torch.full((b, h, s), float("nan"), device=DEVICE)
    acc_flat = torch.full((b * h * s * d + 7,), float("nan"), device=DEVICE)
    sem_flat = torch.full((n_sem + 5,), -7, dtype=torch.int32, device=DEVICE)
    acc = acc_flat[:b * h * s * d]
    acc = (acc.view(b, s, h, d).transpose(1, 2) if heads_last else acc.view(b, h, s, d))
    sem = sem_flat[:n_sem]
    kernel, grid, args, kwargs = fb._preprocess_launch(out, dout, None, delta, (acc, sem))
    assert kwargs["ZERO"]
    assert (args[-3] > 1) == (n_sem > grid[0] * grid[1])  # chunks of counters, or one each
    kernel[grid](*args, **kwargs)
    assert torch.equal(acc, torch.zeros_like(acc)) and torch.equal(sem, torch.zeros_like(sem))
    assert acc_flat[-7:].isnan().all() and (sem_flat[-5:] == -7).all()
    want = (out.double() * dout.double()).sum(-1)
    torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_docs, sort", [(40, True), (40, False), (300, True)])
def test_the_hopper_preprocess_writes_the_compact_grids_sequence_order(n_docs, sort,
                                                                       monkeypatch):
    """For the Hopper backward's compact varlen grid the preprocess writes the order it
    takes the sequences in after the counters (`hopper.backward.sequence_order`): the
    most keys first, ties by index (empty sequences last), over more than one 32-sequence
    turn; in their own order past SORT_MAX_DOCS sequences or with VARLEN_LONGEST_FIRST
    off. The counters are zeroed, delta written, nothing past the buffer touched."""
    import fusedattn.tiles.flash_bwd as fb
    from fusedattn.hopper import backward as knobs
    from fusedattn.tiles.common import Varlen

    monkeypatch.setattr(knobs, "VARLEN_LONGEST_FIRST", sort)
    monkeypatch.setattr(knobs, "VARLEN_COMPACT", {64: True, 128: True})
    g = torch.Generator().manual_seed(n_docs)
    # many ties, some empty; shorter past SORT_MAX_DOCS, where the order is the sequences'
    # own (the interpreter runs each of the preprocess's programs in turn)
    lengths = torch.randint(0, 9 if n_docs <= 256 else 2, (n_docs,), generator=g) * 16
    cu = offsets_of(lengths)
    varlen = Varlen(cu.to(DEVICE), cu.to(DEVICE), int(lengths.max()), int(lengths.max()))
    order = knobs.sequence_order(varlen, 64)
    assert order[1] == n_docs and order[2] == int(sort and n_docs <= 256)
    total, heads = int(cu[-1]), 2
    out, dout = _rand(1, heads, total, 16, seed=1), _rand(1, heads, total, 16, seed=2)
    delta = torch.empty(1, heads, total, device=DEVICE)
    acc = torch.empty(1, heads, total, 64, device=DEVICE)
    size = knobs.counters(n_docs, heads, varlen.max_seqlen_q, 64, varlen=varlen)
    sem_flat = torch.full((size + 5,), -7, dtype=torch.int32, device=DEVICE)
    kernel, grid, args, kwargs = fb._preprocess_launch(out, dout, None, delta,
                                                       (acc, sem_flat[:size]), order)
    assert kwargs["ORDER_DOCS"]
    kernel[grid](*args, **kwargs)
    got = sem_flat[size - n_docs:size].cpu()
    want = (sorted(range(n_docs), key=lambda i: (-int(lengths[i]), i))
            if order[2] else list(range(n_docs)))
    assert got.tolist() == want
    assert not sem_flat[:size - n_docs].any() and (sem_flat[size:] == -7).all()
    torch.testing.assert_close(delta.double(), (out.double() * dout.double()).sum(-1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask, deterministic", [
    (Mask(causal=True), True), (Mask(), False), (Mask(window=(40, 0), softcap=20.0), True)])
def test_the_hopper_path_precompiles_its_kernels_as_it_launches(mask, deterministic,
                                                                monkeypatch):
    """On the Hopper path `precompile_backward` compiles the preprocess, zeroing (ZERO), and
    the Gluon kernel, as the backward will launch them: the same grids, constexprs and
    specialised arguments, tensors of the same dtypes, TMA descriptors of the same blocks
    and layouts; only what the kernels leave unspecialised may differ (stand-ins: one
    step's tile for dQ's accumulator, k and v for dK and dV)."""
    import fusedattn.dispatch as dispatch
    import fusedattn.tiles.flash_bwd as fb
    from fusedattn.hopper import backward as knobs
    from fusedattn.hopper import backward_kernel

    monkeypatch.setattr(knobs, "_sm_count", lambda device: 132)  # (no GPU in CI)
    q = _rand(2, 4, 300, 64, dtype=torch.bfloat16, seed=0)
    k, v = (_rand(2, 2, 300, 64, dtype=torch.bfloat16, seed=i) for i in (1, 2))
    submitted = []

    class Recorder:
        """Stands for the pool: records what is submitted, compiles nothing."""
        def submit(self, fn, kernel, grid, args, kwargs):
            from concurrent.futures import Future

            submitted.append((kernel, grid, args, kwargs))
            done = Future()
            done.set_result(None)
            return done

    monkeypatch.setattr(dispatch, "backward_path", lambda *a, **kw: ("hopper", "forced"))
    monkeypatch.setattr(fb, "EMULATION", False)
    monkeypatch.setattr(fb, "_POOL", Recorder())
    ahead = _launch_preparation(monkeypatch, submitted)
    monkeypatch.setattr(fb, "_SUBMITTED", set())
    monkeypatch.setattr(fb, "_PENDING", [])
    fb.precompile_backward(q, k, v, is_causal=mask.causal, scale=0.1, precision="ieee",
                           mask=mask, deterministic=deterministic)
    assert len(submitted) == 2
    assert ahead == [0]
    # the buffers as `flash_backward` makes them
    out, lse = torch.empty_like(q), torch.empty((2, 4, 300), device=DEVICE)
    dout, delta = torch.ones_like(out), torch.empty_like(lse)
    hopper = (torch.empty_like(q, dtype=torch.float32),
              torch.empty(knobs.counters(2, 4, 300, 64, bool(mask.softcap)),
                          dtype=torch.int32, device=DEVICE))
    wants = [fb._preprocess_launch(out, dout, None, lse, hopper),
             knobs.hopper_backward_launch(dout, q, k, v, lse, delta, *hopper,
                                          torch.empty_like(k), torch.empty_like(v), scale=0.1,
                                          mask=mask, deterministic=deterministic)]
    # (`test_flash`, `backward_kernel.UNSPECIALISED`: what the kernels leave unspecialised)
    free = {"n_sem", "sem_chunk", "sa_b", "sa_h", "sa_s", *backward_kernel.UNSPECIALISED}
    for (kernel, grid, args, kwargs), want in zip(submitted, wants, strict=True):
        kernel2, grid2, args2, kwargs2 = want
        assert kernel is kernel2 and grid == grid2 and kwargs == kwargs2
        for name, a, a2 in zip(kernel.arg_names[:len(args)], args, args2, strict=True):
            if isinstance(a, torch.Tensor):
                assert a.dtype == a2.dtype and a.device == a2.device, name
            elif hasattr(a, "block_shape"):  # a TMA descriptor: what the compile reads
                assert (a.block_shape, a.layout, a.base.dtype) == (
                    a2.block_shape, a2.layout, a2.base.dtype), name
            elif name not in free:
                assert a == a2, name
    assert wants[0][3]["ZERO"] and wants[1][0] is backward_kernel._flash_bwd_sm90
    assert submitted[1][3]["DETERMINISTIC"] is deterministic
