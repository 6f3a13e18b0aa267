"""`fusedattn run-all`: the chapter's `run_all.sh` as one resumable command.

Units of work, each in its own fresh process (`fusedattn_lab.worker`):
- boundary: every version on 1x1, 7x13, 33x31, 65x33, verified before and after timing;
- main: the main shape(s) in N independent processes, each with warm-up and repeat;
- memory (GPU only): one process per (version, shape) measuring the peak of one call.

After every unit `records.jsonl` is rewritten atomically, so a killed run leaves whole
records only, and `--resume DIR` skips every unit already on disk. Records are append-only:
a unit run again (after an error) keeps its failed attempt, marked `superseded`. Every
record is checked against the plan when it is read (`read_records`). `summary.csv` (long
format, schema `SummaryRow`) is derived from the live records, atomically, once all are
there (a run cut short leaves none rather than a stale one), and the figures from the CSV.
Records and summary: `fusedattn_lab.records`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from fusedattn import mode
from fusedattn_lab.evidence import environment, sha256_file, write_atomic, write_json
from fusedattn_lab.records import (
    SummaryRow,
    done_units,
    read_records,
    summarize,
    summary_csv,
    write_records,
)
from fusedattn_lab.worker import MARK

BOUNDARY = ((1, 1), (7, 13), (33, 31), (65, 33))  # the chapter's 2026-09-11 recheck


@dataclass(frozen=True)
class Plan:
    versions: tuple[str, ...]
    seqs: tuple[int, ...]            # main shapes: each seq with `dim`
    dim: int
    block: int
    processes: int
    settings: dict                   # bench.Settings as a dict
    boundary: tuple[tuple[int, int], ...] = BOUNDARY
    causal: bool = False

    def protocols(self) -> list[str]:
        """The input protocols of the run: settings["inputs"] may name several, comma-separated
        (the chapter's two drivers: `uniform,normal`)."""
        return self.settings["inputs"].split(",")

    def units(self) -> list[dict]:
        """Every unit of work, for each input protocol; in emulation only the boundary suite
        (no times, no peaks). With several protocols each unit's name ends in its protocol."""
        several = len(self.protocols()) > 1
        units = []
        for proto in self.protocols():
            tag = f"-{proto}" if several else ""
            common = {"versions": list(self.versions), "block": self.block,
                      "settings": dict(self.settings, inputs=proto), "causal": self.causal}
            units += [dict(common, unit=f"boundary-{s}x{d}{tag}", kind="timing",
                           suite="boundary", seq=s, dim=d, process=0)
                      for s, d in self.boundary]
            if mode.EMULATION:
                continue
            for seq in self.seqs:
                units += [dict(common, unit=f"main-{seq}x{self.dim}-p{p}{tag}", kind="timing",
                               suite="main", seq=seq, dim=self.dim, process=p)
                          for p in range(self.processes)]
                units += [dict(common, unit=f"memory-{seq}x{self.dim}-{v}{tag}", kind="memory",
                               suite="main", seq=seq, dim=self.dim, versions=[v])
                          for v in self.versions]
        return units


# --- the units' processes ---------------------------------------------------------------

def run_unit_process(unit: dict, timeout_s: float = 3600) -> list[dict]:
    """Run one unit in a fresh Python process; parse its record lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "fusedattn_lab.worker", json.dumps(unit)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, code = exc.stdout or "", f"timed out after {timeout_s} s", -1
    recs = [json.loads(line[len(MARK):]) for line in stdout.splitlines()
            if line.startswith(MARK)]
    if not recs or code != 0:
        tail = (stderr or "").strip().splitlines()[-3:]
        recs = [{"unit": unit["unit"], "kind": unit["kind"], "version": v,
                 "seq": unit["seq"], "dim": unit["dim"], "block": unit["block"],
                 "error": f"worker exited {code}: " + " | ".join(tail)}
                for v in unit["versions"]]
    return recs


# --- the run -------------------------------------------------------------------------------

def run_dir_for(base: Path, env: dict) -> Path:
    gpu = env.get("gpu") or "emulation"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return base / slug / stamp


def execute(plan: Plan, run_dir: Path, console, progress_factory) -> tuple[list[dict],
                                                                          list[SummaryRow]]:
    """Run every unit not yet on disk, then write summary.csv (and return both)."""
    from fusedattn_lab.registry import VERSIONS

    for name in ("plan.json", "environment.json", "records.jsonl", "summary.csv"):
        if (run_dir / name).exists() and not (run_dir / name).is_file():
            raise ValueError(f"{run_dir / name} is not a file; a run folder holds its {name} "
                             "as one")
    plan_path = run_dir / "plan.json"
    if plan_path.exists():
        stored = json.loads(plan_path.read_text())
        if stored != json.loads(json.dumps(asdict(plan))):
            raise ValueError(f"{run_dir} holds a run with another plan; resume only with the "
                             "same options (see its plan.json)")
    env = environment()
    write_json(plan_path, asdict(plan))
    if not (run_dir / "environment.json").exists():
        write_json(run_dir / "environment.json", env)
    env = json.loads((run_dir / "environment.json").read_text())
    records_path = run_dir / "records.jsonl"
    records = read_records(records_path, plan)
    done = done_units(records)
    todo = [u for u in plan.units() if u["unit"] not in done]
    for r in records:  # a failed attempt stays on disk, marked, when its unit runs again
        if r["unit"] not in done:
            r["superseded"] = True
    if done:
        console.print(f"resuming: {len(done)} unit(s) on disk, {len(todo)} to run")
    if todo:  # the summary is derived from the records: none while they are incomplete
        (run_dir / "summary.csv").unlink(missing_ok=True)
    with progress_factory() as progress:
        task = progress.add_task("run-all", total=len(todo))
        for unit in todo:
            progress.update(task, description=unit["unit"])
            records += run_unit_process(unit)
            write_records(records_path, records)
            progress.advance(task)
    hashes = {v: sha256_file(VERSIONS[v].source_file()) for v in plan.versions}
    rows = summarize(records, env, plan, hashes)
    write_atomic(run_dir / "summary.csv", summary_csv(rows))
    return records, rows
