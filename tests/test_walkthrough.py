"""The walkthrough, the exercises as commands, and their figures."""

import math

import matplotlib.image as mpimg
import pytest
import torch

from fusedattn.problem import ProblemError
from fusedattn_lab import walkthrough as wt
from fusedattn_lab.cli import main


def test_hand_example_walk():
    w = wt.walk()
    assert w.online.tolist() == pytest.approx([2.6456, 0.9278], abs=5e-5)
    assert torch.allclose(w.online, w.materialized, atol=1e-15)
    assert [s.m_i for s in w.steps] == [2, 2, 4]


def test_forget_rescale_breaks_both_components_and_names_the_worst():
    fr = wt.forget_rescale()
    # without alpha on acc: acc = [1, 2e^-1] + [3, 1] while l = 1.1851 is rescaled
    expect = torch.tensor([1 + 3, 2 * math.exp(-1) + 1], dtype=torch.float64) / fr["steps"][-1].l_i
    assert torch.allclose(fr["wrong"], expect)
    assert fr["wrong"].tolist() == pytest.approx([3.3752, 1.4646], abs=5e-5)
    assert fr["worst_component"] == 0 and (fr["error"] > 0.5).all()
    assert fr["steps"][-1].l_i == pytest.approx(1.1851, abs=5e-5)  # l is still rescaled


def test_order_experiment_reports_ulps():
    ex = wt.order_experiment([2, 1, 4], wt.HAND_VALUES, [4, 2, 1], torch.float32)
    assert ex["perm"] == [2, 0, 1]
    assert len(ex["ulps"]) == 2 and ex["bitwise_equal"] == (ex["ulps"] == [0, 0])
    assert torch.allclose(ex["original"], ex["reordered"], atol=1e-6)
    # a longer row in float32: reversing the order moves some output by a few ULPs
    gen = torch.Generator().manual_seed(1)
    s = (torch.rand(64, generator=gen, dtype=torch.float64) * 8).tolist()
    v = torch.rand(64, 3, generator=gen, dtype=torch.float64).tolist()
    ex = wt.order_experiment(s, v, s[::-1], torch.float32)
    assert max(ex["ulps"]) > 0 and not ex["bitwise_equal"]
    assert torch.allclose(ex["original"], ex["reordered"], rtol=1e-5)


def test_ulps():
    one = torch.tensor([1.0], dtype=torch.float32)
    assert wt.ulps(one, torch.nextafter(one, torch.tensor([2.0]))) == [1]
    neg = torch.tensor([-1.0], dtype=torch.float32)
    assert wt.ulps(neg, torch.nextafter(neg, torch.tensor([0.0]))) == [1]


def test_bad_rows_and_orders():
    with pytest.raises(ProblemError):
        wt.walk([1, 2], [[1.0], [2.0], [3.0]])
    with pytest.raises(ProblemError):
        wt.walk([], [])
    with pytest.raises(ProblemError, match="permutation"):
        wt.order_experiment([2, 1, 4], wt.HAND_VALUES, [4, 4, 1])
    with pytest.raises(ProblemError, match="permutation"):
        wt.parse_order("4,2", 3)


def test_key_masks_for_s33_block16():
    masks = wt.key_masks(33, 16)
    assert len(masks) == 3 and [sum(m) for m in masks] == [16, 16, 1]
    grid = wt.mask_grid(masks)
    assert grid.splitlines()[2].endswith("#" + "." * 15 + "  1 valid, 15 masked")
    with pytest.raises(ProblemError):
        wt.key_masks(33, 12)


def test_wrong_fill_is_wrong_and_right_fill_is_right():
    demo = wt.wrong_fill(33, 16)
    assert demo["masked_slots"] == 15
    assert demo["right_err"] < 1e-14 and demo["wrong_err"] > 1e-3


def test_walkthrough_command_and_figure(tmp_path, capsys):
    fig = tmp_path / "steps.png"
    assert main(["walkthrough", "--order", "4,2,1", "--figure", str(fig)]) == 0
    out = capsys.readouterr().out
    assert "2.6456, 0.9278" in out and "0.1142, 0.0420, 0.8438" in out
    assert "max grew" in out and "ULPs" in out
    assert mpimg.imread(fig).shape[1] > 500
    assert main(["walkthrough", "--forget-rescale"]) == 0
    assert "3.3752, 1.4646" in capsys.readouterr().out
    svg = tmp_path / "own.svg"
    assert main(["walkthrough", "--scores", "0.5,-1", "--values", "1;2", "--figure",
                 str(svg)]) == 0
    assert svg.read_text().startswith("<?xml")


@pytest.mark.parametrize("argv", [
    ["walkthrough", "--scores", "1,x"],
    ["walkthrough", "--values", "1,0;2"],
    ["walkthrough", "--figure", "/nonexistent/dir/x.png"],
    ["walkthrough", "--figure", "x.pdf"],
    ["masks", "--block-k", "0"],
    ["masks", "--seq", "0"],
])
def test_bad_inputs_are_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusedattn: error:") and err.count("\n") == 1


def test_masks_command_and_figure(tmp_path, capsys):
    fig = tmp_path / "masks.svg"
    assert main(["masks", "--seq", "33", "--block-k", "16", "--figure", str(fig)]) == 0
    out = capsys.readouterr().out
    assert "3 iterations" in out and "fill 0" in out and fig.stat().st_size > 1000


@pytest.mark.emulation_only("the sweep without times; on a GPU it is evidence")
def test_sweep_command_in_emulation(tmp_path, capsys):
    assert main(["sweep", "--version", "t0", "--block-k", "16,64", "--seq", "20", "--dim",
                 "3", "--out", str(tmp_path)]) == 0
    (folder,) = (tmp_path / "emulation").iterdir()
    lines = (folder / "sweep.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("version,block_k,seq,dim,causal,iterations")
    assert ",16,20,3,False,2," in lines[1] and ",64,20,3,False,1," in lines[2]
    assert main(["sweep", "--version", "online", "--out", str(tmp_path)]) == 2
    assert main(["sweep", "--version", "t0", "--block-k", "24", "--out", str(tmp_path)]) == 2
