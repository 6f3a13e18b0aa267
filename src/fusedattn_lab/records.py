"""run-all's records and summary: `records.jsonl` (one JSON object per version per unit,
append-only, each checked against the run's plan when read) and `summary.csv` (long format,
schema `SummaryRow`: the median of the per-process medians with their range, the chapter's
12.6 table), derived from the live records. `fusedattn_lab.runall` runs the units that
write them."""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from fusedattn_lab.evidence import provenance, write_atomic

if TYPE_CHECKING:
    from fusedattn_lab.runall import Plan


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
    from fusedattn_lab.registry import VERSIONS

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
