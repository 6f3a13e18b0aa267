"""What the portable forward (`tiles/flash_kernels._flash_fwd`) compiles to on sm_90a,
without a GPU: Triton 3.6 builds it for each configuration (the launcher's config table,
`configs.forward_config`, for B4 H32 S4096) and this reports its registers, shared memory,
ptxas' spills and its SASS counts of the instructions that matter (wgmma: HGMMA for bf16,
QGMMA for FP8; the e4m3 conversions; exp2). It shows that a dtype the GPU tier has not run
yet (FP8, issue 34) compiles for Hopper and onto which tensor-core instructions; it is a
compiler report, not a time and not a test of the results.

    PYTHONPATH=src python3 scripts/portable_compile_report.py [--out F] [--against REV]

`--against REV` instead compares, configuration by configuration, the SASS of the kernel
file at git revision REV with today's, for the dtypes both take (bf16, fp16, fp32) and a
few mask and head-dim variants (`SAME`): "identical" (the same instructions in the same
order), "reordered" (the same opcodes, scheduled or allocated otherwise) or "different".
It tells whether a change to the kernel changed what the GPU runs for those dtypes.

`--fp8-decode-tiles` compiles `tiles.fp8_decode` (FUSEDATTN_FP8_DECODE=1's e4m3 decode
kernel) at each of `decode_tiles.FP8_DECODE`'s tiles and head dims 64/128/256, with
`per_key_warp`: a key tile's most instructions x warps / keys (what a key costs the SM's
issue slots, across tiles of different widths and warp counts).

`--decode` compiles instead the split-KV decode configurations `attention_with_kvcache`
launches (`configs.decode_config` for one query row, an 8k cache; paged or not; the lengths
read per sequence, causal bottom-right), in e4m3 and in bf16 beside it (GQA packed, 4 query
heads a K/V head, as both run); for e4m3 both kernels, `tiles.fp8_decode`'s ("fp8-decode")
and `_flash_fwd`'s ("decode").

Each build specialises its arguments as a launch does (`JITFunction.run`): pointers
16-byte aligned, an int equal to 1 (the head dim's stride) a constant, an int divisible by
16 hinted so, but the `shape_jit` ints. Without that (the reports before 2026-12-05:
sm90-compile 2203Z, 2318Z, 2347Z, 0334Z) the loads were scalar, there was no cp.async
pipeline, and the registers, spills and shared memory were not a launch's. Decode rows
give `tile_paths`: the fewest and the most instructions of the key loop's paths (a key
tile; paged, each block's lookup forks a path), and `tile_ops`: the loop's 12 commonest
opcodes.

(run with a Python whose Triton is 3.6, the H200's, e.g. a venv of `pip install
triton==3.6.0 torch`)."""

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gluon_compile_report import cubin_facts, key_loop, opcodes, path_lengths  # noqa: E402

COUNTED = r"\b([HQ]GMMA\.\S+|[HQ]MMA\.\S+|F2FP\.\S+|MUFU\.EX2|LDL|STL)"
# dtype, head dim, causal: the fp8 suite's rows, and bf16 beside them for comparison
ROWS = [(dt, d, c) for dt in ("fp8e4nv", "bf16") for d in (64, 128, 256) for c in (False, True)]


