"""The Python of a training step with and without the kept plans on recorded calls
(`api.KEEP_RECORDED`), on the CPU: emulation (set TRITON_INTERPRET=1), with every replayed
launch stubbed out after warm-up, so what is timed is the host path's Python and torch's
CPU-side work alone. Not a GPU host time (the H200's figure is `host_profile.py --train`):
a check that a change to the Python path goes the way it should, where no GPU is at hand.

    TRITON_INTERPRET=1 python3 scripts/kept_plans_python_ab.py [--rounds 5] [--out F]

Each round times `attention` and `attention_varlen` fwd+bwd steps with the switch on, then
off, 500 steps a reading; the medians over rounds are reported."""

import torch
from python_path import arguments, reading, report  # (scripts/: the same timing)

import fusedattn.api as api
from fusedattn import attention, attention_varlen, launch


def main() -> None:
    args = arguments(__doc__)
    cu = torch.tensor([0, 20, 40, 64], dtype=torch.int32)
    x = [torch.randn(64, 2, 16, requires_grad=True) for _ in range(3)]
    g = [torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3)]
    steps = {
        "attention fwd+bwd": lambda: attention(*g, is_causal=True).sum().backward(),
        "attention_varlen fwd+bwd": lambda: attention_varlen(
            *x, cu, cu, 24, 24, is_causal=True).sum().backward(),
    }
    for setting in (True, False):  # both routes record their plans, running the kernels
        api.KEEP_RECORDED = setting
        for step in steps.values():
            for _ in range(3):
                step()
    launch.Replay.__call__ = lambda self, inputs: None  # from here on, no kernel runs
    readings: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, step in steps.items():
            for setting in (True, False):
                api.KEEP_RECORDED = setting
                readings.setdefault(f"{name}, KEEP_RECORDED={setting}", []).append(
                    reading(step, 20, 500))
    api.KEEP_RECORDED = True
    report(readings, args.out, "a step")

if __name__ == "__main__":
    main()
