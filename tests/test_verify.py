import pytest
import torch

from fusedattn_lab.verify import TOLERANCE, check, poison


def _pair():
    ref = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    return ref.to(torch.float32), ref


def test_exact_result_passes():
    out, ref = _pair()
    result = check(out, ref)
    assert result.ok and result.max_abs < 1e-7 and result.reasons == ()


def test_poisoned_output_is_unwritten_not_nan():
    out, ref = _pair()
    poison(out)
    result = check(out, ref)
    assert not result.ok
    assert result.n_unwritten == 12 and result.n_nan == 0


def test_one_unwritten_element_fails_whatever_the_error():
    out, ref = _pair()
    poison(out[1:2, 2:3])
    result = check(out, ref)
    assert not result.ok and result.n_unwritten == 1 and result.max_abs < 1e-7


def test_a_computed_nan_fails_even_though_max_error_is_tiny():
    # The chapter's HIP check took std::max over errors, which NaN slips through.
    out, ref = _pair()
    out[2, 3] = float("nan")
    result = check(out, ref)
    assert not result.ok and result.n_nan == 1 and result.n_unwritten == 0


def test_inf_fails():
    out, ref = _pair()
    out[0, 0] = float("inf")
    assert check(out, ref).n_inf == 1 and not check(out, ref).ok


def test_error_at_the_tolerance_fails_and_says_where():
    out, ref = _pair()
    out[2, 1] += TOLERANCE["float32"].abs_max * 1.5
    result = check(out, ref)
    assert not result.ok and result.where == (2, 1)
    assert result.max_abs >= TOLERANCE["float32"].abs_max


def test_float32_tolerance_is_the_chapters_bound():
    assert TOLERANCE["float32"].abs_max == 2e-4


def test_low_precision_bound_is_twice_the_peer_plus_a_floor():
    from fusedattn_lab.verify import precision_key

    assert precision_key(torch.float32, "tf32") == "tf32"
    assert precision_key(torch.bfloat16) == "bfloat16"
    ref = torch.zeros(4, 4, dtype=torch.float64)
    out = torch.full((4, 4), 0.01, dtype=torch.bfloat16)
    # peer error 0.004: limit 2 * 0.004 + 2^-8 = 0.0119 > 0.01 (bf16 0.01 ~ 0.010009)
    assert check(out, ref, peer_error=0.004).ok
    assert not check(out, ref, peer_error=0.001).ok  # limit 0.0059
    import pytest

    with pytest.raises(ValueError, match="peer"):
        check(out, ref)


def test_poison_for_half_precisions_is_nan_and_detected():
    for dtype in (torch.float16, torch.bfloat16):
        out = poison(torch.zeros(3, 2, dtype=dtype))
        assert torch.isnan(out).all()
        result = check(out, torch.zeros(3, 2, dtype=torch.float64), peer_error=1e-3)
        assert result.n_unwritten == 6 and result.n_nan == 0 and not result.ok


def test_stress_bound_is_relative_to_torchs_fp32_error_and_chapter_bound_stays():
    from fusedattn_lab.verify import TOLERANCE, needs_peer, precision_key

    # the chapter's protocols keep the fixed 2e-4
    for protocol in ("uniform", "normal", None):
        assert precision_key(torch.float32, None, protocol) == "float32"
        assert not needs_peer(torch.float32, None, protocol)
    assert precision_key(torch.float32, None, "stress") == "float32-wide"
    assert TOLERANCE["float32-wide"].limit(1.18e-4) == pytest.approx(2 * 1.18e-4 + 2e-4)
    # tf32 and low precision are not affected by the protocol
    assert precision_key(torch.float32, "tf32", "stress") == "tf32"
    assert precision_key(torch.bfloat16, None, "stress") == "bfloat16"


def test_stress_check_fails_an_error_above_twice_the_peer():
    from fusedattn_lab.verify import check

    ref = torch.zeros(4, 4, dtype=torch.float64)
    out = torch.full((4, 4), 3e-4)
    assert check(out, ref, protocol="stress", peer_error=1e-4).ok          # < 4e-4
    assert not check(out, ref, protocol="stress", peer_error=1e-5).ok      # >= 2.2e-4
    assert not check(out, ref, protocol="uniform").ok                      # >= 2e-4


def test_low_precision_floor_is_half_an_ulp_at_the_largest_magnitude():
    bf16 = TOLERANCE["bfloat16"]
    assert bf16.limit(1e-3) == pytest.approx(2e-3 + 2.0**-8)            # |ref| <= 1
    assert bf16.limit(1e-3, magnitude=8.0) == pytest.approx(2e-3 + 8 * 2.0**-8)
    ref = torch.full((3,), 8.0, dtype=torch.float64)
    # one bf16 rounding at 8 (half an ulp: 2^-8 * 8 = 0.03125) passes with a zero peer error
    assert check(torch.full((3,), 8.03125).to(torch.bfloat16), ref, peer_error=0.0).ok
    assert not check(torch.full((3,), 8.125).to(torch.bfloat16), ref, peer_error=0.0).ok
    # fp32's fixed bound does not scale
    assert TOLERANCE["float32"].limit(None, magnitude=100.0) == 2e-4
