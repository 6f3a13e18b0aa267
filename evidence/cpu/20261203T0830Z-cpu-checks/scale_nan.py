"""A large scale against the float64 reference (emulation): NaN rows before 1654fc0."""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import fusedattn
from fusedattn.problem import ProblemError
from fusedattn.reference import attention_ref

q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)).half()
           for i in range(3))
for s in (1e30, 3e38, 1e300):
    try:
        o = fusedattn.attention(q, k, v, scale=s)
        r = attention_ref(q, k, v, scale=s)
        print(f"scale {s:g}: NaN rows {bool(o.float().isnan().any())}, "
              f"max error {(o.double() - r).abs().max().item():.3g}")
    except ProblemError as e:
        print(f"scale {s:g}: refused: {e}")
