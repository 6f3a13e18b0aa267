"""Issue 14's Hopper question, asked of Triton on the H200: do tensor descriptors (TMA), a
persistent grid and Triton's automatic warp specialisation make a FlashAttention forward
faster than the library's kernel, and how close do they come to cuDNN?

A small stand-alone forward (bf16/fp16, contiguous `[B, H, S, D]`, S a multiple of the tiles,
causal top-left or not) with four switches, combinations of which are compiled and
timed at a few tile configs against `fusedattn.attention` (the library's kernel) and SDPA
cuDNN, in one process, on the same inputs, each output checked against cuDNN's:

- DESC: Q, K, V, O through `tl.make_tensor_descriptor` (TMA loads and stores) instead of
  pointer tiles (cp.async);
- WS: `tl.range(..., warp_specialize=True)` on the key loops;
- PERSIST: `SMS` programs that walk the (query tile, batch-head) tiles, heaviest first,
  instead of one program per tile;
- ROTATE: the whole key tiles software-pipelined by hand, FlashAttention-3's overlap within
  one warpgroup (`_tiles_rotated`, pointer loads): the softmax of key tile j runs while the
  wgmma of P_{j-1} V_{j-1} is in flight.

Each compiled variant's registers, spills, shared memory and the order of its key loop's
loads, wgmmas and wgmma waits in Triton's TTGIR are written beside its time (`loop_ops`),
so the CSV shows whether the schedule asked for is the one Triton built.

    python3 scripts/hopper_fwd.py --out DIR [--variants 0000,0001] [--configs 128/64/8/3]
    (writes DIR/hopper_fwd.csv and .json)

It is an experiment, not a library path: what wins here is what the library's kernel should
take up.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import re
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from fusedattn.api import attention
from fusedattn.lab.evidence import environment, write_json
from fusedattn.lab.timing import time_gpu

SMS = 132


@triton.jit
def _tiles(acc, l_i, m_i, q, desc_k, desc_v, p_k, p_v, row0, rows, lo, hi, qk_scale,
           BLOCK_N: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr,
           DESC: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        if DESC:
            kt = desc_k.load([row0 + start, 0]).T
        else:
            kt = tl.load(p_k + (row0 + start + offs_n)[None, :] * D + offs_d[:, None])
        s = tl.dot(q, kt) * qk_scale
        if MASKED:
            s = tl.where(rows[:, None] >= (start + offs_n)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DESC:
            v = desc_v.load([row0 + start, 0])
        else:
            v = tl.load(p_v + (row0 + start + offs_n)[:, None] * D + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _tiles_rotated(acc, l_i, m_i, q, p_k, p_v, row0, lo, hi, qk_scale,
                   BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Whole (unmasked) key tiles [lo, hi), hi > lo, software-pipelined by hand as
    FlashAttention-3 does within one warpgroup: iteration j issues QK_j, then P_{j-1} V_{j-1}
    (an asynchronous wgmma whose result is only carried to the next iteration), then runs
    the softmax of tile j while that second GEMM is still on the tensor cores. Carried
    between iterations: P_{j-1} (in the input dtype) and the rescale factor that acc still
    owes before P_{j-1} V_{j-1} is added."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kt = tl.load(p_k + (row0 + lo + offs_n)[None, :] * D + offs_d[:, None])
    s = tl.dot(q, kt) * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    m_i = m_new
    for start in tl.range(lo + BLOCK_N, hi, BLOCK_N):
        kt = tl.load(p_k + (row0 + start + offs_n)[None, :] * D + offs_d[:, None])
        s = tl.dot(q, kt)                                  # QK_j
        v = tl.load(p_v + (row0 + start - BLOCK_N + offs_n)[:, None] * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # P_{j-1} V_{j-1}, in flight ...
        s = s * qk_scale                                      # ... while tile j's softmax runs
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    v = tl.load(p_v + (row0 + hi - BLOCK_N + offs_n)[:, None] * D + offs_d[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def _one_tile(p_q, p_k, p_v, p_o, desc_q, desc_k, desc_v, desc_o, tile, n_m, seq, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
              CAUSAL: tl.constexpr, DESC: tl.constexpr, WS: tl.constexpr,
              ROTATE: tl.constexpr):
    bh = tile // n_m
    start_m = n_m - 1 - tile % n_m if CAUSAL else tile % n_m  # causal: long tiles first
    row0 = bh * seq
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    if DESC:
        q = desc_q.load([row0 + start_m * BLOCK_M, 0])
    else:
        q = tl.load(p_q + (row0 + rows)[:, None] * D + offs_d[None, :])
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # causal: whole key tiles up to the tile holding the diagonal's first key, then masked
    end = (start_m * BLOCK_M // BLOCK_N) * BLOCK_N if CAUSAL else seq
    if ROTATE:
        if end > 0:
            acc, l_i, m_i = _tiles_rotated(acc, l_i, m_i, q, p_k, p_v, row0, 0, end, qk_scale,
                                           BLOCK_N, D)
    else:
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, p_k, p_v, row0, rows, 0,
                               end, qk_scale, BLOCK_N, D, False, DESC, WS)
    if CAUSAL:
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, p_k, p_v, row0, rows, end,
                               (start_m + 1) * BLOCK_M, qk_scale, BLOCK_N, D, True, DESC,
                               WS)
    out = (acc / l_i[:, None]).to(p_o.dtype.element_ty)
    if DESC:
        desc_o.store([row0 + start_m * BLOCK_M, 0], out)
    else:
        tl.store(p_o + (row0 + rows)[:, None] * D + offs_d[None, :], out)


@triton.jit
def _fwd(p_q, p_k, p_v, p_o, total_rows, seq, qk_scale, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, DESC: tl.constexpr,
         WS: tl.constexpr, PERSIST: tl.constexpr, ROTATE: tl.constexpr):
    n_m = seq // BLOCK_M
    desc_q, desc_k, desc_v, desc_o = p_q, p_k, p_v, p_o
    if DESC:
        desc_q = tl.make_tensor_descriptor(p_q, [total_rows, D], [D, 1], [BLOCK_M, D])
        desc_k = tl.make_tensor_descriptor(p_k, [total_rows, D], [D, 1], [BLOCK_N, D])
        desc_v = tl.make_tensor_descriptor(p_v, [total_rows, D], [D, 1], [BLOCK_N, D])
        desc_o = tl.make_tensor_descriptor(p_o, [total_rows, D], [D, 1], [BLOCK_M, D])
    if PERSIST:
        n_tiles = n_m * (total_rows // seq)
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            _one_tile(p_q, p_k, p_v, p_o, desc_q, desc_k, desc_v, desc_o, tile, n_m, seq,
                      qk_scale, BLOCK_M, BLOCK_N, D, CAUSAL, DESC, WS, ROTATE)
    else:
        tile = tl.program_id(1) * n_m + tl.program_id(0)
        _one_tile(p_q, p_k, p_v, p_o, desc_q, desc_k, desc_v, desc_o, tile, n_m, seq,
                  qk_scale, BLOCK_M, BLOCK_N, D, CAUSAL, DESC, WS, ROTATE)


def _launch_args(q, k, v, out, causal, desc, ws, persist, rotate, config):
    bm, bn, warps, stages = config
    b, h, s, d = q.shape
    grid = (SMS,) if persist else (s // bm, b * h)
    qk_scale = (1.0 / math.sqrt(d)) * 1.4426950408889634
    return grid, (q, k, v, out, b * h * s, s, qk_scale), dict(
        BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, DESC=desc, WS=ws, PERSIST=persist,
        ROTATE=rotate,
        num_warps=warps, num_stages=stages)


def run_variant(q, k, v, causal, variant, config):
    out = torch.empty_like(q)
    grid, args, kwargs = _launch_args(q, k, v, out, causal, *variant, config)

    def launch():
        _fwd[grid](*args, **kwargs)
        return out
    return launch


# the loop's ops that decide what overlaps: loads into shared memory, wgmmas and their waits
_LOOP_OPS = re.compile(r"(ttng\.warp_group_dot_wait|ttng\.warp_group_dot |ttg\.async_wait|"
                       r"ttg\.async_copy_global_to_local|tt\.load |scf\.yield)")


def schedule(kernel) -> dict:
    """Registers, spills, shared memory, and the order of the key loop's loads, wgmmas and
    wgmma waits (`wait(N)`: until at most N wgmma groups are in flight) in Triton's TTGIR."""
    kernel._init_handles()
    ttgir = kernel.asm["ttgir"]
    ops = []
    for line in ttgir[ttgir.find("scf.for"):].splitlines():
        m = _LOOP_OPS.search(line)
        if m:
            pend = re.search(r"pendings = (\d+)", line)
            ops.append(m.group(1).strip().split(".")[-1] + (f"({pend.group(1)})" if pend else ""))
    return {"regs": kernel.n_regs, "spills": kernel.n_spills,
            "shared_bytes": kernel.metadata.shared, "loop_ops": " ".join(ops)}


