"""The Hopper backward (`fusedattn.hopper.backward`) and its dispatch (`backward_path`).

The dispatch runs everywhere (CI too). The Gluon kernel has no interpreter, so its cases are
`gpu_only` (the GPU tier on the H200): gradients on awkward shapes against the float64
reference's autograd, each bounded by twice the portable backward's error on the same inputs
plus a floor, with the Hopper kernel's launch seen (a silent fallback fails them); the same
bits on every run; the racing (non-deterministic) variant within the same bound."""

import random

import pytest
import torch

from fusedattn import attention, attention_varlen
from fusedattn.dispatch import backward_path, hopper_backward_refusal, use_backend
from fusedattn.mode import DEVICE
from fusedattn.reference import attention_ref_grads, varlen_ref_grads
from fusedattn.tiles.common import Mask
from inputs import ON_HOPPER, forget_plans, ragged, rand, script

KERNEL = "_flash_bwd_sm90"


def on_hopper(test):
    """A test of the Gluon backward itself: an sm90 GPU, never the interpreter."""
    test = pytest.mark.skipif(not ON_HOPPER, reason="the Hopper backward runs on sm90 only")(test)
    return pytest.mark.gpu_only("the Gluon kernel needs an sm90 GPU (no interpreter)")(test)


class Launches:
    """The names of the kernels launched inside (Triton's launch hook, which plans'
    replays call too)."""

    def __enter__(self):
        from triton import knobs

        self.names = []
        self._hook = lambda meta: self.names.append(meta.get()["name"])
        knobs.runtime.launch_enter_hook.add(self._hook)  # a HookChain (Triton 3.6)
        return self

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.launch_enter_hook.remove(self._hook)


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "float32"),
    (dict(dim=320), "head dims 320"),
    (dict(dim=48), "head dims 48"),
    (dict(dim=64, dim_v=128), "and 128 (v)"),   # v's head dim over q's
    (dict(dim=256, dim_v=192), "and 192 (v)"),  # v in pieces other than q's
    (dict(dim=128, dim_v=32), "and 32 (v)"),    # v's under 64
    (dict(strided=True), "TMA-aligned"),
])
def test_the_hopper_backward_says_why_it_refuses(change, reason):
    dim = change.get("dim", 128)
    q = rand(1, 2, 16, dim, dtype=change.get("dtype", torch.bfloat16))
    if change.get("strided"):
        q = rand(1, 2, 16, 2 * dim, dtype=torch.bfloat16)[..., ::2]
    v = rand(1, 2, 16, change["dim_v"], dtype=q.dtype) if "dim_v" in change else q
    why = hopper_backward_refusal(q, q, v, mask=Mask())
    assert why is not None and reason in why


def test_a_refused_backward_goes_portable_even_when_hopper_is_forced():
    q = rand(1, 2, 16, 320, dtype=torch.bfloat16)
    with use_backend("hopper"):
        path, why = backward_path(q, q, q, mask=Mask())
    assert path == "portable" and "head dims 320" in why
    assert backward_path(q, q, q, backend="portable", mask=Mask())[0] == "portable"


def test_short_rows_go_portable_under_auto_and_stay_forceable(monkeypatch):
    from fusedattn import dispatch

    monkeypatch.setattr(dispatch, "hopper_backward_refusal", lambda *a, **kw: None)
    for dim, keys in dispatch.HOPPER_BWD_MIN_KEYS.items():
        short, long = (torch.empty(1, 2, n, dim, dtype=torch.bfloat16) for n in (keys - 1, keys))
        path, why = backward_path(short, short, short, mask=Mask(causal=True))
        assert path == "portable" and f"HOPPER_BWD_MIN_KEYS[{dim}] = {keys}" in why
        assert backward_path(long, long, long, mask=Mask())[0] == "hopper"
        # forced at the forward, the choice reaches the backward's thread as `backend`
        assert backward_path(short, short, short, backend="hopper", mask=Mask())[0] == "hopper"

        class Packed:  # varlen: keys a sequence on average (the packed total over the count)
            batch = 3

        packed = torch.empty(1, 2, 3 * keys - 1, dim, dtype=torch.bfloat16)
        path, why = backward_path(packed, packed, packed, mask=Mask(), varlen=Packed())
        assert path == "portable" and f"{keys - 1} keys a row (a sequence on average)" in why
        packed = torch.empty(1, 2, 3 * keys, dim, dtype=torch.bfloat16)
        assert backward_path(packed, packed, packed, mask=Mask(),
                             varlen=Packed())[0] == "hopper"


@pytest.mark.parametrize("entry", ["attention", "attention_varlen"])
def test_the_forwards_backend_reaches_a_backward_run_outside_its_block(entry, monkeypatch):
    # autograd runs the backward after the `with use_backend` block (and maybe on a thread
    # of its own): the forward's choice must travel with the graph, for either entry point
    from fusedattn.tiles import flash_bwd

    seen, real = [], flash_bwd.flash_backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_bwd, "flash_backward", spy)
    q, k, v = (rand(1, 2, 24, 64, dtype=torch.float32, seed=i).requires_grad_()
               for i in range(3))
    with use_backend("portable"):
        if entry == "attention":
            out = attention(q, k, v, is_causal=True)
        else:
            cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=q.device)
            packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # [total, H, D]
            out = attention_varlen(*packed, cu, cu, 14, 14, is_causal=True)
    out.sum().backward()
    assert seen == ["portable"]


@pytest.mark.emulation_only("the CPU's answer: the portable backward, and why")
def test_emulation_runs_the_portable_backward():
    q = rand(1, 2, 16, 128, dtype=torch.bfloat16)
    path, why = backward_path(q, q, q, mask=Mask(causal=True))
    assert path == "portable" and "not on a CUDA GPU" in why


