"""Instructions the host path costs a call, on the CPU, by callgrind: the Python on the way to
the launches and torch's CPU-side work, with every replayed launch stubbed out after
warm-up (emulation: `TRITON_INTERPRET=1` is set here). A count, not a time: it moves by
well under 1% between runs, where the CPU's µs (`python_path.py`) move by 10% or more, so it
can tell a change to the Python path of a few per cent. A training step less finely: its
autograd graph is cyclic garbage, and where the collector's young-generation runs land
moved a step's count by 2-3% for a change of a few hundred instructions (the same in every
run; `--gc-off` counts with the collector off after warm-up: evidence/cpu/
20261205T0823Z-python-path-imports). Not a GPU host time (that is `fusedattn bench --suite
host` on the GPU).

    python3 scripts/instructions_per_call.py [--calls attention,train,...] [--out F] [--gc-off]

Each call kind runs in two processes under `valgrind --tool=callgrind`, one making `--few`
calls after warm-up and one `--many`; (instructions of the second - of the first) /
(many - few) is a call's count, so start-up and warm-up fall out (the collector's
objects frozen after warm-up, so that no full collection lands in one count alone; one
thread). The library is the one Python imports: `PYTHONPATH=OTHER/src` counts another
tree's (`git archive REV src | tar -x -C OTHER`). Put two trees at paths of one length:
at paths of different lengths, forward paths neither tree changed read 3% apart
(evidence/cpu/20261205T0236Z-instructions-backward-path/noise.txt). Lay them out alike
too (both from `git archive`): a stray `fusedattn.egg-info` folder in one tree's src moved
every count of that tree 5-11%, an unchanged path's too (the imports' allocations move the
addresses that the calls' hashed lookups see; evidence/cpu/20261205T2215Z-recorded-apply).
Swap the trees' places and run again before reading a change of a few per cent."""

import argparse
import gc
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")


def calls() -> dict:
    """The call kinds: each a function of no arguments making one call (or training step)
    on small fp32 CPU tensors."""
    import torch
    from host_profile import Floor  # (scripts/, beside this one)

    from fusedattn import attention, attention_varlen, attention_with_kvcache

    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    q, k, v = (rand(2, 2, 32, 64) for _ in range(3))
    x = [rand(96, 2, 64) for _ in range(3)]
    cu = torch.tensor([0, 32, 64, 96], dtype=torch.int32)
    caches = [rand(2, 2, 128, 64) for _ in range(2)]
    q1 = rand(2, 2, 1, 64)
    lengths = torch.full((2,), 100, dtype=torch.int32)
    tq, tk, tv = (rand(2, 2, 32, 64, grad=True) for _ in range(3))
    tx = [rand(96, 2, 64, grad=True) for _ in range(3)]
    return {
        "attention": lambda: attention(q, k, v, is_causal=True),
        "varlen": lambda: attention_varlen(*x, cu, cu, 32, 32, is_causal=True,
                                           check_lengths=False),
        # the default: the offsets' verdict asked for at their version each call
        "varlen-checked": lambda: attention_varlen(*x, cu, cu, 32, 32, is_causal=True),
        "kvcache": lambda: attention_with_kvcache(q1, *caches, cache_seqlens=lengths,
                                                  check_lengths=False),
        # the default: the lengths' values read and checked each call
        "kvcache-checked": lambda: attention_with_kvcache(q1, *caches, cache_seqlens=lengths),
        "train": lambda: attention(tq, tk, tv, is_causal=True).sum().backward(),
        "train-varlen": lambda: attention_varlen(*tx, cu, cu, 32, 32,
                                                 is_causal=True).sum().backward(),
        # torch's own part of "train": a Python autograd Function allocating what ours
        # does, launching nothing (`host_profile.Floor`)
        "train-floor": lambda: Floor.apply(tq, tk, tv).sum().backward(),
    }


def child(name: str, count: int, gc_off: bool = False) -> None:
    """Warm `name` up (its kernels run and record their plans), stub the launches out, then
    make `count` calls (`gc_off`: with the collector off for them)."""
    import torch

    from fusedattn import launch

    torch.set_num_threads(1)
    call = calls()[name]
    for _ in range(3):
        call()
    launch.Replay.__call__ = lambda self, inputs: None  # from here on, no kernel runs
    for _ in range(200):
        call()
    # the objects made so far (torch's, Triton's: millions) out of the collector's reach: a
    # full collection among the counted calls would add ~10^8 instructions to one count
    # and not the other
    gc.collect()
    gc.freeze()
    if gc_off:
        gc.disable()
    for _ in range(count):
        call()


def instructions(name: str, count: int, gc_off: bool = False) -> int:
    """callgrind's instruction total of a child process making `count` calls of `name`."""
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--child", name, str(count), *(["--gc-off"] if gc_off else [])],
        capture_output=True, text=True,
        # one thread: torch's pool threads spinning after a parallel region would add
        # instructions by the wall time, not by the work
        env={**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"},
        check=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", run.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind:\n{run.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls",
                        default="attention,varlen,kvcache,train,train-varlen,train-floor")
    parser.add_argument("--few", type=int, default=200)
    parser.add_argument("--many", type=int, default=1200)
    parser.add_argument("--out", default=None)
    parser.add_argument("--gc-off", action="store_true",
                        help="the collector off for the counted calls")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.gc_off)
    import fusedattn

    results = {}
    for name in args.calls.split(","):
        few, many = (instructions(name, n, args.gc_off) for n in (args.few, args.many))
        results[name] = {"few": few, "many": many,
                         "per_call": round((many - few) / (args.many - args.few))}
        print(f"{name}: {results[name]['per_call']:,} instructions a call", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"library": fusedattn.__file__, "few": args.few, "many": args.many,
                       "gc_off": args.gc_off, "python": sys.version.split()[0],
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
