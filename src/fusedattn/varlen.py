"""`fusedattn.attention_varlen`: packed variable-length batches, forward and backward.

    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     is_causal=False, window=None, softcap=None, scale=None,
                     return_lse=False, precision=None, check_lengths=True, sinks=None,
                     descale_q=None, descale_k=None, descale_v=None)

`q: [total_q, H, D]`, `k, v: [total_k, H_kv, D]` (GQA when H_kv divides H): sequence b is
rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of q and `cu_seqlens_k[b]:cu_seqlens_k[b+1]` of k
and v (int32, starting at 0, non-decreasing, ending at the totals). No padding is read or
computed: programs past a sequence's end return at once, and each sequence sees only its
own keys. Causal and windows are aligned bottom-right within each sequence, as in
FlashAttention: query i of a sequence with Sq queries and Sk keys sits at position
i + Sk - Sq. Returns O `[total_q, H, D]` (and the LSE `[H, total_q] float32`).
`sinks: [H]` as in `attention` (one logit per query head, shared by the sequences).
float8_e4m3fn q, k, v with `descale_q/k/v` run FP8's forward as in `attention` (O in
bfloat16; forward only).
Differentiable (the flash backward kernels with the same sequence offsets); registered as
`torch.ops.fusedattn.varlen_fwd` / `varlen_bwd`.

`max_seqlen_q/k` size the grid; they are checked against `cu_seqlens` (a too-small value
would skip rows silently), which costs one device-to-host copy of the small tensors and
waits for the GPU to reach it (on the H200, most of a short call's host time). The verdict
is kept per offsets tensor while torch's version counter says it is unchanged: the same
tensor passed again (for q and k, or call after call) is not read again, and one written
in place is (`check_cu_seqlens`). `check_lengths=False` skips that check (the offsets'
shape, dtype and device are still checked): the offsets and max_seqlens are then trusted,
as FlashAttention trusts them. Wrong ones give wrong rows or reads past the tensors, so
pass it only with offsets that were checked once (a serving loop's own batcher, a
dataloader's collate).
"""

from __future__ import annotations

import math
import weakref

import torch

from fusedattn import api, dispatch
from fusedattn.api import (
    DTYPES,
    _mask,
    as_sinks,
    autocast_inputs,
    batches,
    call_key,
    call_op,
    check_grad_dim,
    check_options,
    eager_autograd,
    eager_backward,
    elsewhere,
    fp8_descale,
    joined,
    kernel_options,
    new_outputs,
    recorded_apply,
    refuse_double_backward,
    sink_grads,
    typed,
    wants_grads,
)
from fusedattn.launch import KeptPlan, Plans
from fusedattn.mode import DEVICE
from fusedattn.precision import resolve
from fusedattn.problem import (
    FP8,
    ProblemError,
    check_flag,
    check_fp8,
    check_index_tensor,
    check_qkv,
    check_sinks,
    clamp_window,
    is_int,
)
from fusedattn.tiles.common import Varlen


def _packed(t: torch.Tensor) -> torch.Tensor:
    """`[total, H, D]` as the kernels' `[1, H, total, D]` view (no copy)."""
    return t.permute(1, 0, 2)[None]


def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                   cu_k: torch.Tensor, sinks: torch.Tensor | None, max_q: int, max_k: int,
                   is_causal: bool, scale: float,
                   precision: str, window_left: int, window_right: int,
                   softcap: float, descale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = new_outputs(q, v, (q.shape[1], q.shape[0]))
    _varlen_launch(q, k, v, out, lse, cu_q, cu_k, sinks, max_q, max_k, is_causal, scale,
                   precision, window_left, window_right, softcap, descale)
    return out, lse


def _varlen_launch(q, k, v, out, lse, cu_q, cu_k, sinks, max_q, max_k, is_causal, scale,
                   precision, window_left, window_right, softcap, descale,
                   keep: list | None = None):
    """`dispatch.forward` on the packed views, into `out` and `lse` (`keep` receives its
    plan)."""
    dispatch.forward(_packed(q), _packed(k), _packed(v), out=_packed(out),
                     lse=None if lse is None else lse[None],
                     is_causal=is_causal, scale=scale, precision=precision,
                     mask=_mask(is_causal, window_left, window_right, softcap, True),
                     varlen=Varlen(cu_q, cu_k, max_q, max_k), sinks=sinks, descale=descale,
                     keep=keep)


