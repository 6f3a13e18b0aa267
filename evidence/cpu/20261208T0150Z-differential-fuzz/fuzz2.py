import os, random, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fusedattn import attention_varlen, attention_with_kvcache
from fusedattn.reference import varlen_ref, varlen_ref_grads, attention_ref

seed0 = int(sys.argv[1]); n = int(sys.argv[2])
for case in range(seed0, seed0 + n):
    r = random.Random(case)
    g = torch.Generator().manual_seed(case)
    dtype = r.choice([torch.float32, torch.bfloat16, torch.float16])
    Hkv = r.choice([1, 2]); grp = r.choice([1, 2, 4]); H = Hkv * grp
    D = r.choice([16, 32, 48, 64, 80, 128]); Dv = r.choice([D, D, 16, 32])
    causal = r.random() < 0.6
    window = (r.choice([None, 0, 4, 33]), r.choice([None, 0, 7])) if r.random() < 0.3 else None
    softcap = r.choice([None, None, 5.0])
    tol = 2e-3 if dtype == torch.float32 else 4e-2
    if r.random() < float(os.environ.get('VARLEN_SHARE', '0.5')):
        nb = r.choice([1, 2, 3, 5])
        lq = [r.choice([0, 1, 2, 17, 64, 70]) for _ in range(nb)]
        lk = [x if r.random() < 0.5 else r.choice([0, 1, 5, 40, 90]) for x in lq]
        if causal:  # bottom-right causal needs nothing special
            pass
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0).tolist()), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0).tolist()), dtype=torch.int32)
        q = torch.randn(sum(lq), H, D, generator=g).to(dtype).requires_grad_()
        k = torch.randn(sum(lk), Hkv, D, generator=g).to(dtype).requires_grad_()
        v = torch.randn(sum(lk), Hkv, Dv, generator=g).to(dtype).requires_grad_()
        desc = dict(kind="varlen", case=case, lq=lq, lk=lk, H=H, Hkv=Hkv, D=D, Dv=Dv, dtype=str(dtype), causal=causal, window=window, softcap=softcap)
        try:
            out = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), is_causal=causal, window=window, softcap=softcap)
        except Exception as e:
            print("RAISE", desc, type(e).__name__, str(e)[:300], flush=True); continue
        kk, vv = (t.repeat_interleave(grp, dim=1) for t in (k, v))
        ref = varlen_ref(q, kk, vv, cu_q, cu_k, causal=causal, window=window, softcap=softcap)
        mag = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
        err = float((out.detach().double() - ref).abs().max()) / mag if out.numel() else 0.0
        gerr = []
        if out.numel():
            dout = torch.randn(out.shape, generator=g).to(dtype)
            try:
                grads = torch.autograd.grad(out, [q, k, v], dout, allow_unused=True)
            except Exception as e:
                print("BWD-RAISE", desc, type(e).__name__, str(e)[:300], flush=True); continue
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            refo = varlen_ref(qd, kd.repeat_interleave(grp, dim=1), vd.repeat_interleave(grp, dim=1), cu_q, cu_k, causal=causal, window=window, softcap=softcap)
            refg = varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=causal, window=window, softcap=softcap)
            for a, b in zip(grads, refg):
                b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
                m = max(float(b.abs().max()) if b.numel() else 0.0, 1.0)
                gerr.append(float((a.double() - b).abs().max()) / m if a.numel() else 0.0)
        bad = err > tol or any(x > 4 * tol for x in gerr)
        print(("BAD " if bad else "ok  "), desc, f"fwd={err:.2e}", "bwd=" + ",".join(f"{x:.1e}" for x in gerr), flush=True)
    else:
        B = r.choice([1, 2, 3]); S = r.choice([1, 2, 5]); cap = r.choice([64, 128, 320] if r.random() < 0.7 else [40, 130, 300])
        page = r.choice([None, 16, 64])
        lens = [r.randint(0, cap - S) for _ in range(B)]
        kc = torch.randn(B, Hkv, cap, D, generator=g).to(dtype)
        vc = torch.randn(B, Hkv, cap, Dv, generator=g).to(dtype)
        q = torch.randn(B, H, S, D, generator=g).to(dtype)
        kn = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
        vn = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
        sinks = torch.randn(H, generator=g) if r.random() < 0.3 else None
        lengths = torch.tensor(lens, dtype=torch.int32)
        desc = dict(kind="kvcache", case=case, B=B, S=S, cap=cap, lens=lens, H=H, Hkv=Hkv, D=D, Dv=Dv, dtype=str(dtype), causal=causal, window=window, softcap=softcap, sinks=sinks is not None)
        k_full, v_full = kc.clone(), vc.clone()
        for b in range(B):
            k_full[b, :, lens[b]:lens[b] + S] = kn[b]; v_full[b, :, lens[b]:lens[b] + S] = vn[b]
        try:
            if page is not None and cap % page == 0:
                from inputs import paged
                pk, table = paged(kc, page, 2, case); pv, _ = paged(vc, page, 2, case)
                out = attention_with_kvcache(q, pk, pv, cache_seqlens=lengths, k_new=kn, v_new=vn, block_table=table, is_causal=causal, window=window, softcap=softcap, sinks=sinks)
                from fusedattn.reference import paged_to_dense
                kc = torch.stack(paged_to_dense(pk, table, torch.full((B,), cap, dtype=torch.int32)))
                vc = torch.stack(paged_to_dense(pv, table, torch.full((B,), cap, dtype=torch.int32)))
                desc["paged"] = page
            else:
                out = attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k_new=kn, v_new=vn, is_causal=causal, window=window, softcap=softcap, sinks=sinks)
        except Exception as e:
            print("RAISE", desc, type(e).__name__, str(e)[:300], flush=True); continue
        err = 0.0
        for b in range(B):
            n = lens[b] + S
            kk = k_full[b:b+1, :, :n].repeat_interleave(grp, dim=1); vv = v_full[b:b+1, :, :n].repeat_interleave(grp, dim=1)
            ref = attention_ref(q[b:b+1], kk, vv, causal=causal, align="bottom-right", window=window, softcap=softcap, sinks=sinks)
            mag = max(float(ref.abs().max()), 1.0)
            err = max(err, float((out[b:b+1].double() - ref).abs().max()) / mag)
        cache_ok = torch.equal(kc, k_full) and torch.equal(vc, v_full)
        print(("BAD " if err > tol or not cache_ok else "ok  "), desc, f"fwd={err:.2e} cache={cache_ok}", flush=True)
