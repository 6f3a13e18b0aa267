"""What the Hopper forward kernel compiles to, without a GPU: build `_flash_fwd_sm90` for
sm_90a with Triton 3.6 and report, per configuration, its shared memory, its registers and
stack (cuobjdump) and its SASS counts of the instructions that matter here (wgmma, TMA
loads, mbarrier waits and arrives, named barriers, spills, exp2).

    python3 scripts/gluon_compile_report.py [--kernel FILE] [--configs JSON] [--out F]

`--kernel` compiles another version of `forward_kernel.py` (e.g. `git show REV:path > f`).
A configuration names the kernel's constexprs (`TILE`, the launcher's, fills the rest);
parameters a version lacks are left out, so one report compares versions. This is a
compiler report, not a time."""

import argparse
import collections
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "src/fusedattn/hopper/forward_kernel.py"
COUNTED = r"\b(HGMMA|UTMALDG|SYNCS\.PHASECHK|SYNCS\.ARRIVE|BAR\.SYNC|LDL|STL|MUFU\.EX2)"
# what the launcher (`hopper.forward`) passes by default, beside each configuration's own
DEFAULTS = dict(BLOCK_M=64, STAGES=3, HAS_LEFT=False, HAS_RIGHT=False, BOTTOM_RIGHT=False,
                SOFTCAP=False, VARLEN=False, WRITE_LSE=True, PINGPONG=True, SINKS=False,
                SHARED_KV=False, LOADER_REGS=24, CONSUMER_REGS=240)
CONFIGS = [  # D_A/D_B: Q's and K's pieces; DV_A/DV_B: V's and O's (default: Q's)
    dict(name="D128", D_A=128, D_B=0, BLOCK_N=128),
    dict(name="D128 causal", D_A=128, D_B=0, BLOCK_N=128, HAS_RIGHT=True),
    dict(name="D128 causal sinks", D_A=128, D_B=0, BLOCK_N=128, HAS_RIGHT=True, SINKS=True),
    dict(name="D128 causal shared-kv", D_A=128, D_B=0, BLOCK_N=128, HAS_RIGHT=True,
         SHARED_KV=True),
    dict(name="D64", D_A=64, D_B=0, BLOCK_N=128, STAGES=4),
    dict(name="D192", D_A=128, D_B=64, BLOCK_N=64),
    dict(name="D192/128 causal", D_A=128, D_B=64, DV_A=128, DV_B=0, BLOCK_N=64,
         HAS_RIGHT=True),
    dict(name="D128/64 varlen", D_A=128, D_B=0, DV_A=64, DV_B=0, BLOCK_N=128, VARLEN=True,
         HAS_RIGHT=True, BOTTOM_RIGHT=True),
]


def _desc(rows: int, dim: int):
    from triton.experimental.gluon import language as gl

    block = [1, 1, rows, dim]
    return f"tensordesc<bf16{block},{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"


def compile_config(fn, config: dict):
    """The compiled kernel for one configuration (bf16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = DEFAULTS | {k: v for k, v in config.items() if k != "name"}
    c.setdefault("DV_A", c["D_A"])
    c.setdefault("DV_B", c["D_B"])
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    pieces = {"q": (bm, "D"), "k": (bn, "D"), "v": (bn, "DV"), "o": (bm, "DV")}
    types = {}
    for t, (rows, which) in pieces.items():
        types[f"{t}_desc"] = _desc(rows, c[f"{which}_A"])
        types[f"{t}2_desc"] = _desc(rows, c[f"{which}_B"] or c[f"{which}_A"])
    types |= {"p_o": "*bf16", "p_lse": "*fp32", "p_cu_q": "*i32", "p_cu_k": "*i32",
              "p_sinks": "*fp32", "qk_scale": "fp32", "cap": "fp32"}
    signature, constants = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in c:
            signature[name] = "constexpr"
            constants[(i,)] = c[name]
        else:  # strides i64, counts and window sides i32 (as the launcher's values are)
            signature[name] = types.get(name, "i64" if name[:3] in ("so_", "sl_") else "i32")
    source = GluonASTSource(fn, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def report(kernel_file: Path, configs: list[dict]) -> list[dict]:
    import triton

    spec = importlib.util.spec_from_file_location("forward_kernel_under_report", kernel_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    rows = []
    fn = module._flash_fwd_sm90
    for config in configs:
        missing = sorted(set(config) - {"name"} - set(fn.arg_names))
        if missing:  # a configuration of a parameter this version does not have
            rows.append(dict(name=config["name"], skipped=f"no {', '.join(missing)}"))
            continue
        compiled = compile_config(fn, config)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([tools / "cuobjdump", "--dump-sass", cubin.name],
                                  capture_output=True, text=True, check=True).stdout
        regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        rows.append(dict(name=config["name"], shared=compiled.metadata.shared,
                         registers=int(regs[1]), stack=int(regs[2]),
                         **collections.Counter(re.findall(COUNTED, sass))))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", type=Path, default=KERNEL)
    ap.add_argument("--configs", default="", help="a JSON list of configurations")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = report(args.kernel, json.loads(args.configs) if args.configs else CONFIGS)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(dict(kernel=str(args.kernel), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