def precompile(jobs):
    """Compile every (problem, variant, config) on 12 threads (Triton's compile releases
    the GIL in its passes and ptxas): {job: {"error": ...} or its `schedule`}."""
    def one(job):
        (b, h, s, d, causal), variant, config = job
        t = torch.empty(16, 16, dtype=torch.bfloat16, device="cuda")
        grid, args, kwargs = _launch_args(t.view(1, 1, 16, 16), t, t, t, causal, *variant,
                                          config)
        args = (*args[:4], b * h * s, s, args[6])
        try:
            return schedule(_fwd.warmup(*args, grid=grid, **{**kwargs, "D": d}))
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    with ThreadPoolExecutor(12) as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


PROBLEMS = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (2, 32, 8192, 64, True),
            (4, 32, 4096, 64, False)]
CONFIGS = [(128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)]
# (DESC, WS, PERSIST, ROTATE); `--variants` picks some by their 0/1 digits, e.g. 0000,0001
VARIANTS = [(False, False, False, False), (True, False, False, False),
            (True, True, False, False), (True, False, True, False), (True, True, True, False),
            (False, False, True, False), (False, False, False, True),
            (False, False, True, True)]


def measure(problem, compiled, variants, configs, *, deadline: float) -> list[dict]:
    """cuDNN, the library's kernel and every variant x config on one problem."""
    b, h, s, d, causal = problem
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flop = 4.0 * b * h * s * s * d / (2 if causal else 1)
    label = f"bf16 B{b} H{h} S{s} D{d}{' causal' if causal else ''}"

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=causal)

    ref = cudnn()
    rows = []
    candidates = [("cudnn", None, cudnn, {}),
                  ("fusedattn", None, lambda: attention(q, k, v, is_causal=causal), {})]
    for variant, config in itertools.product(variants, configs):
        desc, ws, persist, rotate = variant
        name = f"desc={int(desc)} ws={int(ws)} persist={int(persist)} rotate={int(rotate)}"
        info = compiled[(problem, variant, config)]
        if "error" in info:
            rows.append({"problem": label, "variant": name, "config": config} | info)
            continue
        candidates.append((name, config, run_variant(q, k, v, causal, variant, config), info))
    for name, config, fn, info in candidates:
        row = {"problem": label, "variant": name, "config": config} | info
        if time.perf_counter() > deadline:
            rows.append(row | {"error": "not run: budget spent"})
            continue
        try:
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            err = float((out.float() - ref.float()).abs().max())
            timing = time_gpu(fn, warmup=5, repeat=30)
            err = max(err, float((fn().float() - ref.float()).abs().max()))
            ok = err < 2e-2
            times = timing.times_ms
            rows.append(row | {
                "first_call_s": round(first, 3), "max_abs_vs_cudnn": err, "verified": ok,
                "median_ms": statistics.median(times), "min_ms": min(times),
                "max_ms": max(times),
                "tflops": flop / statistics.median(times) / 1e9 if ok else None})
        except Exception as exc:  # a variant Triton rejects is a result, not a crash
            rows.append(row | {"error": f"{type(exc).__name__}: {str(exc)[:200]}",
                               "trace": traceback.format_exc()[-600:]})
        r = rows[-1]
        print(f"{label:32} {name:28} {str(config):18} "
              f"{r.get('tflops') or r.get('error', '')!s:>8}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=330.0)
    parser.add_argument("--variants", default="",
                        help="comma-separated DESC/WS/PERSIST/ROTATE digits (default: all)")
    parser.add_argument("--configs", default="",
                        help="comma-separated BLOCK_M/BLOCK_N/warps/stages, e.g. 128/64/8/2")
    args = parser.parse_args()
    wanted = {tuple(c == "1" for c in v) for v in args.variants.split(",") if v}
    unknown = wanted - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: {sorted(unknown)} not among {VARIANTS}")
    variants = [v for v in VARIANTS if not wanted or v in wanted]
    configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",") if c] \
        or CONFIGS
    args.out.mkdir(parents=True, exist_ok=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                device="cuda"))
    started = time.perf_counter()
    compiled = precompile(list(itertools.product(PROBLEMS, variants, configs)))
    print(f"precompiled {len(compiled)} kernels in {time.perf_counter() - started:.0f} s",
          flush=True)
    rows = []
    for problem in PROBLEMS:
        rows += measure(problem, compiled, variants, configs,
                        deadline=started + args.budget_s)
    fields = ["problem", "variant", "config", "first_call_s", "median_ms", "min_ms", "max_ms",
              "tflops", "verified", "max_abs_vs_cudnn", "regs", "spills", "shared_bytes",
              "loop_ops", "error"]
    with open(args.out / "hopper_fwd.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    write_json(args.out / "hopper_fwd.json", {"environment": environment(), "rows": rows,
                                              "command": " ".join(["python3", *sys.argv])})


if __name__ == "__main__":
    main()
