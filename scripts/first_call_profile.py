"""Where the first call's time goes once nothing compiles (issue 31: after
`fusedattn.warmup`, a fresh process's first call still took 0.53-0.63 s with no compile).

For each cold-start problem given (default: the Hopper kernel's bf16 S1000 D128 and the
portable bf16 H28/4 S1777 D112 causal), it runs `fusedattn_lab.coldstart.run_fresh` in the
"after warmup" mode (or `--mode`'s) with cProfile around the first call, and prints that
call's time, its compiles (none expected after warmup) and the functions with the most
cumulative time, then those `--match` names (the compiles' and launchers' parts).

    python3 scripts/first_call_profile.py [--out DIR] [--top N] [--problems 0,3] [--mode M]
"""

import argparse
import json
import pstats
import sys
from pathlib import Path


def main() -> int:
    from fusedattn_lab.coldstart import MODES, problems, run_fresh

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--problems", default="3,0", help="indices into coldstart.problems()")
    ap.add_argument("--mode", default="after warmup", choices=MODES,
                    help="how the process starts (an empty cache profiles the compiles)")
    ap.add_argument("--match", default=r"_build\b|triton_key|__init__.py.*\(compile\)|"
                    r"_init_handles|CudaUtils|make_launcher|subprocess.py.*\(run\)",
                    help="also list the functions whose file:line(name) matches (a regex)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in map(int, args.problems.split(",")):
        p = problems()[i]
        stats_path = out / f"first_call_{i}.prof"
        row = run_fresh(p, args.mode, profile=str(stats_path))
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("problem", "first_call_s",
                                                  "second_call_s", "compiles", "error")}))
        if stats_path.exists():
            text = out / f"first_call_{i}.txt"
            with text.open("w") as f:
                pstats.Stats(str(stats_path), stream=f).sort_stats("cumulative").print_stats(
                    args.top)
                if args.match:
                    pstats.Stats(str(stats_path), stream=f).sort_stats(
                        "cumulative").print_stats(args.match)
            print(text.read_text())
    (out / "first_call_profile.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
