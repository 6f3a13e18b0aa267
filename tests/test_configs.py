"""The tile table and its rule (what a GPU would launch; read here with EMULATION off)."""

from dataclasses import replace
from pathlib import Path

import pytest

from fusedattn import configs


def override(monkeypatch, **fields):
    """Environment overrides as they would be read at import (`configs.OVERRIDES`)."""
    monkeypatch.setattr(configs, "OVERRIDES", replace(configs.OVERRIDES, **fields))


@pytest.fixture
def gpu_rules(monkeypatch, tmp_path):
    """The rules as a GPU takes them, without a tuned table (the GPU tier has one)."""
    monkeypatch.setattr(configs, "EMULATION", False)
    override(monkeypatch, table=tmp_path / "no-table.json")


def test_every_kernel_takes_one_config_without_a_search(gpu_rules, monkeypatch):
    override(monkeypatch, autotune=False)
    assert not configs.autotune_requested()
    override(monkeypatch, autotune=True)
    assert configs.autotune_requested()


def test_overrides_are_read_from_the_environment_once():
    env = {"FUSEDATTN_AUTOTUNE": "1", "FUSEDATTN_ONE_LOOP": "0", "FUSEDATTN_SPLIT_D": "0",
           "FUSEDATTN_INDEX64": "1", configs.TABLE_ENV: "/t.json"}
    assert configs.Overrides.from_env(env) == configs.Overrides(
        autotune=True, one_loop=False, split_d=False, index64=True, table=Path("/t.json"))
    assert configs.Overrides.from_env({"FUSEDATTN_ONE_LOOP": "yes"}) == configs.Overrides()


@pytest.mark.parametrize("dim, seq, bh, causal, precision, want", [
    (64, 4096, 128, False, None, (128, 64, 8, 3)),     # bf16 D64: the tuned winner
    (128, 4096, 128, False, None, (128, 128, 8, 3)),   # bf16 D128
    (128, 4096, 128, True, None, (64, 64, 4, 3)),      # bf16 D128 causal
    (256, 4096, 32, False, None, (128, 64, 8, 2)),     # D256: 128 rows with 8 warps fit
    (64, 4096, 16, False, "ieee", (64, 64, 4, 2)),     # fp32 exact: the FMA winner
    (200, 4096, 16, False, "ieee", (32, 32, 4, 2)),    # fp32 exact past 128: smaller
    (200, 4096, 16, False, "tf32", (64, 32, 4, 1)),    # tf32 past 128: one stage
    (64, 4096, 16, False, "tf32x3", (128, 64, 8, 3)),  # fp32's default at D64: 16-bit's tiles
    (128, 4096, 16, True, "tf32x3", (64, 64, 4, 2)),   # D128: 4-byte words, 2 stages
    (128, 256, 1024, False, "tf32x3", (32, 32, 4, 2)),  # short D128 fp32: small tiles
    (96, 700, 4, False, "tf32x3", (32, 64, 4, 2)),     # fp32, 44 programs of 64 rows: 32 rows
    (96, 700, 4, False, "ieee", (32, 32, 4, 2)),       # the same, exact: FMA tiles smaller
    (64, 4096, 2, False, "ieee", (32, 32, 4, 2)),      # 128 programs of 64 rows: idle SMs
    (64, 4096, 3, False, "ieee", (64, 64, 4, 2)),      # 192 fill the 132 SMs
    (64, 200, 4, False, None, (32, 32, 4, 2)),         # short, few programs: small tiles
    (64, 256, 1024, False, None, (64, 64, 4, 3)),      # short but many programs
])
def test_forward_table(gpu_rules, dim, seq, bh, causal, precision, want):
    assert configs.forward_config(dim=dim, seq_q=seq, programs_per_tile_row=bh,
                                  causal=causal, precision=precision) == want


def test_backward_table_by_head_dim_and_bytes(gpu_rules):
    assert configs.backward_configs(dim=64, itemsize=2) == configs.BACKWARD[64]
    assert configs.backward_configs(dim=65, itemsize=2) == configs.BACKWARD[128]
    assert configs.backward_configs(dim=64, itemsize=4) == configs.BACKWARD[128]  # fp32
    assert configs.backward_configs(dim=200, itemsize=2) == configs.BACKWARD[256]
    for dim in (1, 64, 128):  # exact fp32: CUDA-core FMA dots, small tiles at every head dim
        assert configs.backward_configs(dim=dim, itemsize=4,
                                        precision="ieee") == configs.BACKWARD_IEEE
    assert configs.backward_configs(dim=64, itemsize=4, precision="tf32") == configs.BACKWARD[128]
    for dim in (64, 128):  # tf32x3 at any head dim, tf32 past 64: fp32's own small tiles
        assert configs.backward_configs(dim=dim, itemsize=4,
                                        precision="tf32x3") == configs.BACKWARD_FP32_WIDE
    assert configs.backward_configs(dim=128, itemsize=4,
                                    precision="tf32") == configs.BACKWARD_FP32_WIDE
    # the 16-bit wide row takes 8 warps (4 spilled its two 256-column accumulators)
    assert configs.BACKWARD[256][0][2] == 8 and configs.BACKWARD[256] != configs.BACKWARD_FP32_WIDE


