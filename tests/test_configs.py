"""The tile table and its rule (what a GPU would launch; read here with EMULATION off)."""

import pytest

from fusedattn import configs


@pytest.fixture
def gpu_rules(monkeypatch):
    monkeypatch.setattr(configs, "EMULATION", False)


def test_every_kernel_takes_one_config_without_a_search(gpu_rules, monkeypatch):
    monkeypatch.delenv("FUSEDATTN_AUTOTUNE", raising=False)
    assert not configs.autotune_requested()
    monkeypatch.setenv("FUSEDATTN_AUTOTUNE", "1")
    assert configs.autotune_requested()


@pytest.mark.parametrize("dim, seq, bh, causal, precision, want", [
    (64, 4096, 128, False, None, (128, 64, 8, 3)),     # bf16 D64: the tuned winner
    (128, 4096, 128, False, None, (128, 128, 8, 3)),   # bf16 D128
    (128, 4096, 128, True, None, (64, 64, 4, 3)),      # bf16 D128 causal
    (256, 4096, 32, False, None, (64, 64, 4, 3)),      # D256 fits 64-row tiles
    (64, 4096, 16, False, "ieee", (64, 64, 4, 2)),     # fp32 exact: the FMA winner
    (200, 4096, 16, False, "ieee", (32, 32, 4, 2)),    # fp32 exact past 128: smaller
    (200, 4096, 16, False, "tf32", (64, 32, 4, 1)),    # tf32 past 128: one stage
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
    assert configs.backward_configs(dim=64, itemsize=4,
                                    precision="tf32x3") == configs.BACKWARD[256]


@pytest.mark.emulation_only("the interpreter's one config; the GPU's are the tables above")
def test_emulation_runs_one_small_config():
    assert configs.forward_config(dim=64, seq_q=4096, programs_per_tile_row=1, causal=False,
                                  precision=None) == configs.EMULATED
