"""The index algebra of `notes/patches/mask-constants.patch` (the forward's `_masked`) and
`notes/patches/bwd-mask-constants.patch` (the backward's `_masked_p`), checked against the
masks' rule with numpy on random tiles, bounds and row positions: a wgmma accumulator's
axis-1 index n = 8j + 2q + e, with 8j + e the constants compared and 2q the lane's part.
The kernels cannot run here (Gluon is not interpreted); this checks the formulas alone.

    python3 scripts/mask_index_check.py [--cases N]
"""

import argparse

import numpy as np


def _view(r: int, n: int):
    """The [R, N/8, 4, 2] view's parts: 8j + e, 2q and the row index, broadcastable."""
    j, q, e = np.arange(n // 8) * 8, np.arange(4) * 2, np.arange(2)
    const = j[None, :, None, None] + e[None, None, None, :]
    return const, q[None, None, :, None], np.arange(r)[:, None, None, None]


def forward_case(rng) -> bool:
    """`_masked`: keys start_n + n along axis 1, each row's position pos[r]."""
    bn, m = int(rng.choice([64, 128])), 64
    start_n, seq_k = int(rng.integers(0, 4096)), int(rng.integers(1, 5000))
    pos = rng.integers(-100, 5000, size=m)
    left, right = int(rng.integers(0, 300)), int(rng.integers(-50, 300))
    has_right, has_left = rng.random() < 0.7, rng.random() < 0.4
    cols = start_n + np.arange(bn)
    rule = np.broadcast_to(cols < seq_k, (m, bn)).copy()
    if has_right:
        rule &= cols[None, :] <= (pos + right)[:, None]
    if has_left:
        rule &= cols[None, :] >= (pos - left)[:, None]
    const, lane, _ = _view(m, bn)
    got = const < seq_k - start_n - lane
    if has_right:
        got = got & (const <= (pos + right - start_n)[:, None, None, None] - lane)
    if has_left:
        got = got & (const >= (pos - left - start_n)[:, None, None, None] - lane)
    return np.array_equal(rule, np.broadcast_to(got, (m, bn // 8, 4, 2)).reshape(m, bn))


def backward_case(rng) -> bool:
    """`_masked_p`: QX = 1 keys along axis 1 (S), QX = 0 queries along axis 1 (S^T)."""
    qx = int(rng.integers(0, 2))
    r, n = (64, 128) if qx == 1 else (128, 64)
    k0, q0, seq_k = int(rng.integers(0, 4096)), int(rng.integers(-200, 4096)), int(
        rng.integers(1, 5000))
    left, right = int(rng.integers(0, 300)), int(rng.integers(-50, 300))
    has_right, has_left = rng.random() < 0.7, rng.random() < 0.4
    rows, cols = np.arange(r)[:, None], np.arange(n)[None, :]
    keys, qpos = (k0 + cols, q0 + rows) if qx == 1 else (k0 + rows, q0 + cols)
    rule = np.broadcast_to(keys < seq_k, (r, n)).copy()
    if has_right:
        rule &= keys <= qpos + right
    if has_left:
        rule &= keys >= qpos - left
    const, lane, r4 = _view(r, n)
    if qx == 1:
        got = const < seq_k - k0 - lane
        if has_right:
            got = got & (const <= (q0 + right - k0 + r4) - lane)
        if has_left:
            got = got & (const >= (q0 - left - k0 + r4) - lane)
    else:
        got = k0 + r4 < seq_k
        if has_right:
            got = got & (const >= (k0 - q0 - right + r4) - lane)
        if has_left:
            got = got & (const <= (k0 - q0 + left + r4) - lane)
    return np.array_equal(rule, np.broadcast_to(got, (r, n // 8, 4, 2)).reshape(r, n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20000)
    args = parser.parse_args()
    for name, case, seed in (("forward", forward_case, 0), ("backward", backward_case, 1)):
        rng = np.random.default_rng(seed)
        bad = sum(not case(rng) for _ in range(args.cases))
        print(f"{name}: {bad} mismatches in {args.cases} cases")


if __name__ == "__main__":
    main()
