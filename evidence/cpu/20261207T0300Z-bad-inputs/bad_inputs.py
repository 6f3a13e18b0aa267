"""The input fuzz of evidence/cpu/20261203T0830Z-cpu-checks/input_fuzz.py (116 bad calls,
run as it stands, its own report), then the calls it lacks, through its `tryit`: "PE" is a
fusedattn ProblemError, "ok" a call that ran, anything else (listed by BAD3) a defect.
Its "meta" case is float16, which never reaches autocast's question; the fp32 ones do."""
import runpy
from pathlib import Path

OLD = Path(__file__).resolve().parents[1] / "20261203T0830Z-cpu-checks/input_fuzz.py"
g = runpy.run_path(str(OLD))  # (sets TRITON_INTERPRET first, as this needs)
tryit, bad, T, torch, fusedattn = g["tryit"], g["bad"], g["T"], g["torch"], g["fusedattn"]
bad.clear()
A, V, KV = fusedattn.attention, fusedattn.attention_varlen, fusedattn.attention_with_kvcache
f32 = torch.float32
m, mp = T(1, 2, 8, 16, dt=f32).to("meta"), T(8, 2, 16, dt=f32).to("meta")
qp, kc, qd = T(8, 2, 16), T(1, 2, 8, 16), T(1, 2, 1, 16)
cu = torch.tensor([0, 5, 8], dtype=torch.int32)
one = torch.tensor([3], dtype=torch.int32)
cases3 = {
    "fp32 meta": lambda: A(m, m, m),
    "v fp32 meta": lambda: V(mp, mp, mp, cu, cu, 5, 5),
    "kv fp32 meta": lambda: KV(m[:, :, :1], m, m, cache_seqlens=one.to("meta")),
    "v one offset": lambda: V(qp, qp, qp, cu[:1], cu[:1], 8, 8),
    "v q/k offsets of two counts": lambda: V(qp, qp, qp, cu, cu[::2], 8, 8),
    "v max True": lambda: V(qp, qp, qp, cu, cu, True, 8),
    "kv window int": lambda: KV(qd, kc, kc.clone(), cache_seqlens=one, window=5),
    "kv cache fp32, q fp16": lambda: KV(qd, kc.float(), kc.float(), cache_seqlens=one),
    "kv sl float": lambda: KV(qd, kc, kc.clone(), cache_seqlens=one.float()),
    "warmup dim -1": lambda: fusedattn.warmup(head_dims=(-1,), heads=(8,)),
    "warmup dtype int8": lambda: fusedattn.warmup(head_dims=(64,), heads=(8,),
                                                  dtypes=("int8",)),
    "warmup heads 0": lambda: fusedattn.warmup(head_dims=(64,), heads=(0,)),
    "warmup heads str": lambda: fusedattn.warmup(head_dims=(64,), heads="8"),
}
print({n: tryit(n, f) for n, f in cases3.items()})
for key, items in bad.items():
    print("BAD3", key, items[:3])
