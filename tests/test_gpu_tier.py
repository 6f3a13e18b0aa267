"""The GPU tier's pytest options (`scripts/gpu_tier.py`): a test stuck past the stack time
under xdist workers leaves every thread's stack in the tier's log, where the thread
method's own dump was lost with its worker (085707Z)."""

import subprocess
import sys

import pytest

from inputs import script

SLEEPER = '''
import time


def test_waits_past_the_stack_time():
    time.sleep(4)  # the line the stack must name


def test_quick():
    pass
'''


def _run(tmp_path, options) -> subprocess.CompletedProcess:
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
         *options, "test_sleeper.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.emulation_only("runs pytest with xdist workers in a subprocess: the tier's own "
                            "options, checked off the tier (not nested in its workers)")
def test_a_stuck_test_leaves_its_stack_in_the_log_under_xdist(tmp_path):
    pytest.importorskip("xdist")
    tier = script("gpu_tier")
    options = tier.plugin_args(2, timeout_s=60, stacks_after_s=1)
    assert options[:2] == ["-n", "2"]
    run = _run(tmp_path, options)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert 'test_sleeper.py", line 6 in test_waits_past_the_stack_time' in log, log
    # without the stack option, the same run leaves no stack: the option is what writes it
    bare = _run(tmp_path, options[:-2])
    assert bare.returncode == 0 and "test_sleeper.py\", line" not in bare.stdout + bare.stderr
