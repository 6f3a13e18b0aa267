"""The Hopper FP8 forward's design measurements on the GPU, in one call (its correctness is
the GPU tier's, `tests/test_fp8.py`; the bench rows of record are `fusedattn bench --suite
fp8`'s):

- the bench's rows (B4 H32 S4096, D64/128/256, causal and not; per-head factors), each
  provider verified against the portable kernel's output (the same formula) and timed:
  the Hopper path with its tiles (`hopper.forward.FP8_TILES`), with each of its FP8 A/B
  switches turned the other way (`FP8_PACK`, `MAX_SPLIT`, `FP8_WARPGROUPS`), and with each
  candidate of `CANDIDATES` (all of them fit in shared memory and compile without
  serialising a wgmma: `scripts/gluon_compile_report.py`), V's transpose alone
  (`hopper/transpose.py`, the part of a call that is not the attention kernel), the
  portable kernel, and cuDNN in bf16 on the dequantised values;
- `--sweep`: the Hopper path against the portable kernel over short sequences (16k tokens
  a call), the measurement an FP8 `dispatch.HOPPER_MIN_KEYS` would rest on.

The FP8 backward's rows are `fusedattn bench --suite fp8`'s (kind fp8-bwd).

    python3 scripts/hopper_fp8_check.py [--out DIR] [--sweep] [--only PROVIDERS]

Prints one line per row; writes `hopper_fp8_check.json` under --out."""

import argparse
import json
import sys
import time

import torch
import triton
from hopper_check import measure, switched  # (scripts/ is on a script's path)

from fusedattn import attention
from fusedattn.dispatch import _PLANS, use_backend
from fusedattn.hopper import forward
from fusedattn.hopper.transpose import v_transposed
from fusedattn.reference import dequantize

ROWS = [(4, 32, 32, 4096, d, c) for d in (64, 128, 256) for c in (False, True)]
# (BLOCK_N, STAGES) per head dim, beside FP8_TILES' own
CANDIDATES = {64: [(256, 3), (64, 6)], 128: [(128, 3), (64, 6)], 256: [(64, 4), (64, 3)]}
SWEEP = [(16384 // s, 16, 16, s, d, c) for d in (64, 128) for c in (False, True)
         for s in (128, 256, 512, 1024, 2048)]
_TILES_NOW = [None]  # the tiles the recorded plans were made with


def _with_tiles(call, dim, tiles):
    """`call` with FP8_TILES[dim, dim] = tiles (None: the table's own). The plans' key does
    not hold the table, so they are dropped where the tiles change."""
    def run():
        own = forward.FP8_TILES[dim, dim]
        chosen = own if tiles is None else tiles
        if _TILES_NOW[0] != chosen:
            _PLANS.clear()
            _TILES_NOW[0] = chosen
        forward.FP8_TILES[dim, dim] = chosen
        try:
            return call()
        finally:
            forward.FP8_TILES[dim, dim] = own
    return run


def providers(q8, k8, v8, factors, causal, candidates):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dim = q8.shape[-1]
    gqa = q8.shape[1] != k8.shape[1]
    kw = dict(is_causal=causal, enable_gqa=gqa, descale_q=factors[0], descale_k=factors[1],
              descale_v=factors[2])
    def on(backend):
        def call():
            with use_backend(backend):
                return attention(q8, k8, v8, **kw)
        return call

    calls = {"portable": on("portable"), "hopper": _with_tiles(on("hopper"), dim, None)}

    def knob(name, value):  # the Hopper path with one of `hopper.forward`'s A/B switches
        return switched(calls["hopper"], name, value)
    calls["hopper-nopack"] = knob("FP8_PACK", False)  # P * P_SCALE and Triton's .to
    calls["hopper-split1"] = knob("MAX_SPLIT", 1)  # the row max in one chain a row
    calls["hopper-2wg"] = knob("FP8_WARPGROUPS", {})  # two consumers at D64 too
    own = forward.FP8_TILES[dim, dim]
    for block_n, stages in candidates:
        calls[f"hopper-n{block_n}-s{stages}"] = _with_tiles(on("hopper"), dim,
                                                            (*own[:5], block_n, stages))
    calls["transpose"] = lambda: v_transposed(v8)[0]  # not an output: not verified
    q, k, v = (dequantize(t, f).to(torch.bfloat16) for t, f in zip((q8, k8, v8), factors,
                                                                   strict=True))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    calls["cudnn-bf16"] = cudnn
    return calls


def bench(rows, only=None, candidates=True):
    results = []
    for b, h, hk, s, d, causal in rows:
        g = torch.Generator(device="cuda").manual_seed(1)
        x = [torch.randn(b, n, s, d, device="cuda", generator=g) for n in (h, hk, hk)]
        factors = [t.abs().amax(dim=(0, 2, 3)) / 256 for t in x]
        q8, k8, v8 = ((t / f.reshape(-1, 1, 1)).to(torch.float8_e4m3fn)
                      for t, f in zip(x, factors, strict=True))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        calls = providers(q8, k8, v8, factors, causal, CANDIDATES[d] if candidates else [])
        # the portable kernel first: the others are checked against its output
        line = measure(calls, flops, only, unverified=("transpose",))
        results.append(dict(row=[b, h, hk, s, d, causal], **line))
        cells = " ".join(
            (f"{n}={v['ms'] * 1e3:.0f}us" if v["tflops"] is None else
             f"{n}={v['tflops']:.0f}(err {v['err']:.1e})") if isinstance(v, dict) else f"{n}=-"
            for n, v in line.items())
        print(f"B{b} H{h}/{hk} S{s} D{d} causal={causal}: {cells}", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true", help="also the short-sequence sweep")
    ap.add_argument("--only", default="", help="the rows' providers, comma-separated "
                    "(default: all; the candidates' names are hopper-nN-sS)")
    args = ap.parse_args()
    t0 = time.time()
    results = bench(ROWS, only=tuple(filter(None, args.only.split(","))))
    sweep = (bench(SWEEP, only=("portable", "hopper", "cudnn-bf16"), candidates=False)
             if args.sweep else [])
    with open(f"{args.out}/hopper_fp8_check.json", "w") as f:
        json.dump(dict(bench=results, sweep=sweep, candidates=CANDIDATES,
                       tiles={f"{a}/{b}": t for (a, b), t in forward.FP8_TILES.items()},
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, seconds=time.time() - t0), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
