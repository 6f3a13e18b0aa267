"""`fusedattn bench --suite coldstart`: a first call in a fresh process, verified."""

import pytest

from fusedattn_lab.cli import main
from fusedattn_lab.suites import BenchProblem


@pytest.mark.gpu_only("nothing is compiled in emulation")
def test_a_fresh_process_first_call_is_verified_and_timed(monkeypatch):
    from fusedattn_lab.coldstart import run_fresh

    monkeypatch.setenv("FUSEDATTN_PREBUILT", "0")  # (the shipped kernels would compile none)

    row = run_fresh(BenchProblem(1, 2, 100, 64, "bf16", True))
    assert "error" not in row, row
    assert row["verified"] and row["first_call_s"] > row["second_call_s"] > 0
    # the compile profile: the forward's kernel, compiled in this call, with its stages
    assert 0 < row["compile_sum_s"] < row["first_call_s"], row
    assert "_flash_fwd" in row["compiles"] and "cubin" in row["compiles"], row
    # after `fusedattn.warmup` for the problem's kind, nothing compiles: neither the first
    # call nor the second shape
    warm = run_fresh(BenchProblem(1, 2, 100, 64, "bf16", True), "after warmup")
    assert "error" not in warm, warm
    assert warm["verified"] and warm["compiles"] == "" and warm["second_shape_compiles"] == 0


@pytest.mark.gpu_only("nothing is compiled in emulation")
def test_a_first_training_call_says_what_its_forward_took(monkeypatch):
    from fusedattn_lab.coldstart import run_fresh

    monkeypatch.setenv("FUSEDATTN_PREBUILT", "0")  # (the shipped kernels would compile none)

    row = run_fresh(BenchProblem(1, 2, 100, 64, "bf16", True, mode="fwd+bwd"))
    assert "error" not in row, row
    # the forward alone (synchronised) and the compiles done by then (the backward's
    # start on threads at the forward: `precompile_backward`); the backward is the rest
    assert 0 < row["first_forward_s"] < row["first_call_s"], row
    assert 1 <= row["forward_compiles"] <= row["compiles"].count(" s ("), row
    assert "_flash_fwd" in row["compiles"] and "bwd" in row["compiles"], row
    # torch's import on a first backward with a given gradient, done before either call
    assert row["torch_backward_import_s"] > 0, row


def test_the_compile_listener_keeps_each_compiles_stages_and_skips_cache_hits():
    from types import SimpleNamespace

    from fusedattn_lab.coldstart import _compile_listener, compile_profile

    records = []
    listen = _compile_listener(records)
    times = SimpleNamespace(ir_initialization=30_000, total=1_530_000,
                            lowering_stages=[("ttir", 100_000), ("cubin", 1_400_000)])
    listen(src=None, metadata={"name": "_flash_fwd"}, metadata_group={}, times=times,
           cache_hit=False)
    listen(src=None, metadata={"name": "_hit"}, metadata_group={}, times=times,
           cache_hit=True)
    assert records == [{"kernel": "_flash_fwd", "total": 1.53, "ir": 0.03, "ttir": 0.1,
                        "cubin": 1.4}]
    assert compile_profile(records) == "_flash_fwd 1.53 s (ir 0.03, ttir 0.10, cubin 1.40)"


@pytest.mark.emulation_only("the interpreter's process; on a GPU the suite and the prebuild "
                            "run warmup processes")
