"""The Hopper forward (`fusedattn.hopper`) and the dispatch rule (`fusedattn.dispatch`).

The dispatch runs everywhere (CI too): which path a call gets and why, and `use_backend`.
The Gluon kernel has no interpreter, so its cases are `gpu_only` (the GPU tier on the
H200): awkward shapes against the float64 reference, each bounded by twice the portable
kernel's error on the same inputs plus a floor, and asserted to have run on the Hopper path
(a silent fallback fails them)."""

import pytest
import torch

from fusedattn import attention, attention_varlen
from fusedattn.dispatch import forward_path, hopper_refusal, use_backend
from fusedattn.hopper.forward import FP8_TILES, kernel_pair
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref, varlen_ref
from fusedattn.tiles.common import Mask
from inputs import ON_HOPPER, both_paths, offsets, script, within_portable


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _same_bits_when_switched(call, monkeypatch, **switched):
    """The bits tests' protocol for a switch of `hopper.forward`: `call()` on the Hopper
    path three times, each output copied and its memory poisoned (NaN: torch's allocator
    hands the freed blocks to the next call), then once with `switched` set; every copy
    must be that last output's bits. Returns it, a tuple of tensors."""
    from fusedattn.hopper import forward as knobs

    def tensors(out):
        return out if isinstance(out, tuple) else (out,)
    with use_backend("hopper"):
        runs = []
        for _ in range(3):
            got = tensors(call())
            runs.append(tuple(t.clone() for t in got))
            for t in got:
                t.fill_(float("nan"))
            del got
        for name, value in switched.items():
            monkeypatch.setattr(knobs, name, value)
        want = tensors(call())
    assert all(torch.equal(a, b) for run in runs for a, b in zip(run, want, strict=True))
    return want


def _assert_near(out, ref, fp8: bool = False) -> None:
    """The Hopper tests' bound against the float64 reference `ref`: the largest error at
    most 2^-6 of |ref|'s largest (bf16's rounding of the output, 2^-8 relative, with room
    for the sums before it), 2^-4 under FP8 (e4m3 operands, P in e4m3)."""
    err = (out.double() - ref).abs().max().item()
    assert err <= (2 ** -4 if fp8 else 2 ** -6) * ref.abs().max().item(), err


def test_use_backend_takes_only_known_names():
    with pytest.raises(ProblemError, match="backend"):
        with use_backend("fast"):
            pass


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "float32"),
    (dict(dim=48), "head dims 48 (q, k)"),  # under 64: not padded
    (dict(dim_v=96), "and 96 (v)"),
    (dict(cache=object()), "KV cache"),
    (dict(strided=True), "TMA-aligned"),
])
def test_the_hopper_path_says_why_it_refuses(change, reason):
    dim = change.get("dim", 128)
    q = _rand(1, 2, 16, dim, dtype=change.get("dtype", torch.bfloat16))
    if change.get("strided"):  # a head dim that is every other element: last stride 2
        q = _rand(1, 2, 16, 2 * dim)[..., ::2]
    v = _rand(1, 2, 16, change["dim_v"]) if "dim_v" in change else q  # no 128/96 tiles
    why = hopper_refusal(q, q, v, mask=Mask(), cache=change.get("cache"))
    assert why is not None and reason in why


@pytest.mark.parametrize("dims, pair", [
    ((128, 128), (128, 128)), ((80, 80), (80, 80)), ((112, 112), (128, 128)),
    ((72, 72), (80, 80)), ((88, 88), (96, 96)), ((160, 160), (192, 192)), ((200, 200), (256, 256)),
    ((128, 112), (128, 128)), ((112, 64), (128, 64)), ((160, 120), (192, 128)), ((200, 120), None),
    ((48, 48), None), ((32, 32), None), ((264, 264), None), ((128, 96), None),
])
def test_the_hopper_kernel_pads_a_head_dim_over_64_up_to_its_pairs(dims, pair):
    assert kernel_pair(*dims) == pair
    assert kernel_pair(*dims, fp8=True) == (dims if dims in FP8_TILES else None)  # exact


def test_a_padded_head_dim_is_refused_only_for_what_padding_cannot_fix():
    q = _rand(1, 2, 16, 112)
    assert "head dims" not in (hopper_refusal(q, q, q, mask=Mask()) or "")
    why = hopper_refusal(*(_rand(1, 2, 16, 100),) * 3, mask=Mask())  # rows of 200 bytes
    assert why is not None and "TMA-aligned" in why
    why = hopper_refusal(*(_rand(1, 2, 16, 40),) * 3, mask=Mask())
    assert why is not None and "padded up to the next of 80/96/128/192/256" in why


@pytest.mark.emulation_only("the CPU's answer: the portable path, and why")
def test_emulation_runs_the_portable_path_and_refuses_a_forced_hopper():
    q = _rand(1, 2, 16, 128)
    path, why = forward_path(q, q, q, mask=Mask())
    assert path == "portable" and "not on a CUDA GPU" in why
    with use_backend("hopper"), pytest.raises(ProblemError, match="Hopper kernel serves"):
        attention(q, q, q)
    with use_backend("portable"):
        assert forward_path(q, q, q, mask=Mask())[0] == "portable"
        out = attention(q, q, q, is_causal=True)
    ref = attention_ref(q, q, q, causal=True, device=DEVICE)
    _assert_near(out, ref)


@pytest.mark.parametrize("dim, causal, claims, least", [
    (64, True, True, "HOPPER_MIN_KEYS_CLAIMED"), (128, True, True, "HOPPER_MIN_KEYS_CLAIMED"),
    (64, True, False, "HOPPER_MIN_KEYS"), (128, True, False, "HOPPER_MIN_KEYS"),
    (64, False, True, "HOPPER_MIN_KEYS_WIDE"), (128, False, True, "HOPPER_MIN_KEYS_WIDE"),
    (192, True, True, "HOPPER_MIN_KEYS_CLAIMED"), (256, True, False, "HOPPER_MIN_KEYS")])
