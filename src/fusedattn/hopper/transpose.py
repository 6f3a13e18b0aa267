"""V^T for the Hopper FP8 forward: Hopper's wgmma takes float8 operands K-major only, and
P V's K is the key, so V (`[B, H_kv, S, Dv]`, Dv contiguous) goes to the kernel as
`[B, H_kv, Dv, S']` with the keys contiguous. S' is S rounded up to 16 (a TMA row stride
is a multiple of 16 bytes); the columns S..S' are zeros, because the kernel's last key tile
reads them inside the tensor, where TMA does not fill, and 0 * P keeps O finite where a
float8 NaN pattern would not.

A portable Triton kernel (it runs in the interpreter, so CI checks it), recorded into the
call's plan (`launch.Recording`): V^T is the plan's scratch, made anew per call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedattn.launch import Recording

BLOCK_S = 64  # keys per program


@triton.jit
def _transpose_v(p_v, p_vt, sv_b, sv_h, sv_s, sv_d, svt_b, svt_h, svt_d, heads_kv, seq,
                 padded, DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (i, b * heads_kv + h): V^T[b, h, :, i * BLOCK_S ...] = V[b, h, keys, :]^T,
    zeros for keys from `seq` to `padded`."""
    bh = tl.program_id(1)
    b = bh // heads_kv
    h = bh % heads_kv
    keys = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, DV)
    tile = tl.load(p_v + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
                   + keys[:, None].to(tl.int64) * sv_s + dims[None, :] * sv_d,
                   mask=(keys < seq)[:, None], other=0.0)
    tl.store(p_vt + b.to(tl.int64) * svt_b + h.to(tl.int64) * svt_h
             + dims[:, None].to(tl.int64) * svt_d + keys[None, :], tl.trans(tile),
             mask=(keys < padded)[None, :])


def v_transposed(v: torch.Tensor, recording: Recording | None = None) -> torch.Tensor:
    """V^T (`[B, H_kv, Dv, S']`, contiguous, S' = S rounded up to 16, zeros past S) of
    `[B, H_kv, S, Dv]` `v` (any strides), by one launch recorded into `recording`."""
    b, heads_kv, seq, dim = v.shape
    padded = -(-seq // 16) * 16
    vt = torch.empty((b, heads_kv, dim, padded), dtype=v.dtype, device=v.device)
    recording = recording or Recording((v,))
    recording.scratch(vt)
    recording.launch(_transpose_v, (triton.cdiv(padded, BLOCK_S), b * heads_kv), v, vt,
                     *v.stride(), *vt.stride()[:3], heads_kv, seq, padded, DV=dim,
                     BLOCK_S=BLOCK_S)
    return vt