@pytest.mark.emulation_only("the interpreter's one config; the GPU's are the tables above")
def test_emulation_runs_one_small_config():
    assert configs.forward_config(dim=64, seq_q=4096, programs_per_tile_row=1, causal=False,
                                  precision=None) == configs.EMULATED


def test_a_tuned_table_entry_comes_before_the_rules(gpu_rules, monkeypatch, tmp_path):
    from fusedattn_lab.tune import write_table

    table = tmp_path / "gpu.json"
    key = configs.table_key("fwd", precision=None, dim=100, causal=True, seq=3000,
                            programs=64)
    assert key == "fwd 16bit d128 causal s4096 fills"  # padded dim, bucket, grid fills
    write_table(table, {key: [32, 64, 4, 2]}, {"git_commit": "abc"})
    bwd = configs.table_key("bwd", precision="tf32", dim=64, causal=False, seq=4096,
                            programs=8)
    dec = configs.table_key("decode", precision=None, dim=128, causal=False, seq=4,
                            programs=256)
    write_table(table, {bwd: [[32, 32, 4, 1], [64, 32, 4, 1]], dec: [16, 256, 8, 3]},
                {"git_commit": "def"})
    override(monkeypatch, table=table)
    # the first write's entry kept, both writes' provenance kept
    assert configs.forward_config(dim=100, seq_q=3000, programs_per_tile_row=64,
                                  causal=True, precision=None) == (32, 64, 4, 2)
    assert configs.backward_configs(dim=64, itemsize=4, precision="tf32", causal=False,
                                    seq=4096, programs=8) == ((32, 32, 4, 1), (64, 32, 4, 1))
    assert configs.decode_config(dim=128, rows=4, seq_k=8192, programs=256) == (16, 256, 8, 3)
    # e4m3 decode takes the rule: the table's entries were timed in 16 bits
    assert configs.decode_config(dim=128, rows=4, seq_k=8192, programs=256,
                                 fp8=True) == (16, 128, 4, 3)
    # a key the table lacks falls back to the rules
    assert configs.forward_config(dim=100, seq_q=3000, programs_per_tile_row=64,
                                  causal=False, precision=None) == (128, 128, 8, 3)
    import json
    assert [p["git_commit"] for p in json.loads(table.read_text())["provenance"]] == \
        ["abc", "def"]


def test_no_table_means_the_rules(gpu_rules, monkeypatch, tmp_path):
    override(monkeypatch, table=tmp_path / "missing.json")
    assert configs.tuned_table() == {}
    assert configs.backward_configs(dim=64, itemsize=2, seq=4096) == configs.BACKWARD[64]


@pytest.mark.emulation_only("on a GPU `tune` times the candidates")
def test_tune_is_refused_in_emulation_and_bad_options_first(capsys):
    from fusedattn_lab.cli import main

    assert main(["tune", "--kernel", "fwd"]) == 2
    assert "a GPU" in capsys.readouterr().err
    assert main(["tune", "--kernel", "sideways"]) == 2
    assert main(["tune", "--dtype", "bf16", "--precision", "tf32"]) == 2
    assert main(["tune", "--dim", "300"]) == 2
    assert main(["tune", "--batch", "1"]) == 2  # B without H
    assert "both or neither" in capsys.readouterr().err
    assert main(["tune", "--kernel", "decode", "--batch", "1", "--heads", "1"]) == 2


def test_tune_cases_and_candidates():
    from fusedattn_lab.tune import candidate_configs, default_cases

    fwd = default_cases("fwd", "bf16", None, [128], [512, 4096], [True])
    assert [(c.batch, c.heads) for c in fwd] == [(64, 16), (4, 32)]
    assert all(candidate_configs(c) for c in fwd)
    (bwd,) = default_cases("bwd", "fp32", "tf32x3", [64], [4096], [False])
    assert all(max(a[:2]) <= 64 and max(b[:2]) <= 64 for a, b in candidate_configs(bwd))
    (dec,) = default_cases("decode", "bf16", None, [128], [8192], [False])
    assert dec.key().startswith("decode 16bit d128 full s64")
    (one,) = default_cases("fwd", "fp32", "ieee", [64], [128], [False], (1, 1))
    assert (one.batch, one.heads) == (1, 1) and one.key() == "fwd ieee d64 full s128 few"


