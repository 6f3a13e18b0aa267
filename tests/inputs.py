"""Small helpers the reliability tests share: seeded inputs on the mode's device, int32
index tensors, and the one check against the float64 reference."""

import torch

from fusedattn.mode import DEVICE
from fusedattn_lab.verify import check


def rand(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return t.requires_grad_() if grad else t


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def passes(got, ref):
    result = check(got, ref)
    assert result.ok, result.reasons
