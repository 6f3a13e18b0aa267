"""What the FP8 forward's V^T transpose (`hopper/transpose.py`'s `_transpose_v`) compiles to
on sm_90a, without a GPU: its global and shared memory instructions by width, per head dim
and layout (dense, varlen), with the launch's specialisations (V's last stride 1; pointers,
V's other strides and V^T's row stride multiples of 16). A store that compiles to one byte
an instruction instead of 16 shows here.

    python3 scripts/transpose_compile_report.py [FILE ...] [--out F]

FILE: versions of transpose.py (default today's; e.g. `git show REV:path > f`). Only the
kernel's source is taken from each (the module imports torch, which this needs not).
Run with a Python whose Triton is 3.6 (the H200's). A compiler report, not a time."""

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gluon_compile_report import cubin_facts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEMORY = r"\b((?:STG|LDG|STS|LDS|LDSM|STSM)(?:\.[\w.]+)?)"
SIXTEEN = ("sv_b", "sv_h", "sv_s", "svt_b", "svt_h", "svt_d", "width")


def _kernel(path: Path):
    """`_transpose_v` of `path`, its source alone loaded with triton."""
    text = path.read_text()
    source = text[text.index("@triton.jit"):text.index("\ndef v_transposed")]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import triton\nimport triton.language as tl\n\n" + source)
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"transpose_{abs(hash(f.name))}", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (the decorator has read the source: the file can go)
    os.unlink(f.name)
    return module._transpose_v


def compile_one(fn, dim: int, varlen: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(DV=dim, BLOCK_S=64, ALIGN=16, VARLEN=varlen, sv_d=1)
    if not varlen:
        constants.update(p_cu_k=None, p_cu_t=None)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
            continue
        signature[name] = {"p_v": "*fp8e4nv", "p_vt": "*fp8e4nv"}.get(
            name, "*i32" if name.startswith("p_") else "i32")
        if name.startswith("p_") or name in SIXTEEN:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def memory_ops(compiled) -> dict:
    import triton

    _, sass = cubin_facts(Path(triton.__file__).parent / "backends/nvidia/bin", compiled)
    return dict(sorted(collections.Counter(re.findall(MEMORY, sass)).items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path,
                    default=[ROOT / "src/fusedattn/hopper/transpose.py"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for path in args.files:
        fn = _kernel(path)
        for varlen in (False, True):
            for dim in (64, 128, 256):
                row = dict(file=str(path), dim=dim, varlen=varlen,
                           memory=memory_ops(compile_one(fn, dim, varlen)))
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