def _configuration(dtype: str, dim: int, causal: bool):
    """The `_flash_fwd` signature and constexprs `flash.flash_forward` would launch with at
    B4 H32 S4096 (16-byte aligned, contiguous rows: ALIGN = 1, every stride a multiple of
    16), its warps and stages, and its int arguments' values (`_prefill_ints`)."""
    import triton.language as tl

    from fusedattn import configs
    from fusedattn.precision import DEFAULT_FP32

    precision = DEFAULT_FP32 if dtype == "fp32" else None  # (fp32: tf32x3, its default)
    bm, bn, warps, stages = configs.forward_config(dim=dim, seq_q=4096,
                                                   programs_per_tile_row=128, causal=causal,
                                                   precision=precision)
    block_d, block_d2 = configs.head_dim_pieces(dim, precision=precision, aligned=True)
    pointers = dict(p_q=dtype, p_k=dtype, p_v=dtype, p_o="bf16", p_lse="fp32")
    absent = ("p_cu_q", "p_cu_k", "p_seqlens_k", "p_table", "p_sinks")
    fp8 = dtype.startswith("fp8")
    constants = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_DV=block_d,
        BLOCK_DV2=block_d2, PRECISION=precision, INDEX=tl.int32, BOTTOM_RIGHT=False,
        PACK_GQA=False, ONE_LOOP=configs.single_key_loop(seq_k=4096, precision=precision,
                                                         has_left=False),
        ALIGN=1, HAS_LEFT=False, HAS_RIGHT=causal, SOFTCAP=False, VARLEN=False,
        SEQLENS_K=False, PAGED=False, WRITE_LSE=True, SPLIT=False, SINKS=False, FP8=fp8,
        PAD_D=False, OVERLAP=0, PAD_DV=False, OVERLAP_V=0, **dict.fromkeys(absent))
    if not fp8:
        constants["p_descale"] = None
    else:
        pointers["p_descale"] = "fp32"
    return pointers, constants, warps, stages, _prefill_ints(dim, causal)


def _strides(*shape: int) -> list[int]:
    """A contiguous tensor's strides."""
    out = [1]
    for n in reversed(shape[1:]):
        out.insert(0, out[0] * n)
    return out


def _prefill_ints(dim: int, causal: bool, batch=4, heads=32, seq=4096) -> dict:
    """The int arguments of `_flash_fwd` at a contiguous B4 H32 S4096 launch (what Triton
    specialises on: a 1 becomes a constant, a multiple of 16 a divisibility hint)."""
    x = _strides(batch, heads, seq, dim)
    ints = {f"s{t}_{a}": v for t in "qkvo" for a, v in zip("bhsd", x, strict=True)}
    return ints | dict(so_split=0, sl_b=heads * seq, sl_h=seq, sl_split=0, st_b=0,
                       n_heads=heads, group=1, seq_q=seq, seq_k=seq, head_dim=dim,
                       head_dim_v=dim, left=-1, right=0 if causal else -1, page=0,
                       split_len=0, seqlens_add=0, n_pages=0,
                       bucket_q=seq, bucket_k=seq)


# decode (`--decode`): dtype, head dim, paged; a query row of each head of a GQA group of 4
# (packed), 8192 keys, causal bottom-right, split-KV
DECODE = [(dt, d, paged) for dt in ("fp8e4nv", "bf16") for d in (64, 128, 256)
          for paged in (False, True)]


