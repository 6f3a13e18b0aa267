#!/usr/bin/env bash
# Issue 7 on the H200: the flash kernel in the chapter's protocol, then the bench suites.
# Each step has its own time limit; the CSVs are rewritten after every problem, so what
# finished is kept. Evidence comes back as $OUT/evidence-flash.tgz.
set -u
export COLUMNS=170
E=/tmp/ev
timeout 90 python3 -m fusedattn run-all --version materialized,t1,torch-eager,flash --processes 3 --out $E 2>&1 | tail -14
timeout 150 python3 -m fusedattn bench --suite bf16 --warmup 3 --repeat 10 --out $E 2>&1 | tail -55
timeout 40 python3 -m fusedattn bench --suite fp32 --warmup 3 --repeat 10 --out $E 2>&1 | tail -16
timeout 45 python3 -m fusedattn bench --suite memory --providers flash,sdpa-flash,sdpa-cudnn --warmup 1 --repeat 3 --out $E 2>&1 | tail -8
timeout 90 python3 -m fusedattn bench --suite fp16 --warmup 3 --repeat 10 --out $E 2>&1 | tail -8
tar -C $E -czf "${OUT:-/tmp}/evidence-flash.tgz" .
