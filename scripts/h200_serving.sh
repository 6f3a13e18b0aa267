#!/usr/bin/env bash
# The GPU tier, then the serving suites (decode, varlen, window) on the H200, in one call.
# Evidence lands in /tmp/ev and comes back as $OUT/ev.tgz.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src FUSEDATTN_GIT_COMMIT=<sha> FUSEDATTN_GIT_DIRTY=0 &&
#   bash scripts/h200_serving.sh
set -u
export COLUMNS=200 PYTHONUNBUFFERED=1
E=/tmp/ev
mkdir -p $E
timeout 290 python3 scripts/gpu_tier.py --out $E 2>&1 | grep -E "FAILED|ERROR|passed|failed|GPU tier" | tail -30
for s in decode varlen window; do
  timeout 100 python3 -m fusedattn bench --suite $s --warmup 5 --repeat 20 --out $E 2>&1 | tail -14
done
tar -C $E -czf "${OUT:-/tmp}/ev.tgz" .
