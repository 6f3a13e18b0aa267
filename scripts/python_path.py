"""The Python of an inference call, on the CPU: emulation (set TRITON_INTERPRET=1), every
replayed launch stubbed out after warm-up, so what is timed is the host path's Python and
torch's CPU-side work alone (`attention`, `attention_varlen` and `attention_with_kvcache`
with `check_lengths=False`, no grad). Not a GPU host time (that is `fusedattn bench --suite
host`): a check that a change to the Python path goes the way it should. Run it with
another tree's library to compare commits (PYTHONPATH=OLD/src, the same script):

    TRITON_INTERPRET=1 python3 scripts/python_path.py [--rounds 5] [--out F]

Each round times every entry point, 2000 calls a reading; the medians over rounds are
reported."""

import argparse
import json
import time

import torch

import fusedattn
from fusedattn import attention, attention_varlen, attention_with_kvcache, launch
from fusedattn.mode import EMULATION


def arguments(doc: str) -> argparse.Namespace:
    """`--rounds` and `--out` of a script that times the Python path, refused outside
    emulation (its launches are stubbed out on the CPU)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not EMULATION:
        parser.error("set TRITON_INTERPRET=1: this times the Python path with the launches "
                     "stubbed out, on the CPU")
    return args


def main() -> None:
    args = arguments(__doc__)
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(1, 2, 32, 16, generator=g) for _ in range(3)]
    packed = [torch.randn(64, 2, 16, generator=g) for _ in range(3)]
    cu = torch.tensor([0, 20, 40, 64], dtype=torch.int32)
    q1 = torch.randn(4, 4, 1, 16, generator=g)
    caches = [torch.randn(4, 2, 64, 16, generator=g) for _ in range(2)]
    lengths = torch.full((4,), 40, dtype=torch.int32)
    calls = {
        "attention": lambda: attention(*dense, is_causal=True),
        "attention_varlen (check_lengths=False)": lambda: attention_varlen(
            *packed, cu, cu, 24, 24, is_causal=True, check_lengths=False),
        "attention_with_kvcache (check_lengths=False)": lambda: attention_with_kvcache(
            q1, *caches, cache_seqlens=lengths, check_lengths=False),
    }
    for call in calls.values():  # each records its plan, running the kernels
        for _ in range(3):
            call()
    launch.Replay.__call__ = lambda self, inputs: None  # from here on, no kernel runs
    readings: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, call in calls.items():
            readings.setdefault(name, []).append(reading(call, 50, 2000))
    report(readings, args.out, "a call", library=fusedattn.__file__)


def reading(call, warm: int, calls: int) -> float:
    """µs a call of `call`: `warm` calls, then the mean of the next `calls`, rounded."""
    for _ in range(warm):
        call()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return round((time.perf_counter() - t0) / calls * 1e6, 1)


def report(readings: dict[str, list], out: str | None, unit: str, **extra) -> None:
    """Each reading's median over the rounds, printed (µs `unit`), and with the readings,
    the environment and `extra` written to `out` as JSON where given."""
    from fusedattn_lab.evidence import environment

    medians = {k: sorted(v)[len(v) // 2] for k, v in readings.items()}
    for name, median in medians.items():
        print(f"{name}: median {median} us {unit}, rounds {readings[name]}")
    if out:
        with open(out, "w") as f:
            json.dump({**extra, "readings_us": readings, "median_us": medians,
                       "environment": environment()}, f, indent=1)

if __name__ == "__main__":
    main()