def test_tune_always_times_what_the_kernel_takes_now(gpu_rules):
    """The rule's (or the table's) config is a candidate of its own case, so the table can
    only replace it with something that ran faster on that case."""
    from fusedattn_lab.tune import candidate_configs, default_cases

    for case in default_cases("fwd", "bf16", None, [64, 128, 256], [256, 4096], [False, True]):
        now = configs.forward_config(dim=case.dim, seq_q=case.seq, causal=case.causal,
                                     programs_per_tile_row=case.batch * case.heads,
                                     precision=None)
        got = candidate_configs(case)
        assert got[0] == now and len(set(got)) == len(got), case.label()
    for case in default_cases("bwd", "bf16", None, [64, 128, 200], [4096], [True]):
        got = candidate_configs(case)
        assert got[0] == configs.backward_configs(dim=case.dim, itemsize=2, causal=True,
                                                  seq=4096, programs=case.batch * case.heads)
        assert len(set(got)) == len(got)
    # decode: one case per head dim and cache length (no mask to tune over)
    cases = default_cases("decode", "bf16", None, [64, 128], [8192], [False, True])
    assert len(cases) == 2
    assert candidate_configs(cases[1])[0] == configs.decode_config(dim=128, rows=4,
                                                                   seq_k=8192, programs=256)


def test_the_committed_tables_are_well_formed():
    """Every committed table: keys as `table_key` writes them, configs of the kernel's
    shape (four ints, power-of-two tiles; the backward a pair), provenance of a clean
    commit on the GPU the file is named for."""
    import json
    import re

    tables = sorted(configs.TUNED_DIR.glob("*.json"))
    assert tables, "no tuned table committed"
    key = re.compile(r"(fwd|bwd|decode) (16bit|ieee|tf32|tf32x3) d(16|32|64|128|256) "
                     r"(causal|full) s(64|128|256|512|1024|2048|4096|8192|16384) (fills|few)")

    def shape(c):
        return (len(c) == 4 and all(isinstance(x, int) and x > 0 for x in c)
                and all(x & (x - 1) == 0 for x in c[:3]))
    for path in tables:
        table = json.loads(path.read_text())
        assert table["entries"], path
        for k, config in table["entries"].items():
            m = key.fullmatch(k)
            assert m, k
            assert (len(config) == 2 and all(map(shape, config))) if m[1] == "bwd" \
                else shape(config), (k, config)
        for prov in table["provenance"]:
            assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"]) and not prov["git_dirty"]
            assert re.sub(r"[^a-z0-9]+", "-", prov["gpu"].lower()) == path.stem


@pytest.mark.emulation_only("fakes the GPU's clock: the interpreter runs the kernels")
def test_tune_verifies_every_candidate_and_keeps_the_fastest_that_passes(monkeypatch):
    import torch

    from fusedattn_lab import timing, tune

    case = tune.TuneCase("fwd", "fp16", None, 24, True, 40, 1, 2, 2)
    ms = {(16, 16, 1, 1): 3.0, (32, 32, 4, 2): 1.0, (16, 32, 2, 2): 2.0}
    monkeypatch.setattr(tune, "candidate_configs", lambda c: list(ms))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    real_call = tune._call

    def call(case, config, inputs, saved):  # (32, 32) the fastest, but wrong: it must not win
        run = real_call(case, config, inputs, saved)

        def timed():
            return run() + 0.5 if config == (32, 32, 4, 2) else run()
        timed.config = config
        return timed

    class Clock:
        def __init__(self, fn):
            fn()
            self.median_ms = ms[fn.config]
    monkeypatch.setattr(tune, "_call", call)
    monkeypatch.setattr(timing, "time_gpu", lambda fn, warmup, repeat: Clock(fn))
    best, report = tune.run_case(case, warmup=0, repeat=1)
    assert [r["status"] for r in report] == ["ok", "FAIL", "ok"]
    assert [r["median_ms"] for r in report] == [3.0, None, 2.0]
    assert best == [16, 32, 2, 2]


