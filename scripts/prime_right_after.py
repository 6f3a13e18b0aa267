"""A process that uses fusedattn right after importing it, with the prime thread on or off
(FUSEDATTN_PRIME): the time from `import fusedattn` to having imported every module of
`prime.MODULES` and hashed `prime.KERNELS` on the main thread, as a first call would. On the
CPU with torch.version.cuda set, so that the thread starts (no kernel runs; not emulation):

    for p in 0 1 1 0; do
      FUSEDATTN_PRIME=$p PYTHONPATH=src python3 scripts/prime_right_after.py
    done
"""

import importlib
import json
import os
import sys
import time

import torch

torch.version.cuda = torch.version.cuda or "13.0"  # the thread starts only under a CUDA torch
start = time.perf_counter()
import fusedattn  # noqa: E402, F401
from fusedattn import prime  # noqa: E402

started = prime._THREAD is not None
for name in prime.MODULES:
    importlib.import_module(name)
for module, kernel in prime.KERNELS:
    getattr(sys.modules[module], kernel).cache_key  # noqa: B018
main_s = time.perf_counter() - start
prime.join()
print(json.dumps({"prime": os.environ.get("FUSEDATTN_PRIME", "1"), "started": started,
                  "import_to_ready_s": round(main_s, 4)}))
