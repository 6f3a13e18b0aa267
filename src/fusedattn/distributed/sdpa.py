"""`ring_sdpa`, `ulysses_sdpa` and `usp_sdpa`: `torch.nn.functional.
scaled_dot_product_attention` on sequence shards, run by fusedattn's ring, Ulysses'
all-to-alls or both (USP), for model code that calls SDPA and cannot be changed.

    with ring_sdpa(group):                 # the ranks of `group` hold zigzag shards
        loss = model(input_ids_shard, position_ids=positions_shard).loss

Inside the context, a `TorchFunctionMode` (torch's public hook for this) catches every
SDPA call and runs `ring_attention` (or `ulysses_attention`) over `group` on its
arguments, which are this rank's `[B, H, S/P, D]` shards; every other function runs as it
would. The mode sees every torch function the context calls, which costs the host time:
1.4-1.7 µs a call on top of 3.0-3.3 on the development CPU (a loop of small operations,
evidence/cpu/20261204T2310Z-sdpa-mode-host-cost). Where the sequence is long enough to
shard, the GPU's time is far larger.

**With torch's `context_parallel`.** `torch.distributed.tensor.experimental.
context_parallel(mesh, buffers=..., buffer_seq_dims=...)` shards a model's buffers along
the sequence in place and wraps SDPA so that its arguments arrive as DTensors sharded on
the sequence dim, then runs its own ring. Under `ring_sdpa()` as well, the mode sees those
DTensors first: it takes their local shards, runs fusedattn over the mesh's group, and
hands back a DTensor of the same placement, so torch shards the buffers and fusedattn
computes the attention. The shards' layout must be the one the attention takes under a
causal mask:
- torch's default "head-tail" load balancing (used for any length divisible by 2P) puts
  chunks r and 2P-1-r of 2P on rank r, which is the ring's zigzag layout (`zigzag_shard`;
  tested against torch's own sharding);
- with torch's load balancing switched off the shards are contiguous, which is Ulysses'
  layout (`contiguous_shard`).
So a causal call is refused under `ring_sdpa` with torch's balancing off, and under
`ulysses_sdpa` with it on: either would be a wrong answer. Without a causal mask any equal
split serves both. `usp_sdpa` takes local shards only (`usp_shard`'s, over a 2-D mesh or
two groups); torch's `context_parallel` shards over one mesh dimension, so its DTensors
are refused there.

Refused, on every rank alike (a ProblemError, never a hang or a local-only answer):
an `attn_mask` (causal masks go by `is_causal=True`), `dropout_p` > 0, K/V heads unlike
q's without `enable_gqa=True` (as SDPA does), inputs that are not 4-D, DTensors that are
not sharded on dim 2 of a 1-D mesh, and everything `ring_attention` (`ulysses_attention`)
refuses.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from fusedattn.problem import ProblemError

# The function SDPA's callers reach, whatever wraps `torch.nn.functional`'s name for it
# (torch's `context_parallel` replaces that name with its own wrapper while active).
_SDPA = torch._C._nn.scaled_dot_product_attention


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    """SDPA's arguments by SDPA's signature."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _torch_load_balance() -> bool:
    """Whether torch's context parallelism shards causal sequences head-tail (its default).
    Read from torch's options where this torch has them; True where it has none."""
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options
    except ImportError:
        return True
    return bool(getattr(_cp_options, "enable_load_balance", True))


def _local(q, k, v, group):
    """(local q, k, v, the mesh to wrap the output in or None, group, refusal): DTensor
    arguments are unwrapped to their shards, the group taken from their mesh."""
    from torch.distributed.tensor import DTensor, Shard

    wrapped = [isinstance(t, DTensor) for t in (q, k, v)]
    if not any(wrapped):
        return q, k, v, None, group, None
    if not all(wrapped):
        return q, k, v, None, group, ProblemError(
            "q, k, v", "some DTensors, some plain tensors",
            "all three DTensors (torch's context_parallel) or all three local shards")
    mesh = q.device_mesh
    if (mesh.ndim != 1 or any(t.device_mesh != mesh for t in (k, v))
            or any(tuple(t.placements) != (Shard(2),) for t in (q, k, v))):
        return q, k, v, None, group, ProblemError(
            "q, k, v placements", [tuple(t.placements) for t in (q, k, v)],
            "DTensors sharded on the sequence dim, Shard(2), over one 1-D mesh")
    mesh_group = mesh.get_group()
    locals_ = tuple(t.to_local() for t in (q, k, v))
    if group is not None and (dist.get_process_group_ranks(group)
                              != dist.get_process_group_ranks(mesh_group)):
        return (*locals_, None, group, ProblemError(
            "group", dist.get_process_group_ranks(group),
            f"the DTensors' mesh's ranks {dist.get_process_group_ranks(mesh_group)} "
            "(or group=None)"))
    return (*locals_, mesh, mesh_group, None)


