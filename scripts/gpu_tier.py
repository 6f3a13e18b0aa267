"""The GPU tier: the whole test suite on the GPU, its result kept as evidence.

    python3 scripts/gpu_tier.py [--out evidence] [pytest args...]

Runs `python -m pytest` (the same suite as CI; tests that make sense on one side only carry
an `emulation_only`/`gpu_only` marker with a reason), with one pytest-xdist worker a
CPU core up to 16 where it is installed (most of the GPU suite's time is Triton and Gluon
compiling each kernel specialisation, seconds each on one core: the H200 machine has 16;
with 8 workers, 1082 tests took 416 s after a prebuild on a fresh machine, 191549Z),
under xdist's worksteal (an idle worker takes queued tests: 1206 tests cold in 247 s on an
H100 against 302 s before, 20261205T193001Z) and
`--timeout=90` (per test, the thread method) where pytest-timeout is, with every
thread's stack written to the log at 75 s (`faulthandler_timeout`), and writes
`<out>/<gpu>/<stamp>-gpu-tier/`: `summary.json` (counts, wall time, the slowest tests, the
environment with its commit, how many entries Triton's cache held at the start),
`junit.xml.gz` and `pytest.txt.gz` (gzip: a tenth of the size, and a device call carries
the whole tracked tree, 64 MiB at most). Exits with pytest's status.
The target: green within 300 s on the H200.
"""

import argparse
import gzip
import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from fusedattn_lab.evidence import environment, write_atomic, write_json
from fusedattn_lab.runall import run_dir_for

TARGET_S = 300
TIMEOUT_S = 90  # a test's limit (pytest-timeout)
STACKS_AFTER_S = 75  # a test still running then has its threads' stacks written out


def _xdist_steals() -> bool:
    from importlib.metadata import version

    return tuple(int(p) for p in version("pytest-xdist").split(".")[:2]) >= (3, 2)


def plugin_args(workers: int, timeout_s: int = TIMEOUT_S,
                stacks_after_s: int = STACKS_AFTER_S) -> list[str]:
    """The tier's pytest options for its plugins: `workers` xdist workers (worksteal), the
    per-test timeout (pytest-timeout's thread method), each where installed, and every
    thread's stack written out once a test runs past `stacks_after_s` (pytest's own
    faulthandler)."""
    # worksteal (xdist 3.2+): an idle worker takes queued tests from a busy one. Under the
    # default, chunks handed out early left one worker with the Hopper backward's reference
    # tests for the last 90 s while the rest sat idle (191631Z: 96% done at 214 s of 301)
    args = ["-n", str(workers), *(["--dist", "worksteal"] if _xdist_steals() else [])] \
        if importlib.util.find_spec("xdist") else []
    # the thread method: a test stuck in a CUDA call (a kernel that never ends) never returns
    # to Python for the signal method's handler, which let two stuck tests hold the tier
    # past the device call's end with no summary (073555Z); the thread method ends the
    # worker, which xdist reports as that test's failure
    if importlib.util.find_spec("pytest_timeout"):
        args += [f"--timeout={timeout_s}", "--timeout-method=thread"]
    # the thread method's stack dump never reached the log under xdist (085707Z: a test
    # killed at 90 s, no stack): the worker's output is captured, and lost with the worker.
    # pytest's faulthandler writes every thread's stack to the stderr it kept before capture
    # (a worker's is the tier's pipe) once a test runs past `stacks_after_s`, before the
    # kill: where a stuck test waits (a CUDA call, a compile) is then in pytest.txt
    # (tests/test_gpu_tier.py)
    return [*args, "-o", f"faulthandler_timeout={stacks_after_s}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="evidence", type=Path)
    args, pytest_args = parser.parse_known_args()
    env = environment()
    out = run_dir_for(args.out, env)
    out = out.with_name(out.name + "-gpu-tier")
    out.mkdir(parents=True, exist_ok=False)
    junit = out / "junit.xml"
    plugins = plugin_args(min(16, os.cpu_count() or 8))
    # -o addopts=: pyproject's -q would cancel -v (one line per test, streamed)
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-p", "no:cacheprovider",
           "--durations=30",
           f"--junitxml={junit}", *plugins, *pytest_args]
    cache = _triton_cache()  # (a warm cache is a different run from a cold one: 155218Z)
    t0 = time.perf_counter()
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        for line in proc.stdout:  # streamed, stamped: a run cut short still shows its pace
            lines.append(f"[{time.perf_counter() - t0:6.1f}s] {line}")
            print(lines[-1], end="", flush=True)
    wall = time.perf_counter() - t0
    write_atomic(out / "pytest.txt", "".join(lines))
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = [(f"{c.get('classname')}::{c.get('name')}", float(c.get("time", 0)),
              "failed" if c.find("failure") is not None or c.find("error") is not None
              else "skipped" if c.find("skipped") is not None else "passed")
             for c in suite.iter("testcase")]
    counts = {s: sum(1 for *_, st in cases if st == s) for s in ("passed", "failed", "skipped")}
    write_json(out / "summary.json", {
        "command": "python3 scripts/gpu_tier.py " + " ".join(sys.argv[1:]),
        "pytest_command": " ".join(cmd[1:]),
        "pytest_exit_status": proc.returncode, "wall_seconds": round(wall, 1),
        "target_seconds": TARGET_S, "within_target": wall <= TARGET_S, **counts,
        "triton_cache_at_start": cache,
        "skipped_tests": [{"test": n, "reason": (c.find("skipped").get("message"))}
                          for c in suite.iter("testcase") if c.find("skipped") is not None
                          for n in [f"{c.get('classname')}::{c.get('name')}"]],
        "failed_tests": [n for n, _, st in cases if st == "failed"],
        "slowest": [{"test": n, "seconds": round(t, 2)}
                    for n, t, _ in sorted(cases, key=lambda c: -c[1])[:30]],
        "environment": env})
    for name in ("pytest.txt", "junit.xml"):
        _compress(out / name)
    print(f"GPU tier: {counts}, {wall:.0f} s (target {TARGET_S} s), written: {out}")
    return proc.returncode


def _triton_cache() -> dict:
    """Triton's cache folder and how many entries (kernels, launchers) it held before the
    run: 0 on a fresh machine, hundreds after an earlier call on a warm one."""
    from triton import knobs

    folder = Path(knobs.cache.dir)
    entries = sum(1 for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else 0
    return {"dir": str(folder), "entries": entries}


def _compress(path: Path) -> None:
    """`path` as `path.gz` (no timestamp inside, so the same log gives the same bytes),
    written whole and renamed, then the original removed."""
    tmp = path.with_name(f".{path.name}.gz.tmp")
    tmp.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    tmp.replace(path.with_name(path.name + ".gz"))
    path.unlink()


if __name__ == "__main__":
    sys.exit(main())
