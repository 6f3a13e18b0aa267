"""Past one GPU: context-parallel attention on torch.distributed: the ring
(`ring_attention`), Ulysses' all-to-alls (`ulysses_attention`) and both composed (USP,
`usp_attention`), with the helpers that shard a full sequence and put it back together,
and `ring_sdpa` / `ulysses_sdpa` / `usp_sdpa`, which run model code's SDPA calls
(torch's `context_parallel`'s too, for the first two) on them."""

from fusedattn.distributed.ring import (
    contiguous_shard,
    ring_attention,
    ring_attention_varlen,
    varlen_shard,
    varlen_unshard,
    zigzag_shard,
    zigzag_unshard,
)
from fusedattn.distributed.sdpa import ring_sdpa, ulysses_sdpa, usp_sdpa
from fusedattn.distributed.ulysses import (
    ulysses_attention,
    ulysses_attention_varlen,
    usp_attention,
    usp_attention_varlen,
    usp_shard,
    usp_varlen_shard,
)

__all__ = ["contiguous_shard", "ring_attention", "ring_attention_varlen", "ring_sdpa",
           "ulysses_attention", "ulysses_attention_varlen", "ulysses_sdpa", "usp_attention",
           "usp_attention_varlen", "usp_sdpa", "usp_shard", "usp_varlen_shard", "varlen_shard",
           "varlen_unshard", "zigzag_shard", "zigzag_unshard"]
