"""Small helpers the tests share: seeded inputs on the mode's device, int32 index
tensors, the one check against the float64 reference, the two forward paths side by side,
and tiny Hugging Face configs."""

import torch

from fusedattn.mode import DEVICE, EMULATION
from fusedattn_lab.verify import check

ON_HOPPER = (not EMULATION and torch.cuda.is_available()
             and torch.cuda.get_device_capability() == (9, 0))


def rand(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return t.requires_grad_() if grad else t


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def passes(got, ref, name="", peer=None):
    """`got` within the dtype's bound of the float64 `ref` (low precision: twice `peer`'s
    error, the same formula by torch in the same dtype, plus a floor)."""
    peer_error = None if peer is None else float((peer.detach().double().cpu() - ref).abs()
                                                 .max())
    result = check(got, ref, peer_error=peer_error)
    assert result.ok, (name, result.reasons, peer_error)


def both_paths(call) -> list:
    """The same call on the Hopper path, then on the portable one (`use_backend`)."""
    from fusedattn.dispatch import use_backend

    outs = []
    for backend in ("hopper", "portable"):
        with use_backend(backend):
            outs.append(call())
    return outs


def within_portable(out, out_portable, ref) -> None:
    """The Hopper path's error against the float64 `ref` at most twice the portable
    kernel's on the same inputs, plus a floor; and finite."""
    assert torch.isfinite(out).all()
    err, err_p = ((o.double() - ref).abs().max().item() for o in (out, out_portable))
    assert err <= 2 * err_p + 1e-3, (err, err_p)


def gpt_oss(transformers, sizes: dict, window: int, **common):
    """A tiny gpt-oss config (attention sinks, sliding and full layers, GQA, a small MoE
    run by its eager experts, which float64 takes) and the `from_config` keywords it needs."""
    heads = sizes["num_attention_heads"]
    config = transformers.GptOssConfig(
        sliding_window=window, head_dim=sizes["hidden_size"] // heads, num_local_experts=4,
        num_experts_per_tok=2, layer_types=[("sliding_attention", "full_attention")[i % 2]
                                            for i in range(sizes["num_hidden_layers"])],
        **sizes, **common)
    return config, {"experts_implementation": "eager"}


def spread_sinks(model) -> None:
    """Sinks of a few units (gpt-oss initialises them near 0, where they barely count)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=g) * 2)