def _kept_varlen(kept: KeptPlan, q, k, v, cu_q, cu_k, sinks, max_q, max_k, *options,
                 descale, lse=True):
    """The eager forward, by `dispatch.kept_forward` with the plan its call key keeps (as
    `api._kept_forward`, `lse` as there); a call autograd records runs it inside
    `_VarlenCall`."""
    out, lse = new_outputs(q, v, (q.shape[1], q.shape[0]) if lse else None)
    # a replay reads its tensors' addresses alone (`launch.Replay`), so the packed tensors
    # stand in for the kernels' views of them (`_packed`, the same storage): no view a call
    dispatch.kept_forward(
        kept, dispatch.forward_inputs(q, k, v, out, lse, offsets=(cu_q, cu_k), sinks=sinks,
                                      descale=descale),
        lambda keep: _varlen_launch(q, k, v, out, lse, cu_q, cu_k, sinks, max_q, max_k,
                                    *options, descale, keep))
    return out, lse


_varlen_fwd_op = torch.library.custom_op("fusedattn::varlen_fwd", _varlen_fwd, mutates_args=())


@_varlen_fwd_op.register_fake
def _(q, k, v, cu_q, cu_k, sinks, max_q, max_k, is_causal, scale, precision, window_left,
      window_right, softcap, descale=None):
    return new_outputs(q, v, (q.shape[1], q.shape[0]))


def _varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                   cu_q: torch.Tensor, cu_k: torch.Tensor, sinks: torch.Tensor | None,
                   max_q: int, max_k: int, is_causal: bool, scale: float, precision: str,
                   window_left: int, window_right: int, softcap: float,
                   backend: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's body; `backend` is the `use_backend` choice the forward ran under
    (as `api._flash_bwd`'s)."""
    return sink_grads(_kept_varlen_bwd(None, dout, q, k, v, out, lse, dlse, cu_q, cu_k,
                                       sinks, max_q, max_k, is_causal, scale, precision,
                                       window_left, window_right, softcap, backend), lse)


def _kept_varlen_bwd(kept, dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks, max_q, max_k,
                     is_causal, scale, precision, window_left, window_right, softcap,
                     backend):
    """`flash_backward`'s (dq, dk, dv[, dsinks]) in the packed layout, with `kept`
    (`launch.KeptPlan` or None), the backward's plan kept with the forward call's key (as
    `api._kept_backward`): `_varlen_bwd` without the op's empty dsinks."""
    from fusedattn.tiles.flash_bwd import flash_backward

    dq, dk, dv, *dsinks = flash_backward(
        _packed(dout), _packed(q), _packed(k), _packed(v), _packed(out), lse[None],
        dlse[None] if dlse is not None else None, is_causal=is_causal, scale=scale,
        precision=precision, mask=_mask(is_causal, window_left, window_right, softcap, True),
        varlen=Varlen(cu_q, cu_k, max_q, max_k), sinks=sinks, backend=backend, kept=kept)
    return (*(g[0].permute(1, 0, 2) for g in (dq, dk, dv)), *dsinks)


_varlen_bwd_op = torch.library.custom_op("fusedattn::varlen_bwd", _varlen_bwd, mutates_args=())


@_varlen_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks, max_q, max_k, is_causal, scale,
      precision, window_left, window_right, softcap, backend="auto"):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            lse.new_empty(0 if sinks is None else sinks.shape[0]))


# the forward op's arguments after q, k, v, the offsets and the sinks that its backward
# takes too; FP8's descale, after them, never has a gradient (`check_fp8`)
BACKWARD_OPTIONS = ("max_q", "max_k", "is_causal", "scale", "precision", "window_left",
                    "window_right", "softcap")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, sinks, *options = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, sinks)
    ctx.set_materialize_grads(False)  # an unused LSE: dLSE None, not zeros (as in api)
    ctx.options = options[:len(BACKWARD_OPTIONS)]
    ctx.kept = None  # `_VarlenCall` gives its call's kept backward plan
    ctx.backend = dispatch.current_backend()  # (as `api._setup_context`: autograd's own thread)