def _grads(q, k, v, dout, backend, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with use_backend(backend):
        out = attention(*leaves, enable_gqa=k.shape[1] != q.shape[1], **kw)
    return torch.autograd.grad(out, leaves, dout)


def _varlen_grads(q, k, v, dout, cu_q, cu_k, max_q, max_k, backend, **kw):
    """`_grads` for `attention_varlen` on packed `[total, H, D]` tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with use_backend(backend):
        out = attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, **kw)
    return torch.autograd.grad(out, leaves, dout)


def _within_portable(grads, ref):
    """The Hopper backward's dQ, dK, dV (`grads("hopper")`, its kernel seen) each within
    twice the portable backward's error (`grads("portable")`) on the same inputs plus a
    floor, against float64 `ref`; returns the Hopper gradients."""
    with Launches() as seen:
        got = grads("hopper")
        torch.cuda.synchronize()
    assert KERNEL in seen.names, seen.names
    portable = grads("portable")
    for name, g, p, r in zip(("dq", "dk", "dv"), got, portable, ref, strict=True):
        assert g.shape == r.shape and torch.isfinite(g).all(), name
        err, err_p = ((x.double() - r).abs().max().item() for x in (g, p))
        assert err <= 2 * err_p + 1e-3, (name, err, err_p)
    return got


def _dense(q, k, v, dout, ref_kw=None, **kw):
    """`_within_portable` for `attention(q, k, v, **kw)` against float64 autograd."""
    return _within_portable(lambda backend: _grads(q, k, v, dout, backend, **kw),
                            attention_ref_grads(q, k, v, dout, device=DEVICE,
                                                **(ref_kw or {})))


CASES = [
    # (B, H, H_kv, Sq, Sk, D, options): each comment says what it exercises
    (1, 1, 1, 1, 1, 64, {}),                          # 1x1: one ragged tile, one key
    (1, 2, 2, 33, 31, 128, {}),                       # ragged query and key tiles
    (2, 3, 3, 33, 31, 64, dict(is_causal=True)),      # causal, rows past Sk see every key
    (1, 2, 2, 100, 300, 128, dict(is_causal=True)),   # Sq < Sk: keys no query sees: 0
    (1, 2, 1, 300, 100, 64, dict(is_causal=True)),    # Sq > Sk, MQA
    (1, 48, 8, 257, 257, 128, dict(is_causal=True)),  # GQA 48/8: dK, dV summed in-program
    (1, 2, 2, 4095, 4095, 128, dict(is_causal=True)),
    (1, 2, 1, 4097, 4097, 64, {}),
    (1, 2, 2, 700, 700, 128, dict(window=(0, 0))),    # a window of 0: the diagonal alone
    (1, 2, 2, 700, 700, 64, dict(window=(800, 800))),  # a window past S: everything
    (1, 2, 2, 700, 650, 128, dict(window=(100, 30))),  # both sides, many edge tiles
    (1, 4, 2, 500, 500, 128, dict(is_causal=True, softcap=30.0)),
    (1, 2, 2, 500, 500, 64, dict(softcap=5.0)),       # softcap where tanh bends
    # head dims padded to the next kernel's (`hopper.backward.kernel_dim`): zeros read past
    # the last column, the stores and dQ's adds stopping there
    (1, 2, 2, 333, 333, 96, dict(is_causal=True)),
    (1, 4, 2, 257, 300, 80, {}),                      # GQA, Sq < Sk, a 160-byte row
    (1, 2, 2, 500, 450, 112, dict(window=(100, 30))),
    (1, 2, 2, 300, 300, 72, dict(softcap=30.0)),      # 144-byte rows, 64 columns past
    # D256: 64 keys a program, dK and dV split by columns over the warpgroups, one slot
    (1, 2, 2, 333, 333, 256, dict(is_causal=True)),
    (1, 4, 2, 257, 300, 256, {}),                     # GQA, Sq < Sk
    (1, 2, 2, 700, 650, 256, dict(window=(100, 30), softcap=30.0)),
    (1, 2, 2, 200, 260, 192, dict(is_causal=True)),   # D192: pieces of 128 + 64 columns
    (1, 4, 2, 300, 280, 192, dict(softcap=30.0)),     # ... GQA, a softcap
    (1, 4, 1, 300, 300, 136, {}),                     # D136 as D192: 272-byte rows, MQA
    (1, 2, 2, 400, 400, 200, dict(window=(50, 20))),  # D200 as D256: 8 columns in a box
]


def _ref_kw(options: dict) -> dict:
    return dict(causal=options.get("is_causal", False), window=options.get("window"),
                softcap=options.get("softcap"))


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_hopper_gradients_against_the_reference(case, dtype):
    b, h, hk, sq, sk, d, options = case
    q, k, v = (rand(b, hh, s, d, dtype=dtype, seed=i) for i, (hh, s) in
               enumerate(((h, sq), (hk, sk), (hk, sk))))
    dout = rand(b, h, sq, d, dtype=dtype, seed=3)
    got = _dense(q, k, v, dout, _ref_kw(options), **options)
    if options.get("is_causal") and sk > sq:  # keys past the last query's: no gradient
        assert not got[1][:, :, sq:].any() and not got[2][:, :, sq:].any()


# V's head dim its own (`hopper.backward.kernel_dims`): V, dO and dV in V's pieces
DV_CASES = [
    # (B, H, H_kv, Sq, Sk, D, Dv, options)
    (1, 2, 2, 200, 260, 192, 128, dict(is_causal=True)),  # MLA: q, k in two pieces, v one
    (1, 4, 2, 300, 280, 192, 128, dict(softcap=30.0)),    # ... GQA, a softcap
    (2, 2, 2, 333, 333, 128, 64, {}),                     # S transposed (no mask)
    (1, 4, 1, 257, 300, 128, 64, dict(is_causal=True)),   # MQA, causal, Sq < Sk
    (1, 2, 2, 300, 300, 256, 128, dict(window=(100, 30))),  # D256's dQ in halves
    (1, 2, 2, 250, 250, 160, 104, dict(is_causal=True)),  # both padded: 192/128's kernel
    (1, 2, 2, 300, 300, 96, 64, {}),                      # q padded: 128/64's kernel
]


@on_hopper
@pytest.mark.parametrize("case", DV_CASES)
def test_hopper_gradients_with_a_v_head_dim_of_its_own(case):
    from fusedattn.hopper.forward import kernel_pair

    b, h, hk, sq, sk, d, dv, options = case
    q = rand(b, h, sq, d, dtype=torch.bfloat16)
    k = rand(b, hk, sk, d, dtype=torch.bfloat16, seed=1)
    v = rand(b, hk, sk, dv, dtype=torch.bfloat16, seed=2)
    dout = rand(b, h, sq, dv, dtype=torch.bfloat16, seed=3)

    def grads(backend):
        if backend == "hopper" and kernel_pair(d, dv) is None:
            # the Hopper forward refuses the pair (forced, the call would raise): "auto"
            # runs it portable and the backward on the Hopper kernel, whose launch
            # `_within_portable` checks
            backend = "auto"
        return _grads(q, k, v, dout, backend, **options)

    got = _within_portable(grads, attention_ref_grads(q, k, v, dout, device=DEVICE,
                                                      **_ref_kw(options)))
    assert got[2].shape == v.shape


@on_hopper
@pytest.mark.parametrize("options", [dict(is_causal=False), dict(is_causal=True)])
@pytest.mark.parametrize("dim, dim_v", [(192, 128), (128, 64)])
def test_hopper_varlen_gradients_with_a_v_head_dim_of_its_own(dim, dim_v, options):
    # dV's masked stores take V's head dim (`dim_v`), dK's q's: rows past a sequence's
    # end, and columns past V's, never written
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(dim, dim_v)
    dout = rand(*q.shape[:-1], dim_v, dtype=q.dtype, seed=3)

    def grads(backend):
        return _varlen_grads(q, k, v, dout, cu_q, cu_k, max_q, max_k, backend, **options)

    ref = varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=options["is_causal"],
                           device=DEVICE)
    got = _within_portable(grads, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, grads("hopper"), strict=True))


@on_hopper
@pytest.mark.parametrize("options", [dict(is_causal=False), dict(is_causal=True),
                                     dict(is_causal=True, window=(200, 0))])
@pytest.mark.parametrize("dim", [64, 96, 128, 192, 256])
def test_hopper_varlen_gradients_with_empty_and_one_token_sequences(dim, options):
    # empty query and key sequences, one token, Sq < Sk and Sq > Sk (bottom-right), GQA
    # 4/2: the rows past a sequence's end are the next sequence's, never written
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(dim)
    dout = rand(*q.shape, dtype=q.dtype, seed=3)

    def grads(backend):
        return _varlen_grads(q, k, v, dout, cu_q, cu_k, max_q, max_k, backend, **options)

    ref = varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=options["is_causal"],
                           window=options.get("window"), device=DEVICE)
    got = _within_portable(grads, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, grads("hopper"), strict=True))


@on_hopper
@pytest.mark.parametrize("order", ["up", "down"])
@pytest.mark.parametrize("options", [dict(is_causal=False), dict(is_causal=True)])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_compact_varlen_grid_gives_the_full_grids_bits(dim, options, order,
                                                           monkeypatch):
    # `hopper.backward.VARLEN_COMPACT` on and off: each sequence's own key tiles
    # (`_key_tile` finds a program's sequence by a prefix sum, 32 sequences a turn: 70
    # here, a dozen empty, one 900 keys long) against the longest sequence's for every
    # one. Right against the reference, and the same bits as the full grid (the adds'
    # order is the same)
    from fusedattn.hopper import backward as knobs

    lengths = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(5))
    lengths[::6] = 0
    lengths[33] = 900
    lengths_q = lengths.roll(1).tolist()  # (Sq != Sk per sequence; empty queries apart)
    q, k, v, cu_q, cu_k, max_q, max_k = ragged(dim, lengths=(lengths_q, lengths.tolist()))
    dout = rand(*q.shape, dtype=q.dtype, seed=3)
    monkeypatch.setattr(knobs, "ORDER", order)
    monkeypatch.setattr(knobs, "VARLEN_COMPACT", {64: True, 128: True})
    grids, real = [], knobs.hopper_backward_launch

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        grids.append((launch[1][0], launch[3]["COMPACT"]))
        return launch

    monkeypatch.setattr(knobs, "hopper_backward_launch", spy)

    def grads(backend):
        return _varlen_grads(q, k, v, dout, cu_q, cu_k, max_q, max_k, backend, **options)

    ref = varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=options["is_causal"],
                           device=DEVICE)
    compact = _within_portable(grads, ref)
    monkeypatch.setattr(knobs, "VARLEN_COMPACT", {64: False, 128: False})
    full = grads("hopper")
    assert all(torch.equal(a, b) for a, b in zip(compact, full, strict=True))
    # 2 K/V heads: the compact grid at most (keys + 70 * 127) // 128 a head, the full
    # grid 70 x 8 (900 keys) a head
    assert grids == [((k.shape[0] + 70 * 127) // 128 * 2, True), (70 * 8 * 2, False)], grids


@on_hopper
@pytest.mark.parametrize("dim", [64, 128])
def test_dq_accumulates_in_qs_layout_where_tma_adds(dim, monkeypatch):
    # `[B, S, H, D]` views: the TMA adds go into an accumulator of q's strides (its cast
    # into dQ then copies like to like), the writer's atomics into a contiguous one; both
    # right against the reference and the same bits
    import fusedattn.tiles.flash_bwd as fb
    from fusedattn.hopper import backward as knobs

    q, k, v, dout = (rand(2, 333, 4, dim, dtype=torch.bfloat16, seed=i).transpose(1, 2)
                     for i in range(4))
    seen, real = [], knobs.hopper_backward_launch

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        seen.append((args[6].stride(), launch[3]["DQ_TMA"]))
        return launch

    monkeypatch.setattr(knobs, "hopper_backward_launch", spy)
    # (the forward's precompile builds a launch too, on stand-ins: not the backward's)
    monkeypatch.setattr(fb, "precompile_backward", lambda *args, **kwargs: None)
    tma = _dense(q, k, v, dout, dict(causal=True), is_causal=True)
    monkeypatch.setattr(knobs, "DQ_TMA", {64: False, 128: False})
    atomics = _grads(q, k, v, dout, "hopper", is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip(tma, atomics, strict=True))
    assert seen == [(q.stride(), True), (q.contiguous().stride(), False)], seen


@on_hopper
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_forward_with_grad_compiles_the_hopper_backward_ahead(deterministic, monkeypatch):
    # `precompile_backward` on the Hopper path: the preprocess and the Gluon kernel compile
    # on the pool's threads while the forward runs, both without error, and the backward
    # then launches that kernel (its gradients right against the reference)
    import fusedattn.tiles.flash_bwd as fb
    from fusedattn.hopper import backward_kernel

    if fb._POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        monkeypatch.setattr(fb, "_POOL", ThreadPoolExecutor(max_workers=3))
    real, jobs = fb._POOL, []

    class Seen:
        def submit(self, fn, kernel, grid, args, kwargs):
            jobs.append((kernel, real.submit(fn, kernel, grid, args, kwargs)))
            return jobs[-1][1]

    monkeypatch.setattr(fb, "_POOL", Seen())
    monkeypatch.setattr(fb, "_SUBMITTED", set())  # (this shape, whatever ran before)
    q, k, v, dout = (rand(1, 3, 1111, 128, dtype=torch.bfloat16, seed=i) for i in range(4))
    _dense(q, k, v, dout, _ref_kw(dict(is_causal=True)), is_causal=True,
           deterministic=deterministic)
    names = [kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
             for kernel, _ in jobs]
    assert backward_kernel._flash_bwd_sm90 in [kernel for kernel, _ in jobs], names
    for _, job in jobs:
        job.result()  # compiled without error


@on_hopper
def test_hopper_backward_with_sinks_lse_gradient_and_strided_dout():
    # sinks' gradient (host side, from delta), a used LSE (dLSE enters delta), [B, S, H, D]
    # views (TMA over their strides) and a dO that is not TMA-ready (made contiguous)
    q, k, v = (rand(2, 300, 4, 64, dtype=torch.bfloat16, seed=i).transpose(1, 2)
               for i in range(3))
    sinks = rand(4, seed=5).requires_grad_()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = rand(2, 4, 300, 128, dtype=torch.bfloat16, seed=3)[..., ::2]
    dlse = rand(2, 4, 300, seed=4)
    grads = {}
    for backend in ("hopper", "portable"):
        with use_backend(backend):
            out, lse = attention(*leaves, is_causal=True, sinks=sinks, return_lse=True)
        grads[backend] = torch.autograd.grad((out, lse), [*leaves, sinks], (dout, dlse))
    ref = attention_ref_grads(q, k, v, dout, causal=True, dlse=dlse, sinks=sinks,
                              device=DEVICE)
    for name, g, p, r in zip(("dq", "dk", "dv", "dsinks"), grads["hopper"],
                             grads["portable"], ref, strict=True):
        err, err_p = ((x.double() - r).abs().max().item() for x in (g, p))
        assert err <= 2 * err_p + 1e-3, (name, err, err_p)


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_backward_gives_the_same_bits_every_run(causal):
    # many key tiles add into each query tile's dQ: the order is what could vary
    q = rand(2, 16, 2048, 128, dtype=torch.bfloat16)
    k, v = (rand(2, 4, 2048, 128, dtype=torch.bfloat16, seed=i) for i in (1, 2))
    dout = rand(2, 16, 2048, 128, dtype=torch.bfloat16, seed=3)
    first = _grads(q, k, v, dout, "hopper", is_causal=causal)
    for _ in range(4):
        again = _grads(q, k, v, dout, "hopper", is_causal=causal)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


ORDER_MASKS = [dict(is_causal=True), {}, dict(window=(100, 30)), dict(window=(150, None)),
               dict(window=(None, 40))]


def _launch_spy(names, monkeypatch) -> list:
    """The keyword `names` (one, or a tuple of them: a tuple each) of every Hopper backward
    launch built from here on (a spy on `hopper.backward.hopper_backward_launch`), in a
    list that grows as they are. The plans kept so far are forgotten: a call that replayed
    one an earlier test recorded on the same shapes would build no launch (the D256 case
    of the dQ buffer's test saw none on the GPU tier, 20261205T023816Z)."""
    from fusedattn.hopper import backward as knobs

    forget_plans()

    seen, real = [], knobs.hopper_backward_launch

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        kw = launch[3]
        seen.append(kw[names] if isinstance(names, str) else tuple(kw[n] for n in names))
        return launch

    monkeypatch.setattr(knobs, "hopper_backward_launch", spy)
    return seen


def _gqa_operands(dim: int) -> tuple:
    """q, k, v and dO of the order and mask tests: GQA 6/2, Sq 777 against Sk 1290, bf16."""
    q = rand(1, 6, 777, dim, dtype=torch.bfloat16)
    k, v = (rand(1, 2, 1290, dim, dtype=torch.bfloat16, seed=i) for i in (1, 2))
    return q, k, v, rand(1, 6, 777, dim, dtype=torch.bfloat16, seed=3)


@on_hopper
@pytest.mark.parametrize("options", ORDER_MASKS)
@pytest.mark.parametrize("order", ["down", "down-heads", "down-front", "up", "rotated"])
def test_every_order_of_the_deterministic_adds_is_right_and_repeats(order, options,
                                                                    monkeypatch):
    # each order forced (the rule picks by mask and size: these shapes would not reach
    # "up"; "rotated" under a mask falls back to the rule), GQA 6/2 with Sq != Sk: right
    # against the reference and the same bits again; "down" launched across the heads
    # (few programs), "down-heads" head by head (`DOWN_ACROSS_HEADS` off) and
    # "down-front" head by head with the last head's first 4 of its 11 key tiles first
    # (`FRONT_TILES`)
    from fusedattn.hopper import backward as knobs

    monkeypatch.setattr(knobs, "DOWN_ACROSS_HEADS", order == "down")
    monkeypatch.setattr(knobs, "FRONT_TILES", 4 if order == "down-front" else 0)
    monkeypatch.setattr(knobs, "ORDER", order.split("-")[0])
    q, k, v, dout = _gqa_operands(128)
    got = _dense(q, k, v, dout, _ref_kw(options), **options)
    again = _grads(q, k, v, dout, "hopper", **options)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


@on_hopper
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("options", [o for o in ORDER_MASKS if o])
@pytest.mark.parametrize("dim", [64, 128])
def test_scores_transposed_under_masks_are_right_and_repeat(dim, options, deterministic,
                                                            monkeypatch):
    # `hopper.backward.SWAP_MASKED` (on at D64, off at D128) forced on: S^T under every
    # mask, GQA 6/2 with Sq != Sk; the kernel must run it (the launch says SWAP_SDP), be
    # right against the reference and give the same bits again
    from fusedattn.hopper import backward as knobs

    monkeypatch.setattr(knobs, "SWAP_MASKED", {64: True, 128: True})
    seen = _launch_spy("SWAP_SDP", monkeypatch)
    q, k, v, dout = _gqa_operands(dim)
    got = _dense(q, k, v, dout, _ref_kw(options), deterministic=deterministic, **options)
    assert seen and all(seen), seen
    if deterministic:
        again = _grads(q, k, v, dout, "hopper", **options)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


@on_hopper
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("options", [o for o in ORDER_MASKS if o])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_masks_key_indices_and_constants_give_the_same_bits(dim, options, swap,
                                                                 monkeypatch):
    # `hopper.backward.MASK_CONSTANTS` moves the mask's compares, never a value: with S or
    # S^T (`SWAP_MASKED`), GQA 6/2 with Sq != Sk, the gradients of both forms are one set
    # of bits (the default's against the reference: the tests above)
    from fusedattn.hopper import backward as knobs

    monkeypatch.setattr(knobs, "SWAP_MASKED", {64: swap, 128: swap})
    q, k, v, dout = _gqa_operands(dim)
    grads = []
    for constants in (True, False):
        monkeypatch.setattr(knobs, "MASK_CONSTANTS", constants)
        grads.append(_grads(q, k, v, dout, "hopper", **options))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@on_hopper
@pytest.mark.parametrize("options", [dict(is_causal=True), {}, dict(window=(100, 30))])
def test_d256s_slots_and_releases_give_the_same_bits(options, monkeypatch):
    # D256's forms move barriers and buffers, never a value: two slots of Q, one of dO and
    # dQ handed over in halves (`hopper.backward.DQ_SPLIT`, `DO_STAGES`: the default), and
    # one slot of both with a whole dQ, released once dV and dK are done (`EARLY_FREE`) or
    # at the step's end. GQA 6/2, Sq != Sk, D256 and D200 (padded): the same bits from
    # each, the launch taking each (the default's against the reference: the cases above)
    from fusedattn.hopper import backward as knobs

    one_slot = dict(TILES={**knobs.TILES, 256: (64, 64, 1)}, DO_STAGES={}, DQ_SPLIT={})
    forms = [({}, (2, 1, 2, True)), (dict(one_slot, EARLY_FREE=True), (1, 1, 1, True)),
             (dict(one_slot, EARLY_FREE=False), (1, 1, 1, False))]
    seen = _launch_spy(("STAGES", "DO_STAGES", "DQ_SPLIT", "EARLY_FREE"), monkeypatch)
    for dim in (256, 200):
        q, k, v, dout = _gqa_operands(dim)
        grads = []
        for switches, launched in forms:
            with monkeypatch.context() as form:
                for name, value in switches.items():
                    form.setattr(knobs, name, value)
                seen.clear()
                grads.append(_grads(q, k, v, dout, "hopper", **options))
            assert seen and all(s == launched for s in seen), (dim, launched, seen)
        for other in grads[1:]:
            assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True)), dim


