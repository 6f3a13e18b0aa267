#!/usr/bin/env bash
# next-device-calls item 31 in one call, from the repo root: `bash notes/item31.sh` (its
# steps in order). TIER=1: the GPU tier first. LEAN=1: the 16-bit and FP8 tables alone, on
# rows ROWS16 and ROWS8 (switch_ab row names) where set.
# Every h200_round.sh invocation is a process of its own: the patch applied by the first
# stays in the tree until `revert`, so the runs between are marked dirty here.
set -x
nvidia-smi --query-gpu=name,driver_version --format=csv
if [ "${TIER:-0}" = 1 ]; then bash scripts/h200_round.sh tier; fi
ABROWS=${ROWS16:-d192,d192c,s1024d192,mla,mlac,d128,d128c,d96,d80,s256d64,s1024d64,s256d128} \
  bash scripts/h200_round.sh apply q-registers switchab Q_REGISTERS \
  "{},{(192, 192): 'all', (192, 128): 'all'},{(128, 128): 'all', (96, 96): 'all', (80, 80): 'all', (64, 64): 'all'}"
export FUSEDATTN_GIT_DIRTY=1
ABROWS=${ROWS8:-fp8d64,fp8d64c,fp8d128,fp8d128c} bash scripts/h200_round.sh switchab FP8_Q_REGISTERS \
  "{},{(128, 128): 'all', (64, 64): 'all'}"
if [ "${LEAN:-0}" = 1 ]; then bash scripts/h200_round.sh revert q-registers; exit 0; fi
ABENTRIES=1 ABROWS=d256 bash scripts/h200_round.sh switchab TILES \
  "{},{(256, 256): (128, 128, 128, 128, 64, 64, 2)}"
mkdir -p /tmp/ev/d256-pieces && mv /tmp/ev/switch_ab-TILES.json /tmp/ev/d256-pieces/alone.json
ABSET="Q_REGISTERS={(256, 256): 'first'}" ABENTRIES=1 ABROWS=d256 bash \
  scripts/h200_round.sh switchab TILES "{},{(256, 256): (128, 128, 128, 128, 64, 64, 2)}" \
  revert q-registers
mv /tmp/ev/switch_ab-TILES.json /tmp/ev/d256-pieces/first-from-registers.json
export FUSEDATTN_GIT_DIRTY=0
ABROWS=d192,d192c bash scripts/h200_round.sh switchab PINGPONG True,False \
  switchab SHARED_KV False,True
ABENTRIES=1 ABROWS=s256d64,s1024d64,d64,d64c bash scripts/h200_round.sh switchab TILES \
  "{},{(64, 64): (64, 0, 64, 0, 64, 128, 6)},{(64, 64): (64, 0, 64, 0, 64, 128, 3)}"
