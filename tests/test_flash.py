"""The flash kernel and `fusedattn.attention` (Triton's interpreter on a CPU)."""


import pytest
import torch

import fusedattn
from fusedattn.api import attention
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref
from fusedattn_lab.verify import check


def _ref(q, k, v, causal=False, scale=None):
    """The one float64 reference (GQA included), with the natural-log LSE."""
    return attention_ref(q, k, v, causal=causal, scale=scale, return_lse=True)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


CASES = [
    # (B, H, H_kv, Sq, Sk, D, causal): comment names the path
    (1, 2, 2, 20, 20, 16, False),   # one query tile, two key tiles (the second masked)
    (1, 2, 2, 33, 33, 16, True),    # causal: diagonal tiles masked inside, tiles past skipped
    (2, 4, 2, 17, 40, 24, False),   # Sq != Sk, GQA 2:1, D=24 padded to 32
    (1, 4, 1, 40, 17, 80, True),    # MQA, Sq > Sk causal (rows past Sk see all keys), D=80
    (1, 1, 1, 1, 1, 1, False),      # one row, one key, D=1 padded to 16
    (1, 2, 2, 48, 48, 64, True),    # whole tiles only: unmasked loads, diagonal tiles masked
    (1, 1, 1, 17, 40, 16, True),    # Sq < Sk causal: keys past the last query never seen
]


@pytest.mark.parametrize("case", CASES)
def test_flash_fp32_matches_float64_reference_with_lse(case):
    b, h, hk, sq, sk, d, causal = case
    q, k, v = _rand(b, h, sq, d), _rand(b, hk, sk, d, seed=1), _rand(b, hk, sk, d, seed=2)
    out, lse = attention(q, k, v, is_causal=causal, enable_gqa=hk != h, return_lse=True)
    ref, ref_lse = _ref(q, k, v, causal)
    result = check(out, ref)
    assert result.ok, result.reasons
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert torch.allclose(lse.double().cpu(), ref_lse, atol=1e-5)


def test_flash_fp16_within_the_low_precision_bound():
    q, k, v = (_rand(1, 2, 24, 32, dtype=torch.float16, seed=s) for s in range(3))
    ref, _ = _ref(q, k, v)
    # the peer: PyTorch's own attention in fp16 (math on fp16 inputs)
    peer = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    peer_err = float((peer.double().cpu() - ref).abs().max())
    result = check(attention(q, k, v), ref, peer_error=peer_err)
    assert result.ok, (result.reasons, peer_err)


def test_layouts_2d_3d_and_strided():
    q, k, v = (_rand(2, 9, 16, seed=s) for s in range(3))  # [H, S, D]
    assert check(attention(q, k, v), _ref(q, k, v)[0]).ok
    assert check(attention(q[0], k[0], v[0]), _ref(q[0], k[0], v[0])[0]).ok  # [S, D]
    # [B, S, H, D] transposed to [B, H, S, D]: non-contiguous strides, no copy
    qs = _rand(1, 9, 2, 16).transpose(1, 2)
    assert not qs.is_contiguous()
    assert check(attention(qs, qs, qs), _ref(qs, qs, qs)[0]).ok


