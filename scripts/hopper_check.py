"""The Hopper forward's design measurements on the GPU, in one call (its correctness is the
GPU tier's, `tests/test_hopper.py`; the bench rows of record are `fusedattn bench`'s):

- the issue's rows, each provider verified against the first's output and timed: the
  Hopper path, the same without ping-pong (`forward.PINGPONG`), with K and V on one
  barrier a slot (`forward.SHARED_KV`), with each thread's own arrivals
  (`forward.THREAD_ARRIVES` on), with two consumer warpgroups at D64
  (`forward.WARPGROUPS`) and with the row sums reduced across lanes each tile
  (`forward.LANE_SUM` off), the portable kernel, SDPA cuDNN and flash, FA4 where it
  imports (`--only` keeps some);
- `--sweep`: the Hopper path against the portable kernel over short sequences (16k tokens a
  call), the measurement behind `dispatch.HOPPER_MIN_KEYS`;
- `--varlen-sweep`: the same for varlen's causal calls (16k tokens of documents up to each
  longest length, H16), the measurement behind varlen's threshold on its longest document.

    python3 scripts/hopper_check.py [--out DIR] [--sweep | --sweep-only] [--only A,B]
                                    [--rows I,J] [--varlen-sweep]

Prints one line per row; writes `hopper_check.json` under --out."""

import argparse
import json
import sys
import time

import torch
import triton

from fusedattn import attention
from fusedattn.dispatch import use_backend
from fusedattn_lab.peers import _fa4_batched
from fusedattn_lab.timing import time_gpu

ROWS = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True),
        (1, 32, 32, 16384, 128, True), (2, 32, 32, 8192, 64, True),
        (1, 32, 8, 8192, 128, True), (2, 16, 16, 4096, 256, False),
        (4, 32, 32, 4096, 96, False), (4, 32, 32, 4096, 192, False),
        (4, 32, 32, 4096, 64, False), (64, 16, 16, 256, 64, False)]


def switched(call, name, value):
    """`call` with `hopper.forward`'s A/B switch `name` set to `value` while it runs (the
    switches are in the plan key: each setting replays its own plan)."""
    def run():
        from fusedattn.hopper import forward

        before = getattr(forward, name)
        setattr(forward, name, value)
        try:
            return call()
        finally:
            setattr(forward, name, before)
    return run


def _on(backend: str, fn, *args, **kw):
    """`fn(*args, **kw)` under `use_backend(backend)`, as a call of no arguments."""
    def call():
        with use_backend(backend):
            return fn(*args, **kw)
    return call


def providers(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    calls = {backend: _on(backend, attention, q, k, v, is_causal=causal, enable_gqa=gqa)
             for backend in ("hopper", "portable")}
    def knob(name, value):  # the Hopper path with one of `hopper.forward`'s A/B switches
        return switched(calls["hopper"], name, value)
    calls["hopper-nopp"] = knob("PINGPONG", False)         # the consumers' explicit turns
    calls["hopper-sharedkv"] = knob("SHARED_KV", True)     # K and V on one mbarrier a slot
    calls["hopper-threadarrive"] = knob("THREAD_ARRIVES", True)  # each thread's arrivals
    calls["hopper-2wg"] = knob("WARPGROUPS", {})  # two consumers at D64 too
    calls["hopper-rowsum"] = knob("LANE_SUM", False)  # row sums shuffled every tile
    calls["hopper-split1"] = knob("MAX_SPLIT", 1)  # the row max in one chain a row
    calls["hopper-mask0"] = knob("MASK_FORM", 0)  # key indices a [BLOCK_N] tensor
    calls["hopper-mask1"] = knob("MASK_FORM", 1)  # constants, the row max in each arm
    calls["hopper-edge2"] = knob("MASK_FORM_EDGE", 2)  # unbounded launches as bounded ones
    for name, which in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def call(which=which):
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=gqa)
        calls[name] = call
    try:  # the lab's FA4 peer: [B, S, H, D] copies made once, outside the timed call
        calls["fa4"] = _fa4_batched(q, k, v, causal, None)
    except ImportError:
        pass
    return calls


