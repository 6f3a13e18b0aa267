"""The process both tools wrap: `python -m fusedattn_lab.profile target --version X ...`:
inputs, one prepare + call, verify. `--planted` runs the registry's planted variant (a
barrier removed on purpose, the chapter's historical bug), which racecheck must catch."""

from __future__ import annotations

import argparse
import sys

from fusedattn.problem import Problem, ProblemError


def target_main(argv: list[str]) -> int:
    """`python -m fusedattn_lab.profile target --version X --seq S --dim D --block B
    [--planted]`"""
    from fusedattn.mode import DEVICE, EMULATION
    from fusedattn.reference import attention_ref
    from fusedattn_lab.inputs import make_inputs
    from fusedattn_lab.registry import VERSIONS, planted_versions
    from fusedattn_lab.verify import check, poison

    ap = argparse.ArgumentParser(prog="fusedattn_lab.profile target")
    ap.add_argument("--version", required=True, help="one name or a comma-separated list")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--planted", action="store_true")
    ap.add_argument("--no-poison", action="store_true",
                    help="skip the NaN fill, so a profiler sees only the version's kernels")
    args = ap.parse_args(argv)
    problem = Problem(args.seq, args.dim, args.block)
    q, k, v = make_inputs(problem, "uniform", 0, DEVICE)
    ref = attention_ref(q, k, v)
    for name in args.version.split(","):
        version = VERSIONS[name]
        prepare = version.planted if args.planted else version.prepare
        if prepare is None:
            raise ProblemError("planted", name, "a version with a planted variant: "
                               + ", ".join(planted_versions()))
        prepared = prepare(q, k, v, problem)
        out = prepared.out
        if not args.no_poison:
            poison(out)
        prepared.call()
        if not EMULATION:
            import torch

            torch.cuda.synchronize()
        result = check(out, ref)
        print(f"TARGET {name}{' (planted)' if args.planted else ''}: {result.verdict} "
              f"max_abs={result.max_abs:.3e}")
    return 0


def _target_cmd(name: str, problem: Problem, planted: bool = False) -> list[str]:
    """`name`: a version or a comma-separated list, run one after another in one process;
    with `planted`, `name`'s planted variant."""
    cmd = [sys.executable, "-m", "fusedattn_lab.profile", "target", "--version", name,
           "--seq", str(problem.seq), "--dim", str(problem.dim), "--block", str(problem.block)]
    return cmd + (["--planted"] if planted else [])
