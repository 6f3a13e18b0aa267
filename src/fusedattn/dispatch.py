"""Which kernel path serves a forward call, and why: the one dispatch rule.

    hopper    Gluon, warp-specialised, TMA + wgmma (`fusedattn.hopper`): fp16/bf16 on an
              sm90 GPU, head dims (q/k, v) in `hopper.forward.TILES` or padded up to a
              pair there (`hopper.forward.kernel_pair`), causal or not (both alignments),
              windows, softcap, GQA, varlen, LSE
    portable  Triton `tl.*` (`fusedattn.tiles`): everything, on every GPU and in emulation
              (e4m3 decode of few rows a K/V head on `tiles.fp8_decode`'s kernel where its
              `refusal` lets it and FUSEDATTN_FP8_DECODE=1 asks: `flash.flash_forward`)

`forward_path` returns the path and a one-line reason; `use_backend("portable" | "hopper"
| "auto")` forces a path for the calls inside it (tests, A/Bs): "hopper" on a call it
cannot serve raises `ProblemError` with the reason, never a silent fallback."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from fusedattn import configs
from fusedattn.hopper import forward as hopper_knobs
from fusedattn.launch import Plans, Recording, current_stream, hashable, inputs_key
from fusedattn.mode import EMULATION
from fusedattn.problem import ProblemError

# The Hopper backward under "auto" from this many keys a row, by head dim (varlen: keys a
# sequence on average, its packed total over its count): the shortest rows measured. Since
# the deterministic adds' order (998da80) it beat the portable passes on every row from
# S256 at D128 and S512 at D64, by 8-33% with no overlap of the spreads (S256 D128 +10%,
# D128 S1024 causal +15%, S2048 causal +33%, 24 documents averaging 1365 keys +8%; S512 D64
# +12%, S1024 D64 causal +9%: evidence/nvidia-h200/20261202T1335Z-bwd-short-rows-d96-fp8).
# Below them (forced, at a7d1d32's kernels: D64 128-row steps, TMA adds) the two paths are
# within 8% either way: S256 D64 1.03x / causal 0.97x, S128 D128 1.03x, S128 D64 0.92x,
# and the Hopper path costs the host more on a short step and the fp32 dQ accumulator's
# memory (evidence/nvidia-h200/20261203T0059Z-bwd-short-rows; S512 D64 1.31x). (It was
# {64: 2048, 128: 4096} before, when the kernel lost at D128 S1024 causal and on the
# varlen row.) D192 and D256 (and the dims padded to them): 128, the shortest row measured,
# where the D256 kernel beat the portable passes too, D192 padded to it included: S128 D256
# 118 TFLOP/s against 96, S128 D192 causal 58 against 47, S256 D256 causal 105 against 87
# (evidence/nvidia-h200/20261203T2249Z-bwd-d256-rows)
HOPPER_BWD_MIN_KEYS = {64: 512, 128: 256, 192: 128, 256: 128}
BACKENDS = ("auto", "hopper", "portable")
# Under this many keys a row the Hopper kernel's programs end before its pipeline fills,
# and the portable kernel ran faster on the H200 (scripts/hopper_check.py --sweep, 16k
# tokens a call: D64 non-causal up to S768, tied at S1024; causal, on the persistent grid
# with fixed shares (before the claims, below), up to S1024 at D128 and at every length
# swept, to S2048, at D64); non-causal at D > 64 the Hopper kernel won from S128 on
# (evidence/nvidia-h200/20261201T1400Z-hopper-sweep, docs/decisions.md#hopper-forward).
# Since the Hopper kernel's two Q slots (`hopper.forward.Q_SLOTS`) it wins non-causal at D64
# too, from S256 (H100, 16k tokens a call, TFLOP/s: S256 275 against the portable kernel's
# 254, S1024 396 / 359, S2048 487 / 391; S128 162 / 165; evidence/nvidia-h100/
# 20261206T0453Z-q-slots), where causal rows, one program an item then, stayed portable
# under 1024 keys (D64 S1024 226 against 257 portable; D128 S512 235 / 252, S1024 354 /
# 337). HOPPER_MIN_KEYS now serves varlen's causal calls, windows of more keys than
# HOPPER_MIN_WINDOW, and dense causal calls with the claims off
HOPPER_MIN_KEYS = 1024
HOPPER_MIN_KEYS_WIDE = 128  # non-causal, no window
# dense causal calls whose launches claim their items on the persistent grid (the rule is
# `hopper.forward.claims`: causal or a window (None, 0), with CAUSAL_CLAIMS on; without the
# claims HOPPER_MIN_KEYS holds):
# the sweep at b0ba999 on an H100 (16k tokens a call, TFLOP/s, Hopper / portable / cuDNN):
# D64 S384 167 / 172 / 209, S512 204 / 200 / 240, S768 247 / 236, S1024 286 / 261; D128 S256
# 167 / 163, S384 229 / 216, S512 281 / 254, S1024 409 / 336 / 417 (evidence/nvidia-h100/
# 20261206T0703Z-causal-claims). Varlen's causal launches claim too (`VARLEN_CLAIMS`); their
# threshold, on the longest document's keys, is HOPPER_MIN_KEYS_VARLEN's (below)
HOPPER_MIN_KEYS_CLAIMED = 512
# varlen's causal calls (their launches claim too) by head dim (q's, as given: a head dim
# padded to a kernel's keeps HOPPER_MIN_KEYS), on the longest document's keys; other head dims
# keep HOPPER_MIN_KEYS. The varlen sweep on an H100 (16k tokens of documents of [longest / 2,
# longest] keys, H16, TFLOP/s, Hopper / portable; evidence/nvidia-h100/20261206T1006Z-varlen-
# sweep, with the documents handed over, `hopper.forward.DOC_ROWS`): D64 longest 1024 202 /
# 211, 1536 247 / 247, 2048 244 / 274, 2560 295 / 237, 4096 365 / 277 (the portable kernel
# ahead or even up to 2048, behind from 2560; between them not measured); D128 768 236 / 231,
# 1024 283 / 259 (HOPPER_MIN_KEYS holds); D96 768 193 / 199, 1024 228 / 223 (it holds);
# D192 512 178 / 159, 768 243 / 201; D256 512 203 / 190, 768 282 / 245 (the Hopper kernel
# ahead from the shortest measured, 512; under it not measured)
HOPPER_MIN_KEYS_VARLEN = {64: 2049, 192: 512, 256: 512}
# A window bounding both sides of a row (left given, and right given or causal) to fewer
# keys than this goes portable too: each Hopper item (a 128- or 192-row query tile, heads
# apart) then spans two or three key steps, mostly masked, and pays its pipeline's fill and
# its epilogue for them, while the portable kernel packs the GQA group. On an H100, B1
# S8192 causal (evidence/nvidia-h100/20261205T1813Z-window-paths, ab2.jsonl): 129 keys a
# row, D64 H64/8 0.168 ms portable against 0.220 (Hopper, two warpgroups) and 0.306 (three,
# the rule's before), D128 H32/8 0.115 against 0.136; 257 keys 0.205 / 0.229 and 0.147 /
# 0.156; 513 keys 0.281 / 0.293 at D64 but 0.209 / 0.199 at D128; 1025 keys about a tie at
# D64 (0.426 / 0.430) and the Hopper kernel's at D128 (0.297 against 0.350)
HOPPER_MIN_WINDOW = 512
_BACKEND = contextvars.ContextVar("fusedattn_backend", default="auto")


@contextlib.contextmanager
def use_backend(name: str):
    """Force the forward's path for the calls made inside (this thread/task only)."""
    if name not in BACKENDS:
        raise ProblemError("backend", name, " or ".join(map(repr, BACKENDS)))
    token = _BACKEND.set(name)
    try:
        yield
    finally:
        _BACKEND.reset(token)