@on_hopper
@pytest.mark.parametrize("dim", [64, 128, 192, 256])
def test_the_dq_buffer_given_back_on_read_gives_the_same_bits(dim, monkeypatch):
    # `hopper.backward.FREE_ON_READ` moves where the writer gives dQ's buffer back, never
    # an add or its order: the same bits with it on and off under the deterministic adds,
    # at every head dim's kernel (D192 in pieces, D256 with dQ in halves), causal, GQA 6/2
    # and Sq != Sk; the launch takes each
    _same_bits_either_way("FREE_ON_READ", dim, monkeypatch, is_causal=True)


@on_hopper
@pytest.mark.parametrize("dim, causal", [(64, True), (128, False), (128, True), (192, True)])
def test_the_slot_freed_by_dqs_hand_off_gives_the_same_bits(dim, causal, monkeypatch):
    # `hopper.backward.SLOT_BY_DQ` drops the slot's own release where it came at the step's
    # end with dQ's hand-off (the loader takes that hand-off for it), never an add: the same
    # bits with it on and off wherever it acts (D64, D128 with S transposed and not, D192
    # in pieces; D256 releases its slots early and never takes it)
    _same_bits_either_way("SLOT_BY_DQ", dim, monkeypatch, is_causal=causal)


@on_hopper
@pytest.mark.parametrize("dim, causal", [(64, True), (128, False), (128, True), (192, True),
                                         (256, True)])