def _gradients(ctx, dout, dlse) -> tuple:
    """(dq, dk, dv, None, None, dsinks or None) of a call's backward (`_backward`,
    `_VarlenCall`): none for the offsets."""
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    args = (dout, q, k, v, out, lse, dlse, cu_q, cu_k, sinks, *ctx.options, ctx.backend)
    if eager_backward(dout, q, dlse):
        grads = _kept_varlen_bwd(ctx.kept, *args)
    else:
        grads = _varlen_bwd_op(*args)
    return (*grads[:3], None, None, grads[3] if sinks is not None else None)


def _backward(ctx, dout, dlse):
    return (*_gradients(ctx, dout, dlse), *(None,) * (len(ctx.options) + 1))


_varlen_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_varlen_bwd_op.register_autograd(refuse_double_backward)
_Varlen = eager_autograd("_Varlen", _varlen_fwd, _setup_context, _backward)


class _VarlenCall(torch.autograd.Function):
    """`attention_varlen`'s eager forward on a call autograd records, as `api._FlashCall`:
    the forward replays the plan its call key keeps, the backward keeps its own beside it
    (`decided`: the call's options, forward plan, backward plan, grad and whether the
    offsets came contiguous)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, sinks, decided, descale):
        options, kept, backward, *_ = decided
        output = _kept_varlen(kept, q, k, v, cu_q, cu_k, sinks, *options, descale=descale)
        _setup_context(ctx, (q, k, v, cu_q, cu_k, sinks, *options), output)
        ctx.kept = backward
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_gradients(ctx, dout, dlse), None, None)  # (none for `decided`, `descale`)


def check_cu_seqlens(name: str, cu: object, total: int, batch: int | None,
                     max_seqlen: object, values: bool = True) -> tuple[torch.Tensor, int]:
    """`cu` a 1-D int32 tensor on the kernels' device: 0, non-decreasing, ending at
    `total` (and `batch + 1` long where given); `max_seqlen` an integer (Python or numpy)
    >= its longest sequence. Returns (`cu` contiguous, as the kernels read it; max_seqlen
    as an int). `values=False` checks all but the offsets' values (no device-to-host copy):
    `max_seqlen` then only an integer >= 1."""
    cu = check_index_tensor(name, cu, DEVICE)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ProblemError(name, tuple(cu.shape), "a 1-D tensor of B + 1 offsets (B >= 1)")
    if batch is not None and cu.numel() != batch + 1:
        raise ProblemError(name, tuple(cu.shape), f"{batch + 1} offsets, as cu_seqlens_q")
    if not values:
        if not is_int(max_seqlen) or max_seqlen < 1:
            raise ProblemError(name.replace("cu_seqlens", "max_seqlen"), max_seqlen,
                               "an int >= 1 (>= the longest sequence)")
        return cu, int(max_seqlen)
    if not torch.compiler.is_compiling() and _seen(cu, total, max_seqlen):
        return cu, int(max_seqlen)
    bounds = read_offsets(cu)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if bounds[0] != 0 or min(lengths) < 0 or bounds[-1] != total:
        raise ProblemError(name, bounds if len(bounds) <= 12 else f"{bounds[:12]}...",
                           f"offsets from 0, non-decreasing, ending at the total rows {total}")
    if not is_int(max_seqlen) or max_seqlen < max(lengths):
        raise ProblemError(name.replace("cu_seqlens", "max_seqlen"), max_seqlen,
                           f"an int >= the longest sequence, {max(lengths)}")
    seen = _passed(cu, total, max_seqlen)
    if seen is not None:
        if len(_PASSED) >= 256:  # offsets tensors are made per batch: keep the newest
            _PASSED.pop(next(iter(_PASSED)))
        _PASSED[id(cu)] = seen
    return cu, int(max_seqlen)


def offsets_of(lengths, device=None) -> torch.Tensor:
    """int32 offsets (`cu_seqlens`) of sequences of `lengths` (a tensor, or a list of ints
    put on `device`): 0, then their running sums."""
    lengths = torch.as_tensor(lengths, device=device)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def read_offsets(cu: torch.Tensor) -> list[int]:
    """The offsets' values on the host: a device-to-host copy, which waits for the GPU."""
    return cu.tolist()