def _sdpa_call(kind: str, group, precision, chunks: int, args, kwargs):
    """One SDPA call through the ring (`kind` "ring"), Ulysses ("ulysses") or USP ("usp",
    `group` then its (Ulysses group, ring group, Ulysses degree)); `chunks`: the
    all-to-alls' overlap; the module docstring says what is refused."""
    from fusedattn.distributed.ring import checked_ring
    from fusedattn.distributed.ulysses import checked_ulysses, checked_usp

    q, k, v, mask, dropout_p, causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
    if kind == "usp":
        from torch.distributed.tensor import DTensor

        mesh, refused = None, None
        if any(isinstance(t, DTensor) for t in (q, k, v)):
            refused = ProblemError("q, k, v", "DTensors", "local shards (`usp_shard`) under "
                                   "usp_sdpa: torch's context_parallel shards over one mesh "
                                   "dimension (ring_sdpa or ulysses_sdpa there)")
            q, k, v = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k, v))
    else:
        q, k, v, mesh, group, refused = _local(q, k, v, group)
    if refused is None:
        if mask is not None:
            refused = ProblemError("attn_mask", "a mask tensor", "None: the ring and "
                                   "Ulysses take is_causal=True or no mask")
        elif dropout_p:
            refused = ProblemError("dropout_p", dropout_p, "0.0 (fusedattn has no dropout)")
        elif not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            refused = ProblemError("q, k, v", [getattr(t, "shape", t) for t in (q, k, v)],
                                   "[B, H, S/P, D] shards")
        elif k.shape[1] != q.shape[1] and not gqa:
            refused = ProblemError("enable_gqa", False, f"True where K/V have heads of "
                                   f"their own ({k.shape[1]} against q's {q.shape[1]}), "
                                   "as SDPA requires")
        elif mesh is not None and causal and _torch_load_balance() != (kind == "ring"):
            refused = ProblemError(
                "torch's context-parallel load balancing",
                "off (contiguous shards)" if kind == "ring" else "on (head-tail shards)",
                "on (head-tail shards, the ring's zigzag layout) for ring_sdpa" if kind ==
                "ring" else "off (contiguous shards, Ulysses' layout) for ulysses_sdpa, "
                "with is_causal=True")
    if kind == "ring":
        out = checked_ring(q, k, v, group, bool(causal), scale, precision, None, refused)
    elif kind == "ulysses":
        out = checked_ulysses(q, k, v, group, bool(causal), scale, precision, None, None,
                              None, chunks, refused)
    else:
        out = checked_usp(q, k, v, *group, bool(causal), scale, precision, None, chunks,
                          refused)
    if mesh is None:
        return out
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(out, mesh, [Shard(2)], run_check=False)


class _SDPAMode(TorchFunctionMode):
    def __init__(self, kind: str, group, precision: str | None, chunks: int):
        super().__init__()
        self.kind, self.group, self.precision, self.chunks = kind, group, precision, chunks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return _sdpa_call(self.kind, self.group, self.precision, self.chunks, args,
                              kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _sdpa_mode(kind: str, group, precision: str | None, chunks: int = 1):
    if not (dist.is_available() and dist.is_initialized()):
        raise ProblemError("group", group, "a process group of an initialised "
                           "torch.distributed (torch.distributed.init_process_group first)")
    with _SDPAMode(kind, group, precision, chunks):
        yield


def ring_sdpa(group=None, *, precision: str | None = None):
    """A context manager: inside it, SDPA calls on this rank's sequence shards run
    `fusedattn.distributed.ring_attention` over `group` (default: the world, or the mesh of
    DTensor arguments under torch's `context_parallel`). Shards as `ring_attention` takes
    them: zigzag (`zigzag_shard`, or torch's head-tail sharding) for `is_causal=True`, any
    equal split otherwise. `precision` is `attention`'s, for every call. Eager mode; the
    module docstring says what is refused."""
    return _sdpa_mode("ring", group, precision)


def ulysses_sdpa(group=None, *, precision: str | None = None, chunks: int = 1):
    """As `ring_sdpa`, by `fusedattn.distributed.ulysses_attention`: contiguous shards
    (`contiguous_shard`, or torch's `context_parallel` with its load balancing off), H
    divisible by P, K/V heads dividing P or divisible by it; `chunks` overlaps the
    all-to-alls with the attention (`ulysses_attention`'s)."""
    from fusedattn.distributed.ulysses import check_chunks

    check_chunks(chunks)
    return _sdpa_mode("ulysses", group, precision, chunks)


def usp_sdpa(mesh=None, *, ulysses_group=None, ring_group=None,
             precision: str | None = None, chunks: int = 1):
    """As `ring_sdpa`, by `fusedattn.distributed.usp_attention`: Ulysses inside a ring, over
    a 2-D `mesh` (dim 0 Ulysses, dim 1 the ring) or the two groups, on `usp_shard`'s local
    shards (no DTensors); `chunks` as `usp_attention`'s."""
    from fusedattn.distributed.ulysses import _usp_groups, check_chunks

    check_chunks(chunks)
    return _sdpa_mode("usp", _usp_groups(mesh, ulysses_group, ring_group), precision, chunks)
