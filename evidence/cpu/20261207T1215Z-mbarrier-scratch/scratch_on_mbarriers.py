"""Does shared scratch land on an mbarrier? Each configuration of
`scripts/gluon_compile_report.py` (CONFIGS for the forward, BWD_CONFIGS for the backward),
compiled for sm_90a by its `compile_config` (Triton 3.6, no GPU needed), read two ways:

  ptx   the PTX's plain `ld.shared`/`st.shared` at known offsets that fall inside an
        mbarrier's 8 bytes (the offsets its `mbarrier.init`s take)
  ir    the IR after Triton's shared-memory allocation: ops holding scratch (an
        `allocation.offset` on anything but a `local_alloc`) whose offset is inside an
        mbarrier's allocation

    python scratch_on_mbarriers.py {ptx,ir} {fwd,bwd} KERNEL_SOURCE

One line a configuration: its name, shared memory (bytes), then the mbarriers and hits."""
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, "/work/main/scripts")
sys.path.insert(0, "/work/main/src")
import gluon_compile_report as g  # noqa: E402


def configs(kind):
    return g.CONFIGS if kind == "fwd" else g.BWD_CONFIGS


def compile_one(kind, source, name):
    mod = g._load(f"k_{kind}", Path(source))
    c = dict(next(x for x in configs(kind) if x["name"] == name))
    if kind == "fwd":
        return g.compile_config(mod._flash_fwd_sm90, c)
    return g.compile_config(mod._flash_bwd_sm90, c, backward=True)


def ptx_hits(ptx):
    base = {}  # registers defined as global_smem + a constant
    for m in re.finditer(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", ptx):
        base.setdefault(m.group(1), int(m.group(3)))
    bars = sorted({base.get(m.group(1)) for m in re.finditer(
        r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", ptx)} - {None})
    offs = {int(x) for x in re.findall(
        r"(?:ld|st)\.shared\.[a-z0-9.]+ \t?(?:%r\d+, )?\[global_smem\+(\d+)\]", ptx)}
    for m in re.finditer(r"(?:ld|st)\.shared\.[a-z0-9.]+ \[ ?(%r\d+) ?\+ 0 ?\]", ptx):
        if m.group(1) in base:
            offs.add(base[m.group(1)])
    hits = sorted(o for o in offs if any(b <= o < b + 8 for b in bars))
    return f"mbarriers {bars} inval {ptx.count('mbarrier.inval')} hits {hits}"


BITS = {"i64": 64, "i32": 32, "f32": 32, "bf16": 16, "f16": 16, "f8E4M3FN": 8, "i8": 8}


def ir_hits(dump):
    i = dump.rfind("IR Dump Before TritonTensorMemoryAllocationPass")
    ir = dump[i:dump.find("IR Dump Before", i + 10)]
    allocs = {}
    for m in re.finditer(r"(%[\w.]+) = ttg\.local_alloc[^\n]*allocation\.offset = (\d+) : i32\}"
                         r" : \(\) -> !ttg\.memdesc<([\dx]+)x(\w+),", ir):
        n = 1
        for d in m.group(3).split("x"):
            n *= int(d)
        allocs[m.group(1)] = (int(m.group(2)), n * BITS[m.group(4)] // 8)
    index = dict(re.findall(r"(%[\w.]+) = ttg\.memdesc_index (%[\w.]+)", ir))
    bars = sorted({allocs[index.get(b, b)] for b in re.findall(r"ttng\.init_barrier (%[\w.]+)", ir)
                   if index.get(b, b) in allocs})
    scratch = {(m.group(1), int(m.group(2))) for m in re.finditer(
        r"\n\s*(?:%[\w.:#]+ = )?([\w.]+)[^\n]*\{[^\n]*allocation\.offset = (\d+) : i32", ir)
        if m.group(1) != "ttg.local_alloc"}
    hits = sorted((op, o) for op, o in scratch if any(b <= o < b + n for b, n in bars))
    return f"mbarriers {bars} scratch {sorted(scratch)} hits {hits}"


def main():
    how, kind, source = sys.argv[1:4]
    if len(sys.argv) > 4:  # (one configuration, its IR dump on stderr: `ir`'s child)
        compile_one(kind, source, sys.argv[4])
        return
    for c in configs(kind):
        if how == "ptx":
            k = compile_one(kind, source, c["name"])
            print(c["name"], "::", k.metadata.shared, ptx_hits(k.asm["ptx"]), flush=True)
        else:
            run = subprocess.run([sys.executable, __file__, how, kind, source, c["name"]],
                                 env=os.environ | {"MLIR_ENABLE_DUMP": "1",
                                                   "TRITON_ALWAYS_COMPILE": "1"},
                                 capture_output=True, text=True)
            print(c["name"], "::", ir_hits(run.stderr), flush=True)


if __name__ == "__main__":
    main()
