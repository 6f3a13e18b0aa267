#!/usr/bin/env bash
# The last call of a session on the H200 (each step has its own limit; what finished is
# kept): the GPU tier, the cold-start suite, the fp32 backward against SDPA efficient, and
# online-tiled against materialized over S (one process: the sweep's shape, not its spread).
# Evidence lands in /tmp/ev and comes back as $OUT/ev.tgz.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src FUSEDATTN_GIT_COMMIT=<sha> FUSEDATTN_GIT_DIRTY=0 &&
#   bash scripts/h200_next.sh
set -u
export COLUMNS=190 PYTHONUNBUFFERED=1
E=/tmp/ev
mkdir -p $E
timeout 200 python3 scripts/gpu_tier.py --out $E 2>&1 | grep -E "FAILED|ERROR|GPU tier" | tail -20
timeout 100 python3 -m fusedattn bench --suite coldstart --out $E 2>&1 | grep -E "│|written"
timeout 60 python3 -m fusedattn bench --suite train-fp32 --providers flash,sdpa-efficient \
  --warmup 2 --repeat 5 --out $E 2>&1 | grep -E "│|written"
timeout 150 python3 -m fusedattn run-all --version materialized,online-tiled,online-tiled-4 \
  --seq 512,2048,8192 --processes 1 --boundary none --warmup 3 --repeat 10 --out $E 2>&1 | tail -14
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
