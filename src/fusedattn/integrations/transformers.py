"""Hugging Face transformers: `attn_implementation="fusedattn"`.

    import fusedattn.integrations.transformers  # registers "fusedattn" (needs the [hf] extra)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fusedattn")

transformers calls the attention function with `query: [B, H, Sq, D]`, `key, value:
[B, H_kv, Sk, D]` and expects `[B, Sq, H, D]` back. The mask function registered beside it
runs once per model call (not per layer): it builds transformers' own SDPA mask, then
- a mask that says no more than `is_causal` does (the lower triangle with Sq == Sk, every
  key with Sq == 1), or a sliding-window causal band with Sq == Sk, becomes None: the layer
  runs `fusedattn.attention` causal, with `window=(W - 1, None)` from its `sliding_window`;
- any other mask that is bottom-right causal (with a window) within sequences once the
  padding is dropped gets a `masks.MaskPlan` attached (`mask.fusedattn_plan`; the mask
  stays the tensor transformers expects, since generate passes it on as a 4D mask):
  left- or right-padded batches in training, prefill and decode, chunked prefill after a
  cache, a static cache's unused tail, packed documents (`DataCollatorWithFlattening`'s
  `position_ids` that restart at 0). Its gathers' indices and `cu_seqlens` are computed
  once, and each layer runs `attention_varlen` on the packed rows (`MaskPlan.attend`;
  the layers pass the same offsets tensors, so their values are checked by the first
  layer alone: `varlen.check_cu_seqlens` keeps the verdict per tensor version; where
  queries and keys are the same tokens, one tensor serves both, read once);
  padded query rows get zeros. A mask that reaches a layer without its plan (a model that
  sliced it) is planned there. Where transformers made no mask because the call keeps a
  cache, packed `position_ids` reach the layer, which plans from them, once per call
  (`masks.plan_from_positions`), as FlashAttention-2's integration does;
- anything else (an arbitrary 4D mask) stays a tensor, and the layer raises `ProblemError`
  naming what is supported, or, after `allow_mask_fallback(True)`, computes it with the
  plain formula (PyTorch's SDPA with that mask), saying so once.
Gemma 2's `softcap`, windows and gpt-oss's attention sinks (`s_aux`, trained through) reach
the kernels in every case; dropout and `output_attentions` are refused.

Context parallel (`sequence_parallel(group)`): inside it, every "fusedattn" layer runs
`fusedattn.distributed.ring_attention` over the ranks of `group`, each holding a shard of
the sequence (zigzag shards when causal):

    with sequence_parallel(group):
        logits = model(zigzag_shard(ids, rank, world, dim=1),
                       position_ids=zigzag_shard(positions, rank, world, dim=1)).logits

The position ids must be sharded like the tokens (RoPE sees true positions): each rank
checks that its own are its shard of one sequence a row (the layout's positions plus a
constant), and the ranks agree, once a model call, so that a rank with packed documents
(positions that restart), unsharded positions or a padding mask makes every rank raise
`ProblemError` instead of one raising while the others wait in the ring. Without a cache
(`use_cache=False`) transformers takes each jump in a zigzag shard's positions for a new
packed document and makes a mask of it; that mask, checked to say nothing else, is dropped.
The labels must be shifted on the whole sequence before sharding (the model's own loss
shifts within a shard, which is wrong at the shard's seams): compute the loss from the
logits, sum it over the ranks and all-reduce the parameters' gradients
(`tests/test_distributed_hf.py` does a training step this way and matches one process on the
whole sequence). Windows and softcap are refused there (the ring has neither); sinks run.
`sequence_parallel(group, kind="ulysses")` runs `ulysses_attention` instead, on contiguous
shards (`contiguous_shard`), with windows, softcap and sinks; `sequence_parallel(mesh=mesh)`
runs USP over a 2-D DeviceMesh (Ulysses x ring) on `usp_shard` shards.

Packed documents (one row, `DataCollatorWithFlattening`'s layout) under any of them:
`sequence_parallel(..., cu_seqlens=offsets)` with the whole row's document offsets, the same
on every rank, and each rank's tokens, position ids (each document's from 0) and labels its
`varlen_shard` (ring), `contiguous_shard` (Ulysses) or `usp_varlen_shard` (USP) of the row:
the layers run `ring_attention_varlen`, `ulysses_attention_varlen` or
`usp_attention_varlen`, attention within each document, and the positions are checked
against that layout as above.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fusedattn.api import attention
from fusedattn.integrations.masks import MaskPlan, plan_from_mask, plan_from_positions
from fusedattn.problem import ProblemError, check_flag

NAME = "fusedattn"
# the process groups of the `sequence_parallel` blocks around this thread's (or task's)
# code, innermost last: a ContextVar, so another thread's plain forward never sees them
_RING: ContextVar[tuple] = ContextVar("fusedattn_sequence_parallel", default=())


SEQUENCE_PARALLEL = ("ring", "ulysses")


class _Spec(NamedTuple):
    """A `sequence_parallel` block: its group, kind ("ring", "ulysses", "usp"), mesh, and
    for packed documents the whole batch's offsets (int32, on the CPU), the longest
    document, and the offsets per device the layers met (one copy each)."""

    group: object
    kind: str
    mesh: object
    cu_seqlens: torch.Tensor | None = None
    longest: int = 0
    on_device: dict | None = None
    chunks: int = 1  # Ulysses' (and USP's) head groups overlapped with the attention

    def offsets(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.cu_seqlens.to(device)
        return self.on_device[device]


def _offsets(cu_seqlens) -> tuple[torch.Tensor, int]:
    """`sequence_parallel`'s cu_seqlens checked: int32 on the CPU, and the longest length."""
    cu = torch.as_tensor(cu_seqlens) if isinstance(cu_seqlens, list | tuple) else cu_seqlens
    if (not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2
            or cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool):
        raise ProblemError("cu_seqlens", cu_seqlens, "the packed batch's document offsets, "
                           "an integer tensor or list [D + 1] from 0, the same on every rank")
    cu = cu.detach().to("cpu", torch.int32)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ProblemError("cu_seqlens", cu.tolist()[:8], "offsets from 0, never decreasing")
    return cu, int(lengths.max())


