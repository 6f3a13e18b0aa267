"""`fusedattn run-all`: the chapter's `run_all.sh` as one resumable command.

Units of work, each in its own fresh process (`fusedattn.lab.worker`):
- boundary: every version on 1x1, 7x13, 33x31, 65x33, verified before and after timing;
- main: the main shape(s) in N independent processes, each with warm-up and repeat;
- memory (GPU only): one process per (version, shape) measuring the peak of one call.

After every unit `records.jsonl` is rewritten atomically, so a killed run leaves whole
records only, and `--resume DIR` skips every unit already on disk. Records are append-only:
a unit run again (after an error) keeps its failed attempt, marked `superseded`. Every
record is checked against the plan when it is read (`read_records`). `summary.csv` (long
format, schema `SummaryRow`) is derived from the live records, atomically, once all are
there (a run cut short leaves none rather than a stale one), and the figures from the CSV.

Summary per (version, shape): the median of the per-process medians, with the min-max range
of those medians (the chapter's 12.6 table).
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fusedattn import mode
from fusedattn.lab.evidence import (
    environment,
    provenance,
    sha256_file,
    write_atomic,
    write_json,
)
from fusedattn.lab.worker import MARK

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


# --- records -------------------------------------------------------------------------------

RECORD_KEYS = ("unit", "kind", "version", "seq", "dim", "block")


class RecordError(ValueError):
    """A line of records.jsonl that is not a record of its run's plan."""

    def __init__(self, path: Path, line: int, why: str):
        super().__init__(f"{path} line {line}: {why}")


def read_records(path: Path, plan: Plan | None = None) -> list[dict]:
    """Every record of `path` (append-only: superseded attempts included), each checked:
    a JSON object with `RECORD_KEYS`; with `plan`, also of a unit and version of the plan,
    and not repeating a live record of the same (unit, version)."""
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as err:
            raise RecordError(path, n, f"not JSON ({err.msg})") from None
        if not isinstance(r, dict) or any(k not in r for k in RECORD_KEYS):
            raise RecordError(path, n, "a record is a JSON object with " + ", ".join(RECORD_KEYS))
        records.append((n, r))
    if plan is not None:
        _check_against_plan(path, records, plan)
    return [r for _, r in records]


def _check_against_plan(path: Path, records: list[tuple[int, dict]], plan: Plan) -> None:
    units = {u["unit"]: u for u in plan.units()}
    seen: dict[tuple[str, str], int] = {}
    for n, r in records:
        unit = units.get(r["unit"])
        if unit is None:
            raise RecordError(path, n, f"unit {r['unit']!r} is not in this run's plan")
        if r["version"] not in unit["versions"]:
            raise RecordError(path, n, f"version {r['version']!r} is not in unit "
                              f"{r['unit']!r} ({', '.join(unit['versions'])})")
        if (r["kind"], r["seq"], r["dim"]) != (unit["kind"], unit["seq"], unit["dim"]):
            raise RecordError(path, n, f"kind/seq/dim {r['kind']}/{r['seq']}/{r['dim']} do "
                              f"not match unit {r['unit']!r}")
        if r.get("superseded"):
            continue
        key = (r["unit"], r["version"])
        if key in seen:
            raise RecordError(path, n, f"repeats line {seen[key]} (unit {r['unit']!r}, "
                              f"version {r['version']!r}): a duplicated line would count "
                              "as another process")
        seen[key] = n


def live(records: list[dict]) -> list[dict]:
    """The records that count: every attempt but those superseded by a retry."""
    return [r for r in records if not r.get("superseded")]


def done_units(records: list[dict]) -> set[str]:
    """Units whose every live record is complete (a unit with an error is run again)."""
    records = live(records)
    bad = {r["unit"] for r in records if "error" in r}
    return {r["unit"] for r in records} - bad


