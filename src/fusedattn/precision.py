"""Precision, resolved in one place: what the user asked for (`precision=` on fp32 inputs)
becomes what `tl.dot` uses, which tolerance row judges the result, and whether PyTorch's
peer runs its matmuls in TF32.

    None           the default: "tf32x3" (DEFAULT_FP32)
    "ieee"         fp32 products exact (FMA on CUDA cores); fp32's fixed bound
    "tf32"         tensor cores, 10-bit mantissas; judged against PyTorch's TF32 error
    "tf32x3"       tensor cores, each product as three TF32 products (big*big + big*small +
                   small*big): about fp32's accuracy; fp32's fixed bound
fp16/bf16 take no option: their products run on tensor cores as they are.

Why the default is tf32x3, not exact FMA: both meet fp32's bound (the tolerance table's
float32 row), and on the H200 tf32x3 ran the forward 4.2x faster than "ieee" (52.9 against
12.6 TFLOP/s at B1 H16 S4096 D64, 1.56x SDPA's fp32 "efficient" kernel, which multiplies
fp32 the same way), the backward 4.2x (30.7 against 7.3), and a new shape's first call took
3.8 s where the FMA dot's unrolled loops took 11.6 (evidence README, commit cd20e7c).
"ieee" stays for exact products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedattn.problem import ProblemError

OPTIONS = (None, "ieee", "tf32", "tf32x3")
DEFAULT_FP32 = "tf32x3"  # what None means for fp32 inputs


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    asked: str | None = None  # as given; None = the default

    @property
    def dot(self) -> str | None:
        """`tl.dot`'s input_precision: "ieee" / "tf32" / "tf32x3" for fp32, None (tensor
        cores on the inputs as they are) for fp16/bf16."""
        if self.dtype != torch.float32:
            return None
        return self.asked or DEFAULT_FP32

    @property
    def op(self) -> str:
        """The string the custom ops and kernels take: `dot` for fp32, "ieee" (unused: their
        dots take the inputs as they are) for fp16/bf16."""
        return self.dot or "ieee"

    @property
    def peer_tf32(self) -> bool:
        """Whether PyTorch's peer computes with TF32 matmuls (the same precision as ours)."""
        return self.dot == "tf32"

    def tolerance_key(self, outside_chapter: bool = False) -> str:
        """The tolerance table's row: "tf32" its own; fp32 "ieee"/"tf32x3" fp32's, which
        becomes "float32-wide" for inputs outside the chapter's protocols."""
        if self.dot == "tf32":
            return "tf32"
        if self.dtype == torch.float32 and outside_chapter:
            return "float32-wide"
        return str(self.dtype).removeprefix("torch.")


def resolve(dtype: torch.dtype, precision: str | None) -> Precision:
    """Check `precision` for `dtype` (a ProblemError names what is allowed)."""
    if precision not in OPTIONS:
        raise ProblemError("precision", precision, "None, 'ieee', 'tf32' or 'tf32x3'")
    if precision in ("tf32", "tf32x3") and dtype != torch.float32:
        raise ProblemError("precision", precision, f"'{precision}' for float32 inputs only")
    return Precision(dtype, precision)