@pytest.mark.parametrize("layout", ["bshd", "contiguous", "sliced", "d-not-innermost"])
def test_o_comes_back_in_a_dense_qs_memory_layout(layout):
    """`attention`'s O takes q's memory layout where q is dense with its head dim innermost
    (`api.new_out`), as SDPA's cuDNN and flash backends do: Hugging Face's `[B, S, H, D]`
    q seen as `[B, H, S, D]` gets O whose `transpose(1, 2)` is contiguous, so the
    integration's `.contiguous()` copies nothing. The bits are those of the same call on
    contiguous inputs; other layouts get a contiguous O."""
    b, h, s, d = 2, 3, 37, 32
    q, k, v = (_rand(b, s, h, d, seed=i) for i in range(3))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    elif layout == "contiguous":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    elif layout == "sliced":  # q/k/v of one fused projection: not dense
        qkv = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=-1)
        q, k, v = qkv.split(d, dim=-1)
    else:  # the head dim is not innermost (stride 1 along the sequence)
        q, k, v = (t.permute(0, 2, 3, 1).contiguous().transpose(-1, -2) for t in (q, k, v))
    out, lse = attention(q, k, v, is_causal=True, return_lse=True)
    dense = layout in ("bshd", "contiguous")
    assert out.stride() == (q.stride() if dense else out.contiguous().stride())
    assert out.transpose(1, 2).is_contiguous() == (layout == "bshd")
    assert lse.is_contiguous()
    plain = [t.contiguous() for t in (q, k, v)]
    want, want_lse = attention(*plain, is_causal=True, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    result = check(out, _ref(q, k, v, causal=True)[0])
    assert result.ok, result.reasons


def test_scale_argument():
    q, k, v = (_rand(1, 1, 8, 16, seed=s) for s in range(3))
    assert check(attention(q, k, v, scale=0.3), _ref(q, k, v, scale=0.3)[0]).ok


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_tensor_core_fp32_is_opt_in_and_fp32_only(precision):
    q, k, v = (_rand(1, 2, 20, 16, seed=s) for s in range(3))
    with pytest.raises(ProblemError, match="float32 only"):
        attention(q.half(), k.half(), v.half(), precision=precision)
    out = attention(q, k, v, precision=precision, is_causal=True)
    # the interpreter computes fp32 dots exactly; on the GPU tf32x3 must still meet fp32's
    # bound (tf32 is judged against the peer's error by the bench)
    result = check(out, _ref(q, k, v, causal=True)[0], precision=precision,
                   peer_error=1e-3)
    assert result.ok, result.reasons


@pytest.mark.gpu_only("rows past the short-sequence rule: fp32's 4-byte tensor-core tiles; "
                     "the interpreter computes fp32 dots exactly whatever is asked")
@pytest.mark.parametrize("dim, seq, causal", [(64, 600, False), (128, 700, True),
                                              (96, 1000, False), (200, 300, False)])
def test_fp32_default_is_tf32x3_within_fp32s_bound(dim, seq, causal):
    from fusedattn.precision import DEFAULT_FP32, resolve

    assert DEFAULT_FP32 == "tf32x3" and resolve(torch.float32, None).dot == "tf32x3"
    q, k, v = (_rand(1, 2, seq, dim, seed=s) for s in range(3))
    out = attention(q, k, v, is_causal=causal)
    assert torch.equal(out, attention(q, k, v, is_causal=causal, precision="tf32x3"))
    result = check(out, _ref(q, k, v, causal=causal)[0])
    assert result.ok, result.reasons


@pytest.mark.parametrize("make, field", [
    (lambda q: (q, q[..., :8], q), "head_dim"),
    (lambda q: (q.double(), q.double(), q.double()), "q.dtype"),
    (lambda q: (q, q.half(), q), "dtypes"),
    (lambda q: (q[0, 0, 0], q[0, 0, 0], q[0, 0, 0]), "q.shape"),       # 1-D
    (lambda q: (q[(None,) * 5], q[(None,) * 5], q[(None,) * 5]), "q.shape"),  # 9-D
    (lambda q: (q, q[:, :3], q[:, :3]), "heads"),                      # 4 vs 3 heads
    (lambda q: (q, q[:, :2], q[:, :2]), "heads"),                      # GQA without the flag
    (lambda q: (q, q, q[:, :, :5]), "k/v shapes"),
    (lambda q: (q, q[:1], q[:1]), "batch"),
    (lambda q: (q, q[0], q[0]), "ranks"),
    (lambda q: (q.new_zeros(2, 4, 0, 16), q, q), "q.shape"),
    (lambda q: (q, "k", q), "k"),
    (lambda q: (q.new_zeros(1, 1, 4, 300),) * 3, "head_dim"),
])
def test_bad_inputs_name_the_field(make, field):
    q = _rand(2, 4, 6, 16)
    with pytest.raises(ProblemError) as info:
        attention(*make(q))
    assert info.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    ({"scale": -1.0}, "scale"), ({"scale": float("nan")}, "scale"),
    ({"precision": "fp8"}, "precision"), ({"is_causal": 1}, "is_causal"),
])
def test_bad_options(kwargs, field):
    q = _rand(1, 1, 4, 16)
    with pytest.raises(ProblemError) as info:
        attention(q, q, q, **kwargs)
    assert info.value.field == field


def test_gqa_ratio_must_divide():
    q, kv = _rand(1, 4, 6, 16), _rand(1, 3, 6, 16)
    with pytest.raises(ProblemError, match="dividing"):
        attention(q, kv, kv, enable_gqa=True)