@contextmanager
def sequence_parallel(group=None, *, kind: str = "ring", mesh=None, cu_seqlens=None,
                      chunks: int = 1):
    """Inside: "fusedattn" layers run context-parallel attention on sequence shards; see the
    module docstring. `kind="ring"`: `ring_attention` over `group` (default: the world;
    zigzag shards when causal); `kind="ulysses"`: `ulysses_attention` over `group`
    (contiguous shards; windows, softcap and sinks run too); `mesh=` (a 2-D DeviceMesh,
    Ulysses x ring): `usp_attention` (`usp_shard` shards). `cu_seqlens`: the model's batch is
    one row of packed documents at these offsets (the whole batch's, the same on every rank),
    each rank's tokens and positions its `varlen_shard` (ring), `contiguous_shard` (Ulysses)
    or `usp_varlen_shard` (USP) of them; the layers run the `*_attention_varlen` functions.
    `chunks` > 1 (Ulysses and USP): the all-to-alls overlap the attention in that many head
    groups (`ulysses_attention`'s `chunks`).
    It holds for the thread (or asyncio task) that enters it, not for others."""
    if kind not in SEQUENCE_PARALLEL:
        raise ProblemError("kind", kind, " or ".join(map(repr, SEQUENCE_PARALLEL)))
    if mesh is not None and (group is not None or kind != "ring"):
        raise ProblemError("mesh", mesh, "a mesh alone (USP: its dim 0 Ulysses, dim 1 the "
                           "ring), not with a group or kind")
    from fusedattn.distributed.ulysses import check_chunks

    check_chunks(chunks)
    if chunks > 1 and kind == "ring" and mesh is None:
        raise ProblemError("chunks", chunks, "1 for the ring (head groups overlap Ulysses' "
                           "all-to-alls: kind='ulysses' or a mesh)")
    spec = _Spec(group, "usp" if mesh is not None else kind, mesh, chunks=chunks)
    if cu_seqlens is not None:
        offsets, longest = _offsets(cu_seqlens)
        spec = spec._replace(cu_seqlens=offsets, longest=longest, on_device={})
    token = _RING.set((*_RING.get(), spec))
    try:
        yield
    finally:
        _RING.reset(token)


