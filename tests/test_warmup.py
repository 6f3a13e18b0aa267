"""`fusedattn.warmup` (issue 31): the calls it makes, the specs it refuses, and on the GPU
that a new length or batch after it compiles nothing."""

import pytest
import torch

import fusedattn
from fusedattn.ahead_of_time import _batches, _lengths, _listen
from fusedattn.mode import DEVICE
from fusedattn.problem import ProblemError


def test_lengths_cover_every_bucket_on_and_off_multiples_of_16():
    lengths = _lengths(1024)
    assert lengths[0] == 1 and max(lengths) == 1024
    for b in (16, 32, 64, 128, 256, 512, 1024):
        assert b in lengths and b - 1 in lengths
    assert _batches(1, 16) == [1, 132] and _batches(64, 4096) == [1]


def test_warmup_makes_its_calls_and_returns_what_it_did(monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "SMS", 4)  # a 4-SM GPU: the batch that fills it is small
    done = fusedattn.warmup(head_dims=(16,), heads=(2,), heads_kv=(1,), dtypes=("fp32",),
                            causal=(True, False), training=True, varlen=True, max_len=16)
    # 2 masks x lengths (1, 15, 16) x batches (1 and the batch that fills the SMs), each
    # with gradients and without (an evaluation's forward, no LSE), and varlen's
    assert done["calls"] == 2 * 3 * 2 * 2 + 2 * 3
    assert done["compiled"] >= 0 and done["seconds"] > 0


def test_warmup_takes_head_dim_pairs_and_sinks(monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "SMS", 4)
    done = fusedattn.warmup(head_dims=((24, 16),), heads=(2,), dtypes=("fp32",),
                            causal=(True,), sinks=True, varlen=True, max_len=16)
    assert done["calls"] == 3 * 2 + 3


def test_warmup_takes_fp8_and_its_backward(monkeypatch):
    from fusedattn import configs

    monkeypatch.setattr(configs, "SMS", 4)
    done = fusedattn.warmup(head_dims=(64,), heads=(2,), heads_kv=(1,), dtypes=("fp8",),
                            causal=(True,), training=True, sinks=True, varlen=True,
                            max_len=16)
    assert done["calls"] == 3 * 2 + 3


@pytest.mark.parametrize("bad", [dict(head_dims=(0,)), dict(head_dims=()),
                                 dict(head_dims=(80,), dtypes=("bf16", "fp8")),
                                 dict(head_dims=((24, 300),)), dict(sinks=1),
                                 dict(heads_kv=(3,)), dict(dtypes=("int8",)),
                                 dict(causal=(1,)), dict(max_len=8), dict(training="yes")])
def test_warmup_refuses_a_bad_spec(bad):
    spec = dict(head_dims=(16,), heads=(2,), max_len=16) | bad
    with pytest.raises(ProblemError):
        fusedattn.warmup(**spec)


@pytest.mark.gpu_only("compiles happen on the GPU only (the interpreter compiles nothing)")
def test_after_warmup_a_new_length_or_batch_compiles_nothing():
    # training and evaluation calls alike
    fusedattn.warmup(head_dims=(64,), heads=(4,), dtypes=("bf16",), causal=(True,),
                     training=True, max_len=2048)
    compiled = []
    restore = _listen(compiled)
    try:
        for batch, seq in ((3, 1500), (2, 700), (5, 77), (1, 2000)):
            q, k, v = (torch.randn(batch, 4, seq, 64, device=DEVICE, dtype=torch.bfloat16)
                       .requires_grad_() for _ in range(3))
            out = fusedattn.attention(q, k, v, is_causal=True)
            # a contiguous upstream gradient, as warmup's (a loss's .sum() hands on a
            # stride-0 one, which specialises the backward anew)
            out.backward(torch.randn_like(out))
            with torch.no_grad():  # an evaluation step's forward (no LSE written)
                fusedattn.attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    finally:
        restore()
    assert compiled == [], compiled


def test_the_cli_reads_head_dim_pairs():
    from fusedattn_lab.cli.warmup import _dims

    assert _dims("128") == (128,) and _dims("64,192/128") == (64, (192, 128))
