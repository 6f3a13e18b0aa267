#!/usr/bin/env bash
# Issues 5 and 6 on the H200: profile + Nsight Compute, compute-sanitizer race checks with
# the planted bug, the BLOCK_K sweeps, and the causal protocol. Usage:
#   scripts/h200_profile.sh races|rest
# Evidence goes to /tmp/ev/<gpu>/<timestamp>-*/ and comes back as $OUT/evidence-<what>.tgz.
set -u
what=${1:?races or rest}
export COLUMNS=170
E=/tmp/ev
case $what in
  races)
    ncu --version | tail -1; compute-sanitizer --version | tail -1
    ncu --query-metrics 2>/dev/null | grep -i "stalled_barrier" | head -4
    timeout 300 python3 -m fusedattn check-races --out $E
    timeout 240 python3 -m fusedattn profile --ncu --out $E ;;
  rest)
    python3 -m fusedattn sweep --version t0 --block-k 16,32,64,128 --seq 128 --out $E
    python3 -m fusedattn sweep --version t0 --block-k 16,32,64,128 --seq 4096 --warmup 5 \
      --repeat 20 --out $E
    python3 -m fusedattn run-all --causal --out $E ;;
esac
tar -C $E -czf "${OUT:-/tmp}/evidence-$what.tgz" .
