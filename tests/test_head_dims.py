"""The forward's head dims in pieces (`configs.head_dim_pieces`): the piece table, the
rows' alignment that allows them, and both products in pieces against the float64
reference (emulation, and long bf16 rows on the GPU)."""

import pytest
import torch

from fusedattn.mode import DEVICE
from fusedattn.reference import attention_ref
from fusedattn_lab.verify import check


def _ref(q, k, v, causal=False):
    return attention_ref(q, k, v, causal=causal, return_lse=True)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dim, pieces", [
    (80, (64, 16)), (96, (64, 32)), (144, (128, 16)), (160, (128, 32)),
    (192, (128, 64)),                              # two whole pieces, no padding
    (72, (64, 16)), (88, (64, 32)), (136, (128, 16)), (168, (128, 64)),
    (176, (128, 64)),                              # the second overlaps the first
    (112, (128, 0)), (200, (256, 0)), (100, (128, 0)),  # no two narrower pieces: padded
    (120, (128, 0)), (240, (256, 0)),
    (48, (64, 0)), (24, (32, 0)),                  # a first piece under 64: padded
    (64, (64, 0)), (16, (16, 0)), (1, (16, 0)), (256, (256, 0)),
])
def test_head_dim_pieces(monkeypatch, dim, pieces):
    from dataclasses import replace

    from fusedattn import configs
    from fusedattn.configs import head_dim_pieces

    padded = (max(16, 1 << (dim - 1).bit_length()), 0)
    assert head_dim_pieces(dim, precision=None) == pieces  # fp16/bf16
    for fp32 in ("ieee", "tf32", "tf32x3"):  # fp32 pads (tf32x3 ran slower split)
        assert head_dim_pieces(dim, precision=fp32) == padded
    assert head_dim_pieces(dim, precision=None, aligned=False) == padded  # rows off 16 B
    # the A/B switch ($FUSEDATTN_SPLIT_D=0, read once): one padded piece
    monkeypatch.setattr(configs, "OVERRIDES", replace(configs.OVERRIDES, split_d=False))
    assert head_dim_pieces(dim, precision=None) == padded


def test_row_alignment():
    """16 bytes' worth of elements where every row starts on 16 bytes, else 1."""
    from fusedattn.tiles.common import row_alignment

    x = torch.zeros(2, 3, 5, 88, dtype=torch.float16)
    assert row_alignment(x[..., :80], x[..., :72]) == 8  # rows of 88: 176 bytes
    assert row_alignment(x.float()[..., :20]) == 4
    assert row_alignment(x[..., :80], x[..., :84].contiguous()) == 1  # rows of 84
    assert row_alignment(x[..., 1:]) == 1                            # data off 16 bytes
    assert row_alignment(x.transpose(2, 3)) == 1                     # last stride not 1
    assert row_alignment(x[:, :, 1:]) == 8                           # a row off: 176 bytes


@pytest.mark.parametrize("one_loop", [False, True])
@pytest.mark.parametrize("case", [
    # (B, H, H_kv, Sq, Sk, D, mask, splits): comment names the path
    (1, 2, 2, 40, 72, 96, "causal", 1),   # 64 + 32; diagonal tiles, whole tiles, ragged
    (1, 2, 1, 33, 50, 80, "full", 1),     # 64 + 16; GQA
    (1, 1, 1, 20, 40, 144, "window", 1),  # 128 + 16; a window: masked tiles at both ends
    (2, 4, 2, 1, 70, 80, "full", 2),      # decode: GQA rows packed, keys split and merged
    (1, 2, 1, 33, 50, 72, "full", 1),     # 64 + 16 overlapping by 8; GQA
    (1, 1, 1, 20, 40, 88, "window", 1),   # 64 + 32 overlapping by 8; a window
    (2, 4, 2, 1, 70, 72, "full", 2),      # decode with an overlapping piece
])
def test_split_head_dim_gives_the_reference(monkeypatch, one_loop, case):
    """A head dim in pieces (`configs.head_dim_pieces`, fp16: the interpreter's bf16 dot
    is broken): both products as a dot per piece and the output a store per piece, in
    both structures of the key loop, against the float64 reference within fp16's bound
    (SDPA's fp16 error on the same inputs sets it), the output and LSE poisoned first."""
    import fusedattn.tiles.flash as flash
    from fusedattn.configs import head_dim_pieces
    from fusedattn.reference import visible
    from fusedattn_lab.verify import poison

    monkeypatch.setattr(flash, "single_key_loop", lambda **_: one_loop)
    b, h, hk, sq, sk, d, kind, splits = case
    assert head_dim_pieces(d, precision=None)[1] > 0  # the case runs the split path
    q, k, v = (_rand(b, n, s, d, dtype=torch.float16, seed=i)
               for i, (n, s) in enumerate([(h, sq), (hk, sk), (hk, sk)]))
    causal, window = kind != "full", (12, 0) if kind == "window" else None
    out, lse = poison(torch.empty_like(q)), poison(torch.empty((b, h, sq), device=DEVICE))
    flash.flash_forward(q, k, v, out=out, lse=lse, is_causal=causal, scale=d ** -0.5,
                        precision="ieee", splits=splits, pack_gqa=splits > 1,
                        mask=flash.Mask(causal=True, window=window) if window else None)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window=window, return_lse=True)
    peer = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible(sq, sk, causal=causal, window=window, device=DEVICE),
        enable_gqa=hk != h)
    result = check(out, ref, peer_error=float((peer.double().cpu() - ref).abs().max()))
    assert result.ok, result.reasons
    assert torch.allclose(lse.double().cpu(), ref_lse, atol=1e-3)