@functools.cache
def _gluon_hopper() -> str | None:
    """None where Triton's Gluon has the Hopper pieces the kernel uses, else why not. (After
    `prime`'s thread: it imports Gluon by another module, `prime.settle`.)"""
    from fusedattn import prime

    prime.settle()
    try:
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            tma,
            warpgroup_mma,
            warpgroup_mma_init,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as e:
        return f"this Triton has no Gluon Hopper API ({e})"
    return None


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _tma_ready(t: torch.Tensor) -> bool:
    """A TMA descriptor can cover `t` as it is: 16-byte aligned data, the last stride 1,
    every other stride a multiple of 16 bytes."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(s * size % 16 == 0 for s in t.stride()[:-1]))


def _device_refusal(q, k, v) -> str | None:
    """What both Hopper kernels need of the tensors and the machine: TMA-ready q/k/v on
    an sm90 GPU, with Triton's Gluon Hopper API; None when all is there."""
    if not all(_tma_ready(t) for t in (q, k, v)):
        return "q/k/v not TMA-aligned (16-byte data and strides, last stride 1)"
    if EMULATION or q.device.type != "cuda":
        return "not on a CUDA GPU (emulation runs the portable kernels)"
    if not _is_sm90(q.device.index if q.device.index is not None else 0):
        return "not an sm90 (Hopper) GPU"
    return _gluon_hopper()


