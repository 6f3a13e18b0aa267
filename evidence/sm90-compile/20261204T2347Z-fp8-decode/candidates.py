"""The decode configurations of `portable_compile_report --decode` at other tiles: registers,
shared memory and spills for sm_90a (Triton 3.6, no GPU). Run from the repository root:
PYTHONPATH=src python3 evidence/sm90-compile/20261204T2347Z-fp8-decode/candidates.py"""
import sys, json
sys.path.insert(0, "scripts")
import portable_compile_report as r
from pathlib import Path
import triton
tools = Path(triton.__file__).parent / "backends/nvidia/bin"
for dt in ("bf16", "fp8e4nv"):
    for dim, cands in ((128, [(16,128,4,3),(16,128,4,2),(16,64,4,3),(16,128,8,3)]), (256, [(16,64,4,3),(16,64,4,2),(16,32,4,3),(16,64,8,3),(16,32,4,2),(16,64,8,2)])):
        for bm, bn, w, st in cands:
            over = r._decode_over(dt, dim, False)
            over.update(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            facts, sass = r.cubin_facts(tools, r.compile_row(dt, dim, True, **over))
            print(dt, dim, (bm,bn,w,st), {k: facts[k] for k in ("registers","shared","spill_stores","spill_loads")}, flush=True)
