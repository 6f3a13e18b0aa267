#!/usr/bin/env bash
# What this tree owes the H200, in one call (each step has its own limit; what finished is
# kept): the GPU tier, the prefill issue's rows, the cold-start suite, online-tiled against
# materialized and online (run-all, check-races), the fp32 backward against SDPA efficient.
# Evidence lands in /tmp/ev and comes back as $OUT/ev.tgz.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src FUSEDATTN_GIT_COMMIT=<sha> FUSEDATTN_GIT_DIRTY=0 &&
#   bash scripts/h200_next.sh
set -u
export COLUMNS=190 PYTHONUNBUFFERED=1
E=/tmp/ev
mkdir -p $E
timeout 200 python3 scripts/gpu_tier.py --out $E 2>&1 | grep -E "FAILED|ERROR|GPU tier" | tail -20
timeout 120 python3 -m fusedattn bench --suite prefill --providers flash,sdpa-cudnn,sdpa-flash,sdpa-efficient \
  --warmup 3 --repeat 10 --out $E 2>&1 | grep -E "│|written" | cut -c1-190
timeout 100 python3 -m fusedattn bench --suite coldstart --out $E 2>&1 | grep -E "│|written"
timeout 100 python3 -m fusedattn run-all --version materialized,online,online-tiled,online-tiled-4 \
  --seq 128,512,2048,8192 --processes 2 --warmup 3 --repeat 10 --out $E 2>&1 | tail -24
timeout 60 python3 -m fusedattn check-races --version online-tiled,online-tiled-4 --out $E \
  2>&1 | tail -12
timeout 60 python3 -m fusedattn bench --suite train-fp32 --providers flash,sdpa-efficient \
  --warmup 2 --repeat 5 --out $E 2>&1 | grep -E "│|written"
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
