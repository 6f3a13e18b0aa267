#!/usr/bin/env bash
# The H200 steps of issues 13 and 14, each with its own limit; what finished is kept.
# Evidence lands in /tmp/ev and comes back as $OUT/ev.tgz (one file: the device tool returns a
# limited number per call); `tune` writes straight to $OUT/tune.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src FUSEDATTN_GIT_COMMIT=<sha> FUSEDATTN_GIT_DIRTY=0 &&
#   bash scripts/h200_next.sh [steps]     (default: races train ncu; also tier, prefill,
#                                          ncu-prefill, ncu-final, ncu-stalls, chapter,
#                                          chapter-ncu, tune, ab-split,
#                                          ab-overlap, ab-heads, ab-split3;
#                                          STOP_AT=s skips ncu rows that would
#                                          start past s seconds, NCU_LIMIT=s
#                                          limits each, NCU_ROWS="name ..." runs only
#                                          those rows, NCU_TAG=t names the folder)
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
    ncu|ncu-prefill|ncu-final|ncu-stalls)  # issues 13 and 14: where the time goes against
            # cuDNN (bf16) and SDPA efficient (fp32), forward and backward; one folder. ncu:
            # the training rows; ncu-prefill: the prefill suite's other misses; ncu-final:
            # every prefill row that misses; ncu-stalls: the same rows' forwards only, with
            # the tensor pipes' busy % and every stall reason (cycles per issued instruction)
      N=$E/nvidia-h200/$(date -u +%Y%m%dT%H%MZ)-$step${NCU_TAG:+-$NCU_TAG}-vs-peer; mkdir -p $N
      python3 -c "from fusedattn.lab.evidence import environment, write_json; import sys; write_json(sys.argv[1], environment())" $N/environment.json
      echo "bash scripts/h200_next.sh $step (the ncu line below, per row)" > $N/command.txt
      what=(--section SpeedOfLight --section WarpStateStats --section Occupancy
            --section ComputeWorkloadAnalysis --section LaunchStats)
      if [ $step = ncu-stalls ]; then
        what=(--nvtx-include "fusedattn-fwd/" --nvtx-include "cudnn-fwd/"
              --nvtx-include "efficient-fwd/" --section SpeedOfLight --section LaunchStats
              --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active")
      fi
      if [ $step = ncu-final ] || [ $step = ncu-stalls ]; then
        rows=("bf16-d128:--dim 128" "bf16-d128-causal:--dim 128 --causal" "bf16-d64:--dim 64"
              "bf16-b2-s8192-d64-causal:--batch 2 --seq 8192 --dim 64 --causal"
              "bf16-gqa-b2-h32-8-s8192-d128-causal:--batch 2 --heads-kv 8 --seq 8192 --causal"
              "bf16-b1-h16-s16384-d80:--batch 1 --heads 16 --seq 16384 --dim 80"
              "bf16-b2-h16-d96:--batch 2 --heads 16 --dim 96"
              "bf16-b2-h16-d112:--batch 2 --heads 16 --dim 112"
              "bf16-b2-h16-d200:--batch 2 --heads 16 --dim 200"
              "bf16-b2-h16-d256:--batch 2 --heads 16 --dim 256"
              "bf16-b64-h16-s256-d64:--batch 64 --heads 16 --seq 256 --dim 64"
              "bf16-b64-h16-s256-d64-causal:--batch 64 --heads 16 --seq 256 --dim 64 --causal"
              "fp32-ieee-d64:--dtype fp32 --precision ieee --batch 1 --heads 16 --dim 64"
              "fp32-tf32x3-d64:--dtype fp32 --precision tf32x3 --batch 1 --heads 16 --dim 64")
      elif [ $step = ncu ]; then
        rows=("bf16-d128:--dim 128" "bf16-d128-causal:--dim 128 --causal"
              "fp32-tf32x3-d64:--dtype fp32 --precision tf32x3 --batch 1 --heads 16 --dim 64")
      else
        rows=("bf16-b2-s8192-d64-causal:--batch 2 --seq 8192 --dim 64 --causal"
              "bf16-b2-h16-d256:--batch 2 --heads 16 --dim 256"
              "bf16-b64-h16-s256-d64:--batch 64 --heads 16 --seq 256 --dim 64"
              "bf16-b1-h16-s16384-d80:--batch 1 --heads 16 --seq 16384 --dim 80")
      fi
      for row in "${rows[@]}"; do
        if [ -n "${NCU_ROWS:-}" ] && [[ " $NCU_ROWS " != *" ${row%%:*} "* ]]; then continue; fi
        if [ $SECONDS -gt ${STOP_AT:-100000} ]; then  # keep the call under the device's limit
          echo "ncu ${row%%:*}: not run (past STOP_AT=$STOP_AT s)" | tee -a $N/command.txt; continue
        fi
        timeout ${NCU_LIMIT:-150} ncu --profile-from-start off --clock-control none --nvtx \
          "${what[@]}" --csv --page details --log-file $N/${row%%:*}.csv python3 scripts/ncu_vs_cudnn.py ${row#*:} > $N/${row%%:*}.log 2>&1
        echo "ncu ${row%%:*} (${row#*:}): rc=$?" | tee -a $N/command.txt; tail -3 $N/${row%%:*}.log
      done
      echo "ncu options: ${what[*]}" >> $N/command.txt
      python3 scripts/ncu_details.py $N | tail -1;;
    prefill)  # issue 14: the prefill rows and the cold start at this commit
      for s in prefill coldstart; do
        timeout 200 python3 -m fusedattn bench --suite $s --out $E 2>&1 | grep -E "written|FAIL"
      done;;
    ab-split|ab-overlap)  # issue 14: the forward's head dims in two pieces (whole, or the
            # second overlapping the first) against one padded piece
      A=$E/nvidia-h200/$(date -u +%Y%m%dT%H%MZ)-$step-d
      timeout 300 python3 scripts/ab_forward.py --switch FUSEDATTN_SPLIT_D --suite $step \
        --out $A 2>&1 | tail -12;;
    ab-split3)  # issue 14: head dims in three pieces against one padded piece
      A=$E/nvidia-h200/$(date -u +%Y%m%dT%H%MZ)-ab-split3-d
      timeout 200 python3 scripts/ab_forward.py --switch FUSEDATTN_SPLIT_D --suite ab-split3 \
        --values 0,3 --out $A 2>&1 | tail -6;;
    ab-heads)  # issue 14: several (batch, head)s per forward program against one
      for n in 2 4; do
        A=$E/nvidia-h200/$(date -u +%Y%m%dT%H%MZ)-ab-heads-$n
        timeout 200 python3 scripts/ab_forward.py --switch FUSEDATTN_HEADS --values 1,$n \
          --suite ab-heads --out $A 2>&1 | tail -8
      done;;
    chapter)  # issue 14: the chapter's 128x64 fp32 (t1 and flash) and the launch floor
      C=$E/nvidia-h200/$(date -u +%Y%m%dT%H%MZ)-chapter-128x64; mkdir -p $C
      echo "bash scripts/h200_next.sh chapter: fusedattn run --version t1,flash --seq 128 \
--dim 64 --warmup 10 --repeat 50 --json run.json; scripts/launch_floor.py launch_floor.json" > $C/command.txt
      timeout 60 python3 -m fusedattn run --version t1,flash --seq 128 --dim 64 --warmup 10 \
        --repeat 50 --json $C/run.json 2>&1 | tail -8 | tee $C/run.txt
      timeout 30 python3 scripts/launch_floor.py $C/launch_floor.json 2>&1 | tail -2;;
    chapter-ncu)  # issue 14: the chapter's 128x64 under Nsight Compute (t1 and flash)
      timeout 120 python3 -m fusedattn profile --version t1,flash --seq 128 --dim 64 --ncu \
        --out $E 2>&1 | tail -12;;
    tune)   # issue 14: the tuned table for every kernel, written straight to $OUT (a cut
            # call keeps what finished); the tier and the benches run again after it lands
      T=${OUT:-/tmp}/tune; mkdir -p $T
      tune() { local limit=$1 name=$2; shift 2
        timeout $limit python3 -m fusedattn tune --table $T/nvidia-h200.json \
          --report $T/tune-$name.csv --repeat 20 "$@" > $T/tune-$name.log 2>&1
        echo "tune $name: rc=$? $(grep -c ' ok' $T/tune-$name.log) ok; $(tail -1 $T/tune-$name.log)"; }
      tune 290 fwd-bf16 --kernel fwd --dtype bf16 --dim 64,128,256 --seq 256,1024,4096,8192
      tune 40 fwd-chapter --kernel fwd --dtype fp32 --precision ieee --dim 64 --seq 128 \
        --causal no --batch 1 --heads 1
      tune 190 bwd-bf16 --kernel bwd --dtype bf16 --dim 64,128 --seq 1024,4096
      tune 50 decode-bf16 --kernel decode --dtype bf16 --dim 64,128 --seq 8192;;
  esac
done
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