def hopper_refusal(q, k, v, *, mask, cache=None, splits=1, pack_gqa=False,
                   config=None) -> str | None:
    """None when the Hopper kernel can serve this call, else the reason it cannot."""
    from fusedattn.hopper.forward import FP8_TILES, KERNEL_DIMS, TILES, kernel_pair

    if q.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        return f"{q.dtype} (the Hopper kernel takes float16/bfloat16/float8_e4m3fn)"
    fp8 = q.dtype == torch.float8_e4m3fn
    if kernel_pair(q.shape[-1], v.shape[-1], fp8) is None:
        padding = "" if fp8 else (", a head dim over 64 padded up to the next of "
                                  + "/".join(map(str, KERNEL_DIMS[1:])))
        return (f"head dims {q.shape[-1]} (q, k) and {v.shape[-1]} (v) (the Hopper kernel "
                f"takes {', '.join(f'{a}/{b}' for a, b in (FP8_TILES if fp8 else TILES))} "
                f"in {q.dtype}{padding})")
    if cache is not None or splits > 1 or pack_gqa:
        return "a KV cache or split-KV decode (portable)"
    if config is not None:
        return "an explicit portable config"
    if q.shape[0] * q.shape[1] * -(-q.shape[2] // 128) >= 2**31:
        return "over 2^31 work items of 128 query rows (the Hopper kernel's 32-bit count)"
    return _device_refusal(q, k, v)


def _choose(refusal, short, *, strict: bool, what: str,
            backend: str | None = None) -> tuple[str, str]:
    """The one rule under `use_backend`: ("hopper" | "portable", why). `refusal()` is the
    Hopper kernel's refusal (None: it can serve the call) and `short()` the reason a
    servable call still goes portable under "auto" (None: it does not); each is asked only
    where needed. A forced "hopper" on a refused call raises where `strict`, else goes
    portable with the refusal as its reason."""
    chosen = backend or _BACKEND.get()
    if chosen == "portable":
        return "portable", "forced by use_backend('portable')"
    why = refusal()
    if why is None:
        if chosen == "hopper":
            return "hopper", "forced by use_backend('hopper')"
        slow = short()
        return ("portable", slow) if slow else ("hopper", "fp16/bf16/e4m3 on sm90 at a "
                                                          "covered head dim")
    if chosen == "hopper" and strict:
        raise ProblemError("backend", "hopper", f"a {what} the Hopper kernel serves; this one "
                           f"has {why}")
    return "portable", why


def forward_path(q, k, v, *, varlen=None, **kw) -> tuple[str, str]:
    """("hopper" | "portable", why) for this call under the current `use_backend`. Under
    "auto", a call the Hopper kernel can serve still goes portable where its rows have
    fewer than `HOPPER_MIN_KEYS` keys (`HOPPER_MIN_KEYS_WIDE` non-causal without a window,
    `HOPPER_MIN_KEYS_CLAIMED` dense calls whose launches claim, `hopper.forward.claims`;
    varlen: the longest sequence's, `HOPPER_MIN_KEYS_VARLEN` by head dim where its launches
    claim), or where a window bounds a row to fewer than
    `HOPPER_MIN_WINDOW` keys (`Mask.span`)."""
    def short():
        keys = varlen.max_seqlen_k if varlen is not None else k.shape[2]
        mask = kw["mask"]
        claimed = hopper_knobs.claims(mask, varlen)
        dim = q.shape[-1]
        if not mask.causal and mask.window is None:
            least, name = HOPPER_MIN_KEYS_WIDE, "HOPPER_MIN_KEYS_WIDE"
        elif claimed and varlen is None:
            least, name = HOPPER_MIN_KEYS_CLAIMED, "HOPPER_MIN_KEYS_CLAIMED"
        elif claimed and dim in HOPPER_MIN_KEYS_VARLEN:
            least, name = HOPPER_MIN_KEYS_VARLEN[dim], f"HOPPER_MIN_KEYS_VARLEN[{dim}]"
        else:
            least, name = HOPPER_MIN_KEYS, "HOPPER_MIN_KEYS"
        span = mask.span()
        if span is not None and span < keys:
            keys, least, name = span, HOPPER_MIN_WINDOW, "HOPPER_MIN_WINDOW"
        if keys < least:
            return (f"{keys} keys a row, under {name} = {least} (the portable kernel is "
                    f"faster there)")
        return None

    return _choose(lambda: hopper_refusal(q, k, v, **kw), short, strict=True, what="call")


def hopper_backward_refusal(q, k, v, *, mask, varlen=None, configs=None) -> str | None:
    """None when the Hopper backward (`hopper.backward`) can serve this call's gradients,
    else the reason it cannot."""
    from fusedattn.hopper.backward import PAD_FROM, PIECES, TILES, kernel_dims, padded_refusal

    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} (the Hopper backward takes float16/bfloat16)"
    if kernel_dims(q.shape[-1], v.shape[-1]) is None:
        return (f"head dims {q.shape[-1]} (q, k) and {v.shape[-1]} (v) (the Hopper backward "
                f"takes {', '.join(map(str, TILES))}, a head dim between {PAD_FROM} and "
                f"{max(TILES)} padded to the next of them, and v's up to q's, "
                f"{'/'.join(map(str, PIECES))} only as q's)")
    why = padded_refusal(q.shape[-1])
    if why is not None:
        return why
    if configs is not None:
        return "explicit portable configs"
    return _device_refusal(q, k, v)


