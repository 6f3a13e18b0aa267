"""Triton's front end alone (`make_ir`: Python to TTIR) for one configuration of the Gluon
forward, RUNS times in one process, each in an empty cache:
python make_ir_loop.py KERNEL_FILE CONFIG_NAME RUNS. Prints the first run and the median
and minimum of the rest (the first pays the process's one-off costs)."""

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gluon_compile_report as g  # noqa: E402
from triton import knobs  # noqa: E402
from triton.experimental.gluon import _runtime as rt  # noqa: E402


class _Stop(Exception):
    """Raised once the front end is done: the rest of the compile is not timed here."""


def main() -> None:
    kernel_file, name, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fn = g._load("kernel_under_test", Path(kernel_file))._flash_fwd_sm90
    config = next(c for c in g.CONFIGS if c["name"] == name)
    make_ir, seconds = rt.GluonASTSource.make_ir, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        make_ir(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        raise _Stop

    rt.GluonASTSource.make_ir = timed
    for _ in range(runs):
        knobs.cache.dir = tempfile.mkdtemp()
        try:
            g.compile_config(fn, config)
        except _Stop:
            pass
    rest = seconds[1:]
    print(f"{name} make_ir first {seconds[0]:.3f}, then median {statistics.median(rest):.3f} "
          f"min {min(rest):.3f}")


if __name__ == "__main__":
    main()