def test_a_warmup_process_answers_what_it_did():
    # `coldstart.warmup_process` (the "after warmup" start and scripts/prebuild.py): a
    # fresh process, the environment passed on (here the interpreter: nothing compiles)
    import json
    import os

    from fusedattn_lab.coldstart import warmup_process

    proc = warmup_process(dict(head_dims=(16,), heads=(1,), max_len=16),
                          dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    # (causal by default: 6 calls, each again in a CUDA graph capture's form)
    assert done["calls"] == 2 * 6 and done["compiled"] == 0, done
    bad = warmup_process(dict(head_dims=(0,), heads=(1,)), dict(os.environ,
                                                                TRITON_INTERPRET="1"))
    assert bad.returncode != 0 and "head_dims" in bad.stderr


@pytest.mark.emulation_only("on a GPU the suite runs")
def test_coldstart_is_refused_in_emulation(capsys):
    assert main(["bench", "--suite", "coldstart"]) == 2
    assert "in emulation nothing is compiled" in capsys.readouterr().err


def test_the_coldstart_table_renders_verified_and_failed_rows():
    """The table after the runs (its bug once lost every run's environment.json): a
    verified row shows True, a failed one its error, cut to 60 characters."""
    from rich.console import Console

    from fusedattn_lab.cli.bench import render_coldstart

    console = Console(record=True, width=260)
    render_coldstart(console, [
        {"problem": "bf16 B2 H8 S1000 D128", "primer_s": 4.9, "first_call_s": 1.58,
         "second_call_s": 5e-4, "sdpa_first_call_s": 0.08, "verified": True,
         "process_s": 10.6, "first_forward_s": 0.734},
        {"problem": "fp32 B1 H4 S700 D96", "error": "OutOfResources: " + "x" * 100}])
    text = console.export_text()
    assert "True" in text and "1.58" in text and "0.50" in text and "0.73" in text
    assert "OutOfResources: " + "x" * 44 in text and "x" * 46 not in text


def _key_calls(monkeypatch, tmp_path):
    """`launch.remembered_triton_key` over a counting stand-in for Triton's key, kept in
    tmp_path; returns (call it, the count, the file)."""
    from pathlib import Path

    import triton

    from fusedattn import launch

    calls = []

    def compute():
        calls.append(1)
        return f"key-{len(calls)}"

    root = Path(triton.__file__).parent
    return (lambda: launch.remembered_triton_key(compute, tmp_path, root), calls,
            tmp_path / launch.TRITON_KEY_FILE)


def test_triton_key_is_computed_once_then_read_until_triton_changes(monkeypatch, tmp_path):
    import json

    from fusedattn import launch

    key, calls, path = _key_calls(monkeypatch, tmp_path)
    assert key() == "key-1" and len(calls) == 1
    assert key() == "key-1" and len(calls) == 1  # a later process: read, not computed
    assert json.loads(path.read_text())["key"] == "key-1"
    assert not list(tmp_path.glob("*.tmp"))  # written whole, through a renamed temporary
    # another Triton (a file's size or time, its version): computed again, and kept
    monkeypatch.setattr(launch, "_triton_fingerprint", lambda root: "another")
    assert key() == "key-2" and len(calls) == 2
    assert key() == "key-2" and len(calls) == 2


@pytest.mark.parametrize("content", ["{not json", '{"fingerprint": 3}', '["a list"]', ""])
def test_a_broken_triton_key_file_is_computed_over_never_trusted(content, monkeypatch,
                                                                 tmp_path):
    key, calls, path = _key_calls(monkeypatch, tmp_path)
    path.write_text(content)
    assert key() == "key-1" and len(calls) == 1
    assert key() == "key-1" and len(calls) == 1  # and rewritten whole


def test_an_unwritable_cache_folder_still_gives_the_key(monkeypatch, tmp_path):
    from pathlib import Path

    import triton

    from fusedattn import launch

    blocked = tmp_path / "file"
    blocked.write_text("")  # a folder that cannot be made: a file is in the way
    got = launch.remembered_triton_key(lambda: "k", blocked / "cache",
                                       Path(triton.__file__).parent)
    assert got == "k"
    # a write that fails half-way (a full disk) leaves no file behind, the key still given

    def fail(*args):
        raise OSError("no space left on device")

    monkeypatch.setattr(launch.os, "replace", fail)
    got = launch.remembered_triton_key(lambda: "k2", tmp_path, Path(triton.__file__).parent)
    assert got == "k2" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_key_is_computed_once_by_threads_that_ask_together():
    # `launch.once`: the first GPU launch starts Triton's key on a thread, and the launch's
    # own compile asks for it while that thread hashes: it waits, it does not hash again
    import threading
    import time

    from fusedattn.launch import once

    calls, gate = [], threading.Barrier(4)

    def slow():
        calls.append(1)
        time.sleep(0.2)  # every other thread asks while the first computes
        return f"key-{len(calls)}"

    key, got = once(slow), []

    def ask():
        gate.wait()
        got.append(key())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["key-1"] * 4 and len(calls) == 1
    key.cache_clear()
    assert key() == "key-2" and len(calls) == 2  # forgotten, computed again

    def fails():
        calls.append(1)
        raise OSError("unreadable")

    failing = once(fails)
    for _ in range(2):  # a raise keeps nothing: the next caller tries again
        with pytest.raises(OSError):
            failing()
    assert len(calls) == 4


def test_fusedattn_puts_its_remembered_key_in_place_of_tritons(monkeypatch, tmp_path):
    from triton.runtime import cache

    import fusedattn.launch  # noqa: F401  (installs it at import)

    assert getattr(cache.triton_key, "remembered", False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cache.triton_key.cache_clear()
    try:  # the same key as Triton's own, computed, then read back
        assert cache.triton_key() == cache.triton_key.original()
        cache.triton_key.cache_clear()
        assert cache.triton_key() == cache.triton_key.original()
        assert (tmp_path / fusedattn.launch.TRITON_KEY_FILE).exists()
    finally:
        cache.triton_key.cache_clear()


def test_the_first_launch_starts_the_remembered_key_only(monkeypatch):
    # `launch._triton_key` (on the launcher pool at the first GPU launch): fusedattn's
    # remembered key, computed once for the launch to find; Triton's own key (with
    # FUSEDATTN_TRITON_KEY=compute) is left to the launch, which would hash it again
    from triton.runtime import cache

    from fusedattn import launch
    from inputs import background_done

    background_done()  # (a compile on a thread would ask the stand-in for its key)
    asked = []

    def key():
        asked.append(1)
        return "k"

    monkeypatch.setattr(cache, "triton_key", key)
    launch._triton_key()
    assert asked == []
    key.remembered = True
    launch._triton_key()
    assert asked == [1]