def test_short_rows_go_portable_under_auto_and_stay_forceable(monkeypatch, dim, causal, claims,
                                                              least):
    # dense causal rows take HOPPER_MIN_KEYS_CLAIMED under the forward's claims, else
    # HOPPER_MIN_KEYS; varlen's causal calls HOPPER_MIN_KEYS_VARLEN by head dim under the
    # claims (on the longest document), else HOPPER_MIN_KEYS
    from fusedattn import dispatch
    from fusedattn.hopper import forward as knobs

    monkeypatch.setattr(dispatch, "hopper_refusal", lambda *a, **kw: None)  # as on an H200
    monkeypatch.setattr(knobs, "CAUSAL_CLAIMS", claims)
    keys = getattr(dispatch, least)
    mask = Mask(causal=causal)
    short, long = _rand(1, 2, keys - 1, dim), _rand(1, 2, keys, dim)
    path, why = forward_path(short, short, short, mask=mask)
    assert path == "portable" and f"{least} = {keys}" in why
    assert forward_path(long, long, long, mask=mask)[0] == "hopper"
    with use_backend("hopper"):
        assert forward_path(short, short, short, mask=mask)[0] == "hopper"

    class Packed:  # varlen: the longest sequence decides, not the packed total
        max_seqlen_k = keys - 1
    assert forward_path(long, long, long, mask=mask, varlen=Packed())[0] == "portable"
    if causal:  # varlen's own rule by head dim where its launches claim (D64's from 2049,
        # D192's and D256's from 512)
        least = (dispatch.HOPPER_MIN_KEYS_VARLEN.get(dim, dispatch.HOPPER_MIN_KEYS) if claims
                 else dispatch.HOPPER_MIN_KEYS)
        assert dispatch.HOPPER_MIN_KEYS_VARLEN[64] > dispatch.HOPPER_MIN_KEYS
        assert dispatch.HOPPER_MIN_KEYS_VARLEN[192] < dispatch.HOPPER_MIN_KEYS
        Packed.max_seqlen_k = least - 1
        path, why = forward_path(long, long, long, mask=mask, varlen=Packed())
        assert path == "portable" and f"= {least} " in why, why
        Packed.max_seqlen_k = least
        assert forward_path(long, long, long, mask=mask, varlen=Packed())[0] == "hopper"


@pytest.mark.parametrize("mask, claimed", [
    (Mask(causal=True), True), (Mask(window=(None, 0)), True),   # a causal right edge
    (Mask(causal=True, window=(None, 7)), True),   # causal: the right side adds nothing
    (Mask(causal=True, softcap=30.0), True), (Mask(causal=True, bottom_right=True), True),
    (Mask(causal=True, window=(100, 0)), False), (Mask(window=(None, 1)), False),
    (Mask(), False)])
def test_one_claim_rule_serves_the_launch_and_the_threshold(monkeypatch, mask, claimed):
    # `hopper.forward.claims`: the launch's choice and the dispatch's threshold read it
    from fusedattn import dispatch
    from fusedattn.hopper import forward as knobs

    class Packed:
        max_seqlen_k = dispatch.HOPPER_MIN_KEYS_CLAIMED

    assert knobs.claims(mask, None) is claimed
    assert knobs.claims(mask, Packed()) is claimed  # varlen: VARLEN_CLAIMS, on by default
    monkeypatch.setattr(dispatch, "hopper_refusal", lambda *a, **kw: None)  # as on an H200
    q = _rand(1, 2, dispatch.HOPPER_MIN_KEYS_CLAIMED, 64)
    path, why = forward_path(q, q, q, mask=mask)
    if claimed:
        assert path == "hopper"
        # varlen takes its own thresholds on the longest document (at least HOPPER_MIN_KEYS)
        assert forward_path(q, q, q, mask=mask, varlen=Packed())[0] == "portable"
    else:  # non-causal: the wide rule; the others under HOPPER_MIN_KEYS or the window's
        assert path == ("hopper" if mask == Mask() else "portable"), why
    for name, value in (("VARLEN_CLAIMS", False), ("VARLEN_DYNAMIC", False)):
        with monkeypatch.context() as m:
            m.setattr(knobs, name, value)
            assert knobs.claims(mask, Packed()) is False
            assert knobs.claims(mask, None) is claimed
    monkeypatch.setattr(knobs, "CAUSAL_CLAIMS", False)
    assert knobs.claims(mask, None) is False and knobs.claims(mask, Packed()) is False
    if claimed:  # the claims off: HOPPER_MIN_KEYS for every causal call
        path, why = forward_path(q, q, q, mask=mask)
        assert path == "portable" and "HOPPER_MIN_KEYS = " in why


@pytest.mark.parametrize("causal, window, path", [
    (True, (510, 0), "portable"), (True, (511, 0), "hopper"),      # 511 and 512 keys a row
    (True, (510, 100), "portable"),      # causal: the right side adds nothing
    (False, (255, 255), "portable"), (False, (255, 256), "hopper"),
    (False, (None, 100), "hopper"), (False, (100, None), "hopper"),  # a side unbounded
    (True, (5000, 0), "hopper")])        # wider than the rows: the rows' rule
def test_short_windows_go_portable_under_auto_and_stay_forceable(monkeypatch, causal, window,
                                                                 path):
    from fusedattn import dispatch

    monkeypatch.setattr(dispatch, "hopper_refusal", lambda *a, **kw: None)  # as on an H200
    least = dispatch.HOPPER_MIN_WINDOW
    q = _rand(1, 2, 2 * least + 1000, 64)
    mask = Mask(causal=causal, window=window)
    got, why = forward_path(q, q, q, mask=mask)
    assert got == path, why
    if path == "portable":
        assert f"HOPPER_MIN_WINDOW = {least}" in why
        with use_backend("hopper"):
            assert forward_path(q, q, q, mask=mask)[0] == "hopper"


def test_two_consumer_warpgroups_under_a_short_window():
    from fusedattn.hopper.forward import WARPGROUPS_MIN_SPAN, consumer_warpgroups

    least = WARPGROUPS_MIN_SPAN
    assert consumer_warpgroups((64, 64), False, False, 8192, True) == 3   # causal alone
    assert consumer_warpgroups((64, 64), False, False, 8192, True, least - 1) == 2
    assert consumer_warpgroups((64, 64), False, False, 8192, True, least) == 3
    assert consumer_warpgroups((64, 64), False, False, 8192, False, 129) == 2
    # the span the launch passes: Mask.span
    assert Mask(causal=True, window=(128, 5)).span() == 129
    assert Mask(window=(128, 5)).span() == 134
    assert Mask(window=(128, None)).span() is None and Mask(causal=True).span() is None


