import os, random, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import fusedattn
from fusedattn.reference import attention_ref_grads
rng = random.Random(int(sys.argv[1]))
bad = 0
for case in range(int(sys.argv[2])):
    b = rng.choice([1, 2]); hk = rng.choice([1, 2]); h = hk * rng.choice([1, 2])
    sq = rng.choice([1, 5, 16, 33]); sk = rng.choice([1, 4, 16, 31, 40])
    d = rng.choice([8, 16, 32, 40]); dv = rng.choice([d, 16])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    causal = rng.random() < 0.5
    window = rng.choice([None, (rng.randint(0, 20), rng.choice([None, rng.randint(0, 20)]))])
    softcap = rng.choice([None, rng.uniform(1, 30)])
    sinks = (torch.randn(h) * 2).requires_grad_() if rng.random() < 0.3 else None
    g = torch.Generator().manual_seed(100 + case)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hk, sk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hk, sk, dv, generator=g).to(dtype).requires_grad_()
    do = torch.randn(b, h, sq, dv, generator=g).to(dtype)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    out = fusedattn.attention(q, k, v, is_causal=causal, window=window, softcap=softcap, sinks=sinks, enable_gqa=h != hk)
    got = torch.autograd.grad(out, leaves, do)
    want = attention_ref_grads(q.detach(), k.detach(), v.detach(), do, causal=causal, window=window, softcap=softcap, sinks=None if sinks is None else sinks.detach())
    tol = 2e-3 if dtype == torch.float32 else 6e-2
    for name, a, w in zip("qkvs", got, want):
        err = (a.double() - w.double()).abs().max().item() / max(1.0, w.double().abs().max().item())
        if not err < tol or not torch.isfinite(a).all():
            bad += 1
            print("BAD", name, err, dict(b=b,h=h,hk=hk,sq=sq,sk=sk,d=d,dv=dv,dtype=dtype,causal=causal,window=window,softcap=softcap,sinks=sinks is not None))
print("bad", bad)
