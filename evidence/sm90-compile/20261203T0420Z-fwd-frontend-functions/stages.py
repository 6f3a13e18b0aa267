"""Triton's stage times of one sm_90a compile of the Gluon forward, each run in an empty
cache: python stages.py KERNEL_FILE CONFIG_NAME [RUNS] (CONFIG_NAME from
`scripts/gluon_compile_report.py`'s CONFIGS); then the last run's `sass_digest`."""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gluon_compile_report as g  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.nvidia import compiler as nv  # noqa: E402
from triton.experimental.gluon import _runtime as rt  # noqa: E402

times: dict[str, float] = {}


def timed(owner, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times[label] = times.get(label, 0.0) + time.perf_counter() - start
        return result

    setattr(owner, attr, wrapper)


def main() -> None:
    kernel_file, name = sys.argv[1], sys.argv[2]
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    fn = g._load("kernel_under_test", Path(kernel_file))._flash_fwd_sm90
    config = next(c for c in g.CONFIGS if c["name"] == name)
    timed(rt.GluonASTSource, "make_ir", "ir")
    for stage in ("make_ttgir", "make_llir", "make_ptx", "make_cubin"):
        timed(nv.CUDABackend, stage, stage[5:])
    for _ in range(runs):
        knobs.cache.dir = tempfile.mkdtemp()
        times.clear()
        start = time.perf_counter()
        compiled = g.compile_config(fn, config)
        total = time.perf_counter() - start
        print(json.dumps(dict(total=round(total, 3),
                              **{k: round(v, 3) for k, v in times.items()})))
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    facts, sass = g.cubin_facts(tools, compiled)
    print("digest", g.sass_digest(sass), facts)


if __name__ == "__main__":
    main()
