#!/usr/bin/env bash
# Issues 2 and 3 on the H200: the chapter's problem under both input protocols, the
# boundary shapes, and graph-mode timing; every record into $OUT/results.tgz.
# Run from the repo root with PYTHONPATH=src (and numpy<2.5 first on the path).
set -u
W=/tmp/fusedattn-work; mkdir -p "$W"
python3 - <<'PY'
import torch, triton, numba, numpy
from importlib.metadata import version
print("torch", torch.__version__, "triton", triton.__version__, "numba", numba.__version__,
      "numba-cuda", version("numba-cuda"), "numpy", numpy.__version__, torch.cuda.get_device_name())
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
run() { python3 -m fusedattn run "$@" 2>&1 | tee -a "$W/log.txt"; echo "rc=${PIPESTATUS[0]}" | tee -a "$W/log.txt"; }
for inputs in uniform normal; do
  run --version all --seq 128 --dim 64 --block 256 --inputs $inputs --json "$W/main_$inputs.json"
done
run --version all --seq 128 --dim 64 --block 256 --timing graph --json "$W/main_graph.json"
for shape in 1x1 7x13 33x31 65x33; do
  s=${shape%x*}; d=${shape#*x}
  for block in 32 256; do
    run --version all --seq $s --dim $d --block $block --warmup 2 --repeat 5 --json "$W/boundary_${shape}_b$block.json"
  done
done
tar -C "$W" -czf "${OUT:-/tmp/out}/results.tgz" .