def run_unit_process(unit: dict, timeout_s: float = 3600) -> list[dict]:
    """Run one unit in a fresh Python process; parse its record lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "fusedattn.lab.worker", json.dumps(unit)],
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


def write_records(path: Path, records: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, default=str) + "\n" for r in records))


# --- summary -------------------------------------------------------------------------------

@dataclass
class SummaryRow:
    """One row of summary.csv: one (version, shape, metric)."""

    version: str
    route: str
    suite: str
    seq: int
    dim: int
    block: int
    metric: str                 # gpu_ms | host_us | peak_bytes | *_model_bytes | max_abs_error
    median: float | None        # median of the per-process medians (or the one value)
    range_low: float | None     # min of the per-process medians
    range_high: float | None    # max of the per-process medians
    max_abs_error: float | None
    verdict: str                # PASS | FAIL | ERROR
    peak_bytes: int | None
    causal: bool = False        # the plan's mask (top-left): part of what was measured
    inputs: str = ""
    seed: int = 0
    warmup: int = 0
    repeat: int = 0
    processes: int = 0
    timing_mode: str = ""
    source_sha256: str = ""
    git_commit: str | None = None
    git_dirty: bool | None = None
    gpu: str | None = None
    driver: str | None = None
    torch: str | None = None
    triton: str | None = None
    numba: str | None = None
    numba_cuda: str | None = None
    date: str = field(default="")


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(records: list[dict], env: dict, plan: Plan, hashes: dict[str, str]
              ) -> list[SummaryRow]:
    """Group records by (suite, version, shape) and reduce them to summary rows."""
    from fusedattn.lab.registry import VERSIONS

    s = plan.settings
    static = {"causal": plan.causal, "seed": s["seed"],
              "warmup": s["warmup"],
              "repeat": s["repeat"], "timing_mode": s["timing"],
              **provenance(env)}
    static["date"] = static["date"] or ""
    groups: dict[tuple, list[dict]] = {}
    peaks: dict[tuple, int | None] = {}
    for r in live(records):
        key = (r.get("suite") or "boundary", r["version"], r["seq"], r["dim"], r["block"],
               r.get("inputs") or s["inputs"])
        if r["kind"] == "memory":
            peaks[key] = r.get("peak_bytes")
        else:
            groups.setdefault(key, []).append(r)
    rows = []
    for key, recs in groups.items():
        suite, name, seq, dim, block, inputs = key
        version = VERSIONS[name]
        errors = [r for r in recs if "error" in r]
        good = [r for r in recs if "error" not in r]
        checks = [c for r in good for c in (r["before"], r.get("after")) if c]
        max_abs = max((c["max_abs"] for c in checks), default=None)
        verdict = "ERROR" if errors or not good else (
            "PASS" if all(r["verdict"] == "PASS" for r in good) else "FAIL")
        base = dict(version=name, route=version.route, suite=suite, seq=seq, dim=dim,
                    block=block, inputs=inputs, max_abs_error=max_abs, verdict=verdict,
                    peak_bytes=peaks.get(key), processes=len(recs),
                    source_sha256=hashes[name], **static)
        rows.append(SummaryRow(metric="max_abs_error", median=max_abs, range_low=max_abs,
                               range_high=max_abs, **base))
        timed = [r["timing"] for r in good if r.get("timing")]
        if timed:
            for metric, col in (("gpu_ms", "median_ms"), ("host_us", "host_us_median")):
                rows.append(SummaryRow(metric=metric, **dict(zip(
                    ("median", "range_low", "range_high"),
                    _spread([t[col] for t in timed]), strict=True)), **base))
        if suite == "main":
            if peaks.get(key) is not None:
                p = peaks[key]
                rows.append(SummaryRow(metric="peak_bytes", median=p, range_low=p,
                                       range_high=p, **base))
            for metric, value in version.intermediate_models(seq).items():
                rows.append(SummaryRow(metric=f"{metric.removesuffix('_bytes')}_model_bytes",
                                       median=value, range_low=value, range_high=value, **base))
    return rows


def summary_csv(rows: list[SummaryRow]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[f.name for f in fields(SummaryRow)],
                            lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    return buf.getvalue()


def read_summary(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- the run -------------------------------------------------------------------------------

def run_dir_for(base: Path, env: dict) -> Path:
    gpu = env.get("gpu") or "emulation"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return base / slug / stamp


def execute(plan: Plan, run_dir: Path, console, progress_factory) -> tuple[list[dict],
                                                                          list[SummaryRow]]:
    """Run every unit not yet on disk, then write summary.csv (and return both)."""
    from fusedattn.lab.registry import VERSIONS

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