# id(offsets tensor) -> `_passed` of a tensor whose values passed `check_cu_seqlens`: the
# same tensor, unchanged since (torch's version counter; a view shares its base's), with the
# same total and max_seqlen, is not read again. A training loop that passes one offsets
# tensor per batch, or a benchmark that passes one many times, then pays one copy per
# tensor, not two per call (it had cost the varlen bench row 1.16 ms a call against its
# kernel's 0.69: evidence/nvidia-h200/20261201T1426Z-ncu-hopper-vs-fa4). A tensor written
# behind torch's back (a raw kernel through its pointer, leaving the counter alone) would
# keep its verdict; `check_lengths=True` reads every new tensor and every new version.
_PASSED: dict[int, tuple] = {}


def _passed(cu: torch.Tensor, total: int, max_seqlen: object) -> tuple | None:
    """What identifies a verdict on `cu` (a weak reference to it, compared by identity, its
    version, the total and max_seqlen it was checked against), or None where none can be
    kept: inside torch.compile, and for an inference tensor (it has no version counter)."""
    if torch.compiler.is_compiling() or cu.is_inference():
        return None
    return weakref.ref(cu), cu._version, total, typed(max_seqlen)


def _seen(cu: torch.Tensor, total: int, max_seqlen: object) -> bool:
    """Whether `cu`'s values passed `check_cu_seqlens` at its current version, against
    this total and max_seqlen (the verdict `_passed` keeps; none is kept for an inference
    tensor, so its version is never read here): `check_cu_seqlens` then reads nothing,
    and a kept call, whose key has checked the offsets' metadata, calls this alone."""
    kept = _PASSED.get(id(cu))
    return (kept is not None and kept[0]() is cu and kept[1] == cu._version
            and kept[2] == total and kept[3] == typed(max_seqlen))


