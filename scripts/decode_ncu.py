"""One decode call profiled: `attention_with_kvcache` on e4m3 caches or on the same values in
bf16 (B32 H32/8, one query over 8192 keys, factors per head), called three times, for
`ncu` to profile the last call's split kernel (issue 34's FP8 decode: 4-12x the bf16
decode's time in bench 025121Z, before the GQA group was packed; ncu 0447Z after).

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats -k regex:_flash_fwd \\
        --launch-skip 2 --launch-count 1 python3 scripts/decode_ncu.py fp8 128
"""

import sys

import torch

from fusedattn import attention_with_kvcache
from fusedattn.problem import FP8


def main() -> None:
    kind, dim = sys.argv[1], int(sys.argv[2])
    g = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(32, n, s, dim, device="cuda", generator=g)
         for n, s in ((32, 1), (8, 8192), (8, 8192))]
    factors = [t.abs().amax(dim=(0, 2, 3)) / 256 for t in x]
    q8, k8, v8 = ((t / f.reshape(-1, 1, 1)).to(FP8) for t, f in zip(x, factors, strict=True))
    lengths = torch.full((32,), 8192, dtype=torch.int32, device="cuda")
    if kind == "fp8":
        call = lambda: attention_with_kvcache(  # noqa: E731
            q8, k8, v8, cache_seqlens=lengths, check_lengths=False, descale_q=factors[0],
            descale_k=factors[1], descale_v=factors[2])
    else:
        q, k, v = ((t.float() * f.reshape(-1, 1, 1)).to(torch.bfloat16) for t, f in
                   zip((q8, k8, v8), factors, strict=True))
        call = lambda: attention_with_kvcache(  # noqa: E731
            q, k, v, cache_seqlens=lengths, check_lengths=False)
    for _ in range(3):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
