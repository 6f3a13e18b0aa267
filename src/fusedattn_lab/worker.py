"""One independent process of `fusedattn run-all`: `python -m fusedattn_lab.worker SPEC_JSON`.

SPEC: {"unit": id, "kind": "timing" | "memory", "versions": [...], "seq", "dim", "block",
"settings": {...}, "process": i}. Prints one `FUSEDATTN-RECORD <json>` line per version;
a version that raises gives a record with an "error" field instead of stopping the rest.
"""

from __future__ import annotations

import json
import sys
import traceback

MARK = "FUSEDATTN-RECORD "


def run_unit(spec: dict) -> list[dict]:
    from fusedattn.problem import Problem
    from fusedattn_lab.protocol import Settings, case_for, measure, measure_peak
    from fusedattn_lab.registry import VERSIONS

    problem = Problem(spec["seq"], spec["dim"], spec["block"], spec.get("causal", False))
    settings = Settings(**spec["settings"])
    base = {"unit": spec["unit"], "kind": spec["kind"], "suite": spec.get("suite"),
            "process": spec.get("process", 0), "seq": problem.seq, "dim": problem.dim,
            "block": problem.block, "causal": problem.causal, "inputs": settings.inputs}
    shared = None
    if spec["kind"] == "timing":
        shared = case_for(problem, settings)
    out = []
    for name in spec["versions"]:
        version = VERSIONS[name]
        rec = dict(base, version=name, route=version.route)
        try:
            if spec["kind"] == "memory":
                rec.update(measure_peak(version, problem, settings))
            else:
                rec.update(measure(version, problem, settings, shared).to_dict())
        except Exception as exc:  # one failing version must not hide the others
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc(limit=5)
        out.append(rec)
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    for rec in run_unit(spec):
        print(MARK + json.dumps(rec, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