RUNNABLE = ("None (causal or full attention), a causal or sliding-window causal mask with "
            "padding (left or right, in training, prefill and decode), chunked prefill, a "
            "static cache, or packed documents")
SUPPORTED = (RUNNABLE + "; for another mask call fusedattn.integrations.transformers"
             ".allow_mask_fallback(True) or use attn_implementation='sdpa'")
_FALLBACK = {"allowed": False, "said": False}


def allow_mask_fallback(allowed: bool = True) -> None:
    """Let masks fusedattn cannot run (an arbitrary 4D mask) fall back, per call, to the
    plain formula (PyTorch's SDPA with the mask), with one warning, instead of raising."""
    check_flag("allowed", allowed)  # ("no" would have allowed it)
    _FALLBACK["allowed"] = allowed


def fusedattn_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                scaling: float | None = None, is_causal: bool | None = None,
                                **kwargs):
    """transformers' attention-function signature; returns `(out [B, Sq, H, D], None)`."""
    if dropout and module.training:
        raise ProblemError("dropout", dropout, "0.0: fusedattn has no attention dropout")
    if kwargs.get("output_attentions"):
        raise ProblemError("output_attentions", True, "False: fusedattn never forms P")
    ring = _RING.get()
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks, a logit per head
    if ring:
        attention_mask = _sharded_mask(attention_mask, kwargs.get("position_ids"), ring[-1],
                                       getattr(module, "is_causal", True)
                                       if is_causal is None else is_causal)
    if attention_mask is not None and not ring:
        # planned once per model call by the mask hook (None: not runnable); else here
        plan = getattr(attention_mask, "fusedattn_plan", False)
        if plan is False and isinstance(attention_mask, torch.Tensor) \
                and attention_mask.dtype == torch.bool:
            plan = plan_from_mask(attention_mask)
        if isinstance(plan, MaskPlan) and plan.seq_k == key.shape[2]:
            return plan.attend(query, key, value, scale=scaling, softcap=kwargs.get("softcap"),
                               sinks=sinks), None
    if attention_mask is not None:
        return _other_mask(query, key, value, attention_mask, scaling, ring, sinks), None
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal) and query.shape[2] > 1
    sliding = kwargs.get("sliding_window")
    window = None
    if sliding is not None and causal:  # a decode step (Sq == 1) came with no mask: it
        window = (int(sliding) - 1, None)  # sees every cached key, so no window applies
    packed = _packed_plan(kwargs.get("position_ids"), query, key, causal, window, ring)
    if packed is not None:
        return packed.attend(query, key, value, scale=scaling, softcap=kwargs.get("softcap"),
                             sinks=sinks), None
    if ring:
        return _context_parallel(query, key, value, ring[-1], causal, scaling, window,
                                 sinks, kwargs), None
    out = attention(query, key, value, is_causal=causal, scale=scaling,
                    enable_gqa=key.shape[1] != query.shape[1], window=window,
                    softcap=kwargs.get("softcap"), sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _context_parallel(query, key, value, spec, causal, scaling, window, sinks, kwargs):
    """A layer under `sequence_parallel`: the ring, Ulysses or USP (`spec`, a `_Spec`) on
    this rank's shard; `[B, S/P, H, D]` back."""
    from fusedattn.distributed import ring_attention, ulysses_attention, usp_attention

    group, kind, mesh = spec.group, spec.kind, spec.mesh
    if spec.cu_seqlens is not None:
        return _packed_context_parallel(query, key, value, spec, causal, scaling, window,
                                        sinks, kwargs)
    if kind == "ulysses":
        out = ulysses_attention(query, key, value, group=group, is_causal=causal,
                                scale=scaling, window=window, softcap=kwargs.get("softcap"),
                                sinks=sinks, chunks=spec.chunks)
        return out.transpose(1, 2).contiguous()
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ProblemError(name, kwargs[name], f"None under sequence_parallel(kind="
                               f"{kind!r}) (the ring has no windows or softcap; "
                               "kind='ulysses' has them)")
    if kind == "usp":
        out = usp_attention(query, key, value, mesh=mesh, is_causal=causal, scale=scaling,
                            sinks=sinks, chunks=spec.chunks)
    else:
        out = ring_attention(query, key, value, group=group, is_causal=causal, scale=scaling,
                             sinks=sinks)
    return out.transpose(1, 2).contiguous()


def _packed_context_parallel(query, key, value, spec, causal, scaling, window, sinks,
                             kwargs):
    """A layer under `sequence_parallel(cu_seqlens=...)`: one row of packed documents, this
    rank's rows of them, through `ring_attention_varlen`, `ulysses_attention_varlen` or
    `usp_attention_varlen`; `[1, rows, H, D]` back."""
    from fusedattn.distributed import (
        ring_attention_varlen,
        ulysses_attention_varlen,
        usp_attention_varlen,
    )

    if query.shape[0] != 1:
        raise ProblemError("batch", query.shape[0], "1 under sequence_parallel(cu_seqlens="
                           "...): the documents packed into one row")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [rows, H, D]
    cu, longest = spec.offsets(query.device), spec.longest
    if spec.kind == "ulysses":
        out = ulysses_attention_varlen(q, k, v, cu, cu, longest, longest, group=spec.group,
                                       is_causal=causal, scale=scaling, window=window,
                                       softcap=kwargs.get("softcap"), sinks=sinks,
                                       chunks=spec.chunks)
        return out[None]
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ProblemError(name, kwargs[name], f"None under sequence_parallel(kind="
                               f"{spec.kind!r}) (the ring has no windows or softcap; "
                               "kind='ulysses' has them)")
    if spec.kind == "usp":
        out = usp_attention_varlen(q, k, v, cu, longest, mesh=spec.mesh, is_causal=causal,
                                   scale=scaling, sinks=sinks, chunks=spec.chunks)
    else:
        out = ring_attention_varlen(q, k, v, cu, longest, group=spec.group,
                                    is_causal=causal, scale=scaling, sinks=sinks)
    return out[None]


def _shard_positions(spec, length: int, causal: bool) -> list[torch.Tensor]:
    """The positions, from 0, that this rank's shard of one sequence holds under `spec`
    (group, kind, mesh), `length` of them: the ring's zigzag shard (non-causal: contiguous
    too), Ulysses' contiguous one, USP's `usp_shard`."""
    import torch.distributed as dist

    from fusedattn.distributed import (
        contiguous_shard,
        usp_shard,
        usp_varlen_shard,
        varlen_shard,
        zigzag_shard,
    )

    group, kind, mesh = spec.group, spec.kind, spec.mesh
    if spec.cu_seqlens is not None:  # packed: each document's positions from 0, sharded
        cu = spec.cu_seqlens
        if int(cu[-1]) != length * (dist.get_world_size(group) if kind != "usp"
                                     else mesh.size(0) * mesh.size(1)):
            return []
        docs = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:],
                                                                    strict=True)])
        try:
            if kind == "usp":
                return [usp_varlen_shard(docs, cu, mesh.get_local_rank(0), mesh.size(0),
                                         mesh.get_local_rank(1), mesh.size(1),
                                         causal=causal)]
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            if kind == "ulysses":
                return [contiguous_shard(docs, rank, world, dim=0)]
            return [varlen_shard(docs, cu, rank, world, causal=causal)]
        except ProblemError:
            return []  # (documents the kind cannot cut: its own call says why)
    if kind == "usp":
        ulysses, ring = mesh.size(0), mesh.size(1)
        full = torch.arange(length * ulysses * ring)
        if full.numel() % (2 * ulysses * ring):
            return []  # (odd shards: the ring refuses them itself)
        return [usp_shard(full, mesh.get_local_rank(0), ulysses, mesh.get_local_rank(1),
                          ring, dim=0)]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full = torch.arange(length * world)
    layouts = [contiguous_shard(full, rank, world, dim=0)]
    if kind == "ring":
        zigzag = [zigzag_shard(full, rank, world, dim=0)] if length % 2 == 0 else []
        layouts = zigzag if causal else zigzag + layouts
    return layouts


