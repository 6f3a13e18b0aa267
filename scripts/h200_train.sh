#!/usr/bin/env bash
# Issue 13 on the H200: the GPU tier (whole suite), then the training benches (the backward
# alone and forward + backward against SDPA's backends, every gradient verified first), and
# the forward at one shape beside cuDNN (64-bit offsets). Each step has its own time limit;
# evidence lands in /tmp/ev and comes back as $OUT/ev.tgz.
set -u
export COLUMNS=170
E=/tmp/ev
mkdir -p $E
P=flash,sdpa-flash,sdpa-cudnn,sdpa-efficient
timeout 330 python3 scripts/gpu_tier.py --out $E 2>&1 | tail -60
timeout 120 python3 -m fusedattn bench --suite train-bf16 --match S4096 --providers $P \
  --warmup 3 --repeat 10 --out $E 2>&1 | tail -40
timeout 40 python3 -m fusedattn bench --suite train-fp16 --match "bwd fp16 B4 H32 S4096 D128" \
  --providers $P --warmup 3 --repeat 10 --out $E 2>&1 | tail -12
timeout 40 python3 -m fusedattn bench --suite train-fp32 --providers flash,sdpa-efficient \
  --warmup 2 --repeat 5 --out $E 2>&1 | tail -12
timeout 40 python3 -m fusedattn bench --suite bf16 --match "S4096 D128" \
  --providers flash,sdpa-flash,sdpa-cudnn --warmup 3 --repeat 10 --out $E 2>&1 | tail -10
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
