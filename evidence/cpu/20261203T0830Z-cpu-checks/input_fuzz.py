import os, itertools, random, traceback, math
os.environ["TRITON_INTERPRET"] = "1"
import torch
import fusedattn
from fusedattn.problem import ProblemError

bad = {}
def tryit(label, fn):
    try:
        fn()
        return "ok"
    except ProblemError:
        return "PE"
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        key = (type(e).__name__, tb.filename.split("site-packages/")[-1].split("main/")[-1], tb.lineno)
        bad.setdefault(key, []).append((label, str(e)[:160]))
        return type(e).__name__

T = lambda *s, dt=torch.float16: torch.randn(*s).to(dt)
q = T(1, 2, 8, 16); k = T(1, 2, 8, 16); v = T(1, 2, 8, 16)
A = fusedattn.attention
cases = {
  "q list": lambda: A([1], k, v),
  "q int": lambda: A(q.int(), k, v),
  "q 1d": lambda: A(T(16), T(16), T(16)),
  "q 5d": lambda: A(T(1,1,2,8,16), T(1,1,2,8,16), T(1,1,2,8,16)),
  "mixed dtype": lambda: A(q, k.float(), v),
  "bf16 v": lambda: A(q, k, v.bfloat16()),
  "scale str": lambda: A(q, k, v, scale="a"),
  "scale nan": lambda: A(q, k, v, scale=float("nan")),
  "scale inf": lambda: A(q, k, v, scale=float("inf")),
  "scale 0": lambda: A(q, k, v, scale=0.0),
  "scale neg": lambda: A(q, k, v, scale=-1.0),
  "scale tensor": lambda: A(q, k, v, scale=torch.tensor(0.5)),
  "scale complex": lambda: A(q, k, v, scale=1j),
  "scale huge": lambda: A(q, k, v, scale=1e300),
  "window neg": lambda: A(q, k, v, window=(-1, 3)),
  "window float": lambda: A(q, k, v, window=(1.5, 2)),
  "window str": lambda: A(q, k, v, window=("a", 1)),
  "window 1": lambda: A(q, k, v, window=(None,)),
  "window int": lambda: A(q, k, v, window=5),
  "window 3": lambda: A(q, k, v, window=(1, 2, 3)),
  "window huge": lambda: A(q, k, v, window=(10**30, 2)),
  "window np": lambda: A(q, k, v, window=(__import__("numpy").int64(2), 2)),
  "window tensor": lambda: A(q, k, v, window=(torch.tensor(2), 2)),
  "window bool": lambda: A(q, k, v, window=(True, 2)),
  "softcap neg": lambda: A(q, k, v, softcap=-1.0),
  "softcap nan": lambda: A(q, k, v, softcap=float("nan")),
  "softcap str": lambda: A(q, k, v, softcap="x"),
  "softcap bool": lambda: A(q, k, v, softcap=True),
  "softcap 0": lambda: A(q, k, v, softcap=0.0),
  "precision bogus": lambda: A(q, k, v, precision="bogus"),
  "precision int": lambda: A(q, k, v, precision=5),
  "precision list": lambda: A(q, k, v, precision=["a"]),
  "causal str": lambda: A(q, k, v, is_causal="yes"),
  "causal None": lambda: A(q, k, v, is_causal=None),
  "causal tensor": lambda: A(q, k, v, is_causal=torch.tensor(True)),
  "gqa str": lambda: A(q, k, v, enable_gqa="y"),
  "lse 3": lambda: A(q, k, v, return_lse=3),
  "det str": lambda: A(q, k, v, deterministic="x"),
  "sinks wrong shape": lambda: A(q, k, v, sinks=torch.zeros(3)),
  "sinks 2d": lambda: A(q, k, v, sinks=torch.zeros(1, 2)),
  "sinks int": lambda: A(q, k, v, sinks=torch.zeros(2, dtype=torch.int32)),
  "sinks list": lambda: A(q, k, v, sinks=[0.0, 0.0]),
  "sinks nan": lambda: A(q, k, v, sinks=torch.tensor([float("nan"), 0.0])),
  "sinks inf": lambda: A(q, k, v, sinks=torch.tensor([float("inf"), 0.0])),
  "heads mismatch": lambda: A(q, T(1, 3, 8, 16), T(1, 3, 8, 16), enable_gqa=True),
  "batch mismatch": lambda: A(q, T(2, 2, 8, 16), T(2, 2, 8, 16)),
  "head dim mismatch": lambda: A(q, T(1, 2, 8, 32), T(1, 2, 8, 32)),
  "dv odd": lambda: A(q, k, T(1, 2, 8, 17)),
  "d odd": lambda: A(T(1,2,8,17), T(1,2,8,17), T(1,2,8,17)),
  "d 1": lambda: A(T(1,2,8,1), T(1,2,8,1), T(1,2,8,1)),
  "d 1024": lambda: A(T(1,1,2,1024), T(1,1,2,1024), T(1,1,2,1024)),
  "kv len mismatch": lambda: A(q, k, T(1, 2, 9, 16)),
  "zero S": lambda: A(T(1,2,0,16), k, v),
  "zero B": lambda: A(T(0,2,8,16), T(0,2,8,16), T(0,2,8,16)),
  "stride0": lambda: A(T(1,1,1,16).expand(1,2,8,16), k, v),
  "transposed": lambda: A(T(1,8,2,16).transpose(1,2), k, v),
  "noncontig last": lambda: A(T(1,2,8,32)[..., ::2], k, v),
  "neg strides flip": lambda: A(q.flip(2), k, v),
  "meta": lambda: A(q.to("meta"), k.to("meta"), v.to("meta")),
  "fp8 no descale": lambda: A(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)),
  "descale on bf16": lambda: A(q, k, v, descale_q=torch.ones(1)),
  "fp8 e5m2": lambda: A(q.to(torch.float8_e5m2), k.to(torch.float8_e5m2), v.to(torch.float8_e5m2), descale_q=torch.ones(1,2), descale_k=torch.ones(1,2), descale_v=torch.ones(1,2)),
  "fp8 bad descale": lambda: A(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), descale_q=torch.ones(3,7), descale_k=torch.ones(1), descale_v=torch.ones(1)),
  "fp8 descale int": lambda: A(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), descale_q=torch.ones(1, dtype=torch.int32), descale_k=torch.ones(1), descale_v=torch.ones(1)),
  "fp8 descale list": lambda: A(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), descale_q=[1.0], descale_k=torch.ones(1), descale_v=torch.ones(1)),
  "fp8 descale nan": lambda: A(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), descale_q=torch.tensor([float('nan')]), descale_k=torch.ones(1), descale_v=torch.ones(1)),
  "fp8 grad": lambda: A(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), descale_q=torch.ones(1, requires_grad=True), descale_k=torch.ones(1), descale_v=torch.ones(1)),
  "complex": lambda: A(q.to(torch.complex64), k.to(torch.complex64), v.to(torch.complex64)),
  "float64": lambda: A(q.double(), k.double(), v.double()),
  "unknown kw": lambda: A(q, k, v, foo=1),
  "grad int backward": lambda: A(q.float().requires_grad_(), k.float(), v.float()).sum().backward(),
  "S 1 kv 1": lambda: A(T(1,2,1,16), T(1,2,1,16), T(1,2,1,16)),
  "nested": lambda: A(torch.nested.nested_tensor([T(2,8,16), T(2,4,16)]), k, v),
}
res = {n: tryit(n, f) for n, f in cases.items()}
print({n: r for n, r in res.items()})
for key, items in bad.items():
    print("BAD", key, items[:3])
