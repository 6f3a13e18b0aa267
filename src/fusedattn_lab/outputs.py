"""Where a command's files go, checked before any work starts.

- Every run gets a folder of its own, created exclusively (`new_run_dir`): two runs started
  in the same second into one `--out` get `STAMP` and `STAMP-2`, and nothing is overwritten.
- An output path that cannot be written (`--json` under /proc, `--out` or `--figure` in a
  read-only folder) is a `ProblemError` before the work, not a traceback after it: the
  nearest existing folder is probed by creating (and removing) a file in it, which is the
  only test that also holds for root and for read-only filesystems.
- In emulation the default base is a temporary folder, not the repository's `evidence/`:
  emulation proves logic, and its output is not evidence (`default_base`). The folder is
  private to the process (`tempfile.mkdtemp`: a name nobody can guess, mode 0700), so no
  other user can plant a link where the files go.
- Evidence from a tree with uncommitted changes keeps the diff beside it
  (`uncommitted.diff`), so the code that ran is always recoverable.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

from fusedattn.mode import EMULATION
from fusedattn.problem import ProblemError

EVIDENCE = Path("evidence")


@functools.cache
def emulation_base() -> Path:
    """This process's private folder for emulation output, made on first use."""
    return Path(tempfile.mkdtemp(prefix="fusedattn-emulation-"))


def default_base(out: Path | None) -> Path:
    """`--out` as given, else `evidence/` on a GPU and a private temporary folder in
    emulation."""
    if out is not None:
        return Path(out)
    return emulation_base() if EMULATION else EVIDENCE


def _probe(folder: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".fusedattn-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def writable_dir(field: str, path: Path | str) -> Path:
    """`path`, a folder that exists or can be created, and written to."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ProblemError(field, str(path), "a folder (this is a file)")
    _check_nearest(field, path, path, "a folder that can be written")
    return path


def _check_nearest(field: str, path: Path, start: Path, what: str) -> None:
    """`start`'s nearest existing folder must take a new file, or `path` is refused."""
    existing = start
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not _probe(existing):
        raise ProblemError(field, str(path), f"{what} ({existing} cannot be written)")


def writable_file(field: str, path: Path | str, suffixes: tuple[str, ...] = ()) -> Path:
    """`path`, a file that can be written (an existing one is replaced); `suffixes`, the
    allowed extensions."""
    path = Path(path)
    if path.is_dir():
        raise ProblemError(field, str(path), "a file path, not a directory")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ProblemError(field, str(path), "a file ending in " + " or ".join(suffixes))
    _check_nearest(field, path, path.parent, "a path that can be written")
    return path


def new_run_dir(base: Path, env: dict, suffix: str = "") -> Path:
    """A fresh folder `base/<gpu>/<stamp><suffix>[-N]`, created exclusively, with the
    uncommitted diff beside it when the tree was dirty."""
    from fusedattn_lab.runall import run_dir_for

    writable_dir("out", base)
    first = run_dir_for(base, env)
    first = first.with_name(first.name + suffix)
    first.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        folder = first if n == 1 else first.with_name(f"{first.name}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        record_uncommitted(folder, env)
        return folder
    raise ProblemError("out", str(base), "a base folder with fewer than 1000 runs per second")


def _git(*args: str) -> str:
    """git's output in the package's repository ('' where git or the repository is not
    there); `diff --no-index` exits 1 when the files differ, which is its success."""
    from fusedattn_lab.evidence import REPO

    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode in (0, 1) else ""


def record_uncommitted(folder: Path, env: dict) -> None:
    """Beside evidence from a dirty tree: `uncommitted.diff` (tracked changes against the
    recorded commit, and every untracked file as an addition). Where the commit was named
    by the machine that sent the tree (its own .git is stale), the diff lives there:
    `uncommitted.txt` says so."""
    from fusedattn_lab.evidence import write_atomic

    if not env.get("git_dirty"):
        return
    if os.environ.get("FUSEDATTN_GIT_COMMIT"):
        write_atomic(folder / "uncommitted.txt",
                     f"The tree that ran was commit {env.get('git_commit')} with uncommitted "
                     "changes, named by the machine that sent it; its diff is not here.\n")
        return
    parts = [_git("diff", "HEAD")]
    for name in _git("ls-files", "--others", "--exclude-standard").splitlines():
        if not name.startswith(f"{EVIDENCE}/"):  # results, not code
            parts.append(_git("diff", "--no-index", "--", os.devnull, name))
    write_atomic(folder / "uncommitted.diff", "".join(parts))
