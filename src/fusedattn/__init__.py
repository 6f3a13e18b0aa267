"""fusedattn: fused attention for PyTorch, forward and backward, on Triton kernels.

    fusedattn.attention(q, k, v, is_causal=..., window=..., softcap=..., enable_gqa=...)
    fusedattn.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, ...)
    fusedattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., ...)
    fusedattn.attention_fp8_backward(dout, q8, k8, v8, descale_q=..., ...)  # FP8's gradients
    fusedattn.attention_varlen_fp8_backward(dout, q8, k8, v8, cu_q, cu_k, max_q, max_k, ...)
    fusedattn.distributed.ring_attention(q, k, v, group=..., is_causal=...)
    fusedattn.warmup(head_dims=..., heads=..., training=...)  # compile ahead of time

Depends on torch and triton only. Importing it reads where the kernels run (the GPU, or
Triton's interpreter where the user set TRITON_INTERPRET=1; see `mode`) and sets nothing.
On a GPU it starts one thread that imports the kernels a first call would (`prime`;
FUSEDATTN_PRIME=0 turns it off).
"""

from fusedattn import mode as _mode  # noqa: F401  (must run before kernel imports)

__version__ = "0.1.0"


_PUBLIC = {"attention": "fusedattn.api", "attention_varlen": "fusedattn.varlen",
           "attention_with_kvcache": "fusedattn.kvcache", "warmup": "fusedattn.ahead_of_time",
           "attention_fp8_backward": "fusedattn.fp8",
           "attention_varlen_fp8_backward": "fusedattn.fp8"}


def __getattr__(name: str):
    # `fusedattn.attention` and its siblings without importing Triton at package import time;
    # kept in the module once found, so that later lookups skip this function (issue 31)
    if name in _PUBLIC:
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_PUBLIC[name]), name)
        return value
    raise AttributeError(f"module 'fusedattn' has no attribute {name!r}")


from fusedattn import prime as _prime  # noqa: E402  (after the package's names are set)

_prime.start()
