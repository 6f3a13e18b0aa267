import os, random, sys, traceback
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fusedattn import attention, attention_varlen, attention_with_kvcache
from fusedattn.reference import attention_ref, attention_ref_grads

seed0 = int(sys.argv[1]); n = int(sys.argv[2])
for case in range(seed0, seed0 + n):
    r = random.Random(case)
    B = r.choice([1, 2, 3]); Hkv = r.choice([1, 2, 3]); grp = r.choice([1, 2, 3]); H = Hkv * grp
    Sq = r.choice([1, 2, 7, 16, 33, 64, 65, 100, 129]); Sk = r.choice([1, 3, 16, 31, 64, 97, 130])
    D = r.choice([16, 24, 32, 40, 64, 72, 80, 96, 128]); Dv = r.choice([D, D, 16, 32, 64]) if D >= 32 else D
    dtype = r.choice([torch.float32, torch.bfloat16, torch.float16])
    causal = r.random() < 0.5
    window = None
    if r.random() < 0.3:
        window = (r.choice([None, 0, 1, 5, 40]), r.choice([None, 0, 3, 50]))
    softcap = r.choice([None, None, 10.0])
    use_sinks = r.random() < 0.25
    lse = r.random() < 0.3
    layout = r.choice(["bhsd", "bshd"])
    g = torch.Generator().manual_seed(case)
    def mk(h, s, d):
        t = torch.randn(B, h, s, d, generator=g)
        if layout == "bshd":
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        return t.to(dtype).requires_grad_()
    q, k, v = mk(H, Sq, D), mk(Hkv, Sk, D), mk(Hkv, Sk, Dv)
    sinks = torch.randn(H, generator=g).requires_grad_() if use_sinks else None
    desc = dict(case=case, B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv, dtype=str(dtype), causal=causal, window=window, softcap=softcap, sinks=use_sinks, lse=lse, layout=layout)
    try:
        res = attention(q, k, v, is_causal=causal, enable_gqa=grp > 1, window=window, softcap=softcap, sinks=sinks, return_lse=lse)
    except Exception as e:
        print("RAISE", desc, type(e).__name__, str(e)[:200], flush=True); continue
    out = res[0] if lse else res
    ref = attention_ref(q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks)
    tol = 2e-3 if dtype == torch.float32 else 4e-2
    mag = max(float(ref.abs().max()), 1.0)
    err = float((out.double() - ref).abs().max()) / mag if out.numel() else 0.0
    dout = torch.randn(out.shape, generator=g).to(dtype)
    try:
        grads = torch.autograd.grad(out, [q, k, v] + ([sinks] if use_sinks else []), dout)
    except Exception as e:
        print("BWD-RAISE", desc, type(e).__name__, str(e)[:200], flush=True); continue
    refg = attention_ref_grads(q, k, v, dout, causal=causal, window=window, softcap=softcap, sinks=sinks)
    gerr = []
    for a, b in zip(grads, refg):
        m = max(float(b.abs().max()), 1.0)
        gerr.append(float((a.double() - b).abs().max()) / m if a.numel() else 0.0)
    bad = err > tol or any(x > 4 * tol for x in gerr) or not torch.isfinite(out).all()
    print(("BAD " if bad else "ok  "), desc, f"fwd={err:.2e}", "bwd=" + ",".join(f"{x:.1e}" for x in gerr), flush=True)
