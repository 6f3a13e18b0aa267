"""Try to make the Hopper backward hang again: the calls of the tests that stuck in a CUDA
call in two GPU tiers (073459Z: `test_large[batch-auto]` and the varlen backward at
D128/Dv64 causal; 085707Z: `test_large[heads-hopper]`; each 6-20 s in every other tier),
repeated in a child process per case, beside processes keeping the GPU busy as the tier's
other workers do. A child that prints nothing for `--stall` seconds has hung: its threads'
stacks (faulthandler, at `--stall` minus 5) and the GPU's utilisation then are kept, and
the child is killed. Each case runs with the deterministic dQ adds and racing ones (the
adds' order is, by a reading of `hopper/backward_kernel.py`, the backward's only wait
across programs), so a hang in one kind and not the other points at it.

    python3 scripts/hang_repro.py [--seconds 300] [--load 8] [--stall 45] [--out hang.json]
        [--cases heads,batch,varlen-vdim,varlen] [--first-stall 240] [--deterministic-only]
        [--switch NAME=VALUE ...]

`--switch` sets a `hopper.backward` switch in the children (a Python literal, e.g.
NAMED_HANDOFF=False, ORDER='down'), to bisect which of the kernel's waits hangs.

GPU only. A run with no hang says only that none came in its iterations. The whole run
ends by `--seconds` plus one compile's wait, and `--out` is rewritten after every case, so a
run cut short keeps the cases it finished."""

import argparse
import json
import os
import select
import subprocess
import sys
import time

CASES = ("heads", "batch", "varlen-vdim", "varlen")
LINE_WAIT_S = 0.5
FIRST_STALL_S = 240  # a child's first step compiles its kernels: silent for longer