def test_the_named_barrier_hand_off_gives_the_same_bits(dim, causal, monkeypatch):
    # `hopper.backward.NAMED_HANDOFF` moves how dQ's buffer goes back and forth between
    # the compute warps and the writer (named barriers, not mbarriers), never an add or its
    # order: the same bits with it on and off under the deterministic adds, GQA 6/2,
    # Sq != Sk. The launch takes it where SLOT_BY_DQ acts (D64, D128, D192: 256 + 128
    # threads; D256 hands dQ over in halves: 0 there). A wrong hand-off hangs
    from fusedattn.hopper import backward as knobs

    q, k, v, dout = _gqa_operands(dim)
    seen = _launch_spy("DQ_NAMED", monkeypatch)
    grads = []
    for on in (True, False):
        monkeypatch.setattr(knobs, "NAMED_HANDOFF", on)
        seen.clear()
        grads.append(_grads(q, k, v, dout, "hopper", is_causal=causal))
        want = 256 + 32 * knobs.WRITER_WARPS if on and dim != 256 else 0
        assert knobs.named_threads(dim != 256) == want
        assert seen and all(s == want for s in seen), (dim, on, seen)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), dim


@pytest.mark.parametrize("dim, want_slot_by_dq", [(64, True), (128, True), (192, True),
                                             (256, False)])
def test_the_launch_takes_the_named_hand_off_where_the_slot_goes_with_dq(dim,
                                                                         want_slot_by_dq,
                                                                         monkeypatch):
    # `named_threads`: 256 compute threads and the writer's where SLOT_BY_DQ acts (D64,
    # D128, D192), 0 at D256 (dQ in halves) and with NAMED_HANDOFF off (the CPU build)
    from fusedattn.hopper import backward as knobs

    for on in (True, False):
        monkeypatch.setattr(knobs, "NAMED_HANDOFF", on)
        kw = _cpu_build(dim, Mask(causal=True), True, monkeypatch)[3]
        assert kw["SLOT_BY_DQ"] is want_slot_by_dq
        want = 256 + 32 * knobs.WRITER_WARPS if on and want_slot_by_dq else 0
        assert kw["DQ_NAMED"] == knobs.named_threads(want_slot_by_dq) == want, (dim, on)


@on_hopper
@pytest.mark.parametrize("case", ["varlen", "racing", "one step", "window"])
def test_the_named_barrier_hand_off_against_the_reference(case, monkeypatch):
    # the hand-off's edges, right against the float64 reference: programs with no steps
    # (empty sequences: the writer gives no buffer ahead there) and one step (a buffer's
    # one use, never given back) in a ragged varlen batch; the racing adds (the buffer
    # back after the TMA reduction's read; their bits change from run to run); one query
    # tile (each program one step); a window (steps from both edges)
    from fusedattn.hopper import backward as knobs

    monkeypatch.setattr(knobs, "NAMED_HANDOFF", True)
    seen = _launch_spy("DQ_NAMED", monkeypatch)
    if case == "varlen":
        q, k, v, cu_q, cu_k, max_q, max_k = ragged(128)
        dout = rand(*q.shape, dtype=q.dtype, seed=3)
        _within_portable(
            lambda backend: _varlen_grads(q, k, v, dout, cu_q, cu_k, max_q, max_k, backend,
                                          is_causal=True),
            varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=True, device=DEVICE))
    else:
        shape = {"racing": (1, 4, 2, 777, 1290), "one step": (2, 3, 3, 60, 900),
                 "window": (1, 2, 2, 700, 650)}[case]
        b, h, h_kv, sq, sk = shape
        q, dout = (rand(b, h, sq, 128, dtype=torch.bfloat16, seed=i) for i in (0, 3))
        k, v = (rand(b, h_kv, sk, 128, dtype=torch.bfloat16, seed=i) for i in (1, 2))
        options = {"racing": dict(is_causal=True, deterministic=False), "one step": {},
                   "window": dict(window=(100, 30))}[case]
        _dense(q, k, v, dout, _ref_kw(options), **options)
    assert seen and all(s == 256 + 32 * knobs.WRITER_WARPS for s in seen), (case, seen)


def _same_bits_either_way(name: str, dim: int, monkeypatch, **options):
    """The deterministic Hopper backward's gradients on `_gqa_operands(dim)` with
    `hopper.backward`'s switch `name` on and off: every launch takes the value set, and
    the two give the same bits."""
    from fusedattn.hopper import backward as knobs

    q, k, v, dout = _gqa_operands(dim)
    seen = _launch_spy((name, "DETERMINISTIC"), monkeypatch)
    grads = []
    for on in (True, False):
        monkeypatch.setattr(knobs, name, on)
        seen.clear()
        grads.append(_grads(q, k, v, dout, "hopper", **options))
        assert seen and all(s == (on, True) for s in seen), (name, dim, on, seen)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), (name, dim)


MIB = 1 << 20


@pytest.mark.parametrize("tiles_n, programs, left, right, spread, want", [
    (32, 4096, -1, 0, 2 * MIB, "up"),          # causal, 31 programs an SM
    (64, 512, -1, 0, 2 * MIB, "down"),         # causal, 3.9 an SM: "up"'s tail costs more
    (64, 2048, -1, 0, 16 * MIB, "down"),       # GQA 32/8 S8192: Q and dO too big to spread
    (32, 4096, 100, 30, 2 * MIB, "up"),        # a window with a right bound: as causal
    (32, 4096, 100, -1, 2 * MIB, "down"),      # a left bound alone: the mirror image
    (32, 4096, -1, -1, 2 * MIB, "rotated"),    # unmasked, a head's key tiles fit the SMs
    (133, 4256, -1, -1, 2 * MIB, "down"),      # ... they do not: a program could hang
])
def test_the_adds_order_follows_the_mask_and_the_machine(tiles_n, programs, left, right,
                                                         spread, want, monkeypatch):
    from fusedattn.hopper import backward as knobs

    def picked():
        return knobs.order(tiles_n, programs, left, right, sms=132, spread_bytes=spread)

    assert picked() == want
    monkeypatch.setattr(knobs, "ORDER", "rotated")  # forced, but only where it can run
    assert picked() == ("rotated" if left < 0 and right < 0 and tiles_n <= 132 else want)
    monkeypatch.setattr(knobs, "ORDER", "up")
    assert picked() == "up"


