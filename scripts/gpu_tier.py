"""The GPU tier: the whole test suite on the GPU, its result kept as evidence.

    python3 scripts/gpu_tier.py [--out evidence] [pytest args...]

Runs `python -m pytest` (the same suite as CI; tests that make sense on one side only carry
an `emulation_only`/`gpu_only` marker with a reason) and writes
`<out>/<gpu>/<stamp>-gpu-tier/`: `summary.json` (counts, wall time, the slowest tests, the
environment with its commit), `junit.xml` and `pytest.txt`. Exits with pytest's status.
The target: green within 300 s on the H200.
"""

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from fusedattn.evidence import environment, write_atomic, write_json
from fusedattn.runall import run_dir_for

TARGET_S = 300


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="evidence", type=Path)
    args, pytest_args = parser.parse_known_args()
    env = environment()
    out = run_dir_for(args.out, env)
    out = out.with_name(out.name + "-gpu-tier")
    out.mkdir(parents=True, exist_ok=False)
    junit = out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=30",
           f"--junitxml={junit}", *pytest_args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    write_atomic(out / "pytest.txt", proc.stdout + proc.stderr)
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = [(f"{c.get('classname')}::{c.get('name')}", float(c.get("time", 0)),
              "failed" if c.find("failure") is not None or c.find("error") is not None
              else "skipped" if c.find("skipped") is not None else "passed")
             for c in suite.iter("testcase")]
    counts = {s: sum(1 for *_, st in cases if st == s) for s in ("passed", "failed", "skipped")}
    write_json(out / "summary.json", {
        "command": "python3 scripts/gpu_tier.py " + " ".join(sys.argv[1:]),
        "pytest_exit_status": proc.returncode, "wall_seconds": round(wall, 1),
        "target_seconds": TARGET_S, "within_target": wall <= TARGET_S, **counts,
        "skipped_tests": [{"test": n, "reason": (c.find("skipped").get("message"))}
                          for c in suite.iter("testcase") if c.find("skipped") is not None
                          for n in [f"{c.get('classname')}::{c.get('name')}"]],
        "failed_tests": [n for n, _, st in cases if st == "failed"],
        "slowest": [{"test": n, "seconds": round(t, 2)}
                    for n, t, _ in sorted(cases, key=lambda c: -c[1])[:30]],
        "environment": env})
    print(proc.stdout[-3000:])
    print(f"GPU tier: {counts}, {wall:.0f} s (target {TARGET_S} s), written: {out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