def test_runs_inside_torch_compile_without_graph_breaks():
    q, k, v = (_rand(1, 2, 16, 16, seed=s) for s in range(3))

    def f(q, k, v):
        return attention(q, k, v, is_causal=True) * 2.0 + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # fails on a graph break
    out = compiled(q, k, v)
    assert torch.allclose(out, f(q, k, v))
    assert check((out - 1.0) / 2.0, _ref(q, k, v, causal=True)[0]).ok


@pytest.mark.emulation_only("the host suite's calls on CPU tensors; the GPU times them")
def test_the_host_suites_layer_rows_give_a_layers_output(monkeypatch):
    """`bench --suite host`'s "layer" rows time a Hugging Face layer's forward,
    `.transpose(1, 2).contiguous()` included: every provider's call gives `[B, S, H, D]`,
    contiguous and right (`host._check`), and fusedattn's is its kernel's O, not a copy."""
    from fusedattn_lab import host

    problem = host.HostProblem("layer", 2, 4, 24, 16, True, heads_kv=2)
    gen = torch.Generator().manual_seed(0)
    calls, inputs = host._calls(problem, gen, {"fusedattn": fusedattn}, device="cpu")
    assert inputs[-1] and inputs[0].transpose(1, 2).is_contiguous()
    for name in ("fusedattn", "sdpa"):
        out = calls[name][1]()
        assert out.shape == (2, 24, 4, 16) and out.is_contiguous(), name
        result = host._check(out, inputs)
        assert result.ok, (name, result.reasons)
    written, real = [], fusedattn.attention
    monkeypatch.setattr(fusedattn, "attention", lambda *a, **kw: written.append(
        real(*a, **kw)) or written[-1])
    out = calls["fusedattn"][1]()  # the kernel's O itself: it is [B, S, H, D] memory
    assert out.data_ptr() == written[0].data_ptr()
    assert [p.kind for p in host.problems()].count("layer") == 2


