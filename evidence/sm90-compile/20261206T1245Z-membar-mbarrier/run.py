import sys, re
sys.path.insert(0, __import__("os").path.dirname(__file__))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import k
for v in range(4):
    src = GluonASTSource(k.k1, {"p": "*fp32", "n": "i32", "VARIANT": "constexpr"}, {(2,): v})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = c.asm["ptx"]
    body = [l.strip() for l in ptx.splitlines() if re.search(r"bar\.sync|mbarrier\.(try_wait|arrive)|st\.shared|^\$L__BB|fence", l)]
    print("VARIANT", v); print("\n".join(body)); print()
