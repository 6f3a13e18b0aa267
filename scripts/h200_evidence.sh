#!/usr/bin/env bash
# The committed H200 evidence (issue 4). Usage: scripts/h200_evidence.sh main|sweep
# Runs from the repo root on the device machine (PYTHONPATH=src, numpy<2.5 first).
# Evidence lands in /tmp/ev/<gpu>/<timestamp>/ and comes back as $OUT/evidence-<what>.tgz.
set -u
what=${1:?main or sweep}
export COLUMNS=160
case $what in
  main)
    for inputs in uniform normal; do
      python3 -m fusedattn run-all --inputs "$inputs" --out /tmp/ev
    done ;;
  sweep)
    python3 -m fusedattn run-all --seq 128,512,2048,8192,16384 --processes 2 --warmup 3 \
      --repeat 10 --boundary none --out /tmp/ev ;;
esac
tar -C /tmp/ev -czf "${OUT:-/tmp}/evidence-$what.tgz" .
