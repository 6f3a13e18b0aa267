import sys, re, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import k
for v in range(2):
    src = GluonASTSource(k.k2, {"p": "*fp32", "n": "i32", "VARIANT": "constexpr"}, {(2,): v})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = c.asm["ptx"]
    body = [l.strip() for l in ptx.splitlines() if re.search(r"bar\.sync|mbarrier\.(try_wait|arrive)|st\.shared|^\$L__BB|fence|bra", l)]
    print("VARIANT", v); print("\n".join(body)); print()