def test_q_from_registers_by_its_tables_at_two_warpgroups(monkeypatch):
    # (at three warpgroups, 160 registers a thread, D64's kernel spilled and its wgmmas were
    # serialised in the sm90 compile report; FP8 launches read a table of their own)
    from fusedattn.hopper import forward as knobs

    one, two = (64, 0, 64, 0, 64, 128, 4), (128, 64, 128, 64, 64, 64, 3)
    monkeypatch.setattr(knobs, "Q_REGISTERS", {(64, 64): "all", (192, 192): "first"})
    monkeypatch.setattr(knobs, "FP8_Q_REGISTERS", {(128, 128): "all"})
    assert knobs.q_registers((64, 64), one, False, 2, False) == 1
    assert knobs.q_registers((64, 64), two, False, 2, False) == 2
    assert knobs.q_registers((192, 192), two, False, 2, False) == 1
    assert knobs.q_registers((192, 192), one, False, 2, False) == 0  # (no second piece)
    assert knobs.q_registers((64, 64), one, False, 3, False) == 0
    assert knobs.q_registers((64, 64), one, True, 2, False) == 0  # (FP8: its own table)
    assert knobs.q_registers((128, 128), one, False, 2, False) == 0
    assert knobs.q_registers((128, 128), one, True, 2, False) == 1
    assert knobs.q_registers((128, 128), one, True, 3, False) == 0
    assert knobs.q_registers((128, 128), one, True, 2, True) == 1  # ("all": claims too)
    monkeypatch.setattr(knobs, "Q_REGISTERS", {(192, 192): "unclaimed"})
    assert knobs.q_registers((192, 192), two, False, 2, False) == 2
    assert knobs.q_registers((192, 192), two, False, 2, True) == 0


@pytest.mark.parametrize("kind, launch", [("dense", (True, 2, False, False, 128)),
                                          ("varlen", (True, 2, False, True, 128)),
                                          ("fp8", (True, 2, True, False, 64)),
                                          ("fp8", (True, 2, True, True, 64))])
def test_turns_by_launch(kind, launch, monkeypatch):
    # `takes_turns`: a claimed launch (claim, consumers, fp8, varlen, dim) at two
    # warpgroups follows CLAIMED_TURNS of its kind (an FP8 varlen launch FP8's), or of
    # (kind, dim) where the table has that entry; every other launch PINGPONG; PINGPONG
    # off turns every launch's off
    from fusedattn.hopper import forward as knobs

    others = [(False, 2, False, False, 128), (True, 3, False, False, 64),
              (False, 2, True, True, 128), (False, 3, True, True, 64),
              (True, 3, True, True, 128)]
    for value in (False, True):
        table = {name: not value for name in ("dense", "varlen", "fp8")}
        table[kind] = value
        table[(kind, launch[4] * 2)] = not value  # (another head dim's entry: not this)
        monkeypatch.setattr(knobs, "CLAIMED_TURNS", table)
        assert knobs.takes_turns(*launch) is value
        assert all(knobs.takes_turns(*other) for other in others)
        table[(kind, launch[4])] = not value  # this head dim's entry over the kind's
        assert knobs.takes_turns(*launch) is not value
    monkeypatch.setattr(knobs, "PINGPONG", False)
    monkeypatch.setattr(knobs, "CLAIMED_TURNS", {"dense": True, "varlen": True, "fp8": True})
    assert not any(knobs.takes_turns(*x) for x in [launch, *others])


