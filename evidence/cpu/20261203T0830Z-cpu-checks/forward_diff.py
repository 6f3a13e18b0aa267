import os, random, math, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import fusedattn
from fusedattn.reference import attention_ref, varlen_ref
from fusedattn_lab.verify import check

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
bad = 0
for case in range(int(sys.argv[2]) if len(sys.argv) > 2 else 60):
    b = rng.choice([1, 2]); hk = rng.choice([1, 2]); h = hk * rng.choice([1, 2, 3])
    sq = rng.choice([1, 2, 7, 16, 33, 64, 100]); sk = rng.choice([1, 3, 16, 31, 64, 129])
    d = rng.choice([8, 16, 24, 40, 64, 72, 96, 128]); dv = rng.choice([d, d, 16, 32])
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    causal = rng.random() < 0.5
    window = rng.choice([None, None, (rng.randint(0, 40), rng.choice([None, rng.randint(0, 40)])), (None, rng.randint(0, 20))])
    softcap = rng.choice([None, None, rng.uniform(0.5, 50)])
    scale = rng.choice([None, None, rng.uniform(0.01, 3)])
    sinks = torch.randn(h) * 2 if rng.random() < 0.3 else None
    g = torch.Generator().manual_seed(case)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, sk, dv, generator=g).to(dtype)
    opts = dict(is_causal=causal, window=window, softcap=softcap, scale=scale, sinks=sinks)
    try:
        out, lse = fusedattn.attention(q, k, v, enable_gqa=h != hk, return_lse=True, **opts)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:120], dict(b=b,h=h,hk=hk,sq=sq,sk=sk,d=d,dv=dv,dtype=dtype,**{k_: v_ for k_, v_ in opts.items() if k_ != 'sinks'}))
        continue
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale, sinks=sinks, return_lse=True)
    r = check(out, ref, peer_error=None if dtype == torch.float32 else (1e-3 if dtype == torch.float16 else 8e-3))
    seen = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse).cpu(), seen.cpu()) and ((lse.double().cpu() - ref_lse.cpu())[seen.cpu()].abs().max().item() if seen.any() else 0) < 1e-2
    if not r.ok or not lse_ok:
        bad += 1
        print("BAD", r.reasons, lse_ok, dict(b=b,h=h,hk=hk,sq=sq,sk=sk,d=d,dv=dv,dtype=dtype,**{k_: v_ for k_, v_ in opts.items() if k_ != 'sinks'}), "sinks" if sinks is not None else "")
print("bad", bad)
