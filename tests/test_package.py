"""The package a user installs: the library imports without the lab's dependencies and sets
no global state, the lab chooses its mode explicitly, and the A/B runner's switches are
the library's overrides (issue 29)."""

import os
import subprocess
import sys

import pytest

from fusedattn.problem import ProblemError

# a child process in which the lab's packages cannot be imported at all
BLOCK = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numba", "matplotlib", "rich", "fusedattn_lab"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, _Blocked())
"""


def _child(code: str, env: dict | None = None) -> str:
    """The child's stdout; a failed child's stderr in the assertion (what went wrong)."""
    done = subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True,
                          text=True, env=env or dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_library_imports_and_runs_without_the_lab():
    out = _child("""
import os
before = dict(os.environ)
import fusedattn, fusedattn.api, fusedattn.varlen, fusedattn.kvcache, fusedattn.configs
import fusedattn.tiles.flash, fusedattn.tiles.flash_bwd, fusedattn.distributed
import fusedattn.reference
# (the thread `import fusedattn` starts on a GPU machine, `fusedattn.prime`, finished first:
# whatever it does counts as the import's, and the check does not race it)
fusedattn.prime.join(timeout=120)
changed = {k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)}
assert not changed, f"importing fusedattn changed the environment: {sorted(changed)}"
if os.environ.get("TRITON_INTERPRET") == "1":
    import torch
    q = torch.randn(1, 2, 9, 16)
    assert torch.isfinite(fusedattn.attention(q, q, q, is_causal=True)).all()
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "matplotlib")))
""")
    assert out.split() == ["ok", "[]"]


def test_importing_the_library_sets_no_emulation_flags():
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    out = _child("import os, fusedattn.mode as m\n"
                 "print(m.EMULATION, os.environ.get('TRITON_INTERPRET'), "
                 "os.environ.get('NUMBA_ENABLE_CUDASIM'))", env)
    assert out.split() == ["False", "None", "None"]


def test_a_cpu_tensor_without_emulation_says_how_to_emulate():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _child("import torch, fusedattn\nfrom fusedattn.problem import ProblemError\n"
                 "try:\n    fusedattn.attention(*[torch.randn(1, 1, 4, 16)] * 3)\n"
                 "except ProblemError as e:\n    print(e)\n", env)
    assert "q.device" in out and "TRITON_INTERPRET=1" in out


def test_the_lab_chooses_emulation_explicitly_before_fusedattn():
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    env["FUSEDATTN_EMULATE"] = "1"
    out = subprocess.run([sys.executable, "-c",
                          "import os\nfrom fusedattn_lab import choose_mode\n"
                          "print(choose_mode(), os.environ['TRITON_INTERPRET'])\n"
                          "import fusedattn.mode as m\nprint(m.EMULATION)"],
                         capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["True", "1", "True"]


def test_the_ab_switches_are_the_librarys_overrides():
    from fusedattn_lab.ab import parse_ab

    assert parse_ab("one_loop=1,0") == ("one_loop", (True, False))
    assert parse_ab("split_d=0,1") == ("split_d", (False, True))
    for bad in ("heads=1,2", "one_loop=1,1", "one_loop=1", "table=0,1", "index64=0,2"):
        with pytest.raises(ProblemError, match="FIELD=A,B"):
            parse_ab(bad)
