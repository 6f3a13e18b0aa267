"""FP8 (e4m3) values dequantised into bfloat16 or float32 for the FP8 backward (`fp8`),
one pass: a float8 tensor has 256 codes, so a head's dequantised values are a table of 256,
made by `reference.dequantize` itself (the product in float64, rounded once to the target
dtype) and read by one gather launch. The result is bit for bit `dequantize(t,
descale).to(dtype)`, without that route's float64 tensors: it moves about 35 bytes an
element (1 read, float64 written and read twice, 2 written), this 3 (bf16) or 5 (fp32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedattn.launch import settle_keys
from fusedattn.mode import kernel_launches

BLOCK = 1024  # elements per program


@triton.jit
def _lookup(p_codes, p_table, p_out, n, per_head, heads, BLOCK: tl.constexpr):
    """out[i] = table[head of i, codes[i]] over a contiguous tensor of n elements, head
    (i // per_head) % heads (a `[..., H, S, D]` tensor: per_head = S * D)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    code = tl.load(p_codes + offs, mask=inside, other=0).to(tl.int64)
    head = (offs // per_head) % heads
    tl.store(p_out + offs, tl.load(p_table + head * 256 + code, mask=inside), mask=inside)


def dequantize_as(t: torch.Tensor, descale: torch.Tensor | None, dtype: torch.dtype,
                  head_axis: int = -3) -> torch.Tensor:
    """`reference.dequantize(t, descale).to(dtype)` (a float8_e4m3fn tensor `[..., H, S, D]`,
    `descale` None, one element or `[H]`), contiguous, in one launch: the same bits.
    `head_axis=-2`: the heads of a packed `[total, H, D]` tensor (varlen's)."""
    from fusedattn.reference import dequantize

    heads = descale.numel() if descale is not None else 1
    codes = torch.arange(256, dtype=torch.uint8, device=t.device).view(t.dtype)
    table = dequantize(codes.reshape(1, 256, 1).expand(heads, 256, 1), descale)
    table = table.to(dtype).reshape(heads, 256).contiguous()
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    n = t.numel()
    if n:
        per_head = math.prod(t.shape[head_axis + 1:]) if t.dim() >= -head_axis else 1
        with kernel_launches():
            _lookup[(triton.cdiv(n, BLOCK),)](t.view(torch.uint8), table, out, n,
                                             max(per_head, 1), heads, BLOCK=BLOCK)
    return out


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
