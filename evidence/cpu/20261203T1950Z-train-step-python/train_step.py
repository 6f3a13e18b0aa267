import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from fusedattn import attention
from fusedattn import launch
dt = torch.float32
q,k,v = (torch.randn(2,2,32,64, dtype=dt, requires_grad=True) for _ in range(3))
dout = torch.randn(2,2,32,64, dtype=dt)
def f():
    out = attention(q, k, v, is_causal=True)
    out.backward(dout)
f(); f()
launch.Replay.__call__ = lambda self, inputs: None
f()
import cProfile, pstats
if len(sys.argv) > 2 and sys.argv[2] == "prof":
    pr = cProfile.Profile(); pr.enable()
    for _ in range(int(sys.argv[1])): f()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(35)
else:
    import time; t = time.perf_counter()
    for _ in range(int(sys.argv[1])): f()
    print((time.perf_counter() - t) / int(sys.argv[1]) * 1e6, "us")
