"""Why a first call misses a prebuilt kernel (`fusedattn.prebuilt`): the compiles of a
warmup (as `scripts/prebuild.py` runs it) and of one first call, each in a fresh process
with a cache of its own, recorded by Triton's compilation listener (the kernel, the cache
key's parts: the source's key, the specialisation attributes, the signature, the
constants, and the options), then each of the call's compiles beside the warmup's compiles
of the same kernel, with the parts that differ. The GPU only.

    python3 scripts/prebuilt_misses.py [--out DIR]   (writes DIR/prebuilt_misses.json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

RECORD = """
import json, os, sys
import triton
records = []

def listener(*, src, metadata, metadata_group, times, cache_hit):
    fn = getattr(src, "fn", None)
    records.append(dict(
        name=metadata.get("name"), hit=cache_hit, hash=metadata.get("hash"),
        source_key=getattr(fn, "cache_key", None), attrs=str(getattr(src, "attrs", None)),
        signature=str(sorted(getattr(src, "signature", {}).items())),
        constants=str(sorted((k, str(v)) for k, v in getattr(src, "constants", {}).items())),
        options={k: str(metadata.get(k)) for k in ("num_warps", "num_stages", "num_ctas",
                                                   "maxnreg", "debug")}))

triton.knobs.compilation.listener = listener
import torch, fusedattn
spec = json.loads(sys.argv[1])
if spec.get("warmup"):
    fusedattn.warmup(**spec["warmup"])
else:
    b, h, s, d = spec["call"]
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = fusedattn.attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
torch.cuda.synchronize()
print("RECORDS" + json.dumps(records))
"""
WARMUP = dict(head_dims=(64,), heads=(8,), dtypes=("bf16",), causal=(True,), training=True,
              max_len=4096)
CALLS = [(1, 8, 3001, 64), (1, 8, 1000, 64)]


def run(spec: dict, env: dict) -> list:
    proc = subprocess.run([sys.executable, "-c", RECORD, json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=500)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORDS")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{spec}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RECORDS"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    base = dict(os.environ, FUSEDATTN_PREBUILT="0")
    with tempfile.TemporaryDirectory() as a:
        warm = run({"warmup": WARMUP}, dict(base, TRITON_CACHE_DIR=a, FUSEDATTN_PRIME="0"))
    report = {"warmup": WARMUP, "warmup_compiles": warm, "calls": []}
    for call in CALLS:
        with tempfile.TemporaryDirectory() as b:
            got = run({"call": call}, dict(base, TRITON_CACHE_DIR=b))
        misses = []
        for rec in got:
            if rec["hash"] in {w["hash"] for w in warm}:
                continue
            same = [w for w in warm if w["name"] == rec["name"]]
            diffs = [{k: (rec[k], w[k]) for k in ("source_key", "attrs", "signature",
                                                  "constants", "options") if rec[k] != w[k]}
                     for w in same]
            misses.append(dict(name=rec["name"], call=rec, nearest=min(diffs, key=len)
                               if diffs else "no warmup compile of this kernel"))
        report["calls"].append(dict(call=call, compiles=len(got), misses=misses))
        print(f"call B,H,S,D={call}: {len(got)} compiles, {len(misses)} not in the warmup's")
        for m in misses:
            print(f"  {m['name']}: {json.dumps(m['nearest'])[:1500]}")
    with open(os.path.join(args.out, "prebuilt_misses.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
