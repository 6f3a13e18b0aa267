"""fusedattn: attention forward built materialized and online, thread-level and tile-level.

Importing the package first fixes the execution mode (GPU or emulation), see `mode`.
"""

from fusedattn import mode as _mode  # noqa: F401  (must run before kernel imports)

__version__ = "0.1.0"


_PUBLIC = {"attention": "fusedattn.api", "attention_varlen": "fusedattn.varlen",
           "attention_with_kvcache": "fusedattn.kvcache"}


def __getattr__(name: str):
    # `fusedattn.attention` and its siblings without importing Triton at package import time
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'fusedattn' has no attribute {name!r}")
