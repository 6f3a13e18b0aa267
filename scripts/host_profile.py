"""Where a call's host time goes (issue 31's first step): each entry point called in a loop
without synchronising, under cProfile, its time grouped by the layer it is spent in.

    python3 scripts/host_profile.py [--calls 300] [--out host_profile.json]

On a GPU this is the host cost a user pays per call (the kernels run asynchronously; the
loop's wall time per call is the host's, as long as the GPU keeps up). In emulation the
kernels run in Triton's interpreter on the CPU and dominate: only the layers above the
launch mean anything there, and no figure from it is a GPU host cost.

Layers, by the file a function lives in (its own time, cProfile's tottime):
validation (`fusedattn.problem`, `api._validate`, `varlen.check_*`, `kvcache._validate`),
configs and dispatch (`fusedattn.configs`, `precision`, `dispatch`, `tiles`), the Hopper
launcher's descriptors (`hopper/forward.py`, Triton's `TensorDescriptor`), torch's custom-op
and autograd dispatch (`torch/_library`, `torch/_ops`, `torch/autograd`), Triton's launcher
(`triton/runtime`, its generated launcher), and torch's tensor ops (allocation included,
builtins)."""

import argparse
import cProfile
import json
import pstats
import time

import torch

from fusedattn import attention, attention_varlen, attention_with_kvcache
from fusedattn.mode import DEVICE, EMULATION

LAYERS = [  # (layer, substrings of the file path); the first that matches
    ("validation", ("fusedattn/problem.py", "fusedattn/varlen.py", "fusedattn/kvcache.py")),
    ("api", ("fusedattn/api.py",)),
    ("configs and dispatch", ("fusedattn/configs.py", "fusedattn/precision.py",
                              "fusedattn/dispatch.py", "fusedattn/tiles/")),
    ("hopper launch", ("fusedattn/hopper/", "triton/tools/tensor_descriptor",
                       "gluon/nvidia", "gluon/_runtime")),
    ("torch custom op / autograd", ("torch/_library", "torch/_ops", "torch/autograd",
                                    "torch/_higher_order", "torch/utils/_python_dispatch")),
    ("triton launcher", ("triton/runtime", "triton/backends", "__triton_launcher",
                         "triton/compiler")),
]


def _problems():
    """The issue's four entry points, small enough that the host dominates."""
    dt = torch.bfloat16 if not EMULATION else torch.float32
    s = 256 if not EMULATION else 32
    q, k, v = (torch.randn(4, 8, s, 64, device=DEVICE, dtype=dt) for _ in range(3))
    g = tuple(t.clone().requires_grad_() for t in (q, k, v))
    total = 3 * s
    x = [torch.randn(total, 8, 64, device=DEVICE, dtype=dt) for _ in range(3)]
    cu = torch.tensor([0, s, 2 * s, total], dtype=torch.int32, device=DEVICE)
    kc, vc = (torch.randn(4, 2, 4 * s, 64, device=DEVICE, dtype=dt) for _ in range(2))
    q1 = torch.randn(4, 8, 1, 64, device=DEVICE, dtype=dt)
    lens = torch.full((4,), 4 * s, dtype=torch.int32, device=DEVICE)

    def fwd_bwd():
        attention(*g, is_causal=True).sum().backward()
    return {
        "attention": lambda: attention(q, k, v, is_causal=True),
        "attention fwd+bwd": fwd_bwd,
        "attention_varlen": lambda: attention_varlen(*x, cu, cu, s, s, is_causal=True),
        "attention_with_kvcache": lambda: attention_with_kvcache(
            q1, kc, vc, cache_seqlens=lens, check_lengths=False),
    }


def _layer(path: str) -> str:
    for name, parts in LAYERS:
        if any(p in path for p in parts):
            return name
    return "torch ops and the rest"


def profile(call, calls: int) -> dict:
    for _ in range(5):  # compiles and caches first
        call()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    wall = (time.perf_counter() - t0) / calls
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    layers: dict[str, float] = {}
    for (path, _line, _fn), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():
        layers[_layer(path)] = layers.get(_layer(path), 0.0) + tottime / calls
    return {"us_per_call": wall * 1e6,
            "layers_us": {k: round(v * 1e6, 2) for k, v in sorted(layers.items(),
                                                                    key=lambda kv: -kv[1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"device": str(DEVICE), "emulation": EMULATION, "torch": torch.__version__}
    for name, call in _problems().items():
        result[name] = profile(call, args.calls)
        layers = ", ".join(f"{k} {v:.1f}" for k, v in result[name]["layers_us"].items())
        print(f"{name}: {result[name]['us_per_call']:.1f} us a call (no profiler); "
              f"under cProfile, us a call: {layers}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
