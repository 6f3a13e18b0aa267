"""Past 2^31 elements: 64-bit offsets in the flash forward and backward (GPU tier only)."""

import pytest
import torch

from fusedattn.api import attention
from fusedattn.mode import DEVICE
from fusedattn.reference import attention_ref, attention_ref_grads
from fusedattn_lab.verify import check

# The reproduction: bf16 [4200, 8, 512, 128], 2.2e9 elements per tensor (4.4 GB),
# crashed with an illegal memory access when b * stride was computed in 32 bits.
SHAPE = (4200, 8, 512, 128)
LAST = SHAPE[0] - 1  # batch 4199 starts at element 4199 * 8 * 512 * 128 = 2.2e9 > 2^31


def _peer_error(q, k, v, dout=None):
    """SDPA's own bf16 error on the slice (forward, or gradients with `dout`)."""
    leaves = [t.detach().requires_grad_(dout is not None) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    if dout is None:
        return float((out.double().cpu() - attention_ref(q, k, v, causal=True)).abs().max())
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    got = torch.autograd.grad(out, leaves, dout)
    return [float((g.double().cpu() - r).abs().max()) for g, r in zip(got, ref, strict=True)]


# past 2^31 through the heads (issue 33): the Hopper forward and backward, forced, on one
# batch row of 33,600 heads, the last two checked
HEADS_SHAPE = (1, SHAPE[0] * SHAPE[1], *SHAPE[2:])


@pytest.mark.gpu_only("17 GB of bf16 tensors: more than emulation can run")
@pytest.mark.big_memory("~42 GB with the gradients: two at once do not fit an 80 GB card")
@pytest.mark.parametrize("shape, backend", [(SHAPE, "auto"), (HEADS_SHAPE, "hopper")],
                         ids=["batch-auto", "heads-hopper"])
def test_more_than_2_31_elements_forward_and_backward(shape, backend):
    from fusedattn.dispatch import use_backend

    assert torch.Size(shape).numel() > 2**31
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    with use_backend(backend):
        out = attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    # the slice past 2^31: the last batch row's first two heads, or the last two heads
    sl = (LAST, slice(0, 2)) if shape == SHAPE else (0, slice(shape[1] - 2, shape[1]))
    q_s, k_s, v_s = (t.detach()[sl] for t in (q, k, v))
    result = check(out.detach()[sl], attention_ref(q_s, k_s, v_s, causal=True),
                   peer_error=_peer_error(q_s, k_s, v_s))
    assert result.ok, result.reasons
    # backward: the upstream gradient is zero but on the slice, so only it gets gradients
    dout = torch.zeros_like(out)
    dout[sl] = torch.randn(dout[sl].shape, generator=gen, device=DEVICE, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = attention_ref_grads(q_s, k_s, v_s, dout[sl], causal=True)
    peer = _peer_error(q_s, k_s, v_s, dout[sl])
    for name, g, r, p in zip("qkv", grads, ref, peer, strict=True):
        result = check(g[sl], r, peer_error=p)
        assert result.ok, (f"d{name}", result.reasons)
    untouched = grads[0][0] if shape == SHAPE else grads[0][0, :2]
    assert not torch.any(untouched), "rows with zero upstream gradient got dq != 0"
