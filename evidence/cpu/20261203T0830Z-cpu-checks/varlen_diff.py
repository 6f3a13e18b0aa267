import os, random, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import fusedattn
from fusedattn.reference import varlen_ref, varlen_ref_grads
from fusedattn_lab.verify import check
rng = random.Random(int(sys.argv[1]))
bad = 0
for case in range(int(sys.argv[2])):
    n = rng.choice([1, 2, 4]); hk = rng.choice([1, 2]); h = hk * rng.choice([1, 2])
    lq = [rng.choice([0, 1, 5, 17, 33]) for _ in range(n)]
    same = rng.random() < 0.6
    lk = lq[:] if same else [rng.choice([0, 1, 9, 40]) for _ in range(n)]
    if sum(lq) == 0: lq[0] = 3
    if sum(lk) == 0: lk[0] = 3
    d = rng.choice([16, 32, 48]); dtype = rng.choice([torch.float32, torch.bfloat16])
    causal = rng.random() < 0.5
    window = rng.choice([None, (rng.randint(0, 10), rng.choice([None, 0, 4]))])
    softcap = rng.choice([None, rng.uniform(1, 30)])
    grad = rng.random() < 0.4
    cuq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cuk = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    g = torch.Generator().manual_seed(case)
    q = torch.randn(sum(lq), h, d, generator=g).to(dtype).requires_grad_(grad)
    k = torch.randn(sum(lk), hk, d, generator=g).to(dtype).requires_grad_(grad)
    v = torch.randn(sum(lk), hk, d, generator=g).to(dtype).requires_grad_(grad)
    opts = dict(causal=causal, window=window, softcap=softcap)
    try:
        out = fusedattn.attention_varlen(q, k, v, cuq, cuk, max(lq), max(lk), is_causal=causal, window=window, softcap=softcap)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:150], lq, lk); bad += 1; continue
    ref = varlen_ref(q, k, v, cuq, cuk, **opts)
    r = check(out, ref, peer_error=None if dtype == torch.float32 else 8e-3)
    ok = r.ok
    if grad and ok:
        do = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), do)
        want = varlen_ref_grads(q, k, v, do, cuq, cuk, **opts)
        tol = 2e-3 if dtype == torch.float32 else 6e-2
        for a, w in zip(got, want):
            if a.numel() and not ((a.double() - w.double()).abs().max() / max(1.0, w.double().abs().max().item())) < tol:
                ok = False
    if not ok:
        bad += 1
        print("BAD", r.reasons[:1], dict(lq=lq, lk=lk, h=h, hk=hk, d=d, dtype=dtype, grad=grad, **opts))
print("bad", bad)
