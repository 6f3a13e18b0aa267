"""fusedattn: attention forward built materialized and online, thread-level and tile-level.

Importing the package first fixes the execution mode (GPU or emulation), see `mode`.
"""

from fusedattn import mode as _mode  # noqa: F401  (must run before kernel imports)

__version__ = "0.1.0"


def __getattr__(name: str):
    # `fusedattn.attention` without importing Triton at package import time
    if name == "attention":
        from fusedattn.api import attention

        return attention
    raise AttributeError(f"module 'fusedattn' has no attribute {name!r}")
