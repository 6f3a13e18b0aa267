"""Make the package's prebuilt kernels (`fusedattn.prebuilt`) on the GPU: `fusedattn.warmup`
for each of `prebuilt.SPECS` into an empty Triton cache (each spec split into its single
dtype, head dim and mask, one process each, --jobs at a time: Triton's cache takes writers
side by side), then its entries packed into
`src/fusedattn/prebuilt/` (the old entries replaced) and a tarball of them under --out.
Run it on the H200 after a kernel changes (`bash scripts/h200_round.sh prebuild`), and
commit what it wrote; the GPU tier's `tests/test_prebuilt.py` fails on a kernel the entries
no longer match, and in CI its `test_the_shipped_entries_were_made_from_these_kernel_sources`
fails once a module the shipped kernels compile from is edited (`prebuilt.kernel_sources`).

    python3 scripts/prebuild.py [--out DIR] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def warm(spec: dict) -> dict:
    """`fusedattn.warmup(**spec)` in a process of its own (this one's environment)."""
    from fusedattn_lab.coldstart import warmup_process

    proc = warmup_process(spec)
    if proc.returncode != 0:
        raise SystemExit(f"warmup {spec}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return dict(spec=spec, **json.loads(proc.stdout.strip().splitlines()[-1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="fusedattn-prebuild-"))
    # before Triton is imported: an empty cache of its own, binaries only, nothing installed
    # from the package's old entries
    os.environ.update(TRITON_CACHE_DIR=str(cache), TRITON_STORE_BINARY_ONLY="1",
                      FUSEDATTN_PREBUILT="0", FUSEDATTN_PRIME="0")
    import torch

    from fusedattn import prebuilt
    from fusedattn_lab.evidence import environment

    start = time.perf_counter()
    specs = [single for spec in prebuilt.SPECS for single in prebuilt.singles(spec)]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(warm, specs))
    for run in runs:
        print(run, flush=True)
    env = environment()  # (its commit: FUSEDATTN_GIT_COMMIT where set, as on the device)
    commit = env.get("git_commit")
    made_by = dict(commit=commit, gpu=env.get("gpu"), driver=env.get("driver"),
                   torch=torch.__version__, warmups=runs,
                   seconds=round(time.perf_counter() - start, 1),
                   command=" ".join([sys.executable, *sys.argv]))
    out = prebuilt.ROOT
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    manifest = prebuilt.pack(cache, out, made_by)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(manifest['entries'])} entries, {size / 2**20:.1f} MiB, build "
          f"{manifest['build']}", flush=True)
    with tarfile.open(Path(args.out) / "prebuilt.tgz", "w:gz") as tar:
        tar.add(out, arcname="prebuilt")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
