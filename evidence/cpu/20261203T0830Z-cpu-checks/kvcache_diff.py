import os, random, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import fusedattn
from fusedattn.reference import attention_ref
from fusedattn_lab.verify import check
rng = random.Random(int(sys.argv[1]))
bad = 0
for case in range(int(sys.argv[2])):
    B = rng.choice([1, 2, 3]); hk = rng.choice([1, 2]); h = hk * rng.choice([1, 2, 4])
    d = rng.choice([16, 32, 64]); cap = rng.choice([16, 40, 64])
    s_new = rng.choice([0, 0, 1, 3])
    sq = rng.choice([1, 1, 2, 5]) if s_new == 0 else rng.choice([1, s_new])
    paged = rng.random() < 0.4
    block = rng.choice([8, 16]) if paged else None
    if paged:
        cap = block * rng.choice([2, 4])
    lens = [rng.randint(0, cap - s_new) for _ in range(B)]
    if sum(l + s_new for l in lens) == 0:
        lens[0] = 1
    causal = rng.random() < 0.7
    window = rng.choice([None, (rng.randint(0, 20), rng.choice([None, 0, 3]))])
    softcap = rng.choice([None, rng.uniform(1, 30)])
    sinks = torch.randn(h) if rng.random() < 0.3 else None
    splits = rng.choice([None, 1, 3])
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    g = torch.Generator().manual_seed(case)
    q = torch.randn(B, h, sq, d, generator=g).to(dtype)
    if paged:
        nblocks = B * (cap // block) + 2
        perm = torch.randperm(nblocks, generator=g)[:B * (cap // block)].reshape(B, cap // block).to(torch.int32)
        kc = torch.randn(nblocks, hk, block, d, generator=g).to(dtype); vc = torch.randn(nblocks, hk, block, d, generator=g).to(dtype)
        bt = perm
    else:
        kc = torch.randn(B, hk, cap, d, generator=g).to(dtype); vc = torch.randn(B, hk, cap, d, generator=g).to(dtype); bt = None
    kn = torch.randn(B, hk, s_new, d, generator=g).to(dtype) if s_new else None
    vn = torch.randn(B, hk, s_new, d, generator=g).to(dtype) if s_new else None
    # the dense view of each sequence's keys before the call
    def dense(cache, b):
        if not paged:
            return cache[b]
        return cache[bt[b].long()].permute(1, 0, 2, 3).reshape(hk, -1, d)
    before = [(dense(kc, b).clone(), dense(vc, b).clone()) for b in range(B)]
    sl = torch.tensor(lens, dtype=torch.int32)
    try:
        out = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=sl, k_new=kn, v_new=vn, block_table=bt, is_causal=causal, window=window, softcap=softcap, sinks=sinks, splits=splits)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:150]); bad += 1; continue
    for b in range(B):
        n = lens[b]
        kk = torch.cat([before[b][0][:, :n], kn[b]] if s_new else [before[b][0][:, :n]], dim=1)
        vv = torch.cat([before[b][1][:, :n], vn[b]] if s_new else [before[b][1][:, :n]], dim=1)
        ref = attention_ref(q[b], kk, vv, causal=causal, align="bottom-right", window=window, softcap=softcap, sinks=sinks)
        r = check(out[b], ref, peer_error=None if dtype == torch.float32 else (1e-3 if dtype == torch.float16 else 8e-3))
        # the cache holds the appended rows
        app_ok = True
        if s_new:
            now = dense(kc, b)[:, n:n + s_new]
            app_ok = torch.equal(now, kn[b])
        if not r.ok or not app_ok:
            bad += 1
            print("BAD", r.reasons[:1], app_ok, dict(B=B, h=h, hk=hk, sq=sq, s_new=s_new, d=d, cap=cap, paged=paged, block=block, lens=lens, causal=causal, window=window, softcap=softcap, sinks=sinks is not None, splits=splits, dtype=dtype))
            break
print("bad", bad)