def watch(cmd: list[str], stall_s: float, budget_s: float,
          first_stall_s: float | None = None) -> dict:
    """Run `cmd` (a child printing a line per step, "step N ..."), kill it once it prints
    nothing for `stall_s` seconds (a hang; `first_stall_s` until its first step, which
    compiles) or once `budget_s` is spent; its output, how it ended ("done", "hang",
    "budget", "failed"), its steps and its last step."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    lines, last, stepped = [], time.monotonic(), False
    ended = None
    while ended is None:
        ready, _, _ = select.select([proc.stdout], [], [], LINE_WAIT_S)
        now = time.monotonic()
        if ready:
            line = proc.stdout.readline()
            if not line:  # (the end of its output: the child has ended)
                proc.wait()
                ended = "done" if proc.returncode == 0 else "failed"
                continue
            lines.append(f"[{now - t0:7.1f}s] {line}")
            last, stepped = now, stepped or line.startswith("step ")
        if now - last > (stall_s if stepped or first_stall_s is None else first_stall_s):
            ended = "hang"
        elif now - t0 > budget_s:
            ended = "budget"
    if proc.poll() is None:
        snapshot = _gpu_snapshot() if ended == "hang" else None
        proc.kill()
        rest, _ = proc.communicate()
        lines += [f"[{time.monotonic() - t0:7.1f}s] {x}\n" for x in rest.splitlines()]
    else:
        snapshot = None
    steps = [x for x in lines if "] step " in x]
    return dict(cmd=cmd, ended=ended, seconds=round(time.monotonic() - t0, 1),
                steps=len(steps), last=steps[-1].strip() if steps else None,
                # a diagnosis kernel's device prints (notes/patches/bwd-spin-diag.patch),
                # each thread's copy once
                diag=sorted({x.split("] ", 1)[1].strip() for x in lines if "HANGDIAG" in x}),
                gpu_at_hang=snapshot, output=lines[-200:])


def _gpu_snapshot() -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi failed: {e}"


def _inputs(case: str):
    """(a function of `deterministic` making one forward and backward, a description)."""
    import torch

    from fusedattn import attention, attention_varlen
    from fusedattn.dispatch import use_backend
    from fusedattn.varlen import offsets_of

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    if case in ("heads", "batch"):  # tests/test_large.py's shapes
        shape = (1, 4200 * 8, 512, 128) if case == "heads" else (4200, 8, 512, 128)
        backend = "hopper" if case == "heads" else "auto"
        q, k, v = (rand(*shape).requires_grad_() for _ in range(3))
        dout = rand(*shape)

        def step(deterministic):
            with use_backend(backend):
                out = attention(q, k, v, is_causal=True, deterministic=deterministic)
            torch.cuda.synchronize()
            print("  forward done", flush=True)
            torch.autograd.grad(out, (q, k, v), dout)
        return step, f"{shape} {backend}"
    # tests/inputs.py's ragged batch (empty, one-token and long sequences), GQA 4/2
    lengths_q, lengths_k = [5, 0, 1, 300, 1000, 64], [5, 3, 1, 500, 1000, 0]
    dim, dim_v = 128, (64 if case == "varlen-vdim" else 128)
    cu_q, cu_k = (offsets_of(n, "cuda") for n in (lengths_q, lengths_k))
    q = rand(sum(lengths_q), 4, dim).requires_grad_()
    k = rand(sum(lengths_k), 2, dim).requires_grad_()
    v = rand(sum(lengths_k), 2, dim_v).requires_grad_()
    dout = rand(sum(lengths_q), 4, dim_v)

    def step(deterministic):  # (varlen's adds are deterministic always)
        with use_backend("hopper"):
            out = attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                   is_causal=True)
        torch.cuda.synchronize()
        print("  forward done", flush=True)
        torch.autograd.grad(out, (q, k, v), dout)
    return step, f"varlen D{dim}/{dim_v} causal hopper"


def child(case: str, deterministic: bool, seconds: float, stall_s: float, first_stall_s: float,
          switches: dict) -> None:
    import ctypes
    import faulthandler

    import torch

    from fusedattn.hopper import backward

    for name, value in switches.items():
        setattr(backward, name, value)
    libc = ctypes.CDLL(None)
    step, what = _inputs(case)
    print(f"case {case} ({what}), deterministic={deterministic}, switches={switches}",
          flush=True)
    t0, i = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        # the stacks just before the parent's verdict (the first step compiles: its own)
        wait = (stall_s if i else first_stall_s) - 5
        faulthandler.dump_traceback_later(max(1.0, wait), exit=False)
        step(deterministic)
        torch.cuda.synchronize()
        libc.fflush(None)  # (the kernels' device prints, in C's buffer: out before a kill)
        faulthandler.cancel_dump_traceback_later()
        i += 1
        print(f"step {i} {time.monotonic() - t0:.1f}s", flush=True)


def load() -> None:
    """Keep the GPU busy as a tier's other workers do: matmuls and small kernels."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    while True:
        for _ in range(20):
            a = (a @ a).tanh_()
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300, help="all cases together")
    ap.add_argument("--load", type=int, default=8, help="processes keeping the GPU busy")
    ap.add_argument("--stall", type=float, default=45, help="seconds without a line: a hang")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default="hang_repro.json")
    ap.add_argument("--first-stall", type=float, default=FIRST_STALL_S,
                    help="seconds without a line before a child's first step (it compiles)")
    ap.add_argument("--deterministic-only", action="store_true",
                    help="leave out the racing adds' runs")
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=VALUE",
                    help="a hopper.backward switch set in the children (a Python literal)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--racing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_child:
        return load()
    switches = {}
    if args.switch:  # (the parent imports no fusedattn, as its children are the runs)
        from fusedattn.hopper import backward
        from fusedattn_lab.switches import literal_switches

        switches = literal_switches(ap.error, "--switch", args.switch, backward)
    if args.child:
        return child(args.child, not args.racing, args.seconds, args.stall, args.first_stall,
                     switches)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: {unknown} unknown; cases are {', '.join(CASES)}")
    runs = [(c, racing) for c in cases for racing in (False, True)
            if not (racing and (c.startswith("varlen") or args.deterministic_only))]
    # (varlen's adds: deterministic always)
    share = args.seconds / len(runs)
    deadline = time.monotonic() + args.seconds + args.first_stall
    me = [sys.executable, os.path.abspath(__file__)]
    loads = [subprocess.Popen([*me, "--load-child"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(args.load)]
    results = []
    try:
        for case, racing in runs:
            left = deadline - time.monotonic()
            if left < args.stall:
                results.append(dict(case=case, deterministic=not racing, ended="not run",
                                    steps=0, last=None))
                continue
            # the child's own loop stops at its share; the watch allows it a compile more,
            # within what is left of the run
            cmd = [*me, "--child", case, "--seconds", str(share), "--stall", str(args.stall),
                   "--first-stall", str(args.first_stall), *(["--racing"] if racing else []),
                   *(x for sw in args.switch for x in ("--switch", sw))]
            result = watch(cmd, args.stall, min(share + args.first_stall, left), args.first_stall)
            result.update(case=case, deterministic=not racing, switches=args.switch)
            results.append(result)
            print(f"{case} deterministic={not racing}: {result['ended']} after "
                  f"{result['steps']} steps, {result['seconds']} s ({result['last']})",
                  flush=True)
            _write(args, results)
    finally:
        for p in loads:
            p.kill()
    _write(args, results)


def _write(args, results: list[dict]) -> None:
    """`--out` whole or not at all (a temporary file renamed over it)."""
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(load=args.load, stall_s=args.stall, switches=args.switch,
                       runs=results), f, indent=1)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