CASES = [  # (B, H, Hkv, Sq, Sk, D, causal, window, softcap)
    (2, 4, 4, 1, 1, 128, False, None, None), (1, 3, 3, 127, 127, 64, True, None, None),
    (1, 2, 2, 129, 300, 128, True, None, None), (1, 2, 2, 300, 129, 128, True, None, None),
    (1, 2, 2, 4095, 4095, 128, True, None, None), (2, 48, 8, 257, 257, 128, True, None, None),
    (1, 2, 2, 1000, 1000, 96, False, None, None), (1, 2, 2, 513, 513, 192, True, None, None),
    (1, 2, 2, 700, 700, 256, False, None, None), (1, 2, 2, 2000, 2000, 128, True, (100, 0), None),
    (1, 2, 2, 777, 777, 64, False, (0, 0), None), (1, 2, 2, 777, 777, 64, False, (50, 3000), None),
    (1, 2, 2, 4097, 4097, 64, False, None, None), (3, 5, 1, 333, 555, 128, False, None, None),
    # D64 from 2048 query rows runs three consumer warpgroups (`forward.WARPGROUPS`), two
    # under a window of fewer than 2048 keys a row
    (1, 3, 1, 2500, 3001, 64, True, None, None), (1, 2, 2, 2100, 2100, 64, False, (300, 0), None),
    (1, 2, 2, 2600, 2600, 64, True, (2100, 0), None),  # three under a long window
    # two head-dim pieces against Sq != Sk, GQA and windows
    (1, 6, 2, 301, 1025, 96, True, None, None), (2, 4, 1, 1025, 301, 192, False, (64, 64), None),
    # D80 (64 + 16) and head dims run padded (D72 as 80, D112 as 128, D200 as 256): Sq != Sk,
    # GQA, windows
    (1, 3, 1, 517, 517, 80, True, None, None), (2, 4, 2, 300, 700, 112, False, (64, 0), None),
    (1, 2, 1, 700, 333, 72, False, (100, 20), None),
    (1, 2, 2, 1000, 1000, 200, True, None, None), (1, 4, 2, 255, 129, 112, True, None, None),
    # softcap: a tight cap, one large enough that tanh is its series, and with masks
    (1, 2, 2, 600, 600, 128, False, None, 5.0), (1, 2, 2, 333, 333, 64, True, None, 1e8),
    (1, 4, 2, 517, 517, 96, True, (40, 0), 30.0),
]


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "B{}H{}/{}_{}x{}_D{}_c{}_w{}_cap{}".format(*c))
def test_hopper_forward_matches_the_reference(case, dtype):
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    b, h, hk, sq, sk, d, causal, window, softcap = case
    q, k, v = (_rand(b, n, s, d, dtype=dtype, seed=i)
               for i, (n, s) in enumerate(((h, sq), (hk, sk), (hk, sk))))
    with use_backend("hopper"):  # raises where the Hopper kernel cannot serve the call
        forward_path(q, k, v, mask=Mask(causal=causal, softcap=softcap))
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window=window, softcap=softcap,
                                 return_lse=True, device=DEVICE)
    (out, lse), (out_p, _) = both_paths(lambda: attention(
        q, k, v, is_causal=causal, enable_gqa=hk != h, window=window, softcap=softcap,
        return_lse=True))
    within_portable(out, out_p, ref)
    seen = torch.isfinite(ref_lse)  # rows that see no key: LSE -inf on both
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse.double() - ref_lse)[seen].abs().max().item() < 1e-3


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [128, 96, 192, 112, 80])
def test_hopper_varlen_with_empty_and_one_token_sequences(causal, dim):
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    lens_q, lens_k = [5, 0, 1, 300, 129, 1000, 64], [5, 3, 1, 300, 500, 1000, 0]
    cu_q, cu_k = (offsets(n) for n in (lens_q, lens_k))
    q = _rand(sum(lens_q), 4, dim, seed=1)
    k, v = _rand(sum(lens_k), 2, dim, seed=2), _rand(sum(lens_k), 2, dim, seed=3)
    ref = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, device=DEVICE)
    within_portable(*both_paths(lambda: attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=causal)), ref)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_varlen_over_many_documents(causal, dim):
    # 70 documents: the kernel's prefix sum over the documents' tiles takes three steps of
    # 32 (`forward_kernel._document`); empty, one-token and long ones between; D64 runs
    # three consumer warpgroups (192-row items) where the longest has 2048 rows, 4096
    # causal (`forward.WARPGROUPS_MIN_ROWS_VARLEN_BOUNDED`): the longest has 4200
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    g = torch.Generator().manual_seed(dim)
    lens = [int(n) for n in torch.randint(0, 400, (70,), generator=g)]
    lens[3], lens[40], lens[41], lens[69] = 0, 1, 4200, 0
    cu = offsets(lens)
    q, k, v = (_rand(sum(lens), 4, dim, seed=i) for i in range(3))
    ref = varlen_ref(q, k, v, cu, cu, causal=causal, device=DEVICE)
    within_portable(*both_paths(lambda: attention_varlen(
        q, k, v, cu, cu, max(lens), max(lens), is_causal=causal)), ref)


def test_the_varlen_items_model_gives_every_tile_once():
    # `scripts/varlen_items_model.py`: the kernel's varlen item map transcribed
    model = script("varlen_items_model")
    for lengths, heads, tile in (([5, 0, 1, 300, 129, 1000, 64], 4, 128),
                                 ([0] * 40 + [3000] + [1] * 30, 2, 192), ([0], 3, 128),
                                 ([128] * 33, 16, 128)):
        for causal in (False, True):
            assert model.check(lengths, heads, tile, causal) == "ok"
    # it sees a wrong map: each document's items start one later
    right = model.document
    model.document = lambda *a: (lambda b, first: (b, first + 1))(*right(*a))
    try:
        assert model.check([300, 5], 2, 128, False) != "ok"
    finally:
        model.document = right


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("form", [0, 1])
@pytest.mark.parametrize("case", [  # (B, H, Hkv, Sq, Sk, D, causal, window, softcap)
    (1, 2, 2, 129, 300, 128, True, None, None), (1, 2, 2, 300, 129, 128, True, None, None),
    (1, 3, 1, 2500, 3001, 64, True, None, None), (1, 2, 2, 777, 777, 64, False, (50, 3000), None),
    (1, 2, 2, 777, 777, 64, False, (0, 0), None), (2, 4, 1, 1025, 301, 192, False, (64, 64), None),
    (1, 4, 2, 517, 517, 96, True, (40, 0), 30.0), (1, 4, 2, 255, 129, 112, True, None, None),
    (1, 2, 2, 333, 333, 128, False, None, None)])
