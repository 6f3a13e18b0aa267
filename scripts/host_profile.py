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
    wall = wall_us(call, calls) / 1e6
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
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:25]
    return {"us_per_call": wall * 1e6,
            "layers_us": {k: round(v * 1e6, 2) for k, v in sorted(layers.items(),
                                                                    key=lambda kv: -kv[1])},
            "top_us": [f"{tt / calls * 1e6:7.2f} {cc / calls:5.1f}x "
                       f"{path.split('site-packages/')[-1]}:{ln} {fn}"
                       for (path, ln, fn), (_pc, cc, tt, _ct, _c) in top]}


def wall_us(call, calls: int) -> float:
    """Host µs a call of `call` in a loop without synchronising (after 5 calls, which
    compile and fill the caches)."""
    for _ in range(5):
        call()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    us = (time.perf_counter() - t0) / calls * 1e6
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return us


def _sdpa_problems():
    """SDPA on the same shapes as `_problems` (cuDNN and flash where they serve)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dt = torch.bfloat16
    q, k, v = (torch.randn(4, 8, 256, 64, device=DEVICE, dtype=dt) for _ in range(3))
    g = tuple(t.clone().requires_grad_() for t in (q, k, v))
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def fwd(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=True)

        def fwd_bwd(backend=backend):
            with sdpa_kernel(backend):
                sdpa(*g, is_causal=True).sum().backward()

        def fwd_bare():
            return sdpa(q, k, v, is_causal=True)
        out[f"sdpa {name} (inside sdpa_kernel)"] = fwd
        out[f"sdpa {name} fwd+bwd"] = fwd_bwd
    out["sdpa default, no context"] = fwd_bare
    return out


class Floor(torch.autograd.Function):
    """A Python autograd Function that allocates what ours does and launches nothing: the
    floor torch's autograd puts under any Python attention's training step (SDPA's backward
    node is C++; this one's backward is Python, as ours is). `instructions_per_call.py`
    counts it too."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _pieces():
    """The layers under `attention`, called one by one on the forward's problem."""
    from fusedattn.api import _flash_fwd_op
    from fusedattn.dispatch import forward

    dt = torch.bfloat16
    q, k, v = (torch.randn(4, 8, 256, 64, device=DEVICE, dtype=dt) for _ in range(3))
    q2, k2, v2 = (torch.randn(4, 8, 4096, 128, device=DEVICE, dtype=dt) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=DEVICE, dtype=torch.float32)
    out2 = torch.empty_like(q2)
    lse2 = torch.empty(q2.shape[:3], device=DEVICE, dtype=torch.float32)

    @torch.library.custom_op("fusedattn_probe::nothing", mutates_args=())
    def nothing(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(1)

    g = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))

    opts = dict(is_causal=True, scale=0.125, precision="ieee")
    return {
        "autograd.Function floor fwd+bwd (no kernels)": lambda: Floor.apply(
            *g).sum().backward(),
        "torch.empty_like x2": lambda: (torch.empty_like(q),
                                        torch.empty(q.shape[:3], device=DEVICE)),
        "custom_op doing nothing": lambda: nothing(q),
        "op fusedattn::flash_fwd (S256)": lambda: _flash_fwd_op(q, k, v, None, True, 0.125,
                                                                "ieee", -1, 0, 0.0),
        "dispatch.forward portable (S256)": lambda: forward(q, k, v, out=out, lse=lse, **opts),
        "dispatch.forward hopper (S4096 D128)": lambda: forward(q2, k2, v2, out=out2,
                                                                lse=lse2, **opts),
    }