def _segments_mask(positions: torch.Tensor) -> torch.Tensor:
    """The mask transformers makes from `positions` alone when it takes every jump in them
    for a new packed document (`find_packed_sequence_indices`): causal within each run of
    consecutive positions, `[B, 1, L, L]`."""
    runs = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    length = positions.shape[-1]
    tril = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return (tril & (runs[:, :, None] == runs[:, None, :]))[:, None]


def _same_mask(mask: torch.Tensor, segments: torch.Tensor) -> bool:
    """`mask` says what `segments` says (either may be one batch row for all)."""
    try:
        torch.broadcast_shapes(mask.shape, segments.shape)
    except RuntimeError:
        return False
    return mask.dim() == 4 and bool((mask == segments).all())


def _agreed(ok: bool, spec) -> bool:
    """`ok` and every other rank's under `spec` (one all_reduce a group): every rank raises,
    or none, so no rank waits in the ring for one that raised."""
    import torch.distributed as dist

    groups = ([spec.mesh.get_group(0), spec.mesh.get_group(1)] if spec.kind == "usp"
              else [spec.group])
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(groups[0]) == "nccl" else torch.device("cpu"))
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    for g in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
    return bool(flag.item())


def _sharded_mask(mask, positions, spec, causal) -> torch.Tensor | None:
    """Under `sequence_parallel`: the layer's mask once this rank's `position_ids` are checked
    to be its shard of one sequence per batch row (the layout's positions plus a constant).
    A mask that says only what transformers reads into such positions with no 2D mask and
    no cache (each jump of a zigzag or USP shard taken for a new document:
    `_segments_mask`) is dropped; any other mask stays, for `_other_mask` to refuse. The
    verdict is agreed by every rank and kept on the mask (or, with none, on the positions)
    with what it read, so the layers of one model call share one check and one collective;
    a tensor written in place since is checked again. Positions that restart (packed
    documents) or are not sharded like the tokens (RoPE would see a shard's own positions)
    raise `ProblemError` on every rank."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return mask
    holder = mask if isinstance(mask, torch.Tensor) else positions
    try:
        read = (positions._version, holder._version, bool(causal))
    except RuntimeError:  # inference tensors keep no version: checked every layer
        read = None
    kept = getattr(holder, "fusedattn_sharded", None)
    if (read is None or kept is None or kept[0] is not positions or kept[1] is not spec
            or kept[2:5] != read):
        layouts = [p.to(positions.device) for p in
                   _shard_positions(spec, positions.shape[-1], bool(causal))]
        if spec.cu_seqlens is not None:  # packed: the positions exactly, one row
            one = positions.shape[0] == 1 and any(bool((positions == p).all())
                                                  for p in layouts)
        else:  # one sequence: the layout's positions plus a constant
            one = any(bool(((positions - p) == (positions[:, :1] - p[0])).all())
                      for p in layouts)
        artifact = (one and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                    and _same_mask(mask, _segments_mask(positions)))
        kept = (positions, spec, *(read or (None,) * 3), one,
                _agreed(one and (mask is None or artifact), spec), artifact)
        if read is not None:
            holder.fusedattn_sharded = kept
    one, agreed, artifact = kept[5:]
    if not one and spec.cu_seqlens is None:
        raise ProblemError(
            "position_ids", "a shard that is not one sequence's (positions that restart, as "
            "packed documents', or not sharded like the tokens)",
            "one sequence a batch row, its positions sharded like the tokens (zigzag_shard, "
            "contiguous_shard or usp_shard of the whole sequence's); packed documents: "
            "sequence_parallel(cu_seqlens=...)")
    if not one:
        raise ProblemError(
            "position_ids", "not this rank's shard of the documents at cu_seqlens",
            "one row of the packed documents, each document's positions from 0, sharded "
            "like the tokens (varlen_shard for the ring, contiguous_shard for Ulysses, "
            "usp_varlen_shard for USP; documents as those take them)")
    if not agreed and (mask is None or artifact):
        raise ProblemError("shards", "another rank refused its inputs",
                           "runnable inputs on every rank (the refusing rank raised why)")
    return None if artifact else mask


def _packed_plan(position_ids, query, key, causal, window, ring) -> MaskPlan | None:
    """Packed documents with no mask (a model call that made a cache, so transformers' mask
    hook saw no packing): the plan from `position_ids` that restart, made once per model
    call (kept on the tensor, per window) and only where queries and keys are the same
    tokens; as FlashAttention-2's integration does."""
    if (ring or not causal or not isinstance(position_ids, torch.Tensor)
            or position_ids.dim() != 2 or query.shape[2] != key.shape[2]
            or position_ids.shape[-1] != query.shape[2]):
        return None
    plans = getattr(position_ids, "fusedattn_plans", None)
    if plans is None:
        plans = position_ids.fusedattn_plans = {}
    left = None if window is None else window[0]
    if left not in plans:
        ids = position_ids.expand(query.shape[0], -1) if position_ids.shape[0] == 1 \
            else position_ids
        plans[left] = plan_from_positions(ids, left)
    return plans[left]