def _decode_over(dim: int, paged: bool) -> dict:
    """The constexprs of a decode launch over `_configuration`'s (`flash.flash_forward`
    with a `KVCache`, split-KV, PACK_GQA: `kvcache`'s docstring)."""
    from fusedattn import configs

    bm, bn, warps, stages = configs.decode_config(dim=dim, rows=4, seq_k=8192, programs=128)
    batch, heads, heads_kv, keys, page, splits = 32, 32, 8, 8192, 16, 4
    q, o = _strides(batch, heads, 1, dim), _strides(splits, batch, heads, 1, dim)
    cache = _strides(batch * keys // page, heads_kv, page, dim) if paged else \
        _strides(batch, heads_kv, keys, dim)
    ints = {f"s{t}_{a}": v for t, x in (("q", q), ("k", cache), ("v", cache), ("o", o[1:]))
            for a, v in zip("bhsd", x, strict=True)}
    ints |= dict(so_split=o[0], sl_b=heads, sl_h=1, sl_split=batch * heads,
                 st_b=keys // page if paged else 0, n_heads=heads, group=heads // heads_kv,
                 seq_q=1, seq_k=keys, head_dim=dim, head_dim_v=dim, left=-1, right=0,
                 page=page if paged else 0, split_len=keys // splits, seqlens_add=0,
                 n_pages=batch * keys // page if paged else 0, bucket_q=1, bucket_k=keys)
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, INTS=ints,
                BOTTOM_RIGHT=True, PACK_GQA=True, SEQLENS_K=True, PAGED=paged,
                SPLIT=True, ONE_LOOP=configs.single_key_loop(seq_k=8192, precision=None,
                                                             has_left=False))


# (dtype, head dim, causal, constexprs over the defaults): what --against compares
SAME = [(dt, d, c, {}) for dt in ("bf16", "fp16", "fp32")
        for d, c in ((64, False), (128, True), (128, False), (256, False))]
SAME += [("bf16", 128, True, dict(SOFTCAP=True, HAS_LEFT=True)),
         ("bf16", 64, True, dict(SINKS=True)),
         ("bf16", 96, False, dict(BLOCK_D=64, BLOCK_D2=32, BLOCK_DV=64, BLOCK_DV2=32)),
         ("fp16", 128, True, dict(ONE_LOOP=True))]


def _fewest_most(lengths: list[int]) -> list[int]:
    return [min(lengths), max(lengths)] if lengths else []


def compile_row(dtype: str, dim: int, causal: bool, module=None, **over):
    """`_flash_fwd` of `module` (default today's `tiles.flash_kernels`) compiled for
    sm_90a with `_configuration`'s constexprs, `over` replacing some (SINKS=True makes
    `p_sinks` a pointer)."""
    if module is None:
        from fusedattn.tiles import flash_kernels as module

    pointers, constants, warps, stages, ints = _configuration(dtype, dim, causal)
    warps, stages = over.pop("num_warps", warps), over.pop("num_stages", stages)
    ints = over.pop("INTS", ints)
    constants.update(over)
    for flag, name, kind in (("SINKS", "p_sinks", "fp32"), ("SEQLENS_K", "p_seqlens_k", "i32"),
                             ("PAGED", "p_table", "i32")):
        if over.get(flag):  # the flag's tensor a pointer, not an absent None
            del constants[name]
            pointers[name] = kind
    # (under the heuristics: the JITFunction)
    return _compile(module._flash_fwd.fn, pointers, constants, ints, warps, stages)


def compile_fp8_decode(dim: int, paged: bool, tile=None):
    """`tiles.fp8_decode._fp8_decode` as `flash.flash_forward` launches it for `DECODE`'s
    problem (`_decode_over`'s: one query of each of a GQA group's 4 heads, an 8k cache,
    4 splits), at `tile` (BLOCK_R, BLOCK_N, warps, stages), default
    `configs.fp8_decode_config`'s. V's strides count int32 words."""
    import triton.language as tl

    from fusedattn import configs
    from fusedattn.tiles import fp8_decode

    ints = _decode_over(dim, paged)["INTS"]
    ints = {k: v for k, v in ints.items() if not k.endswith("_d") or k in ("sq_d", "sk_d",
                                                                             "so_d")}
    for a in "bhs":
        ints[f"sv_{a}"] //= 4
    block_r, block_n, warps, stages = tile or configs.fp8_decode_config(dim=dim, rows=4)
    pointers = dict(p_q="fp8e4nv", p_k="fp8e4nv", p_v="fp8e4nv", p_o="fp32", p_lse="fp32",
                    p_seqlens_k="i32", p_descale="fp32")
    constants = dict(p_sinks=None, BLOCK_R=block_r, BLOCK_N=block_n, HEAD_DIM=dim,
                     INDEX=tl.int32, HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False,
                     PAGED=paged, WRITE_LSE=True, SPLIT=True, SINKS=False)
    if paged:
        pointers["p_table"] = "i32"
    else:
        constants["p_table"] = None
    compiled = _compile(fp8_decode._fp8_decode.fn, pointers, constants, ints, warps, stages)
    return compiled, dict(BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps,
                          num_stages=stages)


def _compile(fn, pointers: dict, constants: dict, ints: dict, warps: int, stages: int):
    """`fn` compiled for sm_90a: `constants` its constexprs, `pointers` its pointers'
    element types, `ints` its other ints' values, specialised as a launch does."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    # as a launch specialises (`JITFunction.run`): pointers 16-byte aligned, ints equal to
    # 1 constants and multiples of 16 hinted so, but the `shape_jit` ones
    signature, constexprs, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = divisible
        elif name in ("qk_scale", "cap"):
            signature[name] = "fp32"
        else:  # strides, sizes and the mask's sides
            kind, hint = native_specialize_impl(BaseBackend, ints[name], False,
                                                not param.do_not_specialize, True)
            if kind == "constexpr":
                signature[name] = "constexpr"
                constexprs[(i,)] = hint
            else:
                signature[name] = kind
                if hint == "D":
                    attrs[(i,)] = divisible
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def _loop_facts(sass: str) -> dict:
    """A decode kernel's key loop: its paths' fewest and most instructions (a key tile) and
    its 12 commonest opcodes."""
    loop = key_loop(sass, "MMA")
    return dict(tile_paths=_fewest_most(path_lengths(loop)),
                tile_ops=dict(opcodes(loop).most_common(12)))


def _instructions(sass: str) -> list[str]:
    """The SASS's instructions in order, without their addresses and encodings."""
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).split(";")[0].strip()
            for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def _opcodes(instructions: list[str]) -> collections.Counter:
    return collections.Counter(x.split()[1] if x.startswith("@") else x.split()[0]
                               for x in instructions if x)