@pytest.mark.parametrize("seq_q, seq_k, left, right, bottom", [
    (777, 1290, -1, -1, False), (40, 3000, -1, -1, False), (3000, 130, -1, -1, False),
    (2000, 2000, -1, 0, False), (500, 2900, -1, 0, True), (2900, 500, -1, 0, True),
    (1500, 1700, 300, 40, True), (1500, 1700, 300, -1, False), (900, 2100, -1, 250, False),
])
def test_the_orders_model_counts_every_program_once_and_never_hangs(seq_q, seq_k, left,
                                                                    right, bottom):
    # `scripts/bwd_order_model.py`: the kernel's walk and places transcribed, run with
    # programs launched in order onto few SMs ("rotated": a head's key tiles resident)
    model = script("bwd_order_model")
    tiles = -(-seq_k // model.BLOCK_N)
    for order in ("down", "up", "rotated"):
        if order == "rotated" and (left >= 0 or right >= 0):
            continue
        sms = tiles if order == "rotated" else 1
        assert model.run(order, seq_q, seq_k, left, right, bottom, sms) == "ok", order
    # several heads: "down" launched head by head or across the heads (DOWN_ACROSS), on one
    # SM and on a few
    for across in (False, True):
        for sms in (1, 5):
            assert model.run("down", seq_q, seq_k, left, right, bottom, sms, heads=3,
                             across=across) == "ok", (across, sms)
    # the model sees a wrong launch order: "up" with the lowest key tile first hangs
    if right >= 0 and seq_k > 2 * model.BLOCK_N:
        assert model.run("up", seq_q, seq_k, left, right, bottom, 1) == "ok"
        wrong = model.program
        model.program = lambda pid, n, order, *rest: wrong(n - 1 - pid, n, order, *rest)
        assert "hangs" in model.run("up", seq_q, seq_k, left, right, bottom, 1)


@pytest.mark.parametrize("lengths", [[5, 0, 300, 128, 129, 0, 1], [0, 0, 7], [2000],
                                     list(range(0, 2000, 37)), [128] * 40 + [0] * 3])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("order", ["down", "up"])
def test_the_compact_varlen_grid_runs_the_full_grids_programs_in_its_order(lengths, heads,
                                                                           order):
    # `_key_tile`'s COMPACT, transcribed in the model: at most `varlen_programs` a K/V
    # head, every program with keys of the full grid once and in its order (so each still
    # waits only on programs launched before it), the rest dead at the end
    from fusedattn.hopper import backward as knobs

    model = script("bwd_order_model")
    programs = knobs.varlen_programs(sum(lengths), len(lengths), model.BLOCK_N) * heads
    got = model.compact_launch(lengths, heads, order, programs)
    live = [p for p in got if p is not None]
    assert live == model.full_launch(lengths, heads, order)
    assert got[len(live):] == [None] * (programs - len(live))
    # the bound is tight where every sequence ends one key into a tile
    tight = [model.BLOCK_N * i + 1 for i in range(5)]
    assert knobs.varlen_programs(sum(tight), 5, model.BLOCK_N) == len(
        model.full_launch(tight, 1, order))


def test_the_longest_sequences_first_leave_no_tail_on_the_varlen_row():
    # `hopper.backward.VARLEN_LONGEST_FIRST`'s case, in the model: issue 33's 24 documents
    # at H16 on 132 SMs end 5% past their perfect share in their order (3848 and 3510 keys
    # come late), under 1% longest first
    from fusedattn_lab.serving import _lengths

    model = script("bwd_order_model")
    lengths = list(_lengths(24, 32768, 0))
    for block_m in (64, 128):
        given, first = (model.varlen_makespan(lengths, 16, 132, block_m, f)
                        for f in (False, True))
        assert given > 1.04 and first < 1.01, (block_m, given, first)


def test_down_across_the_heads_has_no_tail_where_head_by_head_has_one():
    # `hopper.backward.DOWN_ACROSS_HEADS`'s case, in the model: B1 H32/8 S8192 causal's
    # 512 programs on 132 SMs; head by head the last head's longest program starts last
    model = script("bwd_order_model")
    one, across = (model.makespan("down", 8192, 8, 132, a) for a in (False, True))
    assert one > 1.2 and across < 1.01, (one, across)
    # and with programs many SMs over, little is left to gain
    assert model.makespan("down", 4096, 128, 132, False) < 1.05


@pytest.mark.parametrize("programs, switch, want", [
    (512, True, True),      # B1 H32/8 S8192 causal: 3.9 programs an SM (+15%, 2302Z)
    (1024, True, False),    # B2: 7.8 (+4.5% before FRONT_TILES; since, -10%: 2025Z)
    (2048, True, False),    # B4: 15.5 (-4.5% across)
    (512, False, False)])   # the switch off
def test_down_goes_across_the_heads_where_programs_are_few(programs, switch, want,
                                                           monkeypatch):
    from fusedattn.hopper import backward as knobs

    monkeypatch.setattr(knobs, "DOWN_ACROSS_HEADS", switch)
    assert knobs.down_across(programs, sms=132) is want
    # racing adds never go across (B2 racing: 381 TFLOP/s across, 507 head by head, 1712Z)
    assert knobs.down_across(programs, sms=132, deterministic=False) is False


@pytest.mark.parametrize("across", [True, False])
def test_the_launch_passes_down_across_the_heads_by_its_switch(across, monkeypatch):
    # the launcher's order code: "down" as DOWN_ACROSS where `down_across` says so (a
    # B1 H2 S128 call: one program); "up" and "rotated" never across (their programs wait
    # on later key tiles of the head)
    from fusedattn.hopper import backward as knobs
    from fusedattn.hopper import backward_kernel as kernel

    monkeypatch.setattr(knobs, "DOWN_ACROSS_HEADS", across)
    for order, want in (("down", kernel.DOWN_ACROSS if across else kernel.DOWN),
                        ("up", kernel.UP), ("rotated", kernel.ROTATED)):
        monkeypatch.setattr(knobs, "ORDER", order)
        kernel_, _, args, _ = _cpu_build(128, Mask(), True, monkeypatch)
        assert dict(zip(kernel_.arg_names[:len(args)], args, strict=True))["order"] == want.value
    # racing adds launch "down" head by head whatever the switch (`down_across`)
    monkeypatch.setattr(knobs, "ORDER", "down")
    kernel_, _, args, _ = _cpu_build(128, Mask(), False, monkeypatch)
    assert dict(zip(kernel_.arg_names[:len(args)], args, strict=True))["order"] == \
        kernel.DOWN.value


@on_hopper
@pytest.mark.parametrize("dim", [128, 256, 200, 192])
def test_the_racing_variant_is_right_too(dim):
    # (D256: one slot released early, dQ's racing TMA adds; D200 padded to it; D192 two
    # pieces, two racing TMA adds a step)
    q, k, v = (rand(1, 8, 1000, dim, dtype=torch.bfloat16, seed=i) for i in range(3))
    dout = rand(1, 8, 1000, dim, dtype=torch.bfloat16, seed=3)
    _dense(q, k, v, dout, dict(causal=True), is_causal=True, deterministic=False)


def test_deterministic_takes_a_bool_and_reaches_the_backward(monkeypatch):
    from fusedattn.problem import ProblemError
    from fusedattn.tiles import flash_bwd

    q = rand(1, 2, 16, 16, dtype=torch.float32, grad=True)
    with pytest.raises(ProblemError, match="deterministic"):
        attention(q, q, q, deterministic="no")
    seen, real = [], flash_bwd.flash_backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_bwd, "flash_backward", spy)
    grads = [torch.autograd.grad(attention(q, q, q, is_causal=True, deterministic=d).sum(),
                                 q)[0] for d in (True, False)]
    assert seen == [True, False]
    # the portable backward is deterministic either way: the same bits
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dim, mask, swapped", [
    (128, Mask(), True), (128, Mask(causal=True), False), (128, Mask(window=(8, 0)), False),
    (128, Mask(softcap=30.0), False), (64, Mask(), True), (64, Mask(causal=True), True),
    (64, Mask(window=(8, 0)), True), (64, Mask(softcap=30.0), False)])
