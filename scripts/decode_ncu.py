"""One decode call profiled: `attention_with_kvcache` on e4m3 caches or on the same values in
bf16 (the serving bench's fp8-decode inputs: B32 H32/8, one query over 8192 keys, factors
per head; before 2026-12-05 05:40 its own copy of them), called three times, for
`ncu` to profile the last call's split kernel (issue 34's FP8 decode: 4-12x the bf16
decode's time in bench 025121Z, before the GQA group was packed; ncu 0447Z after).

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats -k 'regex:_flash_fwd|_fp8_decode' \\
        --launch-skip 2 --launch-count 1 python3 scripts/decode_ncu.py fp8 128
"""

import sys

import torch

from fusedattn import attention_with_kvcache
from fusedattn.tiles.dequantize import dequantize_as
from fusedattn_lab.serving import ServingProblem, _fp8_inputs


def main() -> None:
    kind, dim = sys.argv[1], int(sys.argv[2])
    p = ServingProblem("fp8-decode", 32, 32, 8, 1, 8192, dim)  # the bench's fp8-decode row
    (q8, k8, v8), factors, _, _ = _fp8_inputs(p, torch.Generator(device="cuda").manual_seed(0))
    lengths = torch.full((p.batch,), p.seq_k, dtype=torch.int32, device="cuda")
    if kind == "fp8":
        call = lambda: attention_with_kvcache(  # noqa: E731
            q8, k8, v8, cache_seqlens=lengths, check_lengths=False, descale_q=factors[0],
            descale_k=factors[1], descale_v=factors[2])
    else:
        q, k, v = (dequantize_as(t, f, torch.bfloat16) for t, f in
                   zip((q8, k8, v8), factors, strict=True))
        call = lambda: attention_with_kvcache(  # noqa: E731
            q, k, v, cache_seqlens=lengths, check_lengths=False)
    for _ in range(3):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
