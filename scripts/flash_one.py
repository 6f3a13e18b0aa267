"""One bench problem, one provider, run once more inside the NVTX range `measured`, for
`ncu --nvtx --nvtx-include measured/` (warm-up and autotuning stay outside the range).

    python3 scripts/flash_one.py SUITE 'LABEL TEXT' PROVIDER
e.g. python3 scripts/flash_one.py bf16 'S8192 D64 causal' flash
"""

import sys

import torch

from fusedattn_lab.registry import VERSIONS
from fusedattn_lab.suites import _inputs, check_suite

suite, match, provider = sys.argv[1:4]
problem = next(p for p in check_suite(suite) if match in p.label())
q, k, v = _inputs(problem, 0)
torch.backends.cuda.matmul.allow_tf32 = problem.precision == "tf32"
call = VERSIONS[provider].batched(q, k, v, problem.causal, problem.precision)
call()
call()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("measured")
call()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print(f"{provider} on {problem.label()}: ran once inside NVTX range 'measured'")
