"""A warmup of the portable forward in Triton's interpreter (12 calls, 798 programs), timed
with fusedattn's launches as they are (`mode.kernel_launches` turns the interpreter's
`sanitize_overflow` off for each launch) and with the option forced back on (a launch
context that leaves the options alone): `python measure.py on|off`."""
import contextlib
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
import fusedattn  # noqa: E402
from fusedattn import mode  # noqa: E402

if sys.argv[1] == "on":  # the launches as before: the lock alone
    mode._unchecked_overflow = contextlib.nullcontext
start = time.perf_counter()
fusedattn.warmup(head_dims=(16,), heads=(1,), max_len=16)
print(sys.argv[1], round(time.perf_counter() - start, 2))
