"""FlashAttention-4's sm90 forward, compiled on a CPU with no GPU, reported as
`gluon_compile_report` reports ours: registers, setmaxnreg, the SASS counts that matter,
and each innermost wgmma loop's length, paths and mix. A compiler report, not a time.

FA4 compiles without a GPU under torch's FakeTensorMode (its interface's fake mode) with
its documented CPU-only settings (FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH,
FLASH_ATTENTION_NUM_SMS); CUTE_DSL_KEEP=cubin keeps each kernel's cubin. Its packages
are not ours to install, so it runs in a venv of its own (Python 3.11 here):

    python3 -m venv /tmp/fa4v && /tmp/fa4v/bin/pip install torch==2.13.0 triton==3.6.0 \\
        protobuf cuda-python numpy && /tmp/fa4v/bin/pip install --no-deps \\
        flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \\
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu12==4.8.1 \\
        apache-tvm-ffi==0.1.11 quack-kernels einops
    /tmp/fa4v/bin/python scripts/fa4_sass.py [--configs "128/128 128/128c 192/192 64/64c"]
                                             [--out F] [--loops DIR]

A configuration is "D/Dv", with "c" for causal (and "d" for the backward's deterministic
mode); bf16, B4 S4096 H32 (the tile choice depends on the head dims and the mask, not on
the sizes). `--backward` reports FA4's main backward kernel (not its pre- and
postprocess)."""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_compile_report as report  # noqa: E402  (its SASS helpers, not its compiles)


def compile_fa4(d: int, dv: int, causal: bool, dump: Path) -> Path:
    """FA4's forward for bf16 [4, 4096, 32, d] (v: dv) compiled; its cubin, moved out of
    `dump` (one folder a process: the DSL reads where to keep its files once, and names a
    kernel's file alike for every configuration)."""
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    import torch
    from flash_attn.cute.interface import _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = (torch.empty(4, 4096, 32, d, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        v = torch.empty(4, 4096, 32, dv, dtype=torch.bfloat16, device="cuda")
        _flash_attn_fwd(q, k, v, causal=causal)
    (cubin,) = dump.glob("*flash_fwd_sm90*.cubin")
    return cubin.rename(dump / "kept" / f"{d}_{dv}_{int(causal)}.cubin")


def compile_fa4_backward(d: int, dv: int, causal: bool, dump: Path,
                         deterministic: bool = False) -> Path:
    """FA4's backward (its main sm90 kernel) for bf16 [4, 4096, 32, d] (v, O, dO: dv)
    compiled; its cubin, moved out of `dump` as `compile_fa4`'s (the preprocess and
    postprocess kernels' are left there)."""
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    import torch
    from flash_attn.cute.interface import _flash_attn_bwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = (torch.empty(4, 4096, 32, d, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        v, o, do = (torch.empty(4, 4096, 32, dv, dtype=torch.bfloat16, device="cuda")
                    for _ in range(3))
        lse = torch.empty(4, 32, 4096, dtype=torch.float32, device="cuda")
        _flash_attn_bwd(q, k, v, o, do, lse, causal=causal, deterministic=deterministic)
    (cubin,) = dump.glob("*flash_bwd_sm90*.cubin")
    return cubin.rename(dump / "kept" / f"bwd_{d}_{dv}_{int(causal)}_{int(deterministic)}.cubin")


def facts(cubin: Path) -> tuple[dict, str]:
    """(registers, stack, the SASS counts of `gluon_compile_report.sass_counts`, each
    innermost wgmma loop's length, paths and top opcodes), and the SASS."""
    import triton

    usage, sass = report.cuobjdump(Path(triton.__file__).parent / "backends/nvidia/bin", cubin)
    loops = [dict(start=f"{body[0][0]:05x}", length=len(body),
                  paths=report.path_lengths(body),
                  **dict(report.opcodes(body).most_common(12)))
             for body in report.wgmma_loops(sass)]
    return dict(**usage, **report.sass_counts(sass), loops=loops), sass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=None,
                    help="D/Dv[c][d] ... (c causal, d deterministic: the backward's)")
    ap.add_argument("--backward", action="store_true", help="FA4's backward kernel")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--loops", type=Path, default=None,
                    help="write each configuration's wgmma loops (SASS) into this folder")
    args = ap.parse_args()
    args.configs = args.configs or ("128/128 128/128c 64/64c 192/192 256/256"
                                    if args.backward else
                                    "128/128 128/128c 192/192 192/128c 64/64c")
    rows = []
    dump = Path(tempfile.mkdtemp(prefix="fa4-sass-"))
    (dump / "kept").mkdir()
    for config in args.configs.split():
        m = re.fullmatch(r"(\d+)/(\d+)(c?)(d?)", config)
        if not m or (m[4] and not args.backward):
            ap.error(f"configuration {config!r}: D/Dv with an optional c (causal) and, "
                     "for the backward, d (deterministic)")
        if args.backward:
            cubin = compile_fa4_backward(int(m[1]), int(m[2]), bool(m[3]), dump, bool(m[4]))
        else:
            cubin = compile_fa4(int(m[1]), int(m[2]), bool(m[3]), dump)
        row, sass = facts(cubin)
        if args.loops is not None:
            args.loops.mkdir(parents=True, exist_ok=True)
            for n, body in enumerate(report.wgmma_loops(sass)):
                kind = "bwd-" if args.backward else ""
                (args.loops / f"fa4-{kind}{config.replace('/', '_')}-{n}.sass").write_text(
                    "".join(f"{a:05x} {t}\n" for a, t in body))
        rows.append(dict(name=config, **row))
        print(json.dumps(rows[-1]))
    if args.out:
        args.out.write_text(json.dumps(dict(fa4="4.0.0b36", rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
