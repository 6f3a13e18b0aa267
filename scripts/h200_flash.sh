#!/usr/bin/env bash
# Issue 7 on the H200: the bench suites, the flash kernel in the chapter's protocol (run-all
# at 128x64 with the boundary shapes), then the flash tests on the GPU. Each step has its own
# time limit; the CSVs are rewritten after every problem, so what finished is kept. Evidence
# comes back as $OUT/evidence-flash.tgz (the test log as $OUT/pytest-flash.txt).
set -u
export COLUMNS=170
E=/tmp/ev
mkdir -p $E
timeout 150 python3 -m fusedattn bench --suite bf16 --warmup 3 --repeat 10 --out $E 2>&1 | tail -52
timeout 75 python3 -m fusedattn bench --suite fp32 --warmup 3 --repeat 10 --out $E 2>&1 | tail -22
timeout 110 python3 -m fusedattn run-all --version materialized,t1,torch-eager,flash --processes 3 --out $E 2>&1 | tail -14
timeout 150 python3 -m fusedattn bench --suite fp16 --warmup 3 --repeat 10 --out $E 2>&1 | tail -8
tar -C $E -czf "${OUT:-/tmp}/evidence-flash.tgz" .
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_flash.py \
  -k "fp32_matches or tensor_core or fp16_within" > "${OUT:-/tmp}/pytest-flash.txt" 2>&1
tail -3 "${OUT:-/tmp}/pytest-flash.txt"
