"""V^T for the Hopper FP8 forward: Hopper's wgmma takes float8 operands K-major only, and
P V's K is the key, so V (`[B, H_kv, S, Dv]`, Dv contiguous) goes to the kernel as
`[B, H_kv, Dv, S']` with the keys contiguous, each 16 of them in the order the kernel's P
holds them (key a0 + 2 a1 + 4 a2 + 8 a3 at column a0 + 2 a3 + 4 a1 + 8 a2: then P needs no
shuffle between threads on its way to the P V wgmma).

A TMA box's first column must start on 16 bytes (the H200 faults with an illegal
instruction otherwise), and its row stride be a multiple of 16 bytes. So S' is S rounded
up to 16, and in a packed batch (`[1, H_kv, total, Dv]`, varlen) each sequence starts on a
multiple of 16 columns: sequence b's keys are columns cu_t[b] ... with
cu_t[b] = sum over b' < b of len(b') rounded up to 16, which the kernel writes to a
`[B + 1]` int32 scratch for the attention kernel. Every column that is no key's (each
sequence's padding, and the slack after the last, up to S' = 16 B + total rounded up
to 16) is zero: the
attention kernel's last key tile reads them inside the tensor, where TMA does not fill,
and 0 * P keeps O finite where a float8 NaN pattern would not.

A portable Triton kernel (it runs in the interpreter, so CI checks it), recorded into the
call's plan (`launch.Recording`): V^T (and cu_t) are the plan's scratch, made anew per
call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedattn.launch import Recording, settle_keys

BLOCK_S = 64  # keys per program
ALIGN = 16  # keys (bytes, in float8) a TMA box's column start and row stride align to


@triton.jit
def _transpose_v(p_v, p_vt, p_cu_k, p_cu_t, sv_b, sv_h, sv_s, sv_d, svt_b, svt_h, svt_d,
                 heads_kv, batch, seq, width, DV: tl.constexpr, BLOCK_S: tl.constexpr,
                 ALIGN: tl.constexpr, VARLEN: tl.constexpr):
    """Program (i, b * heads_kv + h): V^T[b, h, :, start + i * BLOCK_S ...] =
    V[b, h, keys, :]^T, zeros from the sequence's length to its padded one. Dense: start
    0, length `seq`, padded `width`. VARLEN: b is the sequence, its keys rows
    cu_k[b] ... of batch row 0, start cu_t[b] (written by its programs of h = 0, i = 0);
    programs b = batch zero the slack from cu_t[batch] to `width`."""
    bh = tl.program_id(1)
    b = bh // heads_kv
    h = bh % heads_kv
    offs = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, DV)
    row_b = b
    start = 0
    first = 0
    length = seq
    padded = width
    if VARLEN:  # sequence b's padded start: the padded lengths before it
        row_b = 0
        for i in range(0, b):
            length_i = tl.load(p_cu_k + i + 1) - tl.load(p_cu_k + i)
            start += (length_i + ALIGN - 1) // ALIGN * ALIGN
        live = b < batch  # else the slack after the last sequence: zeros
        bb = tl.minimum(b, batch - 1)
        first = tl.load(p_cu_k + bb)
        length = tl.where(live, tl.load(p_cu_k + bb + 1) - first, 0)
        padded = tl.where(live, (length + ALIGN - 1) // ALIGN * ALIGN, width - start)
        if live & (h == 0) & (tl.program_id(0) == 0):
            tl.store(p_cu_t + b, start)
            if b == batch - 1:
                tl.store(p_cu_t + batch, start + padded)
    # key k of each 16 goes to column a0 + 2 a3 + 4 a1 + 8 a2 (k's bits a0..a3), the order
    # the attention kernel's P holds them in (`forward_kernel._p_operand`): column j takes
    # key b0 + 2 b2 + 4 b3 + 8 b1 (j's bits), gathered on the load so that the store stays
    # 16 bytes wide (a permuted store compiled to one byte a store:
    # evidence/sm90-compile/20261202T1422Z-fp8-transpose-stores)
    keys = ((offs & ~15) | (offs & 1) | (((offs >> 2) & 1) << 1) | (((offs >> 3) & 1) << 2)
            | (((offs >> 1) & 1) << 3))
    tile = tl.load(p_v + row_b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
                   + (first + keys[:, None]).to(tl.int64) * sv_s + dims[None, :] * sv_d,
                   mask=(keys < length)[:, None], other=0.0)
    tl.store(p_vt + row_b.to(tl.int64) * svt_b + h.to(tl.int64) * svt_h
             + dims[:, None].to(tl.int64) * svt_d + (start + offs)[None, :], tl.trans(tile),
             mask=(offs < padded)[None, :])


def v_transposed(v: torch.Tensor, recording: Recording | None = None,
                 varlen=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(V^T, cu_t) of `[B, H_kv, S, Dv]` `v` (any strides): V^T `[B, H_kv, Dv, S']`,
    contiguous, S' = S rounded up to 16, zeros past S, and cu_t None; with `varlen`
    (`common.Varlen`; v `[1, H_kv, total, Dv]`), S' = total rounded up to 16, + 16 B, and
    cu_t the sequences' first columns (`[B + 1]` int32), as the module says. One launch,
    recorded into `recording`."""
    b, heads_kv, seq, dim = v.shape
    batch = varlen.batch if varlen is not None else b
    width = -(-seq // ALIGN) * ALIGN  # a multiple of 16: V^T's row stride, in bytes
    if varlen is not None:  # room for each sequence's padding
        width += ALIGN * batch
    vt = torch.empty((b, heads_kv, dim, width), dtype=v.dtype, device=v.device)
    cu_t = None
    recording = recording or Recording((v,) if varlen is None else (v, varlen.cu_k))
    recording.scratch(vt)
    if varlen is not None:
        cu_t = torch.empty(batch + 1, dtype=torch.int32, device=v.device)
        recording.scratch(cu_t)
        # programs b = batch zero the slack: up to 16 B columns
        keys = max(-(-varlen.max_seqlen_k // ALIGN) * ALIGN, ALIGN * (batch + 1))
        rows = (batch + 1) * heads_kv
    else:
        keys, rows = width, b * heads_kv
    recording.launch(_transpose_v, (triton.cdiv(keys, BLOCK_S), rows), v, vt,
                     varlen.cu_k if varlen is not None else None, cu_t, *v.stride(),
                     *vt.stride()[:3], heads_kv, batch, seq, width, DV=dim, BLOCK_S=BLOCK_S,
                     ALIGN=ALIGN, VARLEN=varlen is not None)
    return vt, cu_t


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
