#!/usr/bin/env bash
# What the end of the 13:43 session left owed on the H200, in order of value (each step has
# its own limit; what finished is kept). Evidence lands in /tmp/ev
# and comes back as $OUT/ev.tgz.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src FUSEDATTN_GIT_COMMIT=<sha> FUSEDATTN_GIT_DIRTY=0 &&
#   bash scripts/h200_next.sh [steps]     (default: races train ncu)
set -u
export COLUMNS=190 PYTHONUNBUFFERED=1
E=/tmp/ev
mkdir -p $E
for step in ${1:-races train ncu}; do
  case $step in
    tier)   # after any kernel change
      timeout 200 python3 scripts/gpu_tier.py --out $E 2>&1 | grep -E "FAILED|ERROR|GPU tier" | tail -20;;
    races)  # issue 16: the second tiled round and its planted variant; flash beside them
      timeout 150 python3 -m fusedattn check-races --version online-tiled,online-tiled-4,flash \
        --out $E 2>&1 | tail -15;;
    train)  # issue 13: every row of the training suites (S 2048..8192, D 64/128, both masks)
      for s in train-bf16 train-fp16; do
        timeout 280 python3 -m fusedattn bench --suite $s --out $E 2>&1 | grep -E "written|FAIL"
      done;;
    ncu)    # issues 13 and 14: where the time goes against cuDNN (bf16) and SDPA efficient
            # (fp32 tf32x3, the backward that misses), forward and backward; one folder
      N=$E/nvidia-h200/$(date -u +%Y%m%dT%H%MZ)-ncu-vs-peer; mkdir -p $N
      python3 -c "from fusedattn.lab.evidence import environment, write_json; import sys; write_json(sys.argv[1], environment())" $N/environment.json
      echo "bash scripts/h200_next.sh ncu (the ncu line above, per row)" > $N/command.txt
      for row in "bf16-d128:--dim 128" "bf16-d128-causal:--dim 128 --causal" \
                 "fp32-tf32x3-d64:--dtype fp32 --precision tf32x3 --batch 1 --heads 16 --dim 64"; do
        timeout 150 ncu --profile-from-start off --clock-control none --nvtx \
          --section SpeedOfLight --section WarpStateStats --section Occupancy \
          --section ComputeWorkloadAnalysis --section LaunchStats --csv --page details \
          --log-file $N/${row%%:*}.csv python3 scripts/ncu_vs_cudnn.py ${row#*:} > $N/${row%%:*}.log 2>&1
        echo "ncu ${row%%:*}: rc=$?" | tee -a $N/command.txt; tail -3 $N/${row%%:*}.log
      done;;
    tune)   # issue 14: the tuned table (then the tier again: configs change what runs)
      mkdir -p $E/tuned && cp src/fusedattn/tuned/*.json $E/tuned/ 2>/dev/null
      timeout 400 python3 -m fusedattn tune --kernel fwd --dtype bf16 --table $E/tuned/nvidia-h200.json \
        --report $E/tune-fwd-bf16.csv 2>&1 | tail -5;;
  esac
done
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