def test_every_mask_form_gives_the_defaults_bits(case, form, monkeypatch):
    # `hopper.forward.MASK_FORM` (launches a causal or window bound cuts) and
    # MASK_FORM_EDGE (the others) move the mask's compares and the row max's place, never a
    # value: each form's output and LSE are the defaults' bits (the defaults' against the
    # reference: test_hopper_forward_matches_the_reference), varlen and FP8 too
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from fusedattn.hopper import forward as knobs

    b, h, hk, sq, sk, d, causal, window, softcap = case
    q, k, v = (_rand(b, n, s, d, seed=i)
               for i, (n, s) in enumerate(((h, sq), (hk, sk), (hk, sk))))
    calls = [lambda: attention(q, k, v, is_causal=causal, enable_gqa=hk != h, window=window,
                               softcap=softcap, return_lse=True)]
    if sq == sk and hk == h:
        cu = torch.tensor([0, 5, sq // 2, sq], dtype=torch.int32, device=DEVICE)
        flat = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
        calls.append(lambda: attention_varlen(*flat, cu, cu, sq, sq, is_causal=causal,
                                              window=window, softcap=softcap))
    if d in (64, 128) and softcap is None and window is None:
        f8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
        calls.append(lambda: attention(*f8, is_causal=causal, enable_gqa=hk != h))
    with use_backend("hopper"):
        default = [call() for call in calls]
        monkeypatch.setattr(knobs, "MASK_FORM", form)
        monkeypatch.setattr(knobs, "MASK_FORM_EDGE", 2 - form)  # (0 -> 2, 1 -> 1)
        for call, want in zip(calls, default, strict=True):
            got = call()
            for a, b_ in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want)),
                             strict=True):
                assert torch.equal(a, b_)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("dim, dim_v, fp8", [(64, 64, False), (96, 96, False),
                                             (128, 64, False), (128, 128, False),
                                             (128, 128, True), (64, 64, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_items_through_two_q_slots_give_one_slots_bits(dim, dim_v, fp8, causal, monkeypatch):
    # `hopper.forward.Q_SLOTS`: with two Q slots a program's items take them in turn and
    # the loader runs an item ahead; it moves when loads happen, never what is computed.
    # 8 x 12 heads of 300 rows (two warpgroups: 128-row items, three a head) are 288
    # items, more than the SMs, so programs walk two items or more through both slots (on
    # the persistent grid: causal too, by CAUSAL_PERSISTENT_ROWS)
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from fusedattn.hopper import forward as knobs

    q, k = (_rand(8, 12, 300, dim, seed=i) for i in range(2))
    v = _rand(8, 12, 300, dim_v, seed=2)
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    pair = knobs.kernel_pair(dim, dim_v, fp8)
    tile = knobs.tile_entry(pair, fp8, persistent=True)
    assert knobs.q_slots(tile, 2, fp8) == 2  # (these pairs hold two: D128 by PERSISTENT_TILES)
    monkeypatch.setattr(knobs, "CAUSAL_PERSISTENT_ROWS", 1 << 20)
    with use_backend("hopper"):
        two = attention(q, k, v, is_causal=causal, return_lse=True)
        monkeypatch.setattr(knobs, "Q_SLOTS", 1)
        one = attention(q, k, v, is_causal=causal, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(two, one, strict=True))
    ref = attention_ref(q, k, v, causal=causal, device=DEVICE)
    _assert_near(two[0], ref, fp8)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("dim, dim_v, fp8, causal", [(64, 64, False, True),
                                                     (128, 128, False, False),
                                                     (128, 64, False, True),
                                                     (128, 128, True, True)])
def test_q_slots_released_late_give_the_bits_of_released_at_once(dim, dim_v, fp8, causal,
                                                                  monkeypatch):
    # `hopper.forward.LATE_Q_FREE`: a consumer gives an item's Q slot back (its O went out
    # through the slot's tiles by a TMA store) under the next item's first product, not at
    # the item's end. 288 items over the SMs (8 x 12 heads of 300 rows) walk both slots in
    # turn, three calls on poisoned memory; FP8's O goes out through a tile of its own,
    # written again by the next item's store, which the late wait guards too (FP8 releases
    # late only where it claims its items, under the causal mask: `forward.releases_late`)
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")

    q, k = (_rand(8, 12, 300, dim, seed=50 + i) for i in range(2))
    v = _rand(8, 12, 300, dim_v, seed=52)
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    want = _same_bits_when_switched(
        lambda: attention(q, k, v, is_causal=causal, return_lse=True), monkeypatch,
        LATE_Q_FREE=False)
    ref = attention_ref(q, k, v, causal=causal, device=DEVICE)
    _assert_near(want[0], ref, fp8)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("dim, dim_v, causal, varlen, fp8", [
    (64, 64, True, False, False), (80, 80, False, False, False), (96, 96, True, False, False),
    (112, 112, False, False, False), (128, 128, False, False, False),
    (128, 128, True, True, False), (192, 192, False, False, False),
    (192, 192, True, False, False), (192, 128, True, False, False),
    (192, 192, False, True, False), (64, 64, True, False, True), (128, 128, False, False, True),
    (128, 128, True, False, True), (128, 128, True, True, True)])
def test_q_from_registers_gives_the_bits_of_q_from_shared_memory(dim, dim_v, causal, varlen,
                                                                 fp8, monkeypatch):
    # `hopper.forward.Q_REGISTERS` (FP8: `FP8_Q_REGISTERS`): S's products take Q from
    # registers (read from the Q slot's tiles once an item) or from the tiles themselves;
    # the same products, so the same bits. Each pair switched against the default both ways
    # round: 288 items over the SMs (8 x 12 heads of 300 rows, two warpgroups), or a varlen
    # batch of 30 documents with empty, one-row and whole-tile ones, three calls on
    # poisoned memory
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from fusedattn.hopper import forward as knobs

    pair = knobs.kernel_pair(dim, dim_v, fp8)
    name = "FP8_Q_REGISTERS" if fp8 else "Q_REGISTERS"
    switched = {} if pair in getattr(knobs, name) else {pair: "all"}
    if varlen:
        gen = torch.Generator().manual_seed(dim)
        lens = torch.randint(0, 600, (30,), generator=gen).tolist()
        lens[1], lens[4], lens[7], lens[12] = 0, 128, 1, 256
        cu = offsets(lens)
        q, k = (_rand(cu[-1].item(), n, dim, seed=80 + i) for i, n in enumerate((4, 2)))
        v = _rand(cu[-1].item(), 2, dim_v, seed=82)
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))

        def call():
            return attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=causal)
        ref = varlen_ref(q, k, v, cu, cu, causal=causal, device=DEVICE)
    else:
        q, k = (_rand(8, 12, 300, dim, seed=80 + i) for i in range(2))
        v = _rand(8, 12, 300, dim_v, seed=82)
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))

        def call():
            return attention(q, k, v, is_causal=causal, return_lse=True)
        ref = attention_ref(q, k, v, causal=causal, device=DEVICE)
    want = _same_bits_when_switched(call, monkeypatch, **{name: switched})
    _assert_near(want[0], ref, fp8)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("shape, causal, varlen", [((8, 12, 300), False, False),
                                                  ((8, 12, 300), True, False),
                                                  ((2, 6, 2100), False, False),
                                                  (None, True, True)])