def _checked(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, window, softcap, scale, precision,
             check_lengths, sinks, descales=None):
    """`attention_varlen`'s checks and decisions (the packed ring's too): (max_seqlen_q,
    max_seqlen_k, scale, window, softcap) as the op takes them. `descales`, FP8's factors
    (`problem.DESCALE_NAMES`), only from `attention_varlen`, which alone takes
    float8_e4m3fn inputs here."""
    check_qkv(q, k, v, device=DEVICE, ranks={3: "[total, H, D]"},
              dtypes=DTYPES if descales is None else (*DTYPES, FP8))
    window, softcap = check_options(q, k, v, is_causal, scale, precision, window, softcap)
    if k.shape[:-1] != v.shape[:-1]:
        raise ProblemError("k/v shapes", (tuple(k.shape), tuple(v.shape)),
                           "k and v alike but for the head dim")
    if q.shape[1] % k.shape[1] or 0 in q.shape[1:] or 0 in k.shape[1:]:
        raise ProblemError("heads", (q.shape[1], k.shape[1]),
                           ">= 1 each, k/v heads dividing q heads (GQA/MQA)")
    cu_q, max_q = check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], None, max_q,
                                   check_lengths)
    cu_k, max_k = check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], cu_q.numel() - 1, max_k,
                                   check_lengths)
    check_sinks(sinks, q.shape[1], q.device)
    check_grad_dim(q, k, v, sinks)
    if descales is not None:
        check_fp8(q, v, descales, q.shape[1], k.shape[1], wants_grads((q, k, v, sinks)))
    window = clamp_window(window, max_q, max_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return max(1, max_q), max(1, max_k), scale, window, softcap


# `call_key` -> what `_checked` gave (check_lengths=True calls check the offsets' values
# again: `check_cu_seqlens` reads those it has not seen at their version)
_DECIDED = Plans()


def _in_batches(parts, q, k, v, cu_q, cu_k, max_q, max_k, return_lse: bool, options: dict):
    """`attention_varlen` over `parts` (`api.batches`) of the sequences, joined: each part
    its sequences' tokens and its offsets less its first (the offsets read to the host
    for it, even with `check_lengths=False`: a sync in this case alone)."""
    at_q, at_k = cu_q.tolist(), cu_k.tolist()
    got = []
    for part in parts:
        first, last = part.start, part.stop  # (the part's sequences: first..last - 1)
        got.append(attention_varlen(
            q[at_q[first]:at_q[last]], k[at_k[first]:at_k[last]], v[at_k[first]:at_k[last]],
            cu_q[first:last + 1] - at_q[first], cu_k[first:last + 1] - at_k[first], max_q,
            max_k, return_lse=return_lse, **options))
    return joined(got, return_lse, lse_dim=1)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, is_causal: bool = False,
                     window: tuple[int | None, int | None] | None = None,
                     softcap: float | None = None, scale: float | None = None,
                     return_lse: bool = False, precision: str | None = None,
                     check_lengths: bool = True, sinks: torch.Tensor | None = None,
                     descale_q: torch.Tensor | None = None,
                     descale_k: torch.Tensor | None = None,
                     descale_v: torch.Tensor | None = None):
    """Attention over a packed batch of sequences; see the module docstring."""
    if elsewhere(q):  # (`api.elsewhere`)
        with torch.cuda.device(q.device):
            return attention_varlen(**locals())  # (only the parameters are local here)
    q, k, v = autocast_inputs(q, k, v, precision)
    descales = (descale_q, descale_k, descale_v)
    compiling = torch.compiler.is_compiling()
    key = None if compiling else call_key(
        (q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *descales),
        (is_causal, softcap, scale, precision, check_lengths, return_lse), window,
        typed(max_seqlen_q), typed(max_seqlen_k))
    decided = _DECIDED.get(key) if key is not None else None
    if decided is None:  # (the key holds each option with its type: a kept key's passed)
        check_flag("check_lengths", check_lengths)
        check_flag("return_lse", return_lse)
        max_q, max_k, scale, window, softcap = _checked(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
            window, softcap, scale, precision, check_lengths, sinks, descales)
        if not compiling and (parts := batches(cu_seqlens_q.numel() - 1, q.shape[1], 1)):
            return _in_batches(parts, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, return_lse, dict(
                                   is_causal=is_causal, window=window, softcap=softcap,
                                   scale=scale, precision=precision,
                                   check_lengths=check_lengths, sinks=sinks,
                                   descale_q=descale_q, descale_k=descale_k,
                                   descale_v=descale_v))
        # the op's arguments after the sinks, the forward's plan (`_kept_varlen`), the
        # backward's where autograd records the call (`_VarlenCall`), and whether it does
        # (the key holds it: whether any of its tensors requires grad, and grad mode)
        # and whether the offsets are contiguous as they come (the key holds their strides)
        decided = ((max_q, max_k, is_causal, scale, resolve(q.dtype, precision).op,
                    *kernel_options(window, softcap)), KeptPlan(), KeptPlan(),
                   wants_grads((q, k, v, sinks)),
                   cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous())
        if key is not None:
            _DECIDED.put(key, decided)
    elif check_lengths:  # the metadata's checks passed on this key; the offsets' values
        # are checked per tensor and version (`check_cu_seqlens`: read where they are new;
        # one offsets tensor for q and k, with one total and max_seqlen, read once)
        if not _seen(cu_seqlens_q, q.shape[0], max_seqlen_q):
            check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], None, max_seqlen_q)
        if not (cu_seqlens_k is cu_seqlens_q and k.shape[0] == q.shape[0]
                and typed(max_seqlen_k) == typed(max_seqlen_q)) \
                and not _seen(cu_seqlens_k, k.shape[0], max_seqlen_k):
            check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], None, max_seqlen_k)
    options, kept, _, grad, dense = decided
    if not dense:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    descale = None if q.dtype != FP8 else fp8_descale(q, descales, q.shape[1], k.shape[1])
    if compiling or (grad and not api.KEEP_RECORDED):
        out, lse = call_op(_varlen_fwd_op, _Varlen, _varlen_fwd, q, k, v, cu_seqlens_q,
                           cu_seqlens_k, as_sinks(sinks), *options, descale, grad=True)
    elif grad:
        out, lse = recorded_apply(_VarlenCall, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  as_sinks(sinks), decided, descale)
    else:
        out, lse = _kept_varlen(kept, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                as_sinks(sinks), *options, descale=descale, lse=return_lse)
    return (out, lse) if return_lse else out