@pytest.mark.parametrize("dim, row", [(80, 88), (72, 80), (80, 84), (96, 100)])
def test_head_dim_pieces_in_wider_rows(dim, row):
    """Q, K, V as the first `dim` columns of rows `row` wide: rows that start on 16 bytes
    (88, 80: the strides reach the kernel divided by ALIGN) run in pieces, the others (84,
    100) in one padded piece; fp16 against the float64 reference, output poisoned first."""
    import fusedattn.tiles.flash as flash
    from fusedattn.configs import head_dim_pieces
    from fusedattn.tiles.common import row_alignment
    from fusedattn_lab.verify import poison

    q, k, v = (_rand(1, 2, 37, row, dtype=torch.float16, seed=i)[..., :dim] for i in range(3))
    assert (head_dim_pieces(dim, precision=None, aligned=row_alignment(q, k, v) > 1)[1] > 0
            ) == (row * 2 % 16 == 0)
    out = poison(torch.empty(1, 2, 37, dim, dtype=torch.float16, device=DEVICE))
    flash.flash_forward(q, k, v, out=out, lse=None, is_causal=True, scale=dim ** -0.5,
                        precision="ieee")
    ref = attention_ref(q, k, v, causal=True)
    peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    result = check(out, ref, peer_error=float((peer.double().cpu() - ref).abs().max()))
    assert result.ok, result.reasons


@pytest.mark.gpu_only("the tiles of long bf16 rows (two key loops, 128-row tiles); the "
                     "interpreter runs 16x16 tiles and has a broken bf16 dot")
@pytest.mark.parametrize("dim, causal, row", [
    (72, False, 72), (72, True, 72), (80, False, 80), (80, True, 80), (96, False, 96),
    (112, True, 112), (144, True, 144), (176, False, 176), (192, False, 192),
    (200, False, 200), (208, False, 208),
    (80, False, 88), (96, True, 104), (80, False, 84)])  # wider rows: aligned, or not
def test_split_head_dims_on_long_bf16_rows(dim, causal, row):
    """bf16 at S=2600 (ragged) with the rules' tiles, head dims in two pieces, whole (80,
    96, 144, 192) and overlapping (72, 176: a masked padded piece gave wrong outputs at bf16
    S4096 here, `configs.head_dim_pieces`), and padded (112, 200, 208), within the
    low-precision bound that SDPA's error on the same inputs sets; output poisoned first.
    Rows wider than the head dim: on 16 bytes (88, 104; these went wrong before
    `common.row_alignment`) in pieces, else (84) padded."""
    from fusedattn.tiles.flash import flash_forward
    from fusedattn_lab.verify import poison

    q, k, v = (_rand(1, 2, 2600, row, dtype=torch.bfloat16, seed=s)[..., :dim]
               for s in range(3))
    ref, _ = _ref(q, k, v, causal)
    peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = poison(torch.empty_like(q))
    flash_forward(q, k, v, out=out, lse=None, is_causal=causal, scale=dim ** -0.5,
                  precision="ieee")  # the precision of fp32 inputs only
    result = check(out, ref, peer_error=float((peer.double().cpu() - ref).abs().max()))
    assert result.ok, result.reasons