def against(rev: str, tools: Path) -> list[dict]:
    """Today's kernel file against REV's, configuration by configuration (`SAME`)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "-C", root, "show", f"{rev}:src/fusedattn/tiles/"
                           "flash_kernels.py"], capture_output=True, text=True,
                          check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("flash_kernels_at_rev", f.name)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    rows = []
    for dtype, dim, causal, over in SAME:
        then, now = (_instructions(cubin_facts(tools, compile_row(
            dtype, dim, causal, module, **over))[1]) for module in (old, None))
        verdict = ("identical" if then == now else
                   "reordered" if _opcodes(then) == _opcodes(now) else "different")
        rows.append(dict(dtype=dtype, dim=dim, causal=causal, **over, against=rev,
                         instructions=len(now), verdict=verdict))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--against", default=None, help="compare with the kernel at this rev")
    ap.add_argument("--decode", action="store_true", help="the split-KV decode launches")
    ap.add_argument("--fp8-decode-tiles", action="store_true",
                    help="tiles.fp8_decode at decode_tiles.FP8_DECODE's tiles, contiguous")
    args = ap.parse_args()
    import triton

    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    if args.fp8_decode_tiles:
        from decode_tiles import FP8_DECODE

        rows = []
        for dim in (64, 128, 256):
            for tile in FP8_DECODE:
                try:
                    compiled, what = compile_fp8_decode(dim, False, tile)
                except Exception as e:  # noqa: BLE001 (a tile past the SM's shared memory)
                    rows.append(dict(dim=dim, tile=list(tile), error=str(e)[:200]))
                else:
                    facts, sass = cubin_facts(tools, compiled)
                    loop = _loop_facts(sass)
                    rows.append(dict(dim=dim, **what, **loop, per_key_warp=round(
                        max(loop["tile_paths"]) * tile[2] / tile[1], 2), **facts))
                print(json.dumps(rows[-1]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    if args.against:
        rows = against(args.against, tools)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    rows = []
    for dtype, dim, third in DECODE if args.decode else ROWS:
        if args.decode and dtype == "fp8e4nv":  # (third: paged) FUSEDATTN_FP8_DECODE=1's
            compiled, tile = compile_fp8_decode(dim, third)
            facts, sass = cubin_facts(tools, compiled)
            rows.append(dict(dtype=dtype, dim=dim, kind="fp8-decode", paged=third, **tile,
                             **_loop_facts(sass), triton=triton.__version__, **facts,
                             **collections.Counter(re.findall(COUNTED, sass))))
            print(json.dumps(rows[-1]), flush=True)
        if args.decode:  # (third: paged) `_flash_fwd`'s (e4m3's default)
            over = _decode_over(dim, third)
            facts, sass = cubin_facts(tools, compile_row(dtype, dim, True, **over))
            what = dict(kind="decode", paged=third, BLOCK_M=over["BLOCK_M"],
                        BLOCK_N=over["BLOCK_N"], PACK_GQA=over["PACK_GQA"],
                        **_loop_facts(sass))
        else:  # (third: causal)
            facts, sass = cubin_facts(tools, compile_row(dtype, dim, third))
            what = dict(causal=third)
        row = dict(dtype=dtype, dim=dim, **what, triton=triton.__version__, **facts,
                   **collections.Counter(re.findall(COUNTED, sass)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
