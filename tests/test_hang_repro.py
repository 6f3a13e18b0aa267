"""`scripts/hang_repro.py`'s watch: a child that stops printing is a hang, killed and kept
with its last step; one that ends is done; one that outlives its budget is stopped."""

import sys

from inputs import script

CHILD = ("import sys, time\n"
         "for i in range(3):\n"
         "    print('step', i, flush=True)\n")


def _watch(tail, stall_s=1.5, budget_s=30):
    return script("hang_repro").watch([sys.executable, "-c", CHILD + tail],
                                      stall_s, budget_s)


def test_a_child_that_stops_printing_is_a_hang_and_is_killed():
    got = _watch("time.sleep(60)")
    assert got["ended"] == "hang" and got["steps"] == 3, got
    assert got["last"].endswith("step 2") and got["seconds"] < 30, got


def test_a_first_step_gets_its_own_longer_wait():
    # (a child's first step compiles): silent for 2 s before it, 1 s after
    child = "time.sleep(2)\nprint('step 0', flush=True)\ntime.sleep(60)"
    got = script("hang_repro").watch([sys.executable, "-c", "import time\n" + child],
                                     1.0, 30, first_stall_s=4.0)
    assert got["ended"] == "hang" and got["steps"] == 1, got
    assert 2.5 <= got["seconds"] < 10, got
    early = script("hang_repro").watch([sys.executable, "-c", "import time\n" + child],
                                       1.0, 30)
    assert early["ended"] == "hang" and early["steps"] == 0, early


def test_a_child_that_ends_is_done_or_failed_by_its_status():
    assert _watch("")["ended"] == "done"
    got = _watch("sys.exit(3)")
    assert got["ended"] == "failed" and got["steps"] == 3, got


def test_a_child_that_keeps_printing_past_its_budget_is_stopped():
    got = _watch("while True:\n    print('alive', flush=True)\n    time.sleep(0.2)",
                 stall_s=5, budget_s=2)
    assert got["ended"] == "budget" and got["seconds"] < 10, got