@pytest.mark.emulation_only("fakes the GPU's clock: the interpreter runs the kernels")
def test_tune_times_backward_pairs_on_one_saved_forward(monkeypatch):
    """The backward's candidates (dK/dV, dQ) pairs, each verified against float64 autograd,
    all reading the forward's O and LSE run once for the case."""
    import torch

    from fusedattn_lab import timing, tune

    case = tune.TuneCase("bwd", "fp16", None, 16, True, 40, 1, 2, 1)
    pairs = [((32, 32, 4, 2), (32, 32, 4, 2)), ((16, 32, 2, 2), (32, 16, 2, 2))]
    ms = dict(zip(pairs, (2.0, 1.0), strict=True))
    monkeypatch.setattr(tune, "candidate_configs", lambda c: pairs)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    forwards = []
    real_saved, real_call = tune._saved_forward, tune._call
    monkeypatch.setattr(tune, "_saved_forward",
                        lambda *a: forwards.append(1) or real_saved(*a))

    def call(case, config, inputs, saved):
        run = real_call(case, config, inputs, saved)
        run.config = config
        return run

    class Clock:
        def __init__(self, fn):
            self.median_ms = ms[fn.config]
    monkeypatch.setattr(tune, "_call", call)
    monkeypatch.setattr(timing, "time_gpu", lambda fn, warmup, repeat: Clock(fn))
    best, report = tune.run_case(case, warmup=0, repeat=1)
    assert [r["status"] for r in report] == ["ok", "ok"] and len(forwards) == 1
    assert best == [list(c) for c in pairs[1]]


def test_one_loop_rule_and_its_override(monkeypatch):
    """One loop for fp32, a window's left edge and short loops; two (three) for long 16-bit
    loops; FUSEDATTN_ONE_LOOP=0/1 forces either (A/B runs), anything else is the rule."""
    from fusedattn.configs import ONE_LOOP_MAX_KEYS, single_key_loop

    override(monkeypatch, one_loop=None)
    long = ONE_LOOP_MAX_KEYS + 1
    assert single_key_loop(seq_k=ONE_LOOP_MAX_KEYS, precision=None, has_left=False)
    assert not single_key_loop(seq_k=long, precision=None, has_left=False)
    assert single_key_loop(seq_k=long, precision="tf32x3", has_left=False)
    assert single_key_loop(seq_k=long, precision=None, has_left=True)
    override(monkeypatch, one_loop=True)
    assert single_key_loop(seq_k=long, precision=None, has_left=False)
    override(monkeypatch, one_loop=False)
    assert not single_key_loop(seq_k=64, precision="ieee", has_left=True)
    override(monkeypatch, one_loop=None)  # $FUSEDATTN_ONE_LOOP unset or neither 0 nor 1
    assert single_key_loop(seq_k=64, precision=None, has_left=False)


def test_backward_one_loop_rule(monkeypatch):
    """The backward: one loop for fp32, a mask edge and short loops; three for a long
    16-bit loop without a mask (where one loop measured 4-6% slower); the same override."""
    from fusedattn.configs import BWD_ONE_LOOP_MAX, backward_single_loop

    override(monkeypatch, one_loop=None)
    plain = dict(precision=None, has_left=False, has_right=False)
    assert backward_single_loop(seq=BWD_ONE_LOOP_MAX, **plain)
    assert not backward_single_loop(seq=1024, **plain)
    assert backward_single_loop(seq=8192, **plain | {"has_right": True})
    assert backward_single_loop(seq=8192, **plain | {"has_left": True})
    assert backward_single_loop(seq=8192, **plain | {"precision": "ieee"})
    override(monkeypatch, one_loop=True)
    assert backward_single_loop(seq=8192, **plain)


def test_decode_splits_fill_one_wave_by_a_power_of_two():
    sms = configs.SMS
    for programs in (1, 2, 3, 7, 8, 16, 31, 32, 64, 65, 96, sms - 1, sms, 4 * sms):
        for seq_k in (1, 255, 256, 257, 600, 4096, 131072):
            splits = configs.decode_splits(programs=programs, seq_k=seq_k)
            assert splits & (splits - 1) == 0 and 1 <= splits <= 64
            assert splits == 1 or (programs * splits <= sms and 256 * splits <= seq_k + 255)
            # the largest such: twice as many would leave the wave, the keys or 64 behind
            double = 2 * splits
            assert (programs * double > sms or 256 * (double - 1) >= seq_k or double > 64)
    # a grid of a program an SM or more: one launch, no merge (B32 H32/8 one query)
    assert configs.decode_splits(programs=256, seq_k=8192) == 1
    assert configs.decode_splits(programs=8, seq_k=131072) == 16
    assert configs.decode_splits(programs=1, seq_k=10**6) == 64