def test_scores_are_transposed_where_they_pay(dim, mask, swapped, monkeypatch):
    """`hopper.backward`'s launch picks S^T (P and dS as register operands) never under a
    softcap, at D128 for unmasked rows alone (under masks that kernel spilled and ran
    19-34% slower, and with the LSE rows it gained nothing), at D64 under masks too (+10 to
    +13%, evidence 2158Z)."""
    launch = _cpu_launch(dim, mask, True, monkeypatch)
    assert launch["SWAP_SDP"] is swapped


@pytest.mark.parametrize("mask", [Mask(), Mask(causal=True), Mask(softcap=30.0),
                                  Mask(window=(8, 0))])
@pytest.mark.parametrize("dim, dim_v", [(64, 64), (128, 128), (192, 128), (128, 64),
                                        (256, 128)])
def test_the_launch_binds_every_kernel_parameter_once(dim, dim_v, mask, monkeypatch):
    """The launcher's positional and keyword arguments are the kernel's parameters, each
    once (the kernel compiles only on a GPU: a parameter added or dropped on one side
    fails here, in CI)."""
    from fusedattn.hopper import backward_kernel

    kernel, _, args, kwargs = _cpu_build(dim, mask, True, monkeypatch, dim_v=dim_v)
    assert kernel is backward_kernel._flash_bwd_sm90
    names = kernel.arg_names
    assert sorted(set(kwargs) - {"num_warps"}) == sorted(names[len(args):])


def test_every_mbarrier_the_backward_inits_it_invalidates_after_the_partitions():
    """Each `mbarrier.init` of the kernel has its `mbarrier.invalidate`, after the
    partitions join (`gl.warp_specialize`). PTX gives an mbarrier's bytes no other use
    until it is invalidated, and Triton's allocator hands them to scratch after their last
    use: without the invalidations the writer's spin broadcast its counter through an
    unused mbarrier, and the deterministic backward hung or crashed beside other
    processes' kernels (issue 33, evidence/nvidia-h100/20261207T1157Z-spin-diag-main-tier).
    Read from the source: the kernel compiles only on a GPU's Triton."""
    import ast
    import inspect
    import textwrap

    from fusedattn.hopper import backward_kernel

    tree = ast.parse(textwrap.dedent(inspect.getsource(backward_kernel._flash_bwd_sm90.fn)))
    calls = {"init": [], "invalidate": [], "warp_specialize": []}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in calls:
            calls[node.func.attr].append(node)
    inits = {ast.unparse(c.args[0]) for c in calls["init"]}
    invalidated = {ast.unparse(c.args[0]) for c in calls["invalidate"]}
    assert len(inits) >= 5, inits  # kv_bar, dQ's ready and free, the slots' ready and free
    assert invalidated == inits
    (ws,) = calls["warp_specialize"]
    assert all(c.lineno > ws.end_lineno for c in calls["invalidate"])


@pytest.mark.parametrize("kernel, name", [
    ("backward", "bwd D128 causal"), ("backward", "bwd D128 mbarrier hand-off"),
    ("backward", "bwd D64 causal"), ("backward", "bwd D192"),
    ("forward", "D128 causal"), ("forward", "D64 varlen causal claims")])
def test_no_shared_scratch_lands_on_an_mbarrier(kernel, name):
    """The compiled kernels (Triton 3.6, sm_90a: the GPU tier's, or a CPU venv's) read and
    write no mbarrier's bytes as plain shared memory (`gluon_compile_report.
    scratch_on_mbarriers`). Before the backward invalidated its mbarriers, the writer's
    spin broadcast its counter through one, in 29 of its 35 configurations, and hung
    (issue 33); the forward's unused mbarrier shares its offset with scratch that no
    instruction touches."""
    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the kernels compile under Triton 3.6 (this Triton is "
                    f"{triton.__version__}); the GPU tier and a CPU venv of triton==3.6.0 "
                    "run it")
    report = script("gluon_compile_report")
    backward = kernel == "backward"
    module = report._load(f"k_{kernel}", report.BACKWARD if backward else report.KERNEL)
    fn = module._flash_bwd_sm90 if backward else module._flash_fwd_sm90
    config = next(c for c in (report.BWD_CONFIGS if backward else report.CONFIGS)
                  if c["name"] == name)
    ptx = report.compile_config(fn, dict(config), backward=backward).asm["ptx"]
    assert ptx.count("mbarrier.init") >= 5
    assert report.scratch_on_mbarriers(ptx) == []


@pytest.mark.parametrize("dim, softcap, rows", [(64, None, 128), (64, 30.0, 64),
                                                (128, None, 64), (128, 30.0, 64)])
