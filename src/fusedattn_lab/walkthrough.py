"""The chapter's hand example, key by key, and its exercises as computations.

- `walk`: the online recurrence over one query row (`reference.online_trace`), beside the
  materialized softmax result;
- `order_experiment` (exercise 2): the same keys in another order, compared bit for bit;
- `forget_rescale` (exercise 1): the update that forgets to rescale the old accumulator;
- `key_masks` / `wrong_fill` (exercise 3): which keys each BLOCK_K iteration masks, and why
  a masked score must be -inf and not 0;
- `draw_steps`: small multiples, one panel per key, like the chapter's animation frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fusedattn.problem import ProblemError
from fusedattn.reference import Step, online_trace

HAND_SCORES = (2.0, 1.0, 4.0)                          # chapter 12.1
HAND_VALUES = ((1.0, 0.0), (0.0, 2.0), (3.0, 1.0))


def _check_row(scores, values) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    v = torch.as_tensor(values, dtype=torch.float64)
    if s.numel() == 0:
        raise ProblemError("scores", list(scores), "at least one score")
    if v.dim() != 2 or v.shape[0] != s.numel():
        raise ProblemError("values", f"{v.shape[0] if v.dim() == 2 else 'ragged'} rows",
                           f"{s.numel()} value rows of one length (one per score)")
    if not torch.isfinite(s).all() or not torch.isfinite(v).all():
        raise ProblemError("scores/values", "non-finite", "finite numbers")
    return s, v


def materialized_row(scores, values, dtype=torch.float64) -> torch.Tensor:
    """softmax(scores) @ values, computed the materialized way, in `dtype`."""
    s = torch.as_tensor(scores, dtype=dtype)
    return torch.softmax(s, dim=0) @ torch.as_tensor(values, dtype=dtype)


def output_of(steps: list[Step], dtype=torch.float64) -> torch.Tensor:
    """acc / l_i after the last key, divided in `dtype`."""
    last = steps[-1]
    return torch.tensor(last.acc, dtype=dtype) / torch.tensor(last.l_i, dtype=dtype)


@dataclass(frozen=True)
class Walk:
    steps: list[Step]
    online: torch.Tensor         # acc / l
    materialized: torch.Tensor   # softmax(scores) @ V
    probabilities: torch.Tensor


def walk(scores=HAND_SCORES, values=HAND_VALUES) -> Walk:
    s, v = _check_row(scores, values)
    steps = online_trace(s, v)
    return Walk(steps, output_of(steps), materialized_row(s, v), torch.softmax(s, 0))


def ulps(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Distance in units in the last place, element by element (same dtype, float32/64)."""
    itype, magnitude = {torch.float32: (torch.int32, 0x7FFFFFFF),
                        torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}[a.dtype]

    def ordered(x):  # floats -> integers, monotonically: -|bits| for negative floats
        i = x.contiguous().view(itype).to(torch.int64)
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(a) - ordered(b)).abs().tolist()


def parse_order(text: str, n: int) -> list[float]:
    """`--order 4,2,1`: the scores' values in their new order."""
    try:
        items = [float(t) for t in text.split(",")]
    except ValueError:
        raise ProblemError("order", text, "comma-separated numbers") from None
    return items if len(items) == n else _bad_order(text, n)


def _bad_order(text, n):
    raise ProblemError("order", text, f"a permutation of the {n} scores, e.g. 4,2,1")


def order_experiment(scores, values, order_scores: list[float], dtype=torch.float32
                     ) -> dict:
    """Exercise 2: reorder the keys (with their V rows) by their scores' values and compare
    the two outputs in `dtype` (float32 shows rounding differences more often)."""
    s, v = _check_row(scores, values)
    remaining = list(range(s.numel()))
    perm = []
    for x in order_scores:
        match = [i for i in remaining if s[i].item() == x]
        if not match:
            _bad_order(",".join(f"{o:g}" for o in order_scores), s.numel())
        perm.append(match[0])
        remaining.remove(match[0])
    a = output_of(online_trace(s, v, dtype=dtype), dtype)
    b = output_of(online_trace(s[perm], v[perm], dtype=dtype), dtype)
    return {"perm": perm, "original": a, "reordered": b, "ulps": ulps(a, b),
            "bitwise_equal": torch.equal(a, b), "dtype": str(dtype).removeprefix("torch.")}


def forget_rescale(scores=HAND_SCORES, values=HAND_VALUES) -> dict:
    """Exercise 1: l is rescaled but the old acc is not when the max grows."""
    s, v = _check_row(scores, values)
    right = output_of(online_trace(s, v))
    wrong_steps = online_trace(s, v, rescale_acc=False)
    wrong = output_of(wrong_steps)
    return {"right": right, "wrong": wrong, "error": (wrong - right),
            "worst_component": int((wrong - right).abs().argmax()), "steps": wrong_steps}


# --- exercise 3: masks ---------------------------------------------------------------------

MAX_MASK_ROWS = 256    # iterations shown by `fusedattn masks`: a grid a person can read
MAX_MASK_SLOTS = 1024  # BLOCK_K: the widest tile of the row kernels


