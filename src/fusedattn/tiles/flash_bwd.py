"""FlashAttention-2-style backward in Triton: no S x S array, fp32 accumulation, no atomics.

Given the forward's O and natural-log LSE, and dO (and optionally dLSE, the gradient of the
LSE output), with s = scale * Q K^T and P = exp(s - LSE):

    delta_i = rowsum(dO_i * O_i) - dLSE_i                     # preprocess, [B, H, Sq] fp32
    dV_j    = sum_i P_ij dO_i                                  # dK/dV pass, by key tiles
    dP_ij   = dO_i . V_j
    dS_ij   = P_ij (dP_ij - delta_i)                           # d loss / d s_ij
    dK_j    = scale * sum_i dS_ij Q_i
    dQ_i    = scale * sum_j dS_ij K_j                          # dQ pass, by query tiles

(dLSE enters through d LSE_i / d s_ij = P_ij, so the LSE output is differentiable for the
price of one subtraction.) P is recomputed from Q, K and the LSE in both passes, in base 2:
exp(s - LSE) = exp2(s * log2(e) - LSE * log2(e)).

Determinism: each dK/dV tile is owned by one program, which loops over every query tile of
every query head of its GQA group; each dQ tile by one program looping over the key tiles.
No float atomics, so the same inputs give the same bits on every run. The price is that
P and dP are computed twice (once per pass): 7 GEMMs of [BLOCK] tiles instead of 5, the
FLOP convention still counts 2.5x the forward (FlashAttention's).

Extra memory: delta, 4 * B * H * Sq bytes; dQ, dK, dV are written once in the input dtype
(no fp32 dQ accumulator is needed without atomics).

Offsets: batch and head offsets and each tile's first row take `INDEX` bits, 64 where a
tensor passes 2^31 elements (`flash.index_dtype`); offsets inside a tile stay 32-bit.

Causal is top-left aligned, as in the forward: query i sees keys j <= i. A key tile is seen
by the query tiles from its own first key onwards: those straddling the diagonal (and the
ragged last tile) run with masks, those wholly past it without.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import triton

from fusedattn import configs as tuning
from fusedattn import dispatch, launch
from fusedattn.configs import backward_configs, backward_single_loop
from fusedattn.hopper import backward as hopper_knobs
from fusedattn.launch import (
    KeptPlan,
    Plans,
    Recording,
    aliases,
    hashable,
    inputs_key,
    tensor_key,
)
from fusedattn.mode import EMULATION
from fusedattn.precision import resolve
from fusedattn.tiles.common import Mask, Varlen, emulation_operands, index_dtype
from fusedattn.tiles.flash_bwd_kernels import _bwd_preprocess, _flash_bwd_dkdv, _flash_bwd_dq


def _preprocess_launch(out, dout, dlse, delta, hopper: tuple | None = None,
                       order: tuple | None = None) -> tuple:
    """The preprocess's launch (delta), with `hopper` (dQ's fp32 accumulator, in q's layout
    or contiguous, and the counters) zeroing those too (the Hopper kernel adds into them):
    no fills of their own (two launches fewer a backward), unless
    `hopper.backward.ZERO_IN_PREPROCESS` is off (`flash_backward` then fills them).
    `order` (`hopper.backward.sequence_order`: cu_k, the sequences' count, sort or not):
    the compact varlen grid's, whose sequences' order it writes after the counters."""
    zero = hopper is not None
    if zero:
        zero = hopper_knobs.ZERO_IN_PREPROCESS
    rows_b, heads, rows_q, dim_v = out.shape
    pre_m = 64 if not EMULATION else 16
    grid = (triton.cdiv(rows_q, pre_m), rows_b * heads)
    # (unused pointers where it neither zeroes nor orders)
    dq_acc, sem = hopper if zero or order is not None else (delta, delta)
    cu_k, n_docs, sort = order if order is not None else (delta, 0, 0)
    n_sem = sem.numel() - n_docs if zero or order is not None else 0  # (the counters')
    return (_bwd_preprocess, grid,
            (out, dout, dlse if dlse is not None else delta, delta, dq_acc, sem, cu_k,
             *out.stride(), *dout.stride(), *dq_acc.stride()[:3], heads, rows_q, dim_v,
             dq_acc.shape[-1], n_sem,
             triton.cdiv(n_sem, max(grid[0] * grid[1], 1)), n_docs, sort),
            dict(BLOCK_M=pre_m, BLOCK_D=max(16, triton.next_power_of_2(dim_v)),
                 HAS_DLSE=dlse is not None, ZERO=zero,
                 BLOCK_DQ=max(16, triton.next_power_of_2(dq_acc.shape[-1])),
                 ORDER_DOCS=order is not None))


def _launches(dout, q, k, v, out, lse, dlse, delta, dq, dk, dv, *, precision: str, configs,
              mask: Mask, varlen: Varlen | None, scale: float,
              hopper: tuple | None = None, deterministic: bool = True) -> list[tuple]:
    """The backward's launches as (kernel, grid, args, keyword args): the preprocess
    (delta), then the dK/dV pass and the dQ pass, or with `hopper` (dQ's fp32 accumulator
    and the counters, `hopper.backward`) the Hopper kernel that does both. `flash_backward`
    runs them; `precompile_backward` compiles them ahead (Triton's `warmup`) from
    stand-ins."""
    rows_b, heads, rows_q, dim = q.shape  # rows_q: all query rows (packed: total_q)
    heads_kv, dim_v = k.shape[1], v.shape[3]
    if varlen is not None:
        batch, seq_q, seq_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
        seq_args = (varlen.cu_q, varlen.cu_k)
    else:
        batch, seq_q, seq_k = rows_b, rows_q, k.shape[2]
        seq_args = (q, q)  # unused pointers
    block_d = max(16, triton.next_power_of_2(dim))
    block_dv = max(16, triton.next_power_of_2(dim_v))
    dot_precision = resolve(q.dtype, precision).dot  # None for fp16/bf16
    order = None
    if hopper is not None:
        order = hopper_knobs.sequence_order(varlen, dim)
    launches = [_preprocess_launch(out, dout, dlse, delta, hopper, order)]
    if hopper is not None:
        return [*launches, hopper_knobs.hopper_backward_launch(
            dout, q, k, v, lse, delta, *hopper, dk, dv, scale=scale, mask=mask,
            deterministic=deterministic, varlen=varlen)]
    (km, kn, kw, ks), (qm, qn, qw, qs) = configs or backward_configs(
        dim=max(dim, dim_v), itemsize=q.element_size(), precision=dot_precision,
        causal=mask.causal or mask.window is not None, seq=seq_k, programs=batch * heads_kv)
    qk_scale, cap, left, right = mask.kernel_args(scale)
    common = dict(BLOCK_D=block_d, PRECISION=dot_precision, PAD_D=block_d != dim,
                  BLOCK_DV=block_dv, PAD_DV=block_dv != dim_v,
                  INDEX=index_dtype(q, k, v, dout, out, rows=rows_b * heads * rows_q),
                  VARLEN=varlen is not None, BOTTOM_RIGHT=mask.bottom_right)
    # one loop or three: dK/dV loops over the queries, dQ over the keys
    edges = dict(precision=dot_precision, has_left=left >= 0, has_right=right >= 0)
    one_dkdv = backward_single_loop(seq=seq_q, **edges)
    one_dq = backward_single_loop(seq=seq_k, **edges)
    packed = varlen is not None  # sequences start at cu[b]: no batch strides

    def strides(*tensors):
        return [x for t in tensors for x in ((0 if packed else t.stride(0)), *t.stride()[1:])]

    lse_bh = (0 if packed else heads * rows_q, rows_q)
    launches.append((_flash_bwd_dkdv, (triton.cdiv(seq_k, kn), batch * heads_kv),
                     (q, k, v, dout, lse, delta, dk, dv, *seq_args,
                      *strides(q, k, v, dout, dk, dv), *lse_bh, heads, heads_kv,
                      heads // heads_kv, seq_q, seq_k, dim, dim_v, scale, qk_scale, cap, left,
                      right),
                     dict(BLOCK_M=km, BLOCK_N=kn, num_warps=kw, num_stages=ks,
                          ONE_LOOP=one_dkdv, **common)))
    launches.append((_flash_bwd_dq, (triton.cdiv(seq_q, qm), batch * heads),
                     (q, k, v, dout, lse, delta, dq, *seq_args, *strides(q, k, v, dout, dq),
                      *lse_bh, heads, heads // heads_kv, seq_q, seq_k, dim, dim_v, scale,
                      qk_scale, cap, left, right),
                     dict(BLOCK_M=qm, BLOCK_N=qn, num_warps=qw, num_stages=qs,
                          ONE_LOOP=one_dq, **common)))
    return launches


# Compiling the backward ahead, while the forward compiles and runs: a fresh shape's
# forward + backward otherwise pays for three compiles one after another (5-7 s on the
# H200, `bench --suite coldstart`). Triton's compile releases the GIL in its passes and in
# ptxas, so threads overlap. One pool per process; a backward waits for what is in flight
# (never compiling a kernel twice at once); a shape is submitted once.
_POOL: ThreadPoolExecutor | None = None
_PENDING: list[Future] = []
_SUBMITTED: set[tuple] = set()


def precompile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        is_causal: bool, scale: float, precision: str,
                        mask: Mask | None = None, deterministic: bool = True) -> None:
    """Start compiling the backward of `attention(q, k, v, ...)` on background threads,
    from stand-ins shaped as the forward's outputs and dO (contiguous, as autograd hands
    them on); returns at once. A backward whose operands specialise differently compiles
    its own kernels as usual. Nothing in emulation (the interpreter compiles nothing)."""
    global _POOL
    mask = mask or Mask(causal=is_causal)
    key = (q.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), mask,
           precision, q.device, deterministic)
    if EMULATION or key in _SUBMITTED:
        return
    _SUBMITTED.add(key)
    # what a first GPU launch does first (once a process), before these compiles start: the
    # package's prebuilt kernels go into Triton's cache there (`prebuilt.ensure`); a compile
    # submitted before would miss them (the H200: the backward's kernels compiled on an
    # empty cache, the forward's hit, evidence 20261203T1114Z, 1124Z)
    launch.build_launchers_ahead()
    # stand-ins: a compile reads dtypes, strides and pointer alignment, never the data, so
    # q, k and v stand for dQ, dK, dV (`empty_like`: the same strides where dense) and q for
    # O and dO where it is contiguous as they are; only the LSE-sized buffer is new
    out = q if q.is_contiguous() and v.shape[3] == q.shape[3] else torch.empty(
        (*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)  # O's and dO's shape
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if dispatch.backward_path(q, k, v, mask=mask)[0] == "hopper":
        # the portable passes will not run: the preprocess, zeroing as it will there, and
        # the Gluon kernel, beside the forward's compile (evidence 20261203T0401Z). A
        # compile reads dQ's accumulator's dtype, alignment and head dim, and its
        # descriptor's block, so one step's tile stands for it; the counters
        # are as many as the launch checks for (their count is not specialised); k and v
        # stand for dK and dV
        batch, heads, seq_q, dim = q.shape
        softcap = bool(mask.softcap)
        acc = torch.empty((1, 1, hopper_knobs.tiles(dim, softcap)[0], dim),
                          dtype=torch.float32, device=q.device)
        sem = torch.empty(hopper_knobs.counters(batch, heads, seq_q, dim, softcap),
                          dtype=torch.int32, device=q.device)
        launches = [_preprocess_launch(out, out, None, lse, (acc, sem)),
                    hopper_knobs.hopper_backward_launch(
                        out, q, k, v, lse, lse, acc, sem, k, v, scale=scale, mask=mask,
                        deterministic=deterministic)]
    else:
        launches = _launches(out, q, k, v, out, lse, None, lse, q, k, v,
                             precision=precision, configs=None, mask=mask, varlen=None,
                             scale=scale)
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=3, thread_name_prefix="fusedattn-compile")

    def compile_one(kernel, grid, args, kwargs):
        with torch.cuda.device(q.device):  # the thread's current device is the inputs'
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            # and what the first launch would do next: load the module, build the launcher
            # (the host compiler), here off the main thread
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()

    _PENDING.extend(_POOL.submit(compile_one, *launch) for launch in launches)


def _wait_for_precompiles() -> None:
    """Let the background compiles finish (their errors, if any, come back when the
    backward compiles the same kernel itself)."""
    while _PENDING:
        _PENDING.pop().exception()  # waits; the error itself is not raised here


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, *,
                   is_causal: bool, scale: float, precision: str, configs=None,
                   mask: Mask | None = None, varlen: Varlen | None = None,
                   sinks: torch.Tensor | None = None, backend: str | None = None,
                   deterministic: bool = True, kept: KeptPlan | None = None):
    """Gradients of `attention` on validated `[B, H, S, D]` tensors (any strides).

    `lse: [B, H, Sq] float32` is the forward's natural-log LSE; `dlse` its gradient or None.
    Returns `(dq, dk, dv)` (`empty_like` q, k, v: their strides where dense, else
    contiguous), in the inputs' dtype (dK, dV summed over the query heads that share each
    K/V head). `configs`: ((BLOCK_M, BLOCK_N, warps, stages) for dK/dV, the same for dQ), to
    time other tiles; default `configs.backward_configs`. `mask` and `varlen` as in
    `flash.flash_forward` (packed sequences come as `[1, H, total, D]` views).

    `sinks` (`[H]` float32, the forward's attention sinks): the forward's LSE includes
    them, so P = exp(s - LSE) and every formula above hold as they are, and the sinks'
    own gradient is d sink_h = -sum_i exp(sink_h - LSE_i) delta_i over the head's rows
    (delta with dLSE subtracted, as the kernels take it). Returns `(dq, dk, dv, dsinks)`
    then, dsinks `[H]` float32.

    `backend`: the `dispatch.use_backend` choice the forward ran under (default the
    current one); `dispatch.backward_path` picks the path: the Hopper kernel
    (`hopper.backward`: one launch after the preprocess, dQ summed in fp32 and cast here)
    or the portable kernels above. `deterministic=False` lets the Hopper kernel race its
    dQ adds (faster; bits may differ by run); the portable kernels are deterministic
    either way.

    `kept` (`launch.KeptPlan`): the plan a caller keeps for one forward call's key
    (`api._Call.backward`, `varlen._VarlenCall`'s), which fixes every argument here but dO
    and dLSE (varlen: the offsets' tensors too). The plan and the path it took are kept
    under the dispatch's context, dO's and dLSE's `tensor_key` and which of the call's
    tensors (offsets included) are one object (the last of these seen: a training loop's
    calls share them), so a backward of that call decides nothing and keys no other
    tensor."""
    mask = mask or Mask(causal=is_causal)
    kept_key = found = None
    if kept is not None and configs is None:
        kept_key = (backend or dispatch.current_backend(), tuning.OVERRIDES,
                    hopper_knobs.switches(), tensor_key(dout), tensor_key(dlse),
                    aliases((dout, dlse, q, k, v, out, lse, sinks,
                             *((varlen.cu_q, varlen.cu_k) if varlen is not None else ()))))
        found = kept.get(kept_key)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    q, k, v, dout = emulation_operands(q, k, v, dout)
    lse = lse.contiguous()
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    if found is not None:
        path, plan = found
    else:
        path, _ = dispatch.backward_path(q, k, v, backend=backend, mask=mask, varlen=varlen,
                                         configs=configs)
    hopper = None
    if path == "hopper":
        if not dispatch._tma_ready(dout):
            dout = dout.contiguous()
        batch, heads, seq_q, dim = q.shape
        if varlen is not None:
            batch, seq_q = varlen.batch, varlen.max_seqlen_q
        # (zeroed by the preprocess, `_preprocess_launch`, unless that switch is off); the
        # accumulator in q's layout where TMA adds into it (so that dQ's cast below copies
        # like to like: into q's layout from a contiguous one, the varlen row's took 175
        # us, 91 like to like, evidence 20261203T0139Z-bwd-dq-layout), contiguous for the
        # writer's atomics
        acc = (torch.empty_like(q, dtype=torch.float32) if hopper_knobs.tma_adds(dim)
               else torch.empty(q.shape, dtype=torch.float32, device=q.device))
        sem = torch.empty(hopper_knobs.counters(batch, heads, seq_q, dim, bool(mask.softcap),
                                                varlen), dtype=torch.int32, device=q.device)
        if not hopper_knobs.ZERO_IN_PREPROCESS:
            acc.zero_()
            sem.zero_()
        hopper = (acc, sem)
    _wait_for_precompiles()
    inputs = (dout, q, k, v, out, lse, dlse, delta, dq, dk, dv,
              *((varlen.cu_q, varlen.cu_k) if varlen is not None else (None, None)),
              *(hopper or (None, None)))
    if found is not None:
        plan(inputs)
    else:
        key = plan = None
        if configs is None:  # a plan: what `_launches` decides, from this key alone
            key = (tuning.OVERRIDES, precision, mask, scale, inputs_key(inputs), path,
                   hashable(hopper_knobs.switches()), path == "hopper" and bool(deterministic),
                   varlen is not None and (varlen.max_seqlen_q, varlen.max_seqlen_k))
            plan = _PLANS.get(key)
        if plan is None:
            recording = Recording(inputs)
            for kernel, grid, args, kwargs in _launches(
                    dout, q, k, v, out, lse, dlse, delta, dq, dk, dv, precision=precision,
                    configs=configs, mask=mask, varlen=varlen, scale=scale, hopper=hopper,
                    deterministic=deterministic):
                recording.launch(kernel, grid, *args, **kwargs)
            plan = recording.plan()
            if key is not None and plan is not None:
                _PLANS.put(key, plan)
        else:
            plan(inputs)
        if kept_key is not None and plan is not None:
            kept.keep(kept_key, [(path, plan)])
    if hopper is not None:
        dq.copy_(hopper[0])  # the fp32 sums (scaled in the kernel) in the inputs' dtype
    if sinks is None:
        return dq, dk, dv
    return dq, dk, dv, sink_gradient(sinks, lse, delta)


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d sink_h = -sum_i exp(sink_h - LSE_i) delta_i over the head's rows: `lse`, `delta`
    `[B, H, S]` fp32 (the sink-inclusive LSE; delta = rowsum(dO * O) - dLSE), `sinks` `[H]`.
    exp(sink - LSE) is the sink's share of a row (LSE >= sink: -inf only in a row of no key
    with a sink of -inf, whose share is 0)."""
    share = torch.exp(sinks[None, :, None] - lse.masked_fill(lse == float("-inf"), math.inf))
    return -(share * delta).sum((0, 2))


_PLANS = Plans()  # the backward's plans (`launch.Plans`), as the forward's in `dispatch`