def test_query_rows_a_step_follow_the_head_dim_and_softcap(dim, softcap, rows, monkeypatch):
    """D64 takes 128 query rows a step, but 64 under a softcap (where 128 spill 604 B,
    `hopper.backward.SOFTCAP_TILES`), and the deterministic adds' counters follow: one
    per query tile of the launch's."""
    from fusedattn.hopper import backward as knobs

    launch = _cpu_launch(dim, Mask(softcap=softcap), True, monkeypatch)
    assert launch["BLOCK_M"] == rows
    assert knobs.counters(2, 3, 1000, dim, softcap is not None) == 2 * 3 * -(-1000 // rows)
    if rows == 64 and dim == 64:  # counters sized for 128-row steps: refused, not overrun
        with pytest.raises(ValueError, match=r"2 counters for 4 \(query tiles"):
            _cpu_build(dim, Mask(softcap=softcap), True, monkeypatch,
                       n_counters=knobs.counters(1, 2, 128, dim, False))


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("compact", [True, False])
def test_varlen_launches_its_compact_grid_by_the_head_dims_switch(dim, compact, monkeypatch):
    # three sequences of 300, 0 and 1000 keys, 2 K/V heads: compact, (1300 + 3 * 127) //
    # 128 = 13 programs a head (11 with keys), the sequences' count as `n_tiles_n`, and
    # "down" never across the heads; else 3 x 8 a head
    from fusedattn.hopper import backward as knobs
    from fusedattn.hopper import backward_kernel as kernel
    from fusedattn.tiles.common import Varlen

    monkeypatch.setattr(knobs, "_sm_count", lambda device: 132)
    monkeypatch.setattr(knobs, "VARLEN_COMPACT", {64: not compact, 128: not compact,
                                                  dim: compact})
    monkeypatch.setattr(knobs, "ORDER", "down")
    cu = torch.tensor([0, 300, 300, 1300], dtype=torch.int32)
    q = rand(1, 4, 1300, dim, dtype=torch.bfloat16)
    k = rand(1, 2, 1300, dim, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 1300, dtype=torch.float32)
    kernel_, grid, args, kwargs = knobs.hopper_backward_launch(
        q, q, k, k, lse, lse, torch.zeros_like(q, dtype=torch.float32),
        torch.zeros(knobs.counters(3, 4, 1000, dim, varlen=Varlen(cu, cu, 1000, 1000)),
                    dtype=torch.int32), k, k, scale=0.1, mask=Mask(causal=True),
        varlen=Varlen(cu, cu, 1000, 1000))
    named = dict(zip(kernel_.arg_names[:len(args)], args, strict=True))
    assert kwargs["COMPACT"] is compact and kwargs["VARLEN"]
    assert grid == ((13 if compact else 24) * 2,)
    assert named["n_tiles_n"] == (3 if compact else 8)
    assert named["order"] == (kernel.DOWN if compact else kernel.DOWN_ACROSS).value


def _cpu_launch(dim, mask, deterministic, monkeypatch, dim_v=None) -> dict:
    """The keyword arguments `hopper.backward`'s launcher picks for a B1 H2 S128 call."""
    return _cpu_build(dim, mask, deterministic, monkeypatch, dim_v=dim_v)[3]


def _cpu_build(dim, mask, deterministic, monkeypatch, n_counters=None, dim_v=None,
               seq=128) -> tuple:
    """`hopper.backward`'s launch (kernel, grid, args, keyword args) for a B1 H2 S`seq` call
    (on the CPU: the launch is built, not run), its counters `counters(...)` or
    `n_counters`; v, dO and dV of head dim `dim_v` (default q's)."""
    from fusedattn.hopper import backward as knobs

    monkeypatch.setattr(knobs, "_sm_count", lambda device: 132)  # (no GPU in CI)
    q = rand(1, 2, seq, dim, dtype=torch.bfloat16)
    v = rand(1, 2, seq, dim_v or dim, dtype=torch.bfloat16, seed=2)
    zeros = torch.zeros(1, 2, seq, dtype=torch.float32)
    if n_counters is None:
        n_counters = knobs.counters(1, 2, seq, dim, bool(mask.softcap))
    return knobs.hopper_backward_launch(
        v, q, q, v, zeros, zeros, torch.zeros_like(q, dtype=torch.float32),
        torch.zeros(n_counters, dtype=torch.int32), q, v, scale=0.1, mask=mask,
        deterministic=deterministic)


@pytest.mark.parametrize("dim, mask, deterministic, tma, lse", [
    (128, Mask(), True, True, False),             # S^T under deterministic adds: no rows
    (128, Mask(), False, True, True),             # racing: the rows
    (128, Mask(causal=True), True, True, True),
    (128, Mask(softcap=30.0), True, True, True),  # (no S^T under a softcap)
    (64, Mask(causal=True), True, True, True),    # D64 (128-row steps): both
    (64, Mask(), True, True, True),               # ... S^T under deterministic adds too
    (64, Mask(), False, True, True),
    (256, Mask(), True, True, True),              # D256: no S^T (64 keys a program)
    (256, Mask(causal=True), False, True, True),
    (192, Mask(), True, True, True)])             # D192 (two pieces): as D256
def test_dq_adds_and_lse_rows_follow_the_head_dim_and_mask(dim, mask, deterministic, tma,
                                                           lse, monkeypatch):
    """`hopper.backward`'s launch adds dQ by TMA reductions (`DQ_TMA`) and takes LSE and
    delta through shared memory (`lse_in_shared`), at D128 except with S^T under
    deterministic adds (evidence 2031Z, 2049Z), at D64 everywhere (its 128-row steps,
    2150Z); `SWAP_MASKED` transposes S under masks too (at D64 by default), keeping the
    rows."""
    from fusedattn.hopper import backward as knobs

    got = _cpu_launch(dim, mask, deterministic, monkeypatch)
    assert knobs.tma_reduce_available()  # (Triton >= 3.6, as installed here)
    assert (got["DQ_TMA"], got["LSE_SMEM"]) == (tma, lse)
    # a Triton whose Gluon builder has no TMA reduction: the writer's atomics, which take
    # one head-dim piece (D192's two: refused, and the dispatch says so first)
    monkeypatch.setattr(knobs, "tma_reduce_available", lambda: False)
    if dim in knobs.PIECES:
        with pytest.raises(ValueError, match=r"in pieces of \(128, 64\) columns only where"):
            _cpu_launch(dim, mask, deterministic, monkeypatch)
        q = rand(1, 2, 4096, dim, dtype=torch.bfloat16)
        assert "in pieces of" in hopper_backward_refusal(q, q, q, mask=mask)
        monkeypatch.setattr(knobs, "tma_reduce_available", lambda: True)
    else:
        assert _cpu_launch(dim, mask, deterministic, monkeypatch)["DQ_TMA"] is False
    monkeypatch.setattr(knobs, "SWAP_MASKED", dict.fromkeys(knobs.TILES, True))
    got = _cpu_launch(dim, mask, deterministic, monkeypatch)
    bounded = mask.causal or mask.window is not None
    assert got["SWAP_SDP"] is (mask.softcap is None and knobs.TILES[dim][1] >= 128)
    assert got["LSE_SMEM"] is (lse or bounded)


@pytest.mark.parametrize("dim, padded_to", [(72, 128), (80, 128), (96, 128), (112, 128),
                                            (120, 128), (136, 192), (160, 192), (200, 256),
                                            (248, 256)])
def test_a_head_dim_between_runs_padded_to_the_next(dim, padded_to, monkeypatch):
    """`hopper.backward.kernel_dim`: D65-D127 take D128's kernel and tables, D129-D191
    D192's, D193-D255 D256's (the same compiled kernel: its constexprs and descriptor
    blocks are the padded dim's), the descriptors keeping the tensors' own head dim (TMA
    reads zeros past it and stores nothing there), the head dim itself an argument
    (varlen's masked stores); without dQ's TMA adds (their boxes drop the extra columns,
    the writer's atomics would not) the Hopper backward refuses it, and the call goes
    portable."""
    from fusedattn.hopper import backward as knobs

    assert knobs.kernel_dim(dim) == padded_to
    mask = Mask(causal=True)
    kernel_, grid, args, kwargs = _cpu_build(dim, mask, True, monkeypatch)
    padded = _cpu_launch(padded_to, mask, True, monkeypatch)
    assert kwargs == padded  # every constexpr as the padded dim's
    named = dict(zip(kernel_.arg_names[:len(args)], args, strict=True))
    assert named["dim"] == dim
    first, second = knobs.PIECES.get(padded_to, (padded_to, 0))  # (D192: 128 + 64 columns)
    for name in ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "dq_desc"):
        assert named[name].shape[-1] == dim, name
        # (dQ's accumulator in blocks of its parts: D256's halves)
        split = knobs.DQ_SPLIT.get(padded_to, 1) if name == "dq_desc" else 1
        assert named[name].block_shape[-1] == first // split, name
        two = named[name.replace("_desc", "2_desc")]
        assert (two.block_shape[-1], two.shape[-1]) == (second, dim) if second else two is None
    q = rand(1, 2, 4096, dim, dtype=torch.bfloat16)
    assert knobs.padded_refusal(dim) is None
    monkeypatch.setattr(knobs, "tma_reduce_available", lambda: False)
    why = hopper_backward_refusal(q, q, q, mask=mask)
    assert why is not None and f"head dim {dim} runs padded to {padded_to} only where" in why
    with pytest.raises(ValueError, match="only where dQ is added by TMA reductions"):
        _cpu_build(dim, mask, True, monkeypatch)


def test_the_kernels_head_dims():
    from fusedattn.hopper import backward as knobs

    assert [knobs.kernel_dim(d) for d in (16, 48, 63, 64, 65, 127, 128, 129, 192, 193, 256,
                                          257, 320)] == [
        None, None, None, 64, 128, 128, 128, 192, 192, 256, 256, None, None]
    # v's head dim: its own kernel dim up to q's, in pieces only as q's (D192's)
    pairs = {(192, 128): (192, 128), (128, 64): (128, 64), (160, 100): (192, 128),
             (256, 128): (256, 128), (256, 64): (256, 64), (96, 64): (128, 64),
             (192, 192): (192, 192), (200, 136): None, (256, 192): None, (64, 128): None,
             (128, 48): None, (320, 128): None}
    assert {pair: knobs.kernel_dims(*pair) for pair in pairs} == pairs


@pytest.mark.parametrize("dim, dim_v, pieces, pieces_v", [
    (192, 128, (128, 64), (128, 0)),  # MLA: q and k in two pieces, v in one
    (128, 64, (128, 0), (64, 0)),
    (160, 104, (128, 64), (128, 0)),  # both padded: 192/128's kernel
    (256, 128, (256, 0), (128, 0))])
def test_a_v_head_dim_of_its_own_takes_vs_pieces(dim, dim_v, pieces, pieces_v, monkeypatch):
    """V, dO and dV's descriptors take V's pieces (DV, DV2) over their own head dim, Q, K,
    dK and dQ's q's (D, D2); the tiles, slots and switches are q's head dim's, and the
    kernel gets V's head dim for varlen's masked stores."""
    from fusedattn.hopper import backward as knobs

    mask = Mask(causal=True)
    kernel, _, args, kwargs = _cpu_build(dim, mask, True, monkeypatch, dim_v=dim_v)
    assert (kwargs["D"], kwargs["D2"], kwargs["DV"], kwargs["DV2"]) == (*pieces, *pieces_v)
    same = _cpu_launch(dim, mask, True, monkeypatch)  # v's head dim as q's
    assert {n: v for n, v in kwargs.items() if n not in ("DV", "DV2")} == {
        n: v for n, v in same.items() if n not in ("DV", "DV2")}
    named = dict(zip(kernel.arg_names[:len(args)], args, strict=True))
    assert (named["dim"], named["dim_v"]) == (dim, dim_v)
    split = knobs.DQ_SPLIT.get(knobs.kernel_dim(dim), 1)
    for name in ("q_desc", "k_desc", "dk_desc", "dq_desc", "v_desc", "do_desc", "dv_desc"):
        own = name in ("v_desc", "do_desc", "dv_desc")
        first, second = pieces_v if own else pieces
        assert named[name].shape[-1] == (dim_v if own else dim), name
        assert named[name].block_shape[-1] == first // (split if name == "dq_desc" else 1)
        two = named[name.replace("_desc", "2_desc")]
        assert two.block_shape[-1] == second if second else two is None, name


