#!/usr/bin/env bash
# next-device-calls item 31's A/B left after Q from registers landed (f073b7e) and its
# PINGPONG/SHARED_KV/ring A/Bs ran (evidence/nvidia-h100/20261207T0807Z-...): D256 as two
# pieces, alone and with the first from registers, in one call from the repo root:
# `bash notes/item31.sh`. TIER=1: the GPU tier first; ITEM32=1: item 32 next.
# Every h200_round.sh invocation is a process of its own.
set -x
nvidia-smi --query-gpu=name,driver_version --format=csv
if [ "${TIER:-0}" = 1 ]; then bash scripts/h200_round.sh tier; fi
# ITEM32=1: next-device-calls item 32 first (turns by launch: the patch applied, its switch
# both ways in two orders, the patch taken off again)
if [ "${ITEM32:-0}" = 1 ]; then
  bash scripts/h200_round.sh apply turns-by-launch
  FUSEDATTN_GIT_DIRTY=1 ABROWS=d192c,d128c,mlac,s1024d192 bash scripts/h200_round.sh \
    switchab CLAIMED_TURNS True,False
  mkdir -p /tmp/ev/turns-by-launch
  mv /tmp/ev/switch_ab-CLAIMED_TURNS.json /tmp/ev/turns-by-launch/true-first.json
  FUSEDATTN_GIT_DIRTY=1 ABROWS=d192c,d128c,mlac,s1024d192 bash scripts/h200_round.sh \
    switchab CLAIMED_TURNS False,True revert turns-by-launch
  mv /tmp/ev/switch_ab-CLAIMED_TURNS.json /tmp/ev/turns-by-launch/false-first.json
fi
# D256 as two 128-column pieces, alone and with the first piece's Q from registers
ABENTRIES=1 ABROWS=d256 bash scripts/h200_round.sh switchab TILES \
  "{},{(256, 256): (128, 128, 128, 128, 64, 64, 2)}"
mkdir -p /tmp/ev/d256-pieces && mv /tmp/ev/switch_ab-TILES.json /tmp/ev/d256-pieces/alone.json
ABSET="Q_REGISTERS={(256, 256): 'first'}" ABENTRIES=1 ABROWS=d256 bash \
  scripts/h200_round.sh switchab TILES "{},{(256, 256): (128, 128, 128, 128, 64, 64, 2)}"
mv /tmp/ev/switch_ab-TILES.json /tmp/ev/d256-pieces/first-from-registers.json
