import os, sys, torch
from fusedattn.api import attention
d, causal, dtype, b, h, s = int(sys.argv[1]), sys.argv[2] == "1", getattr(torch, sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
out = attention(q, k, v, is_causal=causal)
torch.cuda.synchronize()
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
print(f"d={d} causal={causal} {sys.argv[3]} B{b} H{h} S{s} split={os.environ.get('FUSEDATTN_SPLIT_D','1')} maxerr={(out.float()-ref).abs().max().item():.3g}")
