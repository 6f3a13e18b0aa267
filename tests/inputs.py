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