@pytest.mark.parametrize("dim, mask, deterministic", [
    (128, Mask(), True), (128, Mask(), False), (128, Mask(causal=True), True),
    (128, Mask(window=(8, 0)), False), (128, Mask(softcap=30.0), True),
    (64, Mask(causal=True), True), (64, Mask(), True), (64, Mask(), False),
    (64, Mask(softcap=30.0), True), (256, Mask(), True), (256, Mask(causal=True), False),
    (256, Mask(softcap=30.0), True), (192, Mask(causal=True), True), (192, Mask(), False),
    ((192, 128), Mask(), True), ((192, 128), Mask(causal=True), True), ((128, 64), Mask(), True),
    ((128, 64), Mask(causal=True), False), ((256, 128), Mask(causal=True), True)])
def test_the_compile_report_picks_the_launchers_constexprs(dim, mask, deterministic,
                                                           monkeypatch):
    """`scripts/gluon_compile_report.py --backward` fills what a configuration leaves out
    by the launcher's rule, written again there (it runs without torch): the two agree.
    (A pair: q's head dim and v's, the report's V.)"""
    report = script("gluon_compile_report")
    dim, dim_v = dim if isinstance(dim, tuple) else (dim, dim)
    _, _, left, right = mask.kernel_args(0.1)
    config = dict(D=dim, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
                  SOFTCAP=mask.softcap is not None, DETERMINISTIC=deterministic)
    if dim_v != dim:
        config["V"] = dim_v
    picked = report.backward_constexprs(config)
    launched = _cpu_launch(dim, mask, deterministic, monkeypatch, dim_v=dim_v)
    shared = sorted(set(picked) & set(launched))
    assert {"SWAP_SDP", "DQ_TMA", "LSE_SMEM", "BLOCK_M", "BLOCK_N", "STAGES",
            "DQ_BUFS", "EARLY_FREE", "SLOT_BY_DQ", "DQ_NAMED", "D", "D2", "DV",
            "DV2"} <= set(shared)
    assert {n: picked[n] for n in shared} == {n: launched[n] for n in shared}


def test_the_backward_check_marks_gradients_that_disagree():
    """`scripts/hopper_bwd_check.py` marks a provider whose gradients differ from the
    first's by more than `WRONG_SHARE` of their largest magnitude (FA4's 460 at 128/64),
    not bf16's rounding (cuDNN's 0.001), nor a NaN as agreeing."""
    check = script("hopper_bwd_check")
    assert check.disagrees(460.0, 12.0) and check.disagrees(float("nan"), 12.0)
    assert not check.disagrees(0.001, 12.0) and not check.disagrees(0.0, 0.0)


@pytest.mark.parametrize("zero", [True, False])
def test_the_preprocess_zeroes_the_hopper_buffers_by_its_switch(zero, monkeypatch):
    # `hopper.backward.ZERO_IN_PREPROCESS`: the backward's first launch (the preprocess)
    # zeroes dQ's accumulator and the counters (ZERO, on those buffers), else it leaves
    # them to the fills; the switch is in the plans' keys (`switches`)
    from fusedattn.hopper import backward as knobs
    from fusedattn.tiles import flash_bwd

    monkeypatch.setattr(knobs, "_sm_count", lambda device: 132)
    monkeypatch.setattr(knobs, "ZERO_IN_PREPROCESS", zero)
    q = rand(1, 2, 128, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 128, dtype=torch.float32)
    hopper = (torch.empty(q.shape, dtype=torch.float32),
              torch.empty(knobs.counters(1, 2, 128, 64), dtype=torch.int32))
    launches = flash_bwd._launches(q, q, q, q, q, lse, None, lse, q, q, q, precision="ieee",
                                   configs=None, mask=Mask(causal=True), varlen=None,
                                   scale=0.1, hopper=hopper)
    from fusedattn.hopper import backward_kernel

    (pre, _, args, kwargs), hopper_launch = launches
    assert pre is flash_bwd._bwd_preprocess and kwargs["ZERO"] is zero
    assert hopper_launch[0] is backward_kernel._flash_bwd_sm90
    if zero:
        assert args[4] is hopper[0] and args[5] is hopper[1]
    before = knobs.switches()
    monkeypatch.setattr(knobs, "ZERO_IN_PREPROCESS", not zero)
    assert knobs.switches() != before


def test_the_l2_model_reads_as_ncu_did_and_its_launches_keep_the_adds_order():
    # `scripts/bwd_l2_model.py` against Nsight Compute of B2 GQA 32/8 S8192 D128 causal on
    # an H100 (evidence/nvidia-h100/20261206T1728Z-ncu-gqa-across-heads): head by head
    # 0.95 GB from DRAM and 96% L2 hits, across the heads 9.2 GB and 68%
    model = script("bwd_l2_model")
    heads, across = (model.simulate(order, 2, 8, 4, 8192, 128, 132, 50 << 20, 6, 2.5, 3.0)
                     for order in ("heads", "across"))
    assert 0.8 < heads["dram_gb"] < 1.1 and heads["l2_hit"] > 0.95, heads
    assert 8 < across["dram_gb"] < 12 and across["l2_hit"] < 0.75, across
    # each launch runs every program once, after its pair's lower key tiles (the ones a
    # deterministic "down" program waits on), or a launch could hang
    for order in ("heads", "across", "tail", "front"):
        got = model.launch(order, 8, 64, 3, 16)
        assert sorted(got) == [(p, n) for p in range(8) for n in range(64)], order
        seen = set()
        for p, n in got:
            assert all((p, m) in seen for m in range(n)), (order, p, n)
            seen.add((p, n))


@pytest.mark.parametrize("pairs, tiles, front", [(8, 64, 16), (2, 11, 4), (3, 5, 5),
                                                 (1, 7, 3), (4, 9, 0)])
def test_the_kernels_front_launch_is_the_models(pairs, tiles, front):
    # `backward_kernel._key_tile`'s DOWN + 4 f (`hopper.backward.FRONT_TILES`) transcribed:
    # the launch the L2 model scored ("front", one pair moved), whose programs each come
    # after their pair's lower key tiles (the model's test above)
    model = script("bwd_l2_model")
    last = (pairs - 1) * tiles
    got = []
    for pid in range(pairs * tiles):
        pid = last + pid if pid < front else (pid - front if pid - front < last else pid)
        got.append((pid // tiles, pid % tiles))
    assert got == model.launch("front", pairs, tiles, 1, front)


@pytest.mark.parametrize("front, want", [(16, 8), (3, 3), (0, 0)])
def test_the_launch_puts_the_last_heads_longest_key_tiles_first(front, want, monkeypatch):
    # FRONT_TILES: "down" head by head (racing adds) on B1 H2 S1024, 8 key tiles a head,
    # passes DOWN + 4 f, f at most the head's key tiles; deterministic adds there go
    # across the heads (few programs), which has no front
    from fusedattn.hopper import backward as knobs
    from fusedattn.hopper import backward_kernel as kernel

    monkeypatch.setattr(knobs, "ORDER", "down")
    monkeypatch.setattr(knobs, "FRONT_TILES", front)
    for deterministic, code in ((False, kernel.DOWN.value + 4 * want),
                                (True, kernel.DOWN_ACROSS.value)):
        kernel_, _, args, _ = _cpu_build(128, Mask(causal=True), deterministic, monkeypatch,
                                         seq=1024)
        got = dict(zip(kernel_.arg_names[:len(args)], args, strict=True))["order"]
        assert got == code, (deterministic, got, code)


@pytest.mark.parametrize("seq_q, seq_k, left, right, bottom", [
    (2000, 2000, -1, 0, False), (500, 2900, -1, 0, True), (1500, 1700, 300, 40, True),
    (777, 1290, -1, -1, False),
])
def test_out_of_order_dispatch_can_hang_block_ids_and_never_tickets(seq_q, seq_k, left,
                                                                    right, bottom):
    # the order model's launch with blocks dispatched out of their ids' order (the GPU
    # promises none): a block taking the program of its id can hang "up" and "down" (a
    # program waits on one not yet dispatched, every slot waiting), where a block taking
    # the next ticket's program runs whatever the dispatch (`notes/patches/bwd-tickets.patch`)
    model = script("bwd_order_model")
    rng = random.Random(5)

    def last_of_four(remaining):  # the fourth block id left goes first
        return min(3, len(remaining) - 1)

    def shuffled(remaining):
        return rng.randrange(len(remaining))
    hung = []
    for order in ("down", "up"):
        for sms in (1, 2, 5):
            for pick in (last_of_four, shuffled):
                kw = dict(heads=3, dispatch=pick)
                assert model.run(order, seq_q, seq_k, left, right, bottom, sms,
                                 tickets=True, **kw) == "ok", (order, sms)
                hung.append("hangs" in model.run(order, seq_q, seq_k, left, right, bottom,
                                                 sms, **kw))
    assert any(hung)
