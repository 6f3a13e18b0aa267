"""The primed launch floor: an empty Triton kernel (one program, no memory touched) timed
with the lab's protocol (`lab/timing.time_gpu`, events around the launch, the GPU kept busy
before the start event). The chapter's 128x64 target is twice this.

    python3 scripts/launch_floor.py OUT.json [--warmup 10 --repeat 50]
"""

import argparse
import sys
from pathlib import Path

import triton

from fusedattn_lab.evidence import environment, write_json
from fusedattn_lab.timing import time_gpu


@triton.jit
def _empty(n):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    _empty[(1,)](1)  # compiled outside the timing
    t = time_gpu(lambda: _empty[(1,)](1), warmup=args.warmup, repeat=args.repeat)
    print(f"empty Triton launch, primed: median {t.median_ms * 1e3:.2f} us "
          f"(range {t.min_ms * 1e3:.2f}-{t.max_ms * 1e3:.2f}), host {t.host_us_median:.1f} us")
    write_json(args.out, {"kernel": "empty Triton kernel, grid (1,)", **t.summary(),
                          "environment": environment(),
                          "command": " ".join(["python3", *sys.argv])})


if __name__ == "__main__":
    main()