def test_fp8_q_slot_released_early_gives_the_bits_of_released_at_the_end(shape, causal, varlen,
                                                                          monkeypatch):
    # `hopper.forward.releases_early`: FP8 at D256 (one Q slot) gives an item's Q slot back
    # once its last product of Q is done (FP8's O goes out through tiles of its own), and
    # waits for its O store only before its next item writes the O tile. Against the
    # release at the item's end: 288 items over the SMs, 204 items of 2100 rows (programs
    # with two items), a varlen batch of 40 documents (empty, one-row and whole-tile ones
    # among them), three calls on poisoned memory
    dim = 256
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    if varlen:
        gen = torch.Generator().manual_seed(dim)
        lens = torch.randint(0, 700, (40,), generator=gen).tolist()
        lens[2], lens[5], lens[9], lens[11], lens[20] = 0, 128, 256, 1, 384
        cu = offsets(lens)
        q, k, v = (_rand(cu[-1].item(), n, dim, seed=70 + i).to(torch.float8_e4m3fn)
                   for i, n in enumerate((4, 2, 2)))

        def call():
            return attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=causal)
        ref = varlen_ref(q, k, v, cu, cu, causal=causal, device=DEVICE)
    else:
        q, k, v = (_rand(*shape, dim, seed=70 + i).to(torch.float8_e4m3fn) for i in range(3))

        def call():
            return attention(q, k, v, is_causal=causal, return_lse=True)
        ref = attention_ref(q, k, v, causal=causal, device=DEVICE)
    want = _same_bits_when_switched(call, monkeypatch, FP8_EARLY_Q_FREE=False)
    _assert_near(want[0], ref, fp8=True)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("dim, dim_v, fp8, causal", [(64, 64, False, True),
                                                     (80, 80, False, False),
                                                     (96, 96, False, True),
                                                     (128, 64, False, False),
                                                     (192, 128, False, True),
                                                     (128, 128, True, True)])
def test_varlen_tma_stores_give_the_masked_stores_bits(dim, dim_v, fp8, causal, monkeypatch):
    # `hopper.forward.VARLEN_TMA_STORE`: a varlen O tile whose rows all lie in its document
    # goes out by a TMA store at its packed rows, the last, ragged one by masked stores. 40
    # documents of 0-700 rows (some whole tiles: 128, 256, 384), GQA 4/2, three calls on
    # poisoned memory, each with the masked stores' bits; padded head dims (80: 64 + 16
    # pieces) and V's own head dim clip at O's last column
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")

    gen = torch.Generator().manual_seed(dim)
    lens = torch.randint(0, 700, (40,), generator=gen).tolist()
    lens[2], lens[5], lens[9], lens[11], lens[20] = 0, 128, 256, 1, 384
    cu = offsets(lens)
    q = _rand(cu[-1].item(), 4, dim, seed=60)
    k, v = _rand(cu[-1].item(), 2, dim, seed=61), _rand(cu[-1].item(), 2, dim_v, seed=62)
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    want, = _same_bits_when_switched(
        lambda: attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=causal),
        monkeypatch, VARLEN_TMA_STORE=False)
    ref = varlen_ref(q, k, v, cu, cu, causal=causal, device=DEVICE)
    _assert_near(want, ref, fp8)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("fp8, varlen", [(False, True), (True, False), (True, True)])
def test_claimed_launches_give_the_same_bits_with_turns_or_without(fp8, varlen,
                                                                   monkeypatch):
    # `hopper.forward.CLAIMED_TURNS` by kind: varlen's and FP8's claimed (causal, two
    # warpgroups) launches with turns and without, three calls on poisoned memory each,
    # every output the other setting's bits (dense 16-bit: the issue-order test below);
    # varlen: 30 documents of 0-1500 rows, GQA 4/2; dense: two sequences of 1500, 4 heads
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    gen = torch.Generator().manual_seed(31)
    lens = torch.randint(0, 1500, (30,), generator=gen).tolist() if varlen else [1500] * 2
    if varlen:
        lens[3], lens[7] = 0, 1
    cu = offsets(lens)
    q = _rand(cu[-1].item(), 4, 128, seed=70)
    k, v = (_rand(cu[-1].item(), 2 if varlen else 4, 128, seed=71 + i) for i in range(2))
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    if varlen:
        def call():
            return attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True)
    else:  # the same rows as two sequences of 1500, [B, H, S, D]
        dense = [t.view(2, 1500, t.shape[1], 128).transpose(1, 2) for t in (q, k, v)]

        def call():
            return attention(*dense, is_causal=True)
    from fusedattn.hopper import forward as knobs
    kind = "fp8" if fp8 else "varlen"
    now = knobs.takes_turns(True, 2, fp8, varlen, 128)  # (the table's for this launch)
    turns = {**knobs.CLAIMED_TURNS, kind: not now, (kind, 128): not now}
    asked, takes_turns = [], knobs.takes_turns

    def spy(*launch):  # (the launches' questions: the switch must reach a claimed launch
        asked.append((launch, takes_turns(*launch)))  # of this kind)
        return asked[-1][1]
    monkeypatch.setattr(knobs, "takes_turns", spy)
    want, = _same_bits_when_switched(call, monkeypatch, CLAIMED_TURNS=turns)
    assert ((True, 2, fp8, varlen, 128), not now) in asked, asked
    ref = (varlen_ref(q, k, v, cu, cu, causal=True, device=DEVICE) if varlen
           else attention_ref(*dense, causal=True, device=DEVICE))
    _assert_near(want, ref, fp8)


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("name, value", [("PINGPONG", False),
                                         ("CLAIMED_TURNS", {"dense": True, "varlen": True,
                                                            "fp8": True, ("fp8", 128): True}),
                                         ("THREAD_ARRIVES", True),
                                         ("Q_SLOTS", 1), ("CAUSAL_PERSISTENT_ROWS", 1 << 20),
                                         ("PERSISTENT_TILES", {}),
                                         ("WARPGROUPS_MIN_ROWS_BOUNDED", 2048),
                                         ("LPT_SECTIONS", False), ("CAUSAL_CLAIMS", False)])
