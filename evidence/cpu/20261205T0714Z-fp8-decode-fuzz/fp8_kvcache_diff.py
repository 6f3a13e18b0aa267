"""A differential fuzz of FP8 decode (`attention_with_kvcache` on e4m3 q, caches and new
keys) on both kernels: `tiles.fp8_decode` (FUSEDATTN_FP8_DECODE=1's) and `_flash_fwd`, each
call against the float64 reference of the dequantised values, bounded as tests/test_fp8.py
bounds it (twice the FP8 formula's error by torch, `peers.fp8_peer`, plus the check's
floor), and the appended bytes where they belong. Emulation (the interpreter).

    python3 fp8_kvcache_diff.py SEED CASES
"""
import dataclasses
import os
import random
import sys

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn import configs  # noqa: E402
from fusedattn.reference import attention_ref, dequantize  # noqa: E402
from fusedattn_lab.peers import fp8_peer  # noqa: E402
from fusedattn_lab.verify import check  # noqa: E402

FP8 = torch.float8_e4m3fn
rng = random.Random(int(sys.argv[1]))
bad = served = 0
for case in range(int(sys.argv[2])):
    kernel = rng.choice(["fp8_decode", "flash_fwd"])
    configs.OVERRIDES = dataclasses.replace(configs.OVERRIDES,
                                            fp8_decode=kernel == "fp8_decode")
    B = rng.choice([1, 2, 3]); hk = rng.choice([1, 2]); h = hk * rng.choice([1, 2, 4, 8])
    d = rng.choice([64, 64, 128, 256]); cap = rng.choice([16, 40, 64])
    s_new = rng.choice([0, 0, 1, 3])
    sq = rng.choice([1, 1, 2, 5]) if s_new == 0 else rng.choice([1, s_new])
    paged = rng.random() < 0.4
    block = rng.choice([8, 16]) if paged else None
    if paged:
        cap = block * rng.choice([2, 4])
    lens = [rng.randint(0, cap - s_new) for _ in range(B)]
    if sum(n + s_new for n in lens) == 0:
        lens[0] = 1
    causal = rng.random() < 0.7
    window = rng.choice([None, (rng.randint(0, 20), rng.choice([None, 0, 3]))])
    softcap = rng.choice([None, rng.uniform(1, 30)])
    sinks = torch.randn(h) if rng.random() < 0.3 else None
    splits = rng.choice([None, 1, 3])
    unchecked = rng.random() < 0.3  # check_lengths=False: a kept plan, replayed below
    kind = rng.choice([None, "tensor", "head"])
    if kind is None:
        dq = dk = dv = None
    elif kind == "tensor":
        dq, dk, dv = (torch.tensor(rng.uniform(0.1, 2.0)) for _ in range(3))
    else:
        dq = torch.rand(h) * 2 + 0.1
        dk, dv = (torch.rand(hk) * 2 + 0.1 for _ in range(2))
    g = torch.Generator().manual_seed(case)

    def e4m3(*shape):
        return (torch.randn(*shape, generator=g) * 2).to(FP8)

    q = e4m3(B, h, sq, d)
    if paged:
        nblocks = B * (cap // block) + 2
        bt = torch.randperm(nblocks, generator=g)[:B * (cap // block)].reshape(
            B, cap // block).to(torch.int32)
        kc, vc = e4m3(nblocks, hk, block, d), e4m3(nblocks, hk, block, d)
    else:
        kc, vc, bt = e4m3(B, hk, cap, d), e4m3(B, hk, cap, d), None
    kn = e4m3(B, hk, s_new, d) if s_new else None
    vn = e4m3(B, hk, s_new, d) if s_new else None

    def dense(cache, b):
        if not paged:
            return cache[b]
        return cache[bt[b].long()].permute(1, 0, 2, 3).reshape(hk, -1, d)

    before = [(dense(kc, b).clone(), dense(vc, b).clone()) for b in range(B)]
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = dict(cache_seqlens=sl, k_new=kn, v_new=vn, block_table=bt, is_causal=causal,
              window=window, softcap=softcap, sinks=sinks, splits=splits,
              descale_q=dq, descale_k=dk, descale_v=dv, check_lengths=not unchecked)
    try:
        out = fusedattn.attention_with_kvcache(q, kc, vc, **kw)
        if unchecked:  # the same call again replays the kept plans (the append's too)
            out = fusedattn.attention_with_kvcache(q, kc, vc, **kw)
    except Exception as e:  # noqa: BLE001
        print("RAISED", kernel, type(e).__name__, str(e)[:150]); bad += 1; continue
    rows = sq * h // hk
    served += kernel == "fp8_decode" and rows <= 32
    for b in range(B):
        n = lens[b]
        kk = torch.cat([before[b][0][:, :n], kn[b]] if s_new else [before[b][0][:, :n]], dim=1)
        vv = torch.cat([before[b][1][:, :n], vn[b]] if s_new else [before[b][1][:, :n]], dim=1)
        opts = dict(causal=causal, align="bottom-right", window=window, softcap=softcap,
                    sinks=sinks)
        ref = attention_ref(dequantize(q[b], dq), dequantize(kk, dk), dequantize(vv, dv), **opts)
        peer = fp8_peer(q[b], kk, vv, dq, dk, dv, **opts)
        r = check(out[b], ref, peer_error=float((peer.double() - ref).abs().max()))
        app_ok = True
        if s_new:
            now = [dense(c, b)[:, n:n + s_new] for c in (kc, vc)]
            app_ok = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                         for x, y in zip(now, (kn[b], vn[b])))
        if not r.ok or not app_ok:
            bad += 1
            print("BAD", kernel, r.reasons[:1], app_ok, dict(
                B=B, h=h, hk=hk, sq=sq, s_new=s_new, d=d, cap=cap, paged=paged, block=block,
                lens=lens, causal=causal, window=window, softcap=softcap,
                sinks=sinks is not None, splits=splits, descale=kind, unchecked=unchecked))
            break
    print(case, kernel, f"rows={rows}", "ok" if r.ok and app_ok else "BAD", flush=True)
print("bad", bad, "served by fp8_decode", served)