bad.clear()
V = fusedattn.attention_varlen; KV = fusedattn.attention_with_kvcache
qp = T(10, 2, 16); cu = torch.tensor([0, 4, 10], dtype=torch.int32)
kc = T(2, 2, 16, 16); vc = T(2, 2, 16, 16); qd = T(2, 2, 1, 16); sl = torch.tensor([3, 16], dtype=torch.int32)
sp = lambda t: t.to_sparse()
nest = lambda: torch.nested.nested_tensor([T(2,8,16), T(2,4,16)])
cases2 = {
  "sparse q": lambda: A(sp(q), k, v),
  "sparse kv": lambda: A(q, sp(k), sp(v)),
  "nested q": lambda: A(nest(), k, v),
  "jagged q": lambda: A(torch.nested.nested_tensor([T(2,8,16), T(2,4,16)], layout=torch.jagged), k, v),
  "gqa str": lambda: A(q, k, v, enable_gqa="y"),
  "lse 3": lambda: A(q, k, v, return_lse=3),
  "lse 3 after": lambda: (A(q, k, v), A(q, k, v, return_lse=3)),
  "scale 1e31": lambda: A(q, k, v, scale=1e31),
  "v sparse": lambda: V(sp(qp), qp, qp, cu, cu, 6, 6),
  "v nested": lambda: V(nest(), qp, qp, cu, cu, 6, 6),
  "v lse": lambda: V(qp, qp, qp, cu, cu, 6, 6, return_lse="x"),
  "v lse after": lambda: (V(qp, qp, qp, cu, cu, 6, 6), V(qp, qp, qp, cu, cu, 6, 6, return_lse=2)),
  "v cu float": lambda: V(qp, qp, qp, cu.float(), cu, 6, 6),
  "v cu decreasing": lambda: V(qp, qp, qp, torch.tensor([0, 6, 4, 10], dtype=torch.int32), cu, 6, 6),
  "v cu last": lambda: V(qp, qp, qp, torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32), 6, 6),
  "v max small": lambda: V(qp, qp, qp, cu, cu, 2, 2),
  "v max str": lambda: V(qp, qp, qp, cu, cu, "6", 6),
  "v max neg": lambda: V(qp, qp, qp, cu, cu, -1, 6),
  "v cu 2d": lambda: V(qp, qp, qp, cu[None], cu, 6, 6),
  "v cu empty": lambda: V(qp, qp, qp, cu[:0], cu, 6, 6),
  "v cu int64": lambda: V(qp, qp, qp, cu.long(), cu.long(), 6, 6),
  "v check str": lambda: V(qp, qp, qp, cu, cu, 6, 6, check_lengths="x"),
  "v 4d": lambda: V(q, k, v, cu, cu, 6, 6),
  "kv ok": lambda: KV(qd, kc, vc, cache_seqlens=sl),
  "kv lse": lambda: KV(qd, kc, vc, cache_seqlens=sl, return_lse=1),
  "kv check 0": lambda: KV(qd, kc, vc, cache_seqlens=torch.tensor([3, 99], dtype=torch.int32), check_lengths=0),
  "kv sparse": lambda: KV(qd, sp(kc), sp(vc), cache_seqlens=sl, check_lengths=False),
  "kv sparse q": lambda: KV(sp(qd), kc, vc, cache_seqlens=sl, check_lengths=False),
  "kv over": lambda: KV(qd, kc, vc, cache_seqlens=torch.tensor([3, 17], dtype=torch.int32)),
  "kv neg": lambda: KV(qd, kc, vc, cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)),
  "kv k_new only": lambda: KV(qd, kc, vc, cache_seqlens=sl, k_new=T(2,2,1,16)),
  "kv new overflow": lambda: KV(qd, kc, vc, cache_seqlens=sl, k_new=T(2,2,1,16), v_new=T(2,2,1,16)),
  "kv new wrong S": lambda: KV(qd, kc, vc, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32), k_new=T(2,2,3,16), v_new=T(2,2,3,16)),
  "kv splits 0": lambda: KV(qd, kc, vc, cache_seqlens=sl, splits=0),
  "kv splits float": lambda: KV(qd, kc, vc, cache_seqlens=sl, splits=2.0),
  "kv sl int64": lambda: KV(qd, kc, vc, cache_seqlens=sl.long()),
  "kv sl 2d": lambda: KV(qd, kc, vc, cache_seqlens=sl[None]),
  "kv sl short": lambda: KV(qd, kc, vc, cache_seqlens=sl[:1]),
  "kv bt bad": lambda: KV(qd, kc, vc, cache_seqlens=sl, block_table=torch.tensor([[0],[9]], dtype=torch.int32)),
  "kv bt float": lambda: KV(qd, kc, vc, cache_seqlens=sl, block_table=torch.zeros(2,1)),
  "kv q 3d": lambda: KV(qd[0], kc, vc, cache_seqlens=sl),
  "kv q longer than cache": lambda: KV(T(2,2,20,16), kc, vc, cache_seqlens=sl),
  "kv causal str": lambda: KV(qd, kc, vc, cache_seqlens=sl, is_causal="no"),
}
res = {n: tryit(n, f) for n, f in cases2.items()}
print({n: r for n, r in res.items()})
for key, items in bad.items():
    print("BAD2", key, items[:3])