def key_masks(seq: int, block_k: int) -> list[list[bool]]:
    """For each of the ceil(S/BLOCK_K) iterations of the row kernel: which of its BLOCK_K key
    slots hold a real key (True) and which are masked (False: key >= S)."""
    if seq < 1:
        raise ProblemError("seq", seq, "an integer >= 1")
    if block_k < 1 or block_k & (block_k - 1) or block_k > MAX_MASK_SLOTS:
        raise ProblemError("block_k", block_k, f"a power of two in 1..{MAX_MASK_SLOTS}")
    if -(-seq // block_k) > MAX_MASK_ROWS:
        raise ProblemError("seq", seq, f"at most {MAX_MASK_ROWS} iterations of BLOCK_K="
                           f"{block_k} (S <= {MAX_MASK_ROWS * block_k}): the grid is for reading")
    return [[start + j < seq for j in range(block_k)] for start in range(0, seq, block_k)]


def mask_grid(masks: list[list[bool]]) -> str:
    lines = []
    for it, row in enumerate(masks):
        first = it * len(row)
        lines.append(f"iter {it}  keys {first:>4}..{first + len(row) - 1:<4} "
                     + "".join("#" if m else "." for m in row)
                     + f"  {sum(row)} valid, {len(row) - sum(row)} masked")
    return "\n".join(lines)


def tiled_row(scores, values, block_k: int, fill: float) -> torch.Tensor:
    """The row kernel's tile recurrence in float64: scores padded to whole tiles with
    `fill` (the kernel uses -inf), padded V rows 0 (the kernel's `other=0.0`)."""
    s, v = _check_row(scores, values)
    n = math.ceil(s.numel() / block_k) * block_k
    s = torch.cat([s, torch.full((n - s.numel(),), fill, dtype=s.dtype)])
    v = torch.cat([v, torch.zeros(n - v.shape[0], v.shape[1], dtype=v.dtype)])
    m_i, l_i = torch.tensor(-math.inf, dtype=s.dtype), torch.zeros((), dtype=s.dtype)
    acc = torch.zeros(v.shape[1], dtype=s.dtype)
    for start in range(0, n, block_k):
        tile = s[start:start + block_k]
        m_new = torch.maximum(m_i, tile.max())
        alpha, p = torch.exp(m_i - m_new), torch.exp(tile - m_new)
        acc = acc * alpha + p @ v[start:start + block_k]
        l_i = l_i * alpha + p.sum()
        m_i = m_new
    return acc / l_i


def wrong_fill(seq: int = 33, block_k: int = 16, dim: int = 4, seed: int = 0) -> dict:
    """Exercise 3: one random query row of length `seq`, tiled by `block_k`; the masked
    slots filled with -inf (right) and with 0 (wrong), each against the reference."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(seq, generator=gen, dtype=torch.float64) * 4 - 2
    values = torch.rand(seq, dim, generator=gen, dtype=torch.float64) - 0.5
    ref = materialized_row(scores, values)
    right = tiled_row(scores, values, block_k, -math.inf)
    wrong = tiled_row(scores, values, block_k, 0.0)
    masked = len(key_masks(seq, block_k)) * block_k - seq
    return {"masked_slots": masked, "ref": ref, "right": right, "wrong": wrong,
            "right_err": float((right - ref).abs().max()),
            "wrong_err": float((wrong - ref).abs().max())}


# --- figures -------------------------------------------------------------------------------

def figure_path(path: Path) -> Path:
    """A `--figure` path, checked: .png or .svg, in an existing folder that can be written
    (the CLI checks it before any work)."""
    from fusedattn_lab.outputs import writable_file

    path = Path(path)
    if not path.parent.exists():
        raise ProblemError("figure", str(path), "a path in an existing folder")
    return writable_file("figure", path, (".png", ".svg"))


def draw_steps(w: Walk, path: Path) -> Path:
    """One panel per key (the state after it), then the result beside the materialized one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = figure_path(path)
    n = len(w.steps)
    fig, axes = plt.subplots(1, n + 1, figsize=(2.6 * (n + 1), 3.0), squeeze=False)
    scores = [st.score for st in w.steps]
    for j, st in enumerate(w.steps):
        ax = axes[0][j]
        # the weight of every key read so far, on the current base m_i: they sum to l_i
        weights = [math.exp(x - st.m_i) for x in scores[: j + 1]]
        ax.bar(range(j + 1), weights, color=["C3" if i == j else "C0" for i in range(j + 1)])
        rescaled = j > 0 and st.alpha < 1.0
        ax.set_title(f"key {j}: s={st.score:g}\nm={st.m_i:g} l={st.l_i:.4f}"
                     + ("\nmax grew: history ×α" if rescaled else ""), fontsize=8,
                     color="C3" if rescaled else "black")
        ax.set_xticks(range(j + 1))
        ax.set_ylim(0, 1.7)  # room above the bars for the state
        ax.text(0.02, 0.98, f"α={st.alpha:.4f}\nβ={st.beta:.4f}\nacc=[" +
                ", ".join(f"{a:.4f}" for a in st.acc) + "]",
                transform=ax.transAxes, va="top", fontsize=7)
    ax = axes[0][n]
    idx = range(len(w.online))
    ax.bar([i - 0.2 for i in idx], w.online.tolist(), width=0.4, label="acc / l (online)")
    ax.bar([i + 0.2 for i in idx], w.materialized.tolist(), width=0.4,
           label="softmax · V (materialized)")
    ax.set_xticks(list(idx), [f"O[{i}]" for i in idx])
    ax.set_title("output", fontsize=8)
    ax.legend(fontsize=6)
    fig.suptitle("online softmax, one query row: weights exp(s_j − m_i) after each key "
                 "(red: the new key)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def draw_masks(masks: list[list[bool]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = figure_path(path)
    fig, ax = plt.subplots(figsize=(max(4, len(masks[0]) * 0.3), 0.5 + 0.4 * len(masks)))
    ax.imshow([[1.0 if m else 0.0 for m in row] for row in masks], cmap="Greens", vmin=-0.3,
              vmax=1.0, aspect="auto")
    ax.set_yticks(range(len(masks)), [f"iter {i}" for i in range(len(masks))])
    ax.set_xlabel("slot j in the tile (key = iter·BLOCK_K + j); white = masked (-inf)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
