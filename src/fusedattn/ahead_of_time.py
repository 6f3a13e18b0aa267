"""`fusedattn.warmup` (defined here, in `fusedattn.ahead_of_time`): compile ahead of time
the kernels a model's calls will use (issue 31).

    fusedattn.warmup(head_dims=(128,), heads=(32,), heads_kv=(8,), dtypes=("bf16",),
                     causal=(True,), training=True, varlen=False)

makes one small call of each kind that compiles something different: per dtype, head dim,
heads (with their K/V heads), mask and path, a length in each power-of-two bucket of the
config table (16 .. `max_len`), one that is a multiple of 16 and one that is not (Triton
specialises lengths on it in the portable kernels), at one batch that leaves the SMs idle
and one that fills them (the table's two columns), for the forward's programs (B x H) and,
with `training`, the backward's (B x H_kv), and, where a bucket's shortest lengths leave
them idle at batch 1 and its longest do not, at those too (`_shapes`). Batch and length
within a bucket then compile nothing new: the Hopper kernel does not specialise on sizes at
all, so its one compile per dtype, head dim and mask covers every length from
`dispatch.HOPPER_MIN_KEYS`.
The backward is warmed with contiguous upstream gradients (as a next layer's matmul hands
on); other strides (a loss's `.sum()` hands on a stride-0 one) specialise it anew. With
`training`, each forward is also called without gradients (an evaluation step's), whose
kernels write no LSE and so are kernels of their own. Each causal forward is called once more
in the form a CUDA graph's capture launches (`hopper.forward.as_captured`: on the Hopper path
one program an item, not the claimed items of a call outside a capture), so that a first
capture compiles nothing either. `varlen` makes the same calls through `attention_varlen`,
documents of one length for the batch, its backward too with `training` (a packed training
step's; before 2026-12-07 only its forward was warmed).
"fp8" warms float8 e4m3 q, k, v (head dims 64, 128, 256) and, with `training`,
`attention_fp8_backward` on a bfloat16 upstream gradient; the descale factors (none, per
tensor or per head) make no kernel of their own.
`decode=True` warms `attention_with_kvcache` as a decode loop calls it (`check_lengths=False`,
one new query with its key and value appended, the mask options given, causal): caches of
`max_len` keys and, past `configs.ONE_LOOP_MAX_KEYS`, of that many (a kernel of its own),
contiguous and paged, at batches 1, 2, 4, ... until the split-KV rule stops splitting and the
batch's programs fill the SMs. Each split count's merge is a kernel of its own (the count's
power of two), and a batch whose programs fill the SMs takes the table's other tile.

Compiled kernels land in Triton's cache, `$TRITON_CACHE_DIR` (default
`~/.triton/cache`): a process started later on the same machine (or on an image that
ships that folder, with the same GPU, driver, torch and triton) loads them instead of
compiling. Returns what it did: the calls made, the kernels compiled, the seconds.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from fusedattn.problem import ProblemError, is_int

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.float8_e4m3fn}
MIN_LEN, MAX_LEN = 16, 16384


def _lengths(max_len: int) -> list[int]:
    """Two lengths per power-of-two bucket up to `max_len`: 2^k (a multiple of 16 from 16
    on) and 2^k - 1 (not one), and 1."""
    out, b = [1], MIN_LEN
    while b <= max_len:
        out += [b - 1, b]
        b *= 2
    return out


def _batches(heads: int, seq: int) -> list[int]:
    """1, and the least batch whose programs fill the SMs (`configs.fills_sms`)."""
    from fusedattn.configs import SMS, fills_sms

    tiles = heads * -(-seq // 64)
    return [1] if fills_sms(heads, seq) else [1, -(-SMS // tiles)]


def _shapes(heads: int, heads_kv: int, seq: int) -> list[tuple[int, int]]:
    """The (length, batch) pairs warmup calls for `seq`, one of `_lengths`: the table's
    key is "fills" or "few" by a kernel's programs (`configs.table_key`), B x H for the
    forward and B x H_kv for the backward (a program a K/V head's key tile), so `seq` at
    `_batches` of each; and, where `seq` tops its bucket (a power of two past 64), the
    bucket's shortest lengths at batch 1 where they are "few" and `seq` at batch 1 is not
    (H40 at 129 keys: 120 programs of 132 SMs, at 256 keys 160): one not a multiple of 16
    and one that is, as `_lengths` has them (the same 64-key tiles: seq / 2 is a multiple
    of 64). Varlen's calls take the same pairs as (length, documents): its programs are
    the documents x H."""
    from fusedattn.configs import fills_sms

    pairs = sorted({(seq, b) for n in {heads, heads_kv} for b in _batches(n, seq)})
    if seq > 64 and seq & (seq - 1) == 0:
        short = seq // 2 + 1
        if any(fills_sms(n, seq) and not fills_sms(n, short) for n in {heads, heads_kv}):
            pairs += [(short, 1), (short + 15, 1)]
    return pairs


def _check(name: str, values, allowed) -> tuple:
    values = tuple(values) if isinstance(values, list | tuple) else (values,)
    if not values or any(not allowed(v) for v in values):
        raise ProblemError(name, values, "a non-empty tuple of " + allowed.__doc__)
    return values


def warmup(*, head_dims, heads, heads_kv=None, dtypes=("bf16",), causal=(True,),
           training: bool = False, varlen: bool = False, window=None, softcap=None,
           sinks: bool = False, max_len: int = 4096, decode: bool = False) -> dict:
    """Compile what these calls need (see the module docstring); returns
    {"calls": n, "compiled": n, "seconds": s}. A head dim is an int, or a pair (Q/K's,
    V's) for a V head dim of its own; `sinks=True` warms the calls with attention sinks
    (their kernels are variants of their own). Needs the GPU (in emulation nothing is
    compiled, and the calls are made all the same, slowly: for tests)."""
    from fusedattn import attention, attention_fp8_backward, attention_varlen

    def dim_ok(d):
        """head dims 1..256, or (Q/K's, V's) pairs of them"""
        if isinstance(d, tuple | list):
            return len(d) == 2 and all(is_int(x) and 1 <= x <= 256 for x in d)
        return is_int(d) and 1 <= d <= 256

    def count_ok(h):
        """integers >= 1"""
        return is_int(h) and h >= 1

    def dtype_ok(d):
        """'bf16', 'fp16', 'fp32', 'fp8'"""
        return d in DTYPES

    def bool_ok(c):
        """True/False"""
        return isinstance(c, bool)

    head_dims = _check("head_dims", head_dims, dim_ok)
    heads = _check("heads", heads, count_ok)
    heads_kv = heads if heads_kv is None else _check("heads_kv", heads_kv, count_ok)
    if len(heads_kv) != len(heads) or any(h % g for h, g in zip(heads, heads_kv, strict=True)):
        raise ProblemError("heads_kv", heads_kv, "one per entry of heads, each dividing it")
    dtypes = _check("dtypes", dtypes, dtype_ok)
    if "fp8" in dtypes:
        from fusedattn.problem import FP8_HEAD_DIMS

        for dims in head_dims:
            if any(d not in FP8_HEAD_DIMS for d in (dims if isinstance(dims, tuple | list)
                                                    else (dims,))):
                raise ProblemError("head_dims", head_dims, "with 'fp8' in dtypes, head dims "
                                   f"of {', '.join(map(str, FP8_HEAD_DIMS))}")
    causal = _check("causal", causal, bool_ok)
    if not all(isinstance(x, bool) for x in (training, varlen, sinks, decode)):
        raise ProblemError("training/varlen/sinks/decode", (training, varlen, sinks, decode),
                           "True or False each")
    if not is_int(max_len) or not MIN_LEN <= max_len <= MAX_LEN:
        raise ProblemError("max_len", max_len, f"an int in {MIN_LEN}..{MAX_LEN}")

    from fusedattn.mode import DEVICE

    compiled = []
    listener = _listen(compiled)
    start, calls = time.perf_counter(), 0
    try:
        for dtype in dtypes:
            for dims in head_dims:
                dim, dim_v = dims if isinstance(dims, tuple | list) else (dims, dims)
                for h, hkv in zip(heads, heads_kv, strict=True):
                    sink = torch.zeros(h, device=DEVICE) if sinks else None
                    grad = training and dtype != "fp8"  # FP8 takes its gradients apart
                    for is_causal in causal:
                        for seq in _lengths(max_len):
                            # (the backward's programs are B x H_kv: its batches too)
                            shapes = _shapes(h, hkv if training else h, seq)
                            for length, batch in shapes:
                                q, k, v = (torch.randn(batch, n, length, d, device=DEVICE)
                                           .to(DTYPES[dtype]).requires_grad_(grad)
                                           for n, d in ((h, dim), (hkv, dim), (hkv, dim_v)))
                                mask = dict(is_causal=is_causal, enable_gqa=h != hkv,
                                            window=window, softcap=softcap, sinks=sink)
                                out, made = _step(partial(attention, q, k, v, **mask),
                                                  is_causal, grad)
                                calls += made
                                if training and dtype == "fp8":
                                    attention_fp8_backward(torch.ones_like(out), q, k, v,
                                                           **mask)
                            # varlen's programs: the documents x H (the longest's tiles),
                            # so documents of one length as many as the batches above; with
                            # gradients as the dense calls (a packed training step)
                            for length, docs in (shapes if varlen else ()):
                                q, k, v = (torch.randn(docs * length, n, d, device=DEVICE)
                                           .to(DTYPES[dtype]).requires_grad_(grad)
                                           for n, d in ((h, dim), (hkv, dim), (hkv, dim_v)))
                                cu = torch.arange(0, docs * length + 1, length,
                                                  dtype=torch.int32, device=DEVICE)
                                calls += _step(partial(
                                    attention_varlen, q, k, v, cu, cu, length, length,
                                    is_causal=is_causal, window=window, softcap=softcap,
                                    sinks=sink), is_causal, grad)[1]
                    if decode:
                        calls += _warm_decode(DTYPES[dtype], dim, dim_v, h, hkv, max_len,
                                              dict(window=window, softcap=softcap,
                                                   sinks=sink))
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    finally:
        listener()
    return {"calls": calls, "compiled": len(compiled),
            "seconds": round(time.perf_counter() - start, 3)}


def _step(call, causal: bool, grad: bool) -> tuple:
    """A forward `call()`, once more in a capture's form where causal (`_as_captured`),
    and with `grad` its backward on a ones gradient and the same forward without gradients
    (an evaluation's: it writes no LSE, a kernel of its own); returns (the first call's
    output, the calls made)."""
    out = call()
    calls = 1 + _as_captured(causal, call)
    if grad:
        out.backward(torch.ones_like(out))
        with torch.no_grad():
            call()
            calls += 1 + _as_captured(causal, call)
    return out, calls


def _as_captured(causal: bool, call) -> int:
    """A causal forward `call` once more in a CUDA graph capture's form
    (`hopper.forward.as_captured`); returns the calls made (0 where not causal, whose launch
    is one form)."""
    if not causal:
        return 0
    from fusedattn.hopper.forward import as_captured

    with as_captured():
        call()
    return 1


def _warm_decode(dtype, dim: int, dim_v: int, heads: int, heads_kv: int, max_len: int,
                 options: dict) -> int:
    """`warmup(decode=True)`'s calls for one dtype, head dims and heads (the module
    docstring); returns how many it made. The largest batch's caches hold batch x
    capacity keys (B 256 at one K/V head, B 32 at 8, 4096 keys and D128: 0.5 GB for K and V)."""
    from fusedattn.configs import ONE_LOOP_MAX_KEYS
    from fusedattn.kvcache import attention_with_kvcache
    from fusedattn.mode import DEVICE

    page, calls = 16, 0
    for capacity in sorted({min(max_len, ONE_LOOP_MAX_KEYS), max_len}):
        capacity = -(-capacity // page) * page  # (whole pages, for the paged cache)
        for batch in _decode_batches(heads, heads_kv, capacity):
            q = torch.randn(batch, heads, 1, dim, device=DEVICE).to(dtype)
            new = [torch.randn(batch, heads_kv, 1, d, device=DEVICE).to(dtype)
                   for d in (dim, dim_v)]
            lengths = torch.full((batch,), capacity - 1, dtype=torch.int32, device=DEVICE)
            for paged in (False, True):
                rows = (batch * capacity // page, heads_kv, page) if paged else \
                    (batch, heads_kv, capacity)
                # (never read but by these calls: their values do not matter)
                caches = [torch.empty(*rows, d, device=DEVICE, dtype=dtype)
                          for d in (dim, dim_v)]
                table = torch.arange(batch * capacity // page, dtype=torch.int32,
                                     device=DEVICE).reshape(batch, -1) if paged else None
                attention_with_kvcache(q, *caches, cache_seqlens=lengths, k_new=new[0],
                                       v_new=new[1], block_table=table, check_lengths=False,
                                       **options)
                calls += 1
    return calls


def _decode_batches(heads: int, heads_kv: int, capacity: int) -> list[int]:
    """1, 2, 4, ... up to the first batch that the split-KV rule does not split and whose
    programs fill the SMs (one new query a sequence): every split count's merge and both of
    the tuned table's decode tiles ("few" and "fills": `configs.decode_config`). The two
    ends differ where the SMs are not a power of two: at 8 K/V heads on 132 SMs batch 16
    (128 programs) takes one split and "few", and batch 32 is the first to fill them (on
    the H200, whose table has a "fills" entry, the first batch of 17 or more compiled it:
    the tier of 2026-12-07T17:53Z)."""
    from fusedattn.configs import fills_sms
    from fusedattn.kvcache import chosen_splits

    def last(batch: int) -> bool:
        # (`decode_config`'s key: a program a K/V head's rows, packed)
        return chosen_splits(batch, heads, 1, heads_kv, capacity) == 1 and fills_sms(
            batch * heads_kv, heads // heads_kv)

    batches = [1]
    while not last(batches[-1]):
        batches.append(2 * batches[-1])
    return batches


def _listen(records: list):
    """Count Triton's compiles (not its cache hits) into `records` while warming up;
    returns the function that restores the listener before it."""
    import triton

    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if not hasattr(compilation, "listener"):  # a Triton before 3.4: no count
        return lambda: None
    before = compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            records.append(metadata.get("name", "?"))
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                   cache_hit=cache_hit)

    compilation.listener = listener

    def restore():
        compilation.listener = before
    return restore