def backward_path(q, k, v, *, backend: str | None = None, **kw) -> tuple[str, str]:
    """("hopper" | "portable", why) for a backward, as `forward_path` for the forward,
    except that a backward the Hopper kernel cannot serve goes portable even under
    `use_backend("hopper")` (which forces the forwards). `backend`: the `use_backend`
    choice the forward ran under (autograd may run the backward on a thread of its own,
    where the context is not set); default the current."""
    from fusedattn.hopper.backward import kernel_dim

    def short():
        varlen = kw.get("varlen")
        # (varlen: k is the packed [1, H, total, D])
        keys = k.shape[2] // max(varlen.batch, 1) if varlen is not None else k.shape[2]
        # (a head dim the refusal let through: the kernel's, padded where it is)
        dim = kernel_dim(q.shape[-1])
        least = HOPPER_BWD_MIN_KEYS[dim]
        if keys < least:
            return (f"{keys} keys a row{' (a sequence on average)' if varlen else ''}, under "
                    f"HOPPER_BWD_MIN_KEYS[{dim}] = {least} (the portable backward is "
                    f"as fast there)")
        return None

    # forced, a forward the Hopper forward serves may still need the portable backward
    # (v's head dim over q's, D under 64): that backward is the portable one, and says why
    return _choose(lambda: hopper_backward_refusal(q, k, v, **kw), short, strict=False,
                   what="backward", backend=backend)


def current_backend() -> str:
    """The `use_backend` choice in force here ("auto" outside any)."""
    return _BACKEND.get()


# The forward's plans: per call key, the launches it made (`launch.Replay`), replayed on the
# next call with the same key instead of deciding them again (issue 31: a call's Python
# and Triton's binder cost 6-8x SDPA's host time). The key holds everything the path, the
# config and the kernels' arguments are computed from.
_PLANS = Plans()


def forward_inputs(q, k, v, out, lse, *, offsets=(None, None), cache=(None, None),
                   sinks=None, descale=None) -> tuple:
    """A forward's tensors in the order its plans record them (`launch.Recording`) and
    replay them: `offsets` varlen's (cu_seqlens_q, cu_seqlens_k), `cache` a KV cache's
    (lengths, block table), each a pair (of Nones where the call has none)."""
    return (q, k, v, out, lse, *offsets, *cache, sinks, descale)


