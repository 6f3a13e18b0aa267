#!/usr/bin/env bash
# Issue 7, tuning on the H200: the flash tests on the GPU, each autotune config timed alone on
# the problems that missed their target, and Nsight Compute (full set) on ours and the peer
# (fp32-ieee against SDPA efficient; bf16 D=128 against cuDNN, the aim).
#   scripts/h200_tune.sh bench|ncu
# Results go to /tmp/ev and come back as $OUT/tune-<what>.tgz.
set -u
what=${1:?bench or ncu}
export COLUMNS=170
E=/tmp/ev
mkdir -p $E
case $what in
  bench)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_flash.py 2>&1 | tail -4
    timeout 150 python3 -m fusedattn bench --suite bf16 --configs \
      --match "S8192 D64 causal,S16384 D64 causal,S4096 D128" \
      --providers flash,sdpa-flash,sdpa-cudnn --warmup 3 --repeat 10 --out $E 2>&1 | tail -60
    timeout 100 python3 -m fusedattn bench --suite fp32 --configs \
      --providers flash,sdpa-efficient --warmup 3 --repeat 10 --out $E 2>&1 | tail -25 ;;
  ncu)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_flash.py 2>&1 | tail -4
    ncu --version | tail -1
    for spec in "bf16|S4096 D128|flash" "bf16|S4096 D128|sdpa-cudnn" \
                "fp32|S4096 D64|flash" "fp32|S4096 D64|sdpa-efficient"; do
      IFS='|' read -r suite match prov <<< "$spec"
      name=$(echo "$suite-$match-$prov" | tr ' ' '_')
      timeout 150 ncu --nvtx --nvtx-include "measured/" --set full --clock-control none \
        -f -o $E/$name python3 scripts/flash_one.py "$suite" "$match" "$prov" 2>&1 | tail -3
      ncu --import $E/$name.ncu-rep --page raw --csv > $E/$name.raw.csv 2>&1
      ncu --import $E/$name.ncu-rep --page details > $E/$name.details.txt 2>&1
      rm -f $E/$name.ncu-rep
    done ;;
esac
tar -C $E -czf "${OUT:-/tmp}/tune-$what.tgz" .
