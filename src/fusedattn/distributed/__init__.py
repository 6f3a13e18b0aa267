"""Past one GPU: context-parallel attention on torch.distributed (`ring_attention`), with
the helpers that shard a full sequence and put it back together."""

from fusedattn.distributed.ring import (
    contiguous_shard,
    ring_attention,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = ["contiguous_shard", "ring_attention", "zigzag_shard", "zigzag_unshard"]