def measure(calls: dict, flops: float, only=None, unverified=()) -> dict:
    """Each call (but those not in `only`) checked against the first's output, timed, and
    checked again: {name: dict(ms, tflops, err), or "refused: ..." where it raised}.
    `unverified` names calls that return no output (timed alone: no tflops, no err)."""
    ref, line = None, {}
    for name, call in calls.items():
        if only and name not in only:
            continue
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as e:  # a peer that refuses the row
            line[name] = f"refused: {type(e).__name__}: {str(e)[:80]}"
            continue
        ms = time_gpu(call, warmup=10, repeat=50).median_ms  # the GPU kept busy first
        if name in unverified:
            line[name] = dict(ms=ms, tflops=None, err=None)
            continue
        if ref is None:
            ref = out.float()
        err = max((o.float() - ref).abs().max().item() for o in (out, call()))
        line[name] = dict(ms=ms, tflops=flops / ms / 1e9, err=err)
    return line


def bench(rows, only=None):
    results = []
    for b, h, hk, s, d, causal in rows:
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        line = measure(providers(q, k, v, causal), flops, only)
        results.append(dict(row=[b, h, hk, s, d, causal], **line))
        cells = " ".join(f"{n}={v['tflops']:.0f}" if isinstance(v, dict) else f"{n}=-"
                         for n, v in line.items())
        print(f"B{b} H{h}/{hk} S{s} D{d} causal={causal}: {cells}", flush=True)
    return results


SWEEP = [(16384 // s, 16, 16, s, d, c) for d in (64, 128) for c in (False, True)
         for s in (128, 256, 384, 512, 768, 1024, 2048, 4096)]


VARLEN_SWEEP = ([(d, longest) for d in (64, 128) for longest in (256, 384, 512, 768, 1024,
                                                                1280, 1536, 2048)]
                + [(64, longest) for longest in (2560, 3072, 4096)]
                + [(d, longest) for d in (96, 192, 256) for longest in (512, 768, 1024, 1536,
                                                                        2048)])


def varlen_lengths(longest: int, tokens: int = 16384, seed: int = 0) -> list[int]:
    """Documents of [longest / 2, longest] tokens (the first `longest` itself) until
    `tokens` are packed, the last cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lens, total = [longest], longest
    while total < tokens:
        n = min(int(torch.randint(longest // 2, longest + 1, (1,), generator=gen)),
                tokens - total)
        lens.append(n)
        total += n
    return lens


def varlen_sweep(rows=VARLEN_SWEEP, heads: int = 16):
    """Varlen causal calls, Hopper path against the portable kernel (the first checked
    against the second's output), useful TFLOP/s."""
    from fusedattn import attention_varlen
    from fusedattn.varlen import offsets_of

    results = []
    for d, longest in rows:
        lens = varlen_lengths(longest)
        total = sum(lens)
        cu = offsets_of(lens, "cuda")
        g = torch.Generator(device="cuda").manual_seed(2)
        q, k, v = (torch.randn(total, heads, d, device="cuda", generator=g,
                               dtype=torch.bfloat16) for _ in range(3))
        calls = {backend: _on(backend, attention_varlen, q, k, v, cu, cu, longest, longest,
                              is_causal=True) for backend in ("portable", "hopper")}
        flops = sum(4 * heads * n * n * d / 2 for n in lens)
        line = measure(calls, flops)
        results.append(dict(row=[d, longest, len(lens), total], **line))
        cells = " ".join(f"{n}={v['tflops']:.0f}" if isinstance(v, dict) else f"{n}=-"
                         for n, v in line.items())
        print(f"varlen D{d} longest {longest} ({len(lens)} docs, {total} tokens) causal: "
              f"{cells}", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true", help="also the short-sequence sweep")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep alone")
    ap.add_argument("--only", default="", help="the rows' providers, comma-separated")
    ap.add_argument("--rows", default="", help="indices into ROWS, comma-separated (default: "
                    "all; a short A/B call)")
    ap.add_argument("--varlen-sweep", action="store_true",
                    help="the varlen causal sweep alone (VARLEN_SWEEP)")
    args = ap.parse_args()
    if args.varlen_sweep:
        t0 = time.time()
        results = varlen_sweep()
        with open(f"{args.out}/hopper_check_varlen.json", "w") as f:
            json.dump(dict(varlen_sweep=results, gpu=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=triton.__version__,
                           seconds=time.time() - t0), f, indent=1)
        return 0
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    args.sweep |= args.sweep_only
    t0 = time.time()
    results = [] if args.sweep_only else bench(rows, only=tuple(filter(None,
                                                                       args.only.split(","))))
    sweep = bench(SWEEP, only=("hopper", "portable", "cudnn")) if args.sweep else []
    with open(f"{args.out}/hopper_check.json", "w") as f:
        json.dump(dict(bench=results, sweep=sweep, gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__,
                       seconds=time.time() - t0), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
