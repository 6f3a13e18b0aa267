"""Evidence: the environment a figure was made in, source hashes, atomic file writes."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from fusedattn.mode import EMULATION

REPO = Path(__file__).resolve().parents[2]
"""The checkout the package runs from (git is asked there, not in the working folder)."""


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    """GPU, driver, package versions, git commit and dirty flag, date, mode.

    Where the tree was copied to another machine, whoever sent it names the commit and dirty
    flag in FUSEDATTN_GIT_COMMIT / FUSEDATTN_GIT_DIRTY; they win over the copy's own .git,
    which can be stale (the device machine's copy once carried the session's first commit
    and called every tree "dirty").
    """
    commit = os.environ.get("FUSEDATTN_GIT_COMMIT")
    if commit:
        flag = os.environ.get("FUSEDATTN_GIT_DIRTY")
        dirty: bool | None = None if flag is None else flag == "1"
    else:
        commit = _git("rev-parse", "HEAD")
        dirty = (None if commit is None
                 else bool(_git("status", "--porcelain", "--untracked-files=no")))
    env = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "mode": "emulation" if EMULATION else "gpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "numpy": _version("numpy"),
        "git_commit": commit,
        "git_dirty": dirty,
        "gpu": None,
        "driver": None,
        "cuda_runtime": torch.version.cuda,
    }
    if not EMULATION:
        env["gpu"] = torch.cuda.get_device_name()
        smi = None
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass
        if smi is not None and smi.returncode == 0:
            env["driver"] = smi.stdout.strip().splitlines()[0]
    return env


PROVENANCE = ("git_commit", "git_dirty", "gpu", "driver", "torch", "triton", "numba",
              "numba_cuda", "date")
"""The environment's fields that every result row carries (summary.csv, sweep.csv)."""


def provenance(env: dict) -> dict:
    """The `PROVENANCE` fields of `environment()`, for a result row."""
    return {k: env.get(k) for k in PROVENANCE}


def caption(row: dict) -> str:
    """One line for a figure: where and from what commit its numbers come."""
    return (f"{row.get('gpu') or 'emulation'} · driver {row.get('driver') or '—'} · "
            f"torch {row.get('torch')} · triton {row.get('triton')} · "
            f"{(row.get('date') or '')[:10]} · commit {(row.get('git_commit') or '')[:10]}")


def write_atomic(path: Path | str, text: str) -> None:
    """Write `text` to `path` so that a killed process leaves the old file or the new one,
    never half of it: write a temporary file beside it, fsync, rename over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; evidence is meant to be read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path | str, obj: object) -> None:
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")
