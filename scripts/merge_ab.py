"""Split-KV's merge, this tree's `tiles/splitkv.merge_splits` against an older tree's, in one
process on the GPU (the split partials of decode rows, random, as the split kernel leaves
them: some splits empty).

    git archive REV src | tar -x -C .hostab-base    # an ignored folder, carried
    python3 scripts/merge_ab.py --base .hostab-base [--rounds 5] --out DIR

(`--base` as `scripts/host_ab.py` takes it: the folder holding the older `src/`.)

Until 2026-12-05 the merge was one program per 16 rows walking the splits one load at a
time: a long sequence's 32 rows (B1 H32, 64 splits) ran on two programs. Since then a
program loads every split of up to 16 rows and 32 columns at once. The bench's decode row
B1 Sk131072 ran at 0.75x cuDNN (not profiled); this times the merge alone. Each merge is
checked against the float64 merge of the same partials before timing; the two kernels take
turns (`--rounds`), each a median of 50 calls by `fusedattn_lab.timing.time_gpu`. Writes
DIR/merge_ab.json."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

from fusedattn.tiles import splitkv
from fusedattn_lab.evidence import environment, write_json
from fusedattn_lab.timing import time_gpu

# (name, splits, batch, heads, head dim): the bench's decode rows' merges, as
# `kvcache.chosen_splits` splits them (H32/8, one query: B1 over 131k keys 64 splits, B32
# over 8k 3, B8 over 32k 9), and the head dims beside
ROWS = [("B1 H32 Sk131072 D128", 64, 1, 32, 128), ("B1 H32 Sk131072 D64", 64, 1, 32, 64),
        ("B1 H32 Sk131072 D256", 64, 1, 32, 256), ("B32 H32 Sk8192 D128", 3, 32, 32, 128),
        ("B8 H32 Sk32768 D128", 9, 8, 32, 128)]


def _base(base: Path):
    """The older tree's `splitkv` module (`base`/src/fusedattn/tiles/splitkv.py), imported
    from its file under another name (its imports are this tree's `fusedattn.launch`
    helpers)."""
    spec = importlib.util.spec_from_file_location(
        "splitkv_base", base / "src" / "fusedattn" / "tiles" / "splitkv.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["splitkv_base"] = module
    spec.loader.exec_module(module)
    return module


def _reference(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The float64 merge: sum_s exp(LSE_s - LSE) O_s, O = 0 where no split saw a key."""
    part, lse = part.double(), lse.double()
    m = lse.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    total = w.sum(0)
    return (w[..., None] * part).sum(0) / torch.where(total == 0, 1, total)[..., None]


def run(base, rounds: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, splits, batch, heads, dim in ROWS:
        part = torch.randn(splits, batch, heads, 1, dim, device="cuda", generator=g)
        lse = torch.randn(splits, batch, heads, 1, device="cuda", generator=g) * 4
        empty = torch.rand(splits, batch, heads, 1, device="cuda", generator=g) < 0.1
        lse[empty], part[empty] = float("-inf"), 0.0
        want = _reference(part, lse)
        calls, ok = {}, {}
        for kind, module in (("new", splitkv), ("base", base)):
            out = torch.empty(batch, heads, 1, dim, dtype=torch.bfloat16, device="cuda")
            out_lse = torch.empty(batch, heads, 1, device="cuda")

            def call(module=module, out=out, out_lse=out_lse, part=part, lse=lse):
                module.merge_splits(part, lse, out, out_lse)
            call()
            torch.cuda.synchronize()
            ok[kind] = bool(torch.allclose(out.double(), want, atol=2e-2, rtol=1e-2))
            calls[kind] = call
        times = {kind: [] for kind in calls}
        for _ in range(rounds):
            for kind, call in calls.items():
                times[kind].append(time_gpu(call, warmup=5, repeat=50).median_ms * 1000)
        row = dict(name=name, splits=splits, batch=batch, heads=heads, dim=dim,
                   **{f"{k}_us": statistics.median(v) for k, v in times.items()},
                   **{f"{k}_rounds_us": v for k, v in times.items()},
                   **{f"{k}_ok": v for k, v in ok.items()})
        rows.append(row)
        print(f"{name}: new {row['new_us']:.2f} us (ok={ok['new']}), base {row['base_us']:.2f} "
              f"us (ok={ok['base']})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the folder holding an older tree's src/")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = run(_base(Path(args.base)), args.rounds)
    if args.out:
        write_json(f"{args.out}/merge_ab.json", dict(environment=environment(), rows=rows))


if __name__ == "__main__":
    main()