@pytest.mark.parametrize("dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_the_issue_order_switches_give_the_defaults_bits(name, value, dim, causal,
                                                         monkeypatch):
    # `hopper.forward.PINGPONG` (the warpgroups' turns to issue) and THREAD_ARRIVES (how a
    # warpgroup arrives on a barrier) move when a warpgroup issues, never what it computes:
    # every head dim's output and LSE are the defaults' bits either way (2500 rows: D64's
    # three warpgroups too), so a per-head-dim rule for them needs no test of its own.
    # PERSISTENT_TILES (D128's stages) and WARPGROUPS_MIN_ROWS_BOUNDED (two or three
    # warpgroups under a causal mask) move the pipeline and the items, not the arithmetic
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from fusedattn.hopper import forward as knobs

    q, k, v = (_rand(1, 2, 2500, dim, seed=i) for i in range(3))
    with use_backend("hopper"):
        want = attention(q, k, v, is_causal=causal, return_lse=True)
        monkeypatch.setattr(knobs, name, value)
        got = attention(q, k, v, is_causal=causal, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("dim, dim_v, fp8, three", [(64, 64, False, False),
                                                    (64, 64, False, True),
                                                    (128, 128, False, False),
                                                    (192, 128, False, False),
                                                    (128, 128, True, False)])
@pytest.mark.parametrize("seq_k", [1000, 1300])
def test_claimed_items_give_one_program_an_items_bits_call_after_call(dim, dim_v, fp8, three,
                                                                      seq_k, monkeypatch):
    # `hopper.forward.CAUSAL_CLAIMS`: a causal launch's programs claim items from the plan's
    # counter, which the kernel's last program puts back to zero. 6 x 13 heads of 1000
    # query rows are 624 items (two warpgroups: 128-row items; `three`: D64's three) over
    # 132 SMs, so programs claim several; a counter left anywhere but zero would skip or
    # repeat items in the next call of the plan, so the plan runs three times, each on the
    # memory of the last one's outputs poisoned (NaN: torch's allocator hands the freed
    # blocks back), and each call must give one program an item's bits (the same items and
    # arithmetic, in another order), and LPT_SECTIONS' order the old order's
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from fusedattn.hopper import forward as knobs

    q = _rand(6, 13, 1000, dim, seed=1)
    k = _rand(6, 13, seq_k, dim, seed=2)
    v = _rand(6, 13, seq_k, dim_v, seed=3)
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    assert knobs.CAUSAL_CLAIMS and knobs.LPT_SECTIONS
    if three:
        monkeypatch.setattr(knobs, "WARPGROUPS_MIN_ROWS", 1)
        monkeypatch.setattr(knobs, "WARPGROUPS_MIN_ROWS_BOUNDED", 1)
    want = _same_bits_when_switched(
        lambda: attention(q, k, v, is_causal=True, return_lse=True), monkeypatch,
        CAUSAL_CLAIMS=False, LPT_SECTIONS=False)
    ref = attention_ref(q, k, v, causal=True, device=DEVICE)
    _assert_near(want[0], ref, fp8)


@pytest.mark.parametrize("doc_rows", [True, False])
@pytest.mark.parametrize("dim", [64, 128])
def test_claimed_varlen_items_give_one_program_an_items_bits(dim, doc_rows, monkeypatch):
    # `hopper.forward.VARLEN_CLAIMS`: varlen's causal launches claim the documents' items
    # on the persistent grid, claiming past the empty ones (a document of 0 or 1 rows, and
    # the grid's last items, `_document`); 60 documents of 0-900 query rows over H12/4 are
    # more items than SMs, their keys up to 300 more (bottom-right: each bound of the
    # document the loader hands over, `DOC_ROWS`, or the consumers find again, is read).
    # Three calls on poisoned memory, each with one program an item's bits
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from fusedattn.hopper import forward as knobs

    monkeypatch.setattr(knobs, "DOC_ROWS", doc_rows)
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 900, (60,), generator=gen).tolist()
    lens[3], lens[17] = 0, 1
    lens_k = [n + e for n, e in zip(lens, torch.randint(0, 300, (60,), generator=gen).tolist(),
                                    strict=True)]
    lens_k[40] = lens[40]
    cu, cu_k = (offsets(n) for n in (lens, lens_k))
    q = _rand(cu[-1].item(), 12, dim, seed=40)
    k, v = (_rand(cu_k[-1].item(), 4, dim, seed=41 + i) for i in range(2))
    want, = _same_bits_when_switched(
        lambda: attention_varlen(q, k, v, cu, cu_k, max(lens), max(lens_k), is_causal=True),
        monkeypatch, VARLEN_CLAIMS=False)
    ref = varlen_ref(q, k, v, cu, cu_k, causal=True, device=DEVICE)
    _assert_near(want, ref)


def test_claimed_items_on_two_streams_at_once_and_in_a_cuda_graph():
    # a plan is one stream's (`dispatch.plan_context`): the same causal call queued on two
    # streams at once runs two plans with a counter each, and each gives the default
    # stream's bits; a call captured in a CUDA graph takes one program an item (no counter
    # a replay on another stream could share) and its replays give the same bits
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    q, k, v = (_rand(8, 16, 1536, 128, seed=30 + i) for i in range(3))
    with use_backend("hopper"):
        want = attention(q, k, v, is_causal=True)
        streams = [torch.cuda.Stream() for _ in range(2)]
        outs = [[], []]
        torch.cuda.synchronize()
        for _ in range(4):
            for i, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    outs[i].append(attention(q, k, v, is_causal=True))
        torch.cuda.synchronize()
        assert all(torch.equal(o, want) for out in outs for o in out)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            attention(q, k, v, is_causal=True)  # (warm the captured shape's plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = attention(q, k, v, is_causal=True)
        for _ in range(2):
            captured.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, want)


SMEM = 232448  # the bytes of shared memory one program may take on an H100/H200