def plan_context() -> tuple:
    """What decides a launch beyond the call's own tensors and options: the forced backend
    (`use_backend`), the tuning overrides, the Hopper kernel's A/B switches. Part of every
    forward plan's key; a caller that keeps a plan of its own (`api.attention`) keeps this
    with it and replays only while it is unchanged. With the Hopper forward's claims
    (`hopper.forward.CAUSAL_CLAIMS`), the current stream and whether its launches take a
    CUDA graph capture's form (`hopper.forward.capturing`) too: a causal plan's launch claims
    items from a counter of its own, so its launches must not overlap (one stream's run in
    turn), and a capture takes a launch without one."""
    return _BACKEND.get(), configs.OVERRIDES, hopper_knobs.switches(), _stream_context()


def _stream_context() -> tuple | None:
    if EMULATION or not hopper_knobs.CAUSAL_CLAIMS:  # (no Hopper kernel in emulation)
        return None
    return current_stream(), hopper_knobs.capturing()


def kept_forward(kept, inputs: tuple, launch) -> None:
    """A forward for a caller whose own call key settles the plan key but for
    `plan_context` (`api.attention`, `attention_varlen`, `attention_with_kvcache` on calls
    autograd does not record): the plan `kept` (`launch.KeptPlan`) holds under the current
    context replayed on `inputs` (`forward_inputs`' tuple: the call's tensors, O and the
    LSE made fresh); else `launch(keep)`, the caller's `forward(..., keep=keep)`, and the
    plan it replays or records kept."""
    context = plan_context()
    plan = kept.get(context)
    if plan is not None:
        plan(inputs)
        return
    plans = []
    launch(plans)
    kept.keep(context, plans)


def forward(q, k, v, *, out, lse, is_causal, scale, precision, mask=None, varlen=None,
            cache=None, splits=1, pack_gqa=False, config=None, sinks=None, descale=None,
            keep: list | None = None):
    """The forward behind every entry point: the path `forward_path` picks, launched on
    validated `[B, H, S, D]` tensors (`tiles.flash.flash_forward`'s arguments; `sinks`:
    `[H]` float32 attention sinks, both paths; `descale`: float8 inputs' factors, both
    paths). A call whose key was seen replays that call's plan (`launch.Plan`). `keep`, a
    list, receives the plan replayed or recorded (nothing where the call has none), for a
    caller whose own key settles this one's: it calls the plan on the same `inputs` tuple
    (below) while `plan_context` is unchanged."""
    from fusedattn.tiles.common import Mask

    mask = mask or Mask(causal=is_causal)
    inputs = forward_inputs(
        q, k, v, out, lse, offsets=(None, None) if varlen is None else (varlen.cu_q, varlen.cu_k),
        cache=(None, None) if cache is None else (cache.seqlens, cache.block_table),
        sinks=sinks, descale=descale)
    key = None
    if config is None:
        key = (*hashable(plan_context()), is_causal, scale, precision, mask, splits, pack_gqa,
               inputs_key(inputs),
               varlen is not None and (varlen.max_seqlen_q, varlen.max_seqlen_k),
               cache is not None and cache.added)  # (the launch's int: the key's)
        plan = _PLANS.get(key)
        if plan is not None:
            plan(inputs)
            if keep is not None:
                keep.append(plan)
            return out, None
    path, _ = forward_path(q, k, v, varlen=varlen, mask=mask, cache=cache, splits=splits,
                           pack_gqa=pack_gqa, config=config)
    recording = Recording(inputs)
    compiled = None
    if path == "hopper":
        from fusedattn.hopper.forward import hopper_forward

        hopper_forward(q, k, v, out=out, lse=lse, scale=scale, mask=mask, varlen=varlen,
                       recording=recording, sinks=sinks, descale=descale)
    else:
        from fusedattn.tiles.flash import flash_forward

        _, compiled = flash_forward(
            q, k, v, out=out, lse=lse, is_causal=is_causal, scale=scale, precision=precision,
            config=config, mask=mask, varlen=varlen, cache=cache, splits=splits,
            pack_gqa=pack_gqa, recording=recording, sinks=sinks, descale=descale)
    plan = recording.plan()
    if key is not None and plan is not None:
        _PLANS.put(key, plan)
        if keep is not None:
            keep.append(plan)
    return out, compiled
