#!/bin/bash
# Issue 16's evidence at one clean commit, on the H200, into $1:
#   1. sweep: online-tiled's rows per block against materialized, S = 128..16384;
#   2. ncu of materialized, online and online-tiled (its auto rows) at each S (the time
#      model's inputs: duration, DRAM/L2 bytes, instructions, FFMAs, bank conflicts, stalls);
#   3. run-all of --version all under both input protocols (uniform, normal) at S 128, 2048.
# Steps are selected by $2 (default "sweep ncu runall").
set -u
out=${1:?usage: h200_tiled.sh OUT [steps]}
steps=${2:-sweep ncu runall}
mkdir -p "$out"
for step in $steps; do
  case $step in
    sweep)
      python3 scripts/tiled_sweep.py "$out/tiled-sweep/sweep.csv" --seq 128,512,2048,8192,16384 \
        --rows 4,8,16,32,64,128 --block 256 --causal 0,1 > "$out/tiled-sweep.log" 2>&1
      echo "sweep: rc=$?";;
    ncu)
      for s in 128 512 2048 8192 16384; do
        versions=materialized,online-tiled,online
        [ "$s" -gt 8192 ] && versions=materialized,online-tiled  # online: 0.7 s a launch
        python3 -m fusedattn profile --ncu --version $versions --seq $s --out "$out" \
          > "$out/ncu-$s.log" 2>&1
        echo "ncu S=$s: rc=$?"
      done;;
    runall)
      python3 -m fusedattn run-all --version all --inputs uniform,normal --seq 128,2048 \
        --out "$out" > "$out/run-all.log" 2>&1
      echo "run-all: rc=$?";;
  esac
done
