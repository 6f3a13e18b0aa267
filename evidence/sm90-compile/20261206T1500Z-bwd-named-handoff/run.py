"""`python3 run.py k1 > ptx.txt`, `python3 run.py k2 > ptx2.txt`: each variant's PTX, its
barriers, mbarrier operations, fences and branches in order (sm_90a, Triton 3.6, no GPU)."""
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k  # noqa: E402

KEEP = r"bar\.sync|bar\.arrive|mbarrier\.(try_wait|arrive)|st\.shared|^\$L__BB|fence|bra"
kernel = getattr(k, sys.argv[1])
for variant in range({"k1": 4, "k2": 2, "k3": 3}[sys.argv[1]]):
    src = GluonASTSource(kernel, {"p": "*fp32", "n": "i32", "VARIANT": "constexpr"},
                         {(2,): variant})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    print("VARIANT", variant)
    print("\n".join(line.strip() for line in ptx.splitlines() if re.search(KEEP, line)))
