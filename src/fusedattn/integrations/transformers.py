"""Hugging Face transformers: `attn_implementation="fusedattn"`.

    import fusedattn.integrations.transformers  # registers "fusedattn" (needs the [hf] extra)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fusedattn")

transformers calls the attention function with `query: [B, H, Sq, D]`, `key, value:
[B, H_kv, Sk, D]` and expects `[B, Sq, H, D]` back. The mask function registered beside it
is transformers' own SDPA one, followed by a check, once per model call (not per layer):
a mask that says no more than `is_causal` does (exactly the lower triangle with Sq == Sk:
prefill and training; all True with Sq == 1: a decode step, which attends to every cached
key) becomes None, and so does a sliding-window causal mask with Sq == Sk (the lower
triangle cut to the last W keys: Mistral's, Gemma 2's sliding layers), whose window the
layer passes as `sliding_window=W`. Then fusedattn runs, causal (top-left) for Sq > 1 on
decoder layers, with `window=(W - 1, None)` (query i sees keys i - W + 1 .. i, as
transformers' mask) and Gemma 2's `softcap`. Any other mask (a padded batch, chunked
prefill after a cache, a windowed decode step that does not see every cached key, a static
cache's unused tail) reaches the attention function, which raises `ProblemError` rather
than return a silently different result; use "sdpa" for those.

Context parallel (`sequence_parallel(group)`): inside it, every "fusedattn" layer runs
`fusedattn.distributed.ring_attention` over the ranks of `group`, each holding a shard of
the sequence (zigzag shards when causal):

    with sequence_parallel(group):
        logits = model(zigzag_shard(ids, rank, world, dim=1),
                       position_ids=zigzag_shard(positions, rank, world, dim=1)).logits

The position ids must be sharded like the tokens (RoPE sees true positions), and the labels
shifted on the whole sequence before sharding (the model's own loss shifts within a shard,
which is wrong at the shard's seams): compute the loss from the logits, sum it over the
ranks and all-reduce the parameters' gradients (`tests/test_distributed_hf.py` does a
training step this way and matches one process on the whole sequence). Windows and softcap
are refused there (the ring has neither).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fusedattn.api import attention
from fusedattn.problem import ProblemError

NAME = "fusedattn"
# the process groups of the `sequence_parallel` blocks around this thread's (or task's)
# code, innermost last: a ContextVar, so another thread's plain forward never sees them
_RING: ContextVar[tuple] = ContextVar("fusedattn_sequence_parallel", default=())


@contextmanager
def sequence_parallel(group=None):
    """Inside: "fusedattn" layers run ring attention over `group` (default: the world) on
    sequence shards; see the module docstring. It holds for the thread (or asyncio task)
    that enters it, not for others."""
    token = _RING.set((*_RING.get(), group))
    try:
        yield
    finally:
        _RING.reset(token)


def fusedattn_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                scaling: float | None = None, is_causal: bool | None = None,
                                **kwargs):
    """transformers' attention-function signature; returns `(out [B, Sq, H, D], None)`."""
    if attention_mask is not None:
        raise ProblemError("attention_mask", f"a {tuple(attention_mask.shape)} mask tensor",
                           "None: fusedattn takes causal or full attention only (no padding, "
                           "chunked prefill or sliding window); use attn_implementation='sdpa'")
    if dropout:
        raise ProblemError("dropout", dropout, "0.0: fusedattn has no attention dropout")
    if kwargs.get("output_attentions"):
        raise ProblemError("output_attentions", True, "False: fusedattn never forms P")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal) and query.shape[2] > 1
    sliding = kwargs.get("sliding_window")
    window = None
    if sliding is not None and causal:  # a decode step (Sq == 1) came with no mask: it
        window = (int(sliding) - 1, None)  # sees every cached key, so no window applies
    ring = _RING.get()
    if ring:
        from fusedattn.distributed import ring_attention

        for name in ("sliding_window", "softcap"):
            if kwargs.get(name) is not None:
                raise ProblemError(name, kwargs[name], "None under sequence_parallel (ring "
                                   "attention has no windows or softcap)")
        out = ring_attention(query, key, value, group=ring[-1], is_causal=causal,
                             scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    out = attention(query, key, value, is_causal=causal, scale=scaling,
                    enable_gqa=key.shape[1] != query.shape[1], window=window,
                    softcap=kwargs.get("softcap"))
    return out.transpose(1, 2).contiguous(), None


def fusedattn_mask(*args, **kwargs):
    """transformers' SDPA mask, or None where causal (or sliding-window causal) or full
    attention says the same."""
    mask = sdpa_mask(*args, **kwargs)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    seq_q, seq_k = mask.shape[-2:]
    if seq_q == 1 and bool(mask.all()):
        return None
    if seq_q == seq_k:
        tril = torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).tril()
        # the last row's count of visible keys is the window W (all of them: plain causal)
        width = int(mask.reshape(-1, seq_q, seq_k)[0, -1].sum())
        band = tril.triu(-(width - 1)) if width >= 1 else tril
        if torch.equal(mask, band.expand_as(mask)):
            return None
    return mask


AttentionInterface.register(NAME, fusedattn_attention_forward)
AttentionMaskInterface.register(NAME, fusedattn_mask)