@pytest.mark.parametrize("fp8", [False, True])
def test_every_tile_entry_fits_shared_memory_in_power_of_two_pieces(fp8):
    # `hopper.forward.TILES`: Gluon's tensors, shared buffers and TMA boxes are powers of
    # two, so every head-dim piece and key step is; the buffers fit one program's shared
    # memory at the pair's most consumer warpgroups
    from fusedattn.hopper import forward as knobs

    def pow2(n):
        return n > 0 and n & (n - 1) == 0

    tables = [knobs.FP8_TILES] if fp8 else [knobs.TILES, knobs.PERSISTENT_TILES,
                                             knobs.THREE_TILES]
    entries = [(pair, tile, table is knobs.THREE_TILES) for table in tables
               for pair, tile in table.items()]
    assert all(pair in knobs.TILES for pair in knobs.PERSISTENT_TILES)  # (a pair it serves)
    assert all(pair in knobs.TILES for pair in knobs.THREE_TILES)
    for pair, tile, three in entries:
        d_a, d_b, dv_a, dv_b, block_m, block_n, stages = tile
        assert d_a + d_b == pair[0] and dv_a + dv_b == pair[1], pair
        assert all(pow2(x) for x in (d_a, dv_a, block_m, block_n)), pair
        assert all(x == 0 or pow2(x) for x in (d_b, dv_b)), pair
        assert dv_a <= d_a and dv_b <= d_b, pair  # O goes out through Q's tiles
        consumers = 3 if three else \
            (knobs.FP8_WARPGROUPS if fp8 else knobs.WARPGROUPS).get(pair, 2)
        size = 1 if fp8 else 2
        q = consumers * block_m * pair[0] * size
        kv = stages * block_n * (pair[0] + pair[1]) * size
        o = consumers * block_m * pair[1] * 2 if fp8 else 0  # O's bfloat16 staging
        assert q + kv + o + 1024 <= SMEM, (pair, q + kv + o)
        # Q's slots (`q_slots`): two where they fit beside the ring (1 KB of scratch and
        # the barriers, under 256 bytes, beside them), else one
        for c in (2, 3):
            q_c = c * block_m * pair[0] * size
            o_c = c * block_m * pair[1] * 2 if fp8 else 0
            two = 2 * q_c + kv + o_c + 1024
            slots = knobs.q_slots(tile, c, fp8)
            if two + 256 <= SMEM:
                assert slots == 2, (pair, c)
            elif two > SMEM:
                assert slots == 1, (pair, c)
    if not fp8:  # D64's ring leaves room for a second Q slot; D128's three stages do not,
        # its two on the persistent grid do
        assert knobs.q_slots(knobs.TILES[(64, 64)], 3, False) == 2
        assert knobs.q_slots(knobs.TILES[(128, 128)], 2, False) == 1
        assert knobs.q_slots(knobs.tile_entry((128, 128), False, persistent=True), 2,
                             False) == 2
        assert knobs.tile_entry((128, 128), False, persistent=False) == knobs.TILES[128, 128]
        assert knobs.tile_entry((128, 128), True, persistent=True) == \
            knobs.FP8_TILES[128, 128]
        # `THREE_TILES`: at three consumer warpgroups alone, on either grid
        for pair, tile in knobs.THREE_TILES.items():
            for persistent in (False, True):
                assert knobs.tile_entry(pair, False, persistent, consumers=3) == tile
                assert knobs.tile_entry(pair, False, persistent, consumers=2) == \
                    (persistent and knobs.PERSISTENT_TILES.get(pair) or knobs.TILES[pair])


@pytest.mark.gpu_only("the Gluon kernel runs on an sm90 GPU only")
@pytest.mark.parametrize("dim", [64, 192])
def test_hopper_forward_takes_a_bshd_view_and_writes_every_row(dim):
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    # FlashAttention's [B, S, H, D] as a transposed view: strides the descriptors carry
    q, k, v = (_rand(2, 333, 4, dim, seed=i).transpose(1, 2) for i in range(3))
    out = attention(q, k, v, is_causal=True)
    assert out.stride() == q.stride()  # O in q's memory: a descriptor of its strides too
    ref = attention_ref(q, k, v, causal=True, device=DEVICE)
    _assert_near(out, ref)
    # the same call twice gives the same bits (no atomics, no race)
    assert torch.equal(out, attention(q, k, v, is_causal=True))


@pytest.mark.gpu_only("Triton's compiled launcher runs on a GPU only")
@pytest.mark.parametrize("entry, backend", [
    ("forward", "hopper"), ("training", "hopper"), ("varlen", "hopper"),
    ("training", "portable"), ("varlen", "portable")])
def test_a_direct_replay_gives_the_same_bits_and_keeps_its_tma_maps_per_address(
        entry, backend, monkeypatch):
    # `launch.DirectLaunch` (DIRECT_LAUNCH on): replays call Triton's compiled launcher
    # with what Triton's own launch would pass (the same bits as the fresh call, forward
    # and backward, Hopper and portable kernels), encoding each TMA descriptor's map once
    # per address; new addresses are encoded anew, never served stale
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    from triton.runtime.driver import driver

    from fusedattn import dispatch, launch
    from fusedattn.api import _CALLS
    from fusedattn.tiles import flash_bwd
    from fusedattn.varlen import _DECIDED

    def forget():
        for plans in (dispatch._PLANS, flash_bwd._PLANS, _CALLS, _DECIDED):
            plans.clear()

    utils = driver.active.utils
    fill, encoded, direct = utils.fill_tma_descriptor, [], launch.DirectLaunch.__call__
    directs = []

    def counted(*args):
        encoded.append(args[0])
        return fill(*args)

    def counted_direct(self, stream, inputs):
        directs.append(self)
        return direct(self, stream, inputs)

    cu = torch.tensor([0, 700, 701, 1900], dtype=torch.int32, device=DEVICE)

    def inputs(seed):
        shape = (1900, 4, 128) if entry == "varlen" else (2, 4, 777, 128)
        return [_rand(*shape, seed=seed + i).requires_grad_(entry == "training")
                for i in range(3)]

    def call(q, k, v):
        if entry == "varlen":
            return [attention_varlen(q, k, v, cu, cu, 1199, 1199, is_causal=True)]
        out = attention(q, k, v, is_causal=True)
        if entry != "training":
            return [out]
        return [out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]

    def ptrs(tensors):
        return {t.data_ptr() for t in tensors}

    def same(got, want):
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    first, second = inputs(0), inputs(10)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(launch.DirectLaunch, "__call__", counted_direct)
    monkeypatch.setattr(utils, "fill_tma_descriptor", counted)
    try:
        with use_backend(backend):
            forget()
            fresh_second = call(*second)  # Triton's own launches, no plan
            forget()
            fresh = call(*first)  # recorded
            encoded.clear()
            assert same(call(*first), fresh)  # replayed: q, k and v's maps encoded
            at_first = set(encoded)
            encoded.clear()
            assert same(call(*first), fresh) and same(call(*first), fresh)
            kept = set(encoded)  # (only buffers the call made at new addresses, if any)
            encoded.clear()
            assert same(call(*second), fresh_second)  # the same plan, new addresses
            at_second = set(encoded)
    finally:
        forget()  # (no plan keeps the counting encoder)
    assert directs  # the replays went through `DirectLaunch`
    if backend == "hopper":  # (Triton's own launch encodes every descriptor every launch)
        assert ptrs(first) <= at_first and not ptrs(first) & kept, (at_first, kept)
        assert ptrs(second) <= at_second
    else:
        assert not encoded and not at_first