def sweep_compiles(dim: int, causal: bool) -> dict:
    """Kernels compiled by forward calls over S = 100..16384 (B1 H8, bf16), by Triton's
    compilation listener, and the first call's time at each length."""
    import triton

    compiles = []
    triton.knobs.compilation.listener = (
        lambda *, src, metadata, metadata_group, times, cache_hit: compiles.append(
            (metadata.get("name", "?"), cache_hit)))
    firsts = {}
    for s in (100, 128, 200, 256, 300, 512, 777, 1000, 1024, 1500, 1777, 2048, 3001, 4096,
              5000, 8192, 10000, 16384):
        q, k, v = (torch.randn(1, 8, s, dim, device=DEVICE, dtype=torch.bfloat16)
                   for _ in range(3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        attention(q, k, v, is_causal=causal)
        torch.cuda.synchronize()
        firsts[s] = round(time.perf_counter() - t0, 3)
    triton.knobs.compilation.listener = None
    return {"kernels": len(compiles), "by_name": {n: sum(1 for c in compiles if c[0] == n)
                                                 for n in {c[0] for c in compiles}},
            "first_call_s": firsts}


def train_profile(calls: int) -> dict:
    """A training step's host cost taken apart (issue 31: fwd+bwd was the row furthest from
    SDPA's): `attention` fwd+bwd and SDPA's on `_sdpa_problems`' shapes, each under
    torch.profiler (CPU and CUDA: every thread's CPU time, autograd's own included, and the
    GPU's kernel time a step), and fusedattn's backward under cProfile inside autograd's
    thread (its Function's `backward` wrapped: cProfile sees one thread, the one that
    enables it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import fusedattn.api as api
    from fusedattn.dispatch import use_backend
    from fusedattn.hopper import backward as knobs

    g = tuple(torch.randn(4, 8, 256, 64, device=DEVICE, dtype=torch.bfloat16,
                          requires_grad=True) for _ in range(3))

    def ours():
        attention(*g, is_causal=True).sum().backward()

    def peer(backend):
        def step():
            with sdpa_kernel(backend):
                sdpa(*g, is_causal=True).sum().backward()
        return step

    result = {}
    steps = {"fusedattn": ours, "sdpa cudnn": peer(SDPBackend.CUDNN_ATTENTION),
             "sdpa flash": peer(SDPBackend.FLASH_ATTENTION)}
    def on_hopper(zero):  # the Hopper backward forced (S256 D64 is under its MIN_KEYS)
        def step():
            knobs.ZERO_IN_PREPROCESS = zero
            try:
                with use_backend("hopper"):
                    ours()
            finally:
                knobs.ZERO_IN_PREPROCESS = True
        return step

    def kept(setting):
        def step():
            api.KEEP_RECORDED = setting
            try:
                ours()
            finally:
                api.KEEP_RECORDED = True
        return step

    # A/Bs, in rounds that alternate with SDPA cuDNN's step (a machine that drifts moves
    # them all alike): µs a step, 300 steps a reading. `api.KEEP_RECORDED`; and
    # `hopper.backward.ZERO_IN_PREPROCESS` (dQ's accumulator and the counters zeroed by the
    # preprocess, or by two fills) on the Hopper backward
    contenders = {"fusedattn, kept plans": kept(True),
                  "fusedattn, KEEP_RECORDED off": kept(False),
                  "fusedattn hopper bwd, zeroed by the preprocess": on_hopper(True),
                  "fusedattn hopper bwd, two fills": on_hopper(False),
                  "sdpa cudnn": steps["sdpa cudnn"]}
    readings: dict[str, list] = {name: [] for name in contenders}
    for _ in range(5):
        for name, step in contenders.items():
            readings[name].append(round(wall_us(step, 300), 1))
    result["ab"] = {name: {"median": sorted(r)[len(r) // 2], "rounds": r}
                    for name, r in readings.items()}
    for name, r in result["ab"].items():
        print(f"A/B {name}: median {r['median']} us a step, rounds {r['rounds']}", flush=True)
    for name, step in steps.items():
        wall = wall_us(step, 300)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        threads: dict[int, float] = {}
        for e in prof.events():
            threads[e.thread] = threads.get(e.thread, 0.0) + e.self_cpu_time_total / calls
        table = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in table) / calls
        top = sorted(table, key=lambda e: -e.self_cpu_time_total)[:20]
        result[name] = {
            "us_per_step_no_profiler": round(wall, 1),
            "gpu_kernel_us_per_step": round(gpu, 1),
            "cpu_self_us_per_step_by_thread": sorted((round(v, 1) for v in threads.values()),
                                                     reverse=True),
            "top_cpu_ops": [f"{e.self_cpu_time_total / calls:7.1f} us {e.count / calls:4.1f}x "
                            f"{e.key}" for e in top]}
        print(f"{name}: {wall:.1f} us a step (no profiler); GPU kernels {gpu:.1f} us a step; "
              f"CPU self us a step by thread {result[name]['cpu_self_us_per_step_by_thread']}",
              flush=True)
        print("\n".join("   " + line for line in result[name]["top_cpu_ops"][:12]), flush=True)
    # the backward's Python alone, inside autograd's thread (the Function a recorded call
    # takes: `_FlashCall` with the kept plans, else `_Flash`)
    function = api._FlashCall if api.KEEP_RECORDED else api._Flash
    backward = function.backward
    prof = cProfile.Profile()

    def profiled(ctx, *grads):
        prof.enable()
        try:
            return backward(ctx, *grads)
        finally:
            prof.disable()
    function.backward = staticmethod(profiled)
    try:
        for _ in range(calls):
            ours()
        torch.cuda.synchronize()
    finally:
        function.backward = staticmethod(backward)
    stats = pstats.Stats(prof).stats
    layers: dict[str, float] = {}
    for (path, _line, _fn), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        layers[_layer(path)] = layers.get(_layer(path), 0.0) + tottime / calls * 1e6
    result["fusedattn backward under cProfile"] = {
        "layers_us": {k: round(v, 2) for k, v in sorted(layers.items(), key=lambda kv: -kv[1])},
        "top_us": [f"{tt / calls * 1e6:7.2f} {cc / calls:5.1f}x "
                   f"{path.split('site-packages/')[-1]}:{ln} {fn}"
                   for (path, ln, fn), (_pc, cc, tt, _ct, _c)
                   in sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]]}
    print("fusedattn backward (autograd's thread) under cProfile, us a step:",
          result["fusedattn backward under cProfile"]["layers_us"])
    print("\n".join(result["fusedattn backward under cProfile"]["top_us"]), flush=True)
    return result


def direct_ab(calls: int, rounds: int = 5) -> dict:
    """`launch.DIRECT_LAUNCH` A/B'd in one process: the host µs a call, replays calling
    Triton's compiled launcher themselves (TMA maps kept per address) against Triton's
    own launch, on short rows (the host-bound ones) by "auto" and forced onto the Hopper
    path, in rounds that alternate with SDPA cuDNN's same call. The two sides' outputs
    (and gradients) are checked equal, bit for bit, first."""
    problems = {  # (B, H, S, D, causal, training, backend)
        "fwd B1 H8 S128 D64": (1, 8, 128, 64, False, False, "auto"),
        "fwd B1 H8 S128 D64, hopper": (1, 8, 128, 64, False, False, "hopper"),
        "fwd B4 H16 S512 D128 causal, hopper": (4, 16, 512, 128, True, False, "hopper"),
        "fwd+bwd B4 H8 S256 D64 causal": (4, 8, 256, 64, True, True, "auto"),
        "fwd+bwd B4 H8 S256 D128 causal, hopper": (4, 8, 256, 128, True, True, "hopper"),
    }
    result = {}
    for name, problem in problems.items():
        sides = _direct_sides(*problem)
        got = [sides[side]() for side in ("Triton's launch", "direct", "direct")]
        same = all(torch.equal(a, b) for other in got[1:]
                   for a, b in zip(got[0], other, strict=True))
        readings: dict[str, list] = {side: [] for side in sides}
        for _ in range(rounds):
            for side, call in sides.items():
                readings[side].append(round(wall_us(call, calls), 1))
        result[name] = {"same_bits": same, **{
            side: {"median": sorted(r)[len(r) // 2], "rounds": r}
            for side, r in readings.items()}}
        print(f"{name}: same bits {same}; " + "; ".join(
            f"{side} {r['median']} us" for side, r in result[name].items()
            if side != "same_bits"), flush=True)
    return result


def _direct_sides(b, h, s, d, causal, train, backend) -> dict:
    """`direct_ab`'s three calls on one problem: ours launched directly, ours by Triton's
    launch, SDPA cuDNN; each returns the output (and the gradients where `train`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from fusedattn import launch
    from fusedattn.dispatch import use_backend

    q, k, v = (torch.randn(b, h, s, d, device=DEVICE, dtype=torch.bfloat16,
                           requires_grad=train) for _ in range(3))
    dout = torch.randn_like(q)

    def run(attend):
        out = attend(q, k, v, is_causal=causal)
        return [out, *torch.autograd.grad(out, (q, k, v), dout)] if train else [out]

    def ours(direct):
        def call():
            kept, launch.DIRECT_LAUNCH = launch.DIRECT_LAUNCH, direct
            try:
                with use_backend(backend):
                    return run(attention)
            finally:
                launch.DIRECT_LAUNCH = kept
        return call

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return run(sdpa)

    return {"direct": ours(True), "Triton's launch": ours(False), "sdpa cudnn": cudnn}


def bench_rows(calls: int) -> dict:
    """The host suite's own calls (`fusedattn_lab.host._calls`: the bench's problems,
    inputs and call bodies), fusedattn's alone, each timed and profiled by itself: where a
    bench row's µs go, and whether a row reads the same alone as among the suite's turns."""
    import fusedattn
    from fusedattn_lab import host

    out = {}
    for problem in host.problems():
        gen = torch.Generator(device="cuda").manual_seed(0)
        provided, _ = host._calls(problem, gen, {"fusedattn": fusedattn})
        for name, (_backend, call) in provided.items():
            if name.startswith("fusedattn"):
                out[f"{problem.label()} | {name}"] = got = profile(call, calls)
                print(f"{problem.label()} | {name}: {got['us_per_call']:.1f} us a call",
                      flush=True)
                print("\n".join(got["top_us"][:12]), flush=True)
    return out


def _environment() -> dict | None:
    """The lab's environment record (GPU, driver, versions, commit), where the lab is
    installed."""
    try:
        from fusedattn_lab.evidence import environment
    except ImportError:
        return None
    return environment()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true",
                        help="also count the kernels forward calls over S=100..16384 compile")
    parser.add_argument("--train", action="store_true",
                        help="only a training step's host cost taken apart (a GPU)")
    parser.add_argument("--direct-ab", action="store_true",
                        help="only launch.DIRECT_LAUNCH A/B'd in one process (a GPU)")
    parser.add_argument("--bench-rows", action="store_true",
                        help="only the host suite's calls, each alone, profiled (a GPU)")
    args = parser.parse_args()
    result = {"device": str(DEVICE), "emulation": EMULATION, "torch": torch.__version__,
              "environment": _environment()}
    if args.train or args.direct_ab or args.bench_rows:
        if DEVICE.type != "cuda" or not torch.cuda.is_available():
            parser.error("--train, --direct-ab and --bench-rows time the GPU's host cost: "
                         "they need a GPU")
        if args.train:
            result["train"] = train_profile(min(args.calls, 100))
        elif args.bench_rows:
            result["bench_rows"] = bench_rows(args.calls)
        else:
            result["direct_ab"] = direct_ab(args.calls)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return
    for name, call in _problems().items():
        result[name] = profile(call, args.calls)
        layers = ", ".join(f"{k} {v:.1f}" for k, v in result[name]["layers_us"].items())
        print(f"{name}: {result[name]['us_per_call']:.1f} us a call (no profiler); "
              f"under cProfile, us a call: {layers}", flush=True)
    if DEVICE.type == "cuda":
        for name, call in {**_sdpa_problems(), **_pieces()}.items():
            result[name] = {"us_per_call": wall_us(call, args.calls)}
            print(f"{name}: {result[name]['us_per_call']:.1f} us a call", flush=True)
        for name in ("attention", "attention fwd+bwd"):
            print(f"-- {name}, top functions (own us a call, calls a call):")
            print("\n".join(result[name]["top_us"]))
        if args.sweep:
            for dim, causal in ((128, True), (64, False)):
                key = f"sweep D{dim}{' causal' if causal else ''}"
                result[key] = sweep_compiles(dim, causal)
                print(key, result[key], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