def _other_mask(query, key, value, mask, scaling, ring, sinks) -> torch.Tensor:
    """A mask fusedattn does not run: the plain formula if allowed, else the error."""
    what = f"a {tuple(mask.shape)} mask of {mask.dtype}"
    if sinks is not None:  # the fallback (SDPA) has no sinks: it would drop them
        raise ProblemError("attention_mask", what,
                           RUNNABLE + " (with attention sinks, s_aux, there is no fallback)")
    if ring:
        raise ProblemError("attention_mask", what, "None under sequence_parallel (the ring "
                           "runs causal or full attention)")
    if not _FALLBACK["allowed"]:
        raise ProblemError("attention_mask", what, SUPPORTED)
    if not _FALLBACK["said"]:
        warnings.warn("fusedattn: a mask it cannot run falls back to PyTorch's SDPA with the "
                      "mask (allow_mask_fallback)", stacklevel=3)
        _FALLBACK["said"] = True
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def fusedattn_mask(*args, **kwargs):
    """transformers' SDPA mask, as None where causal (or sliding-window causal) or full
    attention says the same, with its `MaskPlan` attached where it is padding, packing or
    a cache's tail; any other mask as it is (the module docstring)."""
    mask = sdpa_mask(*args, **kwargs)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    seq_q, seq_k = mask.shape[-2:]
    if seq_q == 1 and bool(mask.all()):
        return None
    if seq_q == seq_k:
        tril = torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).tril()
        # the last row's count of visible keys is the window W (all of them: plain causal)
        width = int(mask.reshape(-1, seq_q, seq_k)[0, -1].sum())
        band = tril.triu(-(width - 1)) if width >= 1 else tril
        if torch.equal(mask, band.expand_as(mask)):
            return None
    mask.fusedattn_plan = plan_from_mask(mask)  # None: a mask fusedattn does not run
    return mask


AttentionInterface.register(NAME, fusedattn_attention_forward)
AttentionMaskInterface.register(NAME, fusedattn_mask)
