"""`torch.autocast` around `attention` and `attention_varlen`: fp32 inputs run in autocast's
dtype, as SDPA's do (the same bits as the call made in that dtype, gradients back to the
fp32 leaves); an explicit fp32 `precision` keeps fp32; outside autocast nothing changes."""

import pytest
import torch

from fusedattn import attention, attention_varlen
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError
from inputs import i32, rand


def test_autocast_runs_fp32_inputs_in_its_dtype_with_gradients_to_the_leaves():
    leaves = [rand(1, 2, 24, 16, seed=s, grad=True) for s in range(3)]
    dout = rand(1, 2, 24, 16, seed=3).bfloat16()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = attention(*leaves, is_causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    low = [t.detach().bfloat16().requires_grad_() for t in leaves]
    want = attention(*low, is_causal=True)
    want_grads = torch.autograd.grad(want, low, dout)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        assert g.dtype == torch.float32 and torch.equal(g, w.float())


def test_an_explicit_precision_keeps_fp32_under_autocast():
    q, k, v = (rand(1, 2, 24, 16, seed=s) for s in range(3))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = attention(q, k, v, precision="ieee")
    assert out.dtype == torch.float32
    assert torch.equal(out, attention(q, k, v, precision="ieee"))
    assert attention(q, k, v).dtype == torch.float32  # no autocast: as given


def test_autocast_reaches_attention_varlen():
    cu = i32([0, 5, 16])
    q, k, v = (rand(16, 2, 16, seed=s) for s in range(3))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = attention_varlen(q, k, v, cu, cu, 11, 11, is_causal=True)
    want = attention_varlen(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, 11, 11,
                            is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


def test_a_device_autocast_does_not_know_gets_the_device_refusal():
    # fp32 with no `precision` asks autocast about the inputs' device type; torch raises
    # for one it does not know (meta), which reached the user as a RuntimeError from inside
    # torch: the validator's refusal of the device is what such a call gets
    q = torch.empty(1, 2, 8, 16, device="meta")
    with pytest.raises(ProblemError, match="q.device='meta' is not allowed"):
        attention(q, q, q)
    flat = torch.empty(8, 2, 16, device="meta")
    cu = i32([0, 5, 8])
    with pytest.raises(ProblemError, match="q.device='meta' is not allowed"):
        attention_varlen(flat, flat, flat, cu, cu, 5, 5)


def test_the_devices_calls_ask_autocast_nothing_torch_compile_cannot_trace(monkeypatch):
    # `torch.amp.is_autocast_available` is asked only of device types other than cuda and
    # cpu: torch 2.11's dynamo has no rule for it, so on the GPU machine a fp32 call under
    # torch.compile(fullgraph=True) broke the graph there (4 tier failures, evidence/
    # nvidia-h100/20261207T073459Z-prebuild-tier-cut), where CI's torch traces it
    def refuse(kind):
        raise AssertionError(f"asked is_autocast_available({kind!r})")

    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse)
    q, k, v = (rand(1, 2, 24, 16, seed=s) for s in range(3))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert attention(q, k, v).dtype == torch.bfloat16
    assert attention(q, k, v).dtype == torch.float32
