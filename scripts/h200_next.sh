#!/usr/bin/env bash
# What this tree still owes the H200, in order of need (NOT YET RUN; each step has its own
# limit, and what finished is kept): the GPU tier at this commit, the 64-bit-offset A/B, the
# training benches not yet measured (S 2048 and 8192, fp16 D64, fp32 tf32x3 against SDPA
# efficient), online-tiled against materialized and online (run-all, check-races).
# Evidence lands in /tmp/ev and comes back as $OUT/ev.tgz.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src FUSEDATTN_GIT_COMMIT=<sha> FUSEDATTN_GIT_DIRTY=0 &&
#   bash scripts/h200_next.sh
set -u
export COLUMNS=170 PYTHONUNBUFFERED=1
E=/tmp/ev
mkdir -p $E/nvidia-h200
P=flash,sdpa-flash,sdpa-cudnn,sdpa-efficient
timeout 300 python3 scripts/gpu_tier.py --out $E 2>&1 | tail -25
timeout 120 python3 scripts/index_ab.py $E/nvidia-h200/index_ab.csv 2>&1 | tail -20
timeout 60 python3 -m fusedattn bench --suite train-fp32 --providers flash,sdpa-efficient \
  --warmup 2 --repeat 5 --out $E 2>&1 | tail -10
timeout 150 python3 -m fusedattn bench --suite train-bf16 --match S2048,S8192 --providers $P \
  --warmup 3 --repeat 10 --out $E 2>&1 | tail -40
timeout 60 python3 -m fusedattn bench --suite train-fp16 --match "D64" --providers $P \
  --warmup 3 --repeat 10 --out $E 2>&1 | tail -30
timeout 120 python3 -m fusedattn run-all --version materialized,online,online-tiled,online-tiled-4 \
  --seq 128,512,2048 --processes 2 --warmup 3 --repeat 10 --out $E 2>&1 | tail -20
timeout 90 python3 -m fusedattn check-races --version online-tiled,online-tiled-4 --out $E \
  2>&1 | tail -12
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