def test_the_ops_fake_o_has_the_real_os_strides():
    """torch.compile plans the code after the op by its fake implementation's O: it must
    have the strides the eager O has (q's memory layout for a transposed `[B, S, H, D]` q,
    `api.new_out`), or the code reading it would read the wrong elements."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (_rand(2, 21, 3, 16, seed=s).transpose(1, 2) for s in range(3))
    args = (None, True, 0.25, "tf32x3", -1, -1, 0.0)  # (sinks, is_causal, ..., softcap)
    real, real_lse = torch.ops.fusedattn.flash_fwd(q, k, v, *args)
    assert real.stride() == q.stride()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake, fake_lse = torch.ops.fusedattn.flash_fwd(
            *(mode.from_tensor(t) for t in (q, k, v)), *args)
    assert (fake.shape, fake.stride()) == (real.shape, real.stride())
    assert (fake_lse.shape, fake_lse.stride()) == (real_lse.shape, real_lse.stride())


def test_flash_is_in_the_registry_for_the_chapters_problem(qkv):
    from fusedattn.problem import Problem
    from fusedattn_lab.registry import VERSIONS, select
    from fusedattn_lab.verify import poison

    assert "flash" in [v.name for v in select("all")]
    assert "sdpa-flash" not in [v.name for v in select("all")]  # peers for bench only
    q, k, v = qkv(7, 13)
    for causal in (False, True):
        prepared = VERSIONS["flash"].prepare(q, k, v, Problem(7, 13, 32, causal))
        poison(prepared.out)
        prepared.call()
        result = check(prepared.out, _ref(q, k, v, causal)[0])
        assert result.ok, result.reasons


@pytest.mark.emulation_only("bench in emulation: no times; the GPU bench is evidence")
def test_bench_tiny_suite_in_emulation(tmp_path, capsys):
    from fusedattn_lab.cli import main

    assert main(["bench", "--suite", "tiny", "--providers", "flash,sdpa-math",
                 "--out", str(tmp_path)]) == 0
    (folder,) = (tmp_path / "emulation").iterdir()
    text = (folder / "bench.csv").read_text()
    assert text.count("\n") == 1 + 4 * 2 and ",flash," in text and ",FAIL," not in text
    assert main(["bench", "--suite", "bf16", "--out", str(tmp_path)]) == 2  # GPU-sized
    assert main(["bench", "--providers", "t0", "--out", str(tmp_path)]) == 2


@pytest.mark.emulation_only("a compile per config on a GPU; the GPU run is evidence")
def test_bench_times_each_config_on_matching_problems(tmp_path):
    import csv

    from fusedattn.configs import CONFIGS, candidates
    from fusedattn_lab.cli import main
    assert main(["bench", "--suite", "tiny", "--providers", "flash", "--configs",
                 "--match", "H2/1 S33 D16 causal", "--out", str(tmp_path)]) == 0
    (folder,) = (tmp_path / "emulation").iterdir()
    with open(folder / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["problem"] for r in rows} == {"fp32 B1 H2/1 S33 D16 causal"}
    names = [r["provider"] for r in rows]
    assert names[0] == "flash" and len(names) == 1 + len(candidates(CONFIGS, 16, 64, "ieee"))
    assert len(names) > 2
    assert all(r["status"] == "ok" for r in rows), [r["reason"] for r in rows]
    assert main(["bench", "--suite", "tiny", "--match", "S9999",
                 "--out", str(tmp_path)]) == 2


def test_config_candidates_per_problem():
    from fusedattn.configs import CONFIGS, FMA, SHORT, TENSOR_CORE, candidates

    def shapes(*args):
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in candidates(CONFIGS, *args)}

    assert shapes(64, 4096, "ieee") == set(TENSOR_CORE) | set(FMA)   # fp32 exact: both
    assert shapes(128, 4096, None) == set(TENSOR_CORE)   # fp16/bf16
    assert shapes(64, 4096, "tf32") == set(TENSOR_CORE)
    assert shapes(64, 128, None) == shapes(64, 256, "ieee") == set(SHORT)
    big = shapes(256, 4096, None)
    # past D=128: at most 64 keys a tile, and 128 rows only with 8 warps
    assert big and all(bn <= 64 and (bm <= 64 or w == 8) for bm, bn, w, _ in big)
    assert (128, 64, 8, 3) in big and (128, 128, 8, 3) not in big


def test_flops_model():
    from fusedattn.tiles.flash import flops

    assert flops(4, 32, 4096, 4096, 128, False) == 4 * 4 * 32 * 4096 * 4096 * 128
    assert flops(1, 1, 8, 8, 2, True) == 4 * 8 * 8 * 2 / 2


def test_ratios_are_ours_over_each_peer_per_problem():
    from fusedattn_lab.suites import BenchRow, with_ratios

    def row(provider, tflops, problem="p"):
        return BenchRow(problem, provider, 1, 1, 8, 16, "bf16", False, "", "fwd", "ok", "", 0.0,
                        1.0,
                        1.0, 1.0, 1.0, tflops, None, None)

    rows = with_ratios([row("flash", 400.0), row("sdpa-flash", 320.0), row("sdpa-cudnn", 0.0),
                        row("sdpa-flash", 100.0, "other")])
    assert [r["flash_over_this"] for r in rows] == [None, 1.25, None, None]


def test_offsets_are_64_bit_exactly_where_32_would_overflow(monkeypatch):
    import triton.language as tl

    from fusedattn.tiles.common import index_dtype

    small = torch.empty((4, 32, 4096, 128), device="meta")   # 67M elements
    big = torch.empty((4200, 8, 512, 128), device="meta")    # 2.2e9: the crash
    assert index_dtype(small, small) == tl.int32
    assert index_dtype(small, big) == tl.int64
    # a view whose last element lies past 2^31 though it holds few: strides count, not numel
    strided = torch.empty((2, 1, 1, 1), device="meta").as_strided((2, 1, 1, 1),
                                                                  (2**31, 1, 1, 1))
    assert index_dtype(strided) == tl.int64
    assert index_dtype(small, rows=2**31) == tl.int64          # LSE / delta rows
    from dataclasses import replace

    from fusedattn import configs

    # forced ($FUSEDATTN_INDEX64=1, read once), to measure the cost
    monkeypatch.setattr(configs, "OVERRIDES", replace(configs.OVERRIDES, index64=True))
    assert index_dtype(small) == tl.int64


@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("case", [
    (1, 2, 2, 40, 72, 24, "causal"),       # ragged last key tile, diagonal tiles, padded D
    (1, 2, 1, 64, 64, 16, "window"),       # a window's left edge: masked tiles at both ends
    (2, 2, 2, 33, 50, 16, "full"),         # ragged last tile only
])
def test_one_key_loop_and_two_give_the_reference(monkeypatch, one_loop, case):
    """Both structures of the forward's key loop (`configs.single_key_loop`: one loop that
    masks edge tiles by a branch, or whole and edge tiles in separate loops), whatever the
    rule would pick for the shape, against the float64 reference; the output poisoned
    first (a tile the loop skipped would stay NaN)."""
    import fusedattn.tiles.flash as flash

    b, h, hk, sq, sk, d, kind = case
    monkeypatch.setattr(flash, "single_key_loop", lambda **_: one_loop)
    q, k, v = _rand(b, h, sq, d), _rand(b, hk, sk, d, seed=1), _rand(b, hk, sk, d, seed=2)
    window = (40, 0) if kind == "window" else None
    out = torch.full((b, h, sq, d), float("nan"), device=DEVICE)
    lse = torch.full((b, h, sq), float("nan"), device=DEVICE)
    flash.flash_forward(q, k, v, out=out, lse=lse, is_causal=kind == "causal",
                        scale=d ** -0.5, precision="ieee",
                        mask=flash.Mask(causal=True, window=window) if window else None)
    ref, ref_lse = attention_ref(q, k, v, causal=kind == "causal", window=window,
                                 return_lse=True)
    result = check(out, ref)
    assert result.ok, result.reasons
    assert torch.allclose(lse.double().cpu(), ref_lse, atol=1e-5)


@pytest.mark.gpu_only("the interpreter compiles nothing")
def test_a_new_head_count_reuses_the_compiled_forward():
    """Head counts and the LSE's strides are not specialised (`common.SHAPE_INTS`): after
    one shape has compiled, others that differ only in heads (8, 3, 5, 1) launch the same
    kernel, with no compile and no new launcher."""
    from fusedattn.tiles.flash import _flash_fwd

    def kernels():
        return sum(len(cache[0]) for cache in _flash_fwd.fn.device_caches.values())

    def run(heads):
        q = _rand(2, heads, 1000, 64, seed=heads).to(torch.bfloat16)
        out = attention(q, q, q)
        ref = attention_ref(q[:1, :1], q[:1, :1], q[:1, :1])
        assert (out[:1, :1].double().cpu() - ref).abs().max() < 2e-2

    run(8)
    before = kernels()
    for heads in (3, 5, 1):
        run(heads)
    assert kernels() == before


def _unspecialised(kernel) -> set[str]:
    """The int arguments a kernel leaves unspecialised (`do_not_specialize`), as the GPU's
    JIT function holds them or as the interpreter was handed them (under the heuristics
    that derive the flags, if any)."""
    from triton.runtime.autotuner import Heuristics

    if isinstance(kernel, Heuristics):
        kernel = kernel.fn
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = kernel.kwargs.get("do_not_specialize") or []
    return {kernel.arg_names[n] if isinstance(n, int) else n for n in names}


def test_only_ints_that_cost_nothing_are_left_unspecialised():
    """The forward leaves head counts, the LSE's strides and decode's sizes (the keys a call
    appends, the cache's pages too) unspecialised (a new head count reuses the compiled
    kernel and its launcher); lengths, the head dim,
    window bounds and the operands' strides stay specialised (without "% 16" on them the
    H200 ran prefill up to 3x slower, 20261130T164821Z), and so does every int of the
    backward's kernels (4-29% slower without, 20261130T1654Z) but the LSE's strides (one
    float per row; their "% 16" patterns compiled the backward again after warmup)."""
    from fusedattn.tiles import flash, flash_bwd

    assert _unspecialised(flash._flash_fwd) == {
        "n_heads", "group", "bucket_q", "bucket_k", "sl_b", "sl_h", "sl_split", "page",
        "split_len", "seqlens_add", "n_pages"}
    # (the Hopper backward's counters: their count and each program's share; the compact
    # varlen grid's sequences: their count and whether they are sorted;
    # and dQ's accumulator's strides, q's)
    assert _unspecialised(flash_bwd._bwd_preprocess) == {"n_sem", "sem_chunk", "n_docs",
                                                         "sort_docs", "sa_b", "sa_h", "sa_s"}
    for kernel in (flash_bwd._flash_bwd_dkdv, flash_bwd._flash_bwd_dq):
        assert _unspecialised(kernel) == {"sl_b", "sl_h"}
