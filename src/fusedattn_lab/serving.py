"""`fusedattn bench --suite decode|varlen|window`: the serving entry points against their
peers, in one process, on the same inputs.

- decode: `attention_with_kvcache` (one or a few new queries per sequence over a KV cache,
  dense or paged) against SDPA's cuDNN and flash backends on the same cache (keys up to the
  longest length; here every sequence is full). The bandwidth column is the K and V bytes
  that must be read, `2 * B * H_kv * Sk * D * itemsize`, over the time.
- varlen: `attention_varlen` on a packed batch against the same batch padded to its
  longest sequence and run through SDPA (flash, cuDNN), and FlexAttention with a document
  mask (compiled) on the packed rows. TFLOP/s count the useful FLOPs only (each sequence's
  own causal triangle).
- window: `attention(window=...)` against FlexAttention with a sliding-window block mask and
  SDPA with the window as a boolean mask. Useful TFLOP/s: 4 * D * (visible pairs).
- sinks: `attention(sinks=...)` (gpt-oss's attention sinks, causal, with or without its
  128-key window) against FlashAttention-4's `learnable_sink` where FA4 is staged; SDPA and
  FlexAttention have no sinks.
- mla: prefill with a V head dim unlike Q's (DeepSeek's MLA: 192 and 128) against SDPA's
  cuDNN and flash backends and FA4. TFLOP/s: 2 * (D_qk + D_v) per (query, key) pair seen.
- mla-bwd: its backward alone (each provider's forward once, its graph kept, then dQ, dK
  and dV timed), against the same peers, all three gradients verified; TFLOP/s 2.5 times
  the forward's FLOPs (FlashAttention's convention).
- fp8: `attention` on float8_e4m3fn q, k, v with per-head descale factors (O in bf16)
  against SDPA's cuDNN and flash backends on the same values dequantised to bf16 (SDPA takes
  no FP8; FA4's FP8 runs on SM100 only, FA3 is not staged here). Its error bound is twice
  the FP8 formula's done by torch (`peers.fp8_peer`), not the bf16 peers'.
- fp8-decode: `attention_with_kvcache` on e4m3 q and caches (every sequence full) with
  per-head factors (`fusedattn`; `fusedattn-fp8dec` with FUSEDATTN_FP8_DECODE=1's kernel,
  `tiles.fp8_decode`), against its own bf16 decode (`fusedattn-bf16`) and SDPA's on the
  values dequantised to bf16; the bandwidth column counts each provider's own K/V bytes (one a
  value for e4m3, two for bf16), the bound as fp8's.
- fp8-varlen-bwd: `attention_varlen_fp8_backward` on e4m3 packed documents (the varlen
  row's lengths), each route, beside the bf16 varlen forward + backward on the dequantised
  values (ours, and FA4's where staged: the FP8 backward recomputes its forward too); dQ
  verified, the bound as fp8-bwd's.

Every provider's output is verified against the float64 reference on one sequence / two
heads before it is timed (`lab/verify.check`, peers' errors for the low-precision bound),
and timed with the primed-event protocol (`lab/timing.time_gpu`). A provider that cannot run
a problem is recorded as skipped, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fusedattn.mode import DEVICE, EMULATION
from fusedattn_lab.suites import DTYPES, BenchRow


@dataclass(frozen=True)
class ServingProblem:
    kind: str             # decode | varlen | window | sinks | mla | mla-bwd | fp8 | fp8-bwd
    #                       | fp8-decode | fp8-varlen-bwd
    batch: int
    heads: int
    heads_kv: int
    seq_q: int            # decode: new queries per sequence; varlen: longest sequence
    seq_k: int            # keys per sequence (decode: cache length; window: S)
    dim: int
    dtype: str = "bf16"   # fp8: the output's and the peers' (the inputs are e4m3)
    page: int | None = None       # decode: paged cache with this block size
    window: int | None = None     # window (and sinks, where given): left size (causal)
    lengths: tuple[int, ...] = ()  # varlen: each sequence's length
    dim_v: int | None = None      # mla, mla-bwd: V's head dim (else `dim`)
    causal: bool = True           # mla, mla-bwd, fp8: causal or not (the others are causal)

    def label(self) -> str:
        base = f"{self.kind} {self.dtype} B{self.batch} H{self.heads}/{self.heads_kv}"
        if self.kind == "decode":
            return (f"{base} Sq{self.seq_q} Sk{self.seq_k} D{self.dim}"
                    + (f" paged{self.page}" if self.page else ""))
        if self.kind == "varlen":
            return f"{base} total{sum(self.lengths)} max{self.seq_q} D{self.dim} causal"
        if self.kind == "fp8-varlen-bwd":
            return (f"fp8-varlen-bwd e4m3 (grads {self.dtype}) B{self.batch} "
                    f"H{self.heads}/{self.heads_kv} total{sum(self.lengths)} max{self.seq_q} "
                    f"D{self.dim} causal")
        if self.kind in ("mla", "mla-bwd"):
            return (f"{base} S{self.seq_k} D{self.dim}/{self.dim_v}"
                    + (" causal" if self.causal else ""))
        if self.kind == "fp8-decode":
            return (f"fp8-decode e4m3 (O {self.dtype}) B{self.batch} "
                    f"H{self.heads}/{self.heads_kv} Sq{self.seq_q} Sk{self.seq_k} D{self.dim}")
        if self.kind == "fp8":
            return (f"fp8 e4m3 (O {self.dtype}) B{self.batch} H{self.heads}/{self.heads_kv} "
                    f"S{self.seq_k} D{self.dim}" + (" causal" if self.causal else ""))
        if self.kind == "fp8-bwd":
            return (f"fp8-bwd e4m3 (grads {self.dtype}) B{self.batch} "
                    f"H{self.heads}/{self.heads_kv} S{self.seq_k} D{self.dim}"
                    + (" causal" if self.causal else ""))
        if self.kind == "sinks":
            return (f"{base} S{self.seq_k} D{self.dim} causal sinks"
                    + (f" window{self.window}" if self.window is not None else ""))
        return f"{base} S{self.seq_k} D{self.dim} causal window{self.window}"

    def useful_flops(self) -> float:
        """2 * (D + D_v) (4 * D where they are alike) * (query, key) pairs seen, per head; a
        backward (fp8-bwd, mla-bwd) 2.5 times its forward's, FlashAttention's convention."""
        dims = self.dim + (self.dim_v or self.dim)
        if self.kind in BACKWARDS:
            return 2.5 * replace(self, kind=BACKWARDS[self.kind]).useful_flops()
        if self.kind in ("mla", "fp8") and not self.causal:
            pairs = self.batch * self.seq_k * self.seq_k
        elif self.kind in DECODES:
            pairs = self.batch * self.seq_q * self.seq_k
        elif self.kind == "varlen":
            pairs = sum(n * (n + 1) // 2 for n in self.lengths)
        else:
            s, w = self.seq_k, self.seq_k if self.window is None else self.window
            pairs = self.batch * sum(min(i, w) + 1 for i in range(s))
        return 2.0 * dims * self.heads * pairs

    def kv_bytes(self, itemsize: int | None = None) -> int:
        """The K and V bytes a decode reads, at `itemsize` bytes a value (default: the
        problem's dtype's)."""
        return 2 * self.batch * self.heads_kv * self.seq_k * self.dim * \
            (itemsize or DTYPES[self.dtype].itemsize)


def _lengths(n: int, total: int, seed: int) -> tuple[int, ...]:
    """n sequence lengths, 64..4096, summing to about `total` (a document batch)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.rand(n, generator=g) ** 2
    lengths = (raw / raw.sum() * total).clamp(64, 4096).round().long().tolist()
    return tuple(int(x) for x in lengths)


def serving_suites() -> dict[str, list[ServingProblem]]:
    decode = [ServingProblem("decode", 32, 32, 8, sq, 8192, 128) for sq in (1, 2, 4, 16)]
    decode += [ServingProblem("decode", 32, 32, 8, 1, 8192, 128, page=256),
               ServingProblem("decode", 1, 32, 8, 1, 131072, 128)]
    lengths = _lengths(24, 32768, 0)
    return {
        "decode": decode,
        "varlen": [ServingProblem("varlen", len(lengths), 16, 16, max(lengths), max(lengths),
                                  128, lengths=lengths)],
        "window": [ServingProblem("window", 1, 32, 32, 8192, 8192, 128, window=1024)],
        # gpt-oss-120b's attention: 64 query heads over 8, D64, full and 128-key layers
        # DeepSeek's MLA prefill (heads decompressed: no GQA), beside the prefill suite's
        # D192 row (B4 H32 S4096)
        "mla": [ServingProblem(kind, 4, 32, 32, 4096, 4096, 192, dim_v=128, causal=c)
                for kind in ("mla", "mla-bwd") for c in (False, True)],
        "sinks": [ServingProblem("sinks", 1, 64, 8, 8192, 8192, 64),
                  ServingProblem("sinks", 1, 64, 8, 8192, 8192, 64, window=128)],
        # issue 34's FP8 rows: D128 at S4096 (its target), D64 and D256 beside it
        # the backward's rows (`attention_fp8_backward`, each precision, beside cuDNN's bf16
        # forward + backward): its fp32 route takes D64 and D128 (D256 a skipped row)
        # and decode on e4m3 caches, as the decode suite's first row, and the backward of
        # packed documents, as the varlen suite's row
        "fp8": [ServingProblem(kind, 4, 32, 32, 4096, 4096, d, causal=c)
                for kind in ("fp8", "fp8-bwd") for d in (64, 128, 256) for c in (False, True)]
        + [ServingProblem("fp8-decode", 32, 32, 8, 1, 8192, d) for d in (64, 128, 256)]
        + [ServingProblem("fp8-varlen-bwd", len(lengths), 16, 16, max(lengths), max(lengths),
                          128, lengths=lengths)],
        "tiny-serving": [ServingProblem("decode", 2, 4, 2, 1, 40, 16, "fp32"),
                         ServingProblem("decode", 2, 4, 2, 2, 48, 16, "fp32", page=16),
                         ServingProblem("varlen", 3, 2, 2, 9, 9, 16, "fp32",
                                        lengths=(9, 1, 5)),
                         ServingProblem("window", 1, 2, 2, 40, 40, 16, "fp32", window=7),
                         ServingProblem("sinks", 1, 4, 2, 40, 40, 16, "fp32", window=7),
                         ServingProblem("mla", 1, 2, 2, 40, 40, 24, "fp32", dim_v=16),
                         ServingProblem("mla-bwd", 1, 2, 2, 40, 40, 24, "fp32", dim_v=16),
                         ServingProblem("fp8", 1, 4, 2, 40, 40, 64, causal=True),
                         ServingProblem("fp8-bwd", 1, 4, 2, 40, 40, 64, causal=True),
                         ServingProblem("fp8-decode", 2, 4, 2, 2, 40, 64),
                         ServingProblem("fp8-varlen-bwd", 3, 4, 2, 9, 9, 64,
                                        lengths=(9, 1, 5))],
    }


# --- inputs and providers ----------------------------------------------------------------

def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def _sdpa(backend: str, q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
              "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def call():
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    return call


def _flex(q, k, v, mask_mod, enable_gqa=False):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block = create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2],
                              device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=block, enable_gqa=enable_gqa)


def _fa4(call, after=lambda out: out):
    """FlashAttention-4's call where it imports (`peers/stage-fa4.sh`), as {"fa4": call}; {}
    elsewhere. Its layout is `[B, S, H, D]` (varlen: `[total, H, D]`); `after` maps its
    output (out of out or (out, lse)) to the layout the reference check reads."""
    try:
        import flash_attn.cute as fa4
    except ImportError:
        return {}

    def first(out):
        return out[0] if isinstance(out, tuple) else out
    return {"fa4": lambda: after(first(call(fa4)))}


def _decode(p: ServingProblem, gen):
    """(providers, reference check) for a decode problem: every sequence's cache full."""
    from fusedattn.kvcache import attention_with_kvcache
    from fusedattn.reference import attention_ref

    dt = DTYPES[p.dtype]
    q = _rand((p.batch, p.heads, p.seq_q, p.dim), dt, gen)
    k, v = (_rand((p.batch, p.heads_kv, p.seq_k, p.dim), dt, gen) for _ in range(2))
    seqlens = torch.full((p.batch,), p.seq_k, dtype=torch.int32, device=DEVICE)
    cache, table = (k, v), None
    if p.page:  # the same keys, paged in a shuffled block order
        per = p.seq_k // p.page
        order = torch.randperm(p.batch * per, generator=torch.Generator().manual_seed(1))
        table = order.reshape(p.batch, per).to(torch.int32).to(DEVICE)
        paged = []
        for t in (k, v):
            pages = torch.empty((p.batch * per, p.heads_kv, p.page, p.dim), dtype=dt,
                                device=DEVICE)
            pages[table.flatten().long()] = t.reshape(p.batch, p.heads_kv, per, p.page,
                                                      p.dim).transpose(1, 2).flatten(0, 1)
            paged.append(pages)
        cache = tuple(paged)
    ours = {"fusedattn": lambda: attention_with_kvcache(
        q, *cache, cache_seqlens=seqlens, block_table=table, check_lengths=False)}
    # SDPA: queries at the end of the keys = bottom-right causal; one query sees them all.
    causal = p.seq_q > 1
    if causal:
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(p.seq_q, p.seq_k)
        kw = {"attn_mask": bias}
    else:
        kw = {}
    peers = {name: _sdpa(name, q, k, v, enable_gqa=True, **kw)
             for name in ("sdpa-cudnn", "sdpa-flash")}

    def reference(out):
        heads = [0, p.heads - 1]
        kv = [h // (p.heads // p.heads_kv) for h in heads]
        return (out[0, heads], attention_ref(q[0, heads], k[0, kv], v[0, kv], causal=causal,
                                             align="bottom-right", device=q.device))
    return {**ours, **peers}, reference


def _varlen(p: ServingProblem, gen):
    from fusedattn.reference import attention_ref
    from fusedattn.varlen import attention_varlen, offsets_of

    dt = DTYPES[p.dtype]
    total = sum(p.lengths)
    q, k, v = (_rand((total, p.heads, p.dim), dt, gen) for _ in range(3))
    cu = offsets_of(p.lengths, DEVICE)
    longest = max(p.lengths)
    ours = {"fusedattn": lambda: attention_varlen(q, k, v, cu, cu, longest, longest,
                                                  is_causal=True)}
    # the same batch padded to the longest sequence ([B, H, S, D]); padding rows ignored
    padded = []
    for t in (q, k, v):
        x = torch.zeros((len(p.lengths), p.heads, longest, p.dim), dtype=dt, device=DEVICE)
        for b, (a, n) in enumerate(zip(cu[:-1].tolist(), p.lengths, strict=True)):
            x[b, :, :n] = t[a:a + n].transpose(0, 1)
        padded.append(x)
    peers = {name: _sdpa(name, *padded, is_causal=True) for name in ("sdpa-flash",
                                                                     "sdpa-cudnn")}
    doc = torch.repeat_interleave(torch.arange(len(p.lengths), device=DEVICE),
                                  torch.tensor(p.lengths, device=DEVICE))

    def document_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    packed = [t.transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, total, D]
    peers["flex"] = lambda: _flex(*packed, document_causal)
    peers |= _fa4(lambda fa4: fa4.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
        max_seqlen_k=longest, causal=True))
    n0 = p.lengths[0]

    def unpad(name, out):  # ours and FA4's are packed [total, H, D]; the others'
        if name in ("fusedattn", "fa4"):  # are [B or 1, H, S, D]
            return out[:n0].transpose(0, 1)[[0, p.heads - 1]]
        return out[0, [0, p.heads - 1], :n0]

    def reference(out, name="fusedattn"):
        heads = [0, p.heads - 1]
        return (unpad(name, out), attention_ref(*(t[:n0].transpose(0, 1)[heads]
                                                  for t in (q, k, v)),
                                                causal=True, device=q.device))
    return {**ours, **peers}, reference


def _window(p: ServingProblem, gen):
    from fusedattn.api import attention
    from fusedattn.reference import attention_ref, visible

    dt = DTYPES[p.dtype]
    q, k, v = (_rand((p.batch, p.heads, p.seq_k, p.dim), dt, gen) for _ in range(3))
    w = p.window
    ours = {"fusedattn": lambda: attention(q, k, v, is_causal=True, window=(w, None))}

    def sliding(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= w)

    mask = visible(p.seq_k, p.seq_k, causal=True, window=(w, None), device=DEVICE)
    peers = {"flex": lambda: _flex(q, k, v, sliding),
             "sdpa-efficient": _sdpa("sdpa-efficient", q, k, v, attn_mask=mask),
             "sdpa-cudnn": _sdpa("sdpa-cudnn", q, k, v, attn_mask=mask)}
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # FA4's layout, made once
    peers |= _fa4(lambda fa4: fa4.flash_attn_func(*bshd, causal=True, window_size=(w, 0)),
                  after=lambda out: out.transpose(1, 2))

    def reference(out):
        heads = [0, p.heads - 1]
        return (out[0, heads], attention_ref(q[0, heads], k[0, heads], v[0, heads],
                                             causal=True, window=(w, None), device=q.device))
    return {**ours, **peers}, reference


def _sinks(p: ServingProblem, gen):
    from fusedattn.api import attention
    from fusedattn.reference import attention_ref

    dt = DTYPES[p.dtype]
    q = _rand((p.batch, p.heads, p.seq_k, p.dim), dt, gen)
    k, v = (_rand((p.batch, p.heads_kv, p.seq_k, p.dim), dt, gen) for _ in range(2))
    sinks = _rand((p.heads,), torch.float32, gen) * 2
    window = None if p.window is None else (p.window, None)
    ours = {"fusedattn": lambda: attention(q, k, v, is_causal=True, enable_gqa=True,
                                           window=window, sinks=sinks)}
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # FA4's layout, made once
    fa4_window = (None, None) if p.window is None else (p.window, 0)
    peers = _fa4(lambda fa4: fa4.flash_attn_func(*bshd, causal=True, window_size=fa4_window,
                                                 learnable_sink=sinks),
                 after=lambda out: out.transpose(1, 2))

    def reference(out):
        heads = [0, p.heads - 1]
        kv = [h // (p.heads // p.heads_kv) for h in heads]
        return (out[0, heads], attention_ref(q[0, heads], k[0, kv], v[0, kv], causal=True,
                                             window=window, sinks=sinks[heads],
                                             device=q.device))
    return {**ours, **peers}, reference


def _mla(p: ServingProblem, gen):
    from fusedattn.api import attention
    from fusedattn.reference import attention_ref

    dt = DTYPES[p.dtype]
    q, k = (_rand((p.batch, p.heads, p.seq_k, p.dim), dt, gen) for _ in range(2))
    v = _rand((p.batch, p.heads, p.seq_k, p.dim_v), dt, gen)
    ours = {"fusedattn": lambda: attention(q, k, v, is_causal=p.causal)}
    peers = {name: _sdpa(name, q, k, v, is_causal=p.causal)
             for name in ("sdpa-cudnn", "sdpa-flash")}
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # FA4's layout, made once
    peers |= _fa4(lambda fa4: fa4.flash_attn_func(*bshd, causal=p.causal),
                  after=lambda out: out.transpose(1, 2))

    def reference(out):
        heads = [0, p.heads - 1]
        return (out[0, heads], attention_ref(q[0, heads], k[0, heads], v[0, heads],
                                             causal=p.causal, device=q.device))
    return {**ours, **peers}, reference


def _mla_bwd(p: ServingProblem, gen):
    """(providers, reference check) for an MLA backward: each provider's forward runs once,
    at its first call, and keeps its graph; each call then returns dQ, dK and dV (the
    backward alone, which the timing sees), checked together against float64 autograd on
    two heads."""
    from fusedattn.api import attention
    from fusedattn.dispatch import use_backend
    from fusedattn.reference import attention_ref_grads

    dt = DTYPES[p.dtype]
    q, k = (_rand((p.batch, p.heads, p.seq_k, p.dim), dt, gen) for _ in range(2))
    v, dout = (_rand((p.batch, p.heads, p.seq_k, p.dim_v), dt, gen) for _ in range(2))

    def backward_of(forward, bshd=False):
        """The backward of `forward(q, k, v)` (`bshd`: FA4's [B, S, H, D] layout, its
        gradients turned back), its graph made at the first call."""
        def turn(t):
            return t.transpose(1, 2).contiguous() if bshd else t
        kept = []

        def call():
            if not kept:
                leaves = [turn(t).detach().requires_grad_() for t in (q, k, v)]
                out = forward(*leaves)
                kept.append((leaves, out[0] if isinstance(out, tuple) else out))
            leaves, out = kept[0]
            grads = torch.autograd.grad(out, leaves, turn(dout), retain_graph=True)
            return [g.transpose(1, 2) if bshd else g for g in grads]
        return call

    def ours(backend):
        def forward(*leaves):
            with use_backend(backend):
                return attention(*leaves, is_causal=p.causal)
        return forward

    providers = {"fusedattn": backward_of(ours("auto")),
                 "fusedattn-portable": backward_of(ours("portable"))}
    providers |= {name: backward_of(lambda *t, name=name: _sdpa(name, *t,
                                                                is_causal=p.causal)())
                  for name in ("sdpa-cudnn", "sdpa-flash")}
    fa4_backward = []  # (made once, at FA4's first call: its graph kept as the others')

    def fa4_call(fa4):
        if not fa4_backward:
            fa4_backward.append(backward_of(
                lambda *t: fa4.flash_attn_func(*t, causal=p.causal), bshd=True))
        return fa4_backward[0]()
    providers |= _fa4(fa4_call)
    heads = [0, p.heads - 1]
    ref = attention_ref_grads(q[0, heads], k[0, heads], v[0, heads], dout[0, heads],
                              causal=p.causal, device=q.device)

    def reference(grads):
        return (torch.cat([g[0, heads].flatten() for g in grads]),
                torch.cat([g.flatten() for g in ref]))
    return providers, reference


def _e4m3_per_head(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in e4m3 with a factor per head (heads on `axis`: -3 for `[B, H, S, D]`, -2 for
    packed `[total, H, D]`), each head's largest value mapped to 256 (e4m3's range is
    448): (x8, factors), x8 * factors standing for x."""
    from fusedattn.problem import FP8

    axis = x.dim() + axis
    factors = x.abs().amax(dim=[d for d in range(x.dim()) if d != axis]) / 256
    shape = [1] * x.dim()
    shape[axis] = -1
    return (x / factors.reshape(shape)).to(FP8), factors


def _fp8_inputs(p: ServingProblem, gen):
    """An FP8 problem's e4m3 q, k, v and their per-head factors (`_e4m3_per_head`), and the
    reference's heads: the first and the last query head with their K/V heads' values and
    factors, as `[(tensor, factors)] * 3`."""
    rows_q = p.seq_q if p.kind in DECODES else p.seq_k
    x = [_rand((p.batch, n, s, p.dim), torch.float32, gen)
         for n, s in ((p.heads, rows_q), (p.heads_kv, p.seq_k), (p.heads_kv, p.seq_k))]
    (q8, k8, v8), factors = zip(*(_e4m3_per_head(t, -3) for t in x), strict=True)
    heads = [0, p.heads - 1]
    kv = [h // (p.heads // p.heads_kv) for h in heads]
    picked = [(q8[0, heads], factors[0][heads]), (k8[0, kv], factors[1][kv]),
              (v8[0, kv], factors[2][kv])]
    return (q8, k8, v8), factors, heads, picked


def _fp8(p: ServingProblem, gen):
    """(providers, reference check, the FP8 formula's error by torch) for an FP8 problem."""
    from fusedattn.api import attention
    from fusedattn.reference import attention_ref, dequantize
    from fusedattn.tiles.dequantize import dequantize_as
    from fusedattn_lab.peers import fp8_peer

    (q8, k8, v8), factors, heads, picked = _fp8_inputs(p, gen)
    kw = dict(descale_q=factors[0], descale_k=factors[1], descale_v=factors[2])
    from fusedattn.dispatch import use_backend

    def ours_on(backend):  # the dispatch's choice (Hopper on an H200), and portable's
        def call():
            with use_backend(backend):
                return attention(q8, k8, v8, is_causal=p.causal,
                                 enable_gqa=p.heads != p.heads_kv, **kw)
        return call

    ours = {"fusedattn": ours_on("auto"), "fusedattn-portable": ours_on("portable")}
    dt = DTYPES[p.dtype]
    q, k, v = (dequantize_as(t, f, dt) for t, f in zip((q8, k8, v8), factors, strict=True))
    peers = {name: _sdpa(name, q, k, v, is_causal=p.causal,
                         enable_gqa=p.heads != p.heads_kv)
             for name in ("sdpa-cudnn", "sdpa-flash")}
    ref = attention_ref(*(dequantize(t, f) for t, f in picked), causal=p.causal,
                        device=q8.device)

    def peer_error():
        return float((fp8_peer(*(t for t, _ in picked), *(f for _, f in picked),
                               causal=p.causal).double() - ref).abs().max())

    return {**ours, **peers}, lambda out: (out[0, heads], ref), peer_error


def _fp8_decode(p: ServingProblem, gen):
    """(providers, reference check, the FP8 formula's error by torch) for decode on e4m3
    caches, every sequence full (the queries last: bottom-right)."""
    from fusedattn import configs
    from fusedattn.kvcache import attention_with_kvcache
    from fusedattn.reference import attention_ref, dequantize
    from fusedattn.tiles.dequantize import dequantize_as
    from fusedattn_lab.peers import fp8_peer

    (q8, k8, v8), factors, heads, picked = _fp8_inputs(p, gen)
    seqlens = torch.full((p.batch,), p.seq_k, dtype=torch.int32, device=DEVICE)
    q, k, v = (dequantize_as(t, f, DTYPES[p.dtype]) for t, f in
               zip((q8, k8, v8), factors, strict=True))
    kw = dict(descale_q=factors[0], descale_k=factors[1], descale_v=factors[2])
    opt_in = replace(configs.OVERRIDES, fp8_decode=True)

    def fp8dec():  # FUSEDATTN_FP8_DECODE=1 for this call alone (plans keep it in their key)
        before, configs.OVERRIDES = configs.OVERRIDES, opt_in
        try:
            return attention_with_kvcache(q8, k8, v8, cache_seqlens=seqlens,
                                          check_lengths=False, **kw)
        finally:
            configs.OVERRIDES = before

    providers = {
        "fusedattn": lambda: attention_with_kvcache(q8, k8, v8, cache_seqlens=seqlens,
                                                    check_lengths=False, **kw),
        "fusedattn-fp8dec": fp8dec,
        "fusedattn-bf16": lambda: attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                         check_lengths=False)}
    if p.seq_q == 1:  # (one query sees the whole cache: no mask for SDPA)
        providers.update({name: _sdpa(name, q, k, v, enable_gqa=True)
                          for name in ("sdpa-cudnn", "sdpa-flash")})
    causal = dict(causal=True, align="bottom-right")
    ref = attention_ref(*(dequantize(t, f) for t, f in picked), device=q8.device, **causal)

    def peer_error():
        return float((fp8_peer(*(t for t, _ in picked), *(f for _, f in picked),
                               **causal).double() - ref).abs().max())

    return providers, lambda out: (out[0, heads], ref), peer_error


def _fp8_bwd(p: ServingProblem, gen):
    """(providers, reference check, the bf16 formulas' error by torch) for the FP8
    backward: each provider gives dQ, for dO in bf16, with respect to the dequantised
    values. `fusedattn` is `attention_fp8_backward`'s default (precision "bf16"),
    `fusedattn-fp32` its fp32 route, `sdpa-cudnn` cuDNN's bf16 forward + backward on the
    dequantised values (the FP8 backward recomputes its forward too). The bound is twice
    the bf16 formulas' error (`peers.fp8_backward_peer(dtype=torch.bfloat16)`), the
    loosest of the routes'."""
    from fusedattn.fp8 import attention_fp8_backward
    from fusedattn.reference import attention_ref_grads, dequantize
    from fusedattn.tiles.dequantize import dequantize_as
    from fusedattn_lab.peers import fp8_backward_peer

    (q8, k8, v8), factors, heads, picked = _fp8_inputs(p, gen)
    dout = _rand((p.batch, p.heads, p.seq_k, p.dim), torch.bfloat16, gen)
    kw = dict(is_causal=p.causal, enable_gqa=p.heads != p.heads_kv, descale_q=factors[0],
              descale_k=factors[1], descale_v=factors[2])

    def ours(precision):
        return lambda: attention_fp8_backward(dout, q8, k8, v8, precision=precision, **kw)[0]
    leaves = [dequantize_as(t, f, torch.bfloat16).requires_grad_() for t, f in
              zip((q8, k8, v8), factors, strict=True)]
    forward = _sdpa("sdpa-cudnn", *leaves, is_causal=p.causal,
                    enable_gqa=p.heads != p.heads_kv)
    providers = {"fusedattn": ours("bf16"), "fusedattn-fp32": ours("fp32"),
                 "sdpa-cudnn": lambda: torch.autograd.grad(forward(), leaves, dout)[0]}
    ref = attention_ref_grads(*(dequantize(t, f) for t, f in picked), dout[0, heads],
                              causal=p.causal, device=q8.device)[0]

    def peer_error():
        peer = fp8_backward_peer(dout[0, heads], *(t for t, _ in picked),
                                 *(f for _, f in picked), causal=p.causal,
                                 dtype=torch.bfloat16)[0]
        return float((peer.double() - ref).abs().max())

    return providers, lambda out: (out[0, heads], ref), peer_error


def _fp8_varlen_bwd(p: ServingProblem, gen):
    """(providers, reference check, the bf16 formulas' error by torch) for the FP8
    backward of packed documents: each provider gives dQ `[total, H, D]` for dO in bf16,
    with respect to the dequantised values (factors per head). `fusedattn` and
    `fusedattn-fp32` are `attention_varlen_fp8_backward`'s routes; `fusedattn-bf16` and
    `fa4` the bf16 forward + backward of the same documents on the dequantised values.
    Checked on the first document's first and last query heads."""
    from fusedattn.fp8 import attention_varlen_fp8_backward
    from fusedattn.reference import attention_ref_grads, dequantize
    from fusedattn.tiles.dequantize import dequantize_as
    from fusedattn.varlen import attention_varlen, offsets_of
    from fusedattn_lab.peers import fp8_backward_peer

    total, longest = sum(p.lengths), max(p.lengths)
    x = [_rand((total, n, p.dim), torch.float32, gen) for n in (p.heads, p.heads_kv,
                                                                p.heads_kv)]
    (q8, k8, v8), factors = zip(*(_e4m3_per_head(t, -2) for t in x), strict=True)
    dout = _rand((total, p.heads, p.dim), torch.bfloat16, gen)
    cu = offsets_of(p.lengths, DEVICE)
    offsets = (cu, cu, longest, longest)
    kw = dict(is_causal=True, descale_q=factors[0], descale_k=factors[1],
              descale_v=factors[2])

    def ours(precision):
        return lambda: attention_varlen_fp8_backward(dout, q8, k8, v8, *offsets,
                                                     precision=precision, **kw)[0]
    leaves = [dequantize_as(t, f, torch.bfloat16, head_axis=-2).requires_grad_()
              for t, f in zip((q8, k8, v8), factors, strict=True)]

    def bf16_step(forward):
        return lambda: torch.autograd.grad(forward(*leaves), leaves, dout)[0]
    providers = {"fusedattn": ours("bf16"), "fusedattn-fp32": ours("fp32"),
                 "fusedattn-bf16": bf16_step(lambda *t: attention_varlen(
                     *t, *offsets, is_causal=True))}
    providers |= _fa4(lambda fa4: bf16_step(lambda *t: fa4.flash_attn_varlen_func(
        *t, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        causal=True)[0])())
    n0, heads = p.lengths[0], [0, p.heads - 1]
    kv = [h // (p.heads // p.heads_kv) for h in heads]
    picked = [(q8[:n0, heads], factors[0][heads]), (k8[:n0, kv], factors[1][kv]),
              (v8[:n0, kv], factors[2][kv])]
    picked = [(t.transpose(0, 1), f) for t, f in picked]  # [2, n0, D]: heads first
    dout0 = dout[:n0, heads].transpose(0, 1)
    ref = attention_ref_grads(*(dequantize(t, f) for t, f in picked), dout0, causal=True,
                              device=q8.device)[0]

    def peer_error():
        peer = fp8_backward_peer(dout0, *(t for t, _ in picked), *(f for _, f in picked),
                                 causal=True, dtype=torch.bfloat16)[0]
        return float((peer.double() - ref).abs().max())

    return providers, lambda dq: (dq[:n0, heads].transpose(0, 1), ref), peer_error


BUILDERS: dict[str, Callable] = {"decode": _decode, "varlen": _varlen, "window": _window,
                                 "sinks": _sinks, "mla": _mla, "fp8": _fp8,
                                 "fp8-bwd": _fp8_bwd, "mla-bwd": _mla_bwd,
                                 "fp8-decode": _fp8_decode, "fp8-varlen-bwd": _fp8_varlen_bwd}
# the backward kinds, each with its forward's kind (the FLOPs' convention, the row's mode)
BACKWARDS = {"fp8-bwd": "fp8", "mla-bwd": "mla", "fp8-varlen-bwd": "varlen"}
DECODES = ("decode", "fp8-decode")  # the kinds of one or a few queries over a cache
PROVIDERS = ("fusedattn", "fusedattn-portable", "fusedattn-fp32", "fusedattn-bf16",
             "fusedattn-fp8dec",
             "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "fa4")
"""Every provider a serving problem may have (each builder makes the ones that apply)."""


def run_serving(p: ServingProblem, names: list[str], *, warmup: int, repeat: int,
                seed: int = 0) -> list[dict]:
    """Verify, then time, every provider of one serving problem; rows as dicts (the bench
    CSV's columns plus `gbps`, the K/V bandwidth of decode rows)."""
    from fusedattn_lab.protocol import call_peak
    from fusedattn_lab.timing import time_gpu
    from fusedattn_lab.verify import check, needs_peer

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    # a builder may add the error that bounds its rows (fp8: the FP8 formula's by torch)
    providers, reference, *own_bound = BUILDERS[p.kind](p, gen)
    if EMULATION:  # the compiled and SDPA-backend peers need the GPU
        providers = {n: providers[n] for n in ("fusedattn", "fusedattn-fp32", "fusedattn-bf16",
                                               "fusedattn-fp8dec") if n in providers}
    unmeasured = dict.fromkeys(("max_abs_error", "tolerance", "median_ms", "min_ms", "max_ms",
                                "tflops", "peak_bytes", "call_bytes"))

    def row_of(name: str, **fields) -> dict:
        """A bench.csv row of provider `name`: `BenchRow`'s columns, then `gbps`."""
        base = vars(BenchRow(problem=p.label(), provider=name, batch=p.batch, heads=p.heads,
                             seq=p.seq_k, dim=p.dim, dtype=p.dtype, causal=p.causal,
                             precision="", mode="bwd" if p.kind in BACKWARDS else "fwd",
                             status="", reason="", **unmeasured))
        return {**base, "gbps": None, **fields}

    rows, outs = [], {}
    for name, make in providers.items():
        if name not in names:
            continue
        try:
            call = make() if name == "flex" else make
            out = call()
            if not EMULATION:
                torch.cuda.synchronize()
        except Exception as exc:  # a backend that refuses this problem: recorded
            rows.append(row_of(name, status="skipped", reason=f"{type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:160]}"))
            continue
        got, ref = reference(out, name) if p.kind == "varlen" else reference(out)
        outs[name] = (got, ref, call)
    # low precision: the bound is twice the worst peer's error (SDPA in the same dtype)
    peer_err = own_bound[0]() if own_bound else None
    if peer_err is None and needs_peer(DTYPES[p.dtype], None):
        errs = [float((g.double() - r).abs().max()) for n, (g, r, _) in outs.items()
                if n != "fusedattn"]
        peer_err = max(errs) if errs else None
    for name, (got, ref, call) in outs.items():
        result = check(got, ref, peer_error=peer_err)
        row = row_of(name, status="ok" if result.ok else "FAIL",
                     reason="; ".join(result.reasons), max_abs_error=result.max_abs,
                     tolerance=result.tolerance)
        if not EMULATION and result.ok:
            t = time_gpu(call, warmup=warmup, repeat=repeat)
            peak, call_bytes = call_peak(call)
            row.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                       tflops=p.useful_flops() / (t.median_ms * 1e-3) / 1e12,
                       peak_bytes=peak, call_bytes=call_bytes)
            if p.kind in DECODES:  # each provider's own bytes (fp8-decode: e4m3 for ours)
                itemsize = 1 if p.kind == "fp8-decode" and name in ("fusedattn",
                                                                     "fusedattn-fp8dec") \
                    else None
                row["gbps"] = p.kv_bytes(itemsize) / (t.median_ms * 1e-3) / 1e9
        rows.append(row)
    ours = next((r for r in rows if r["provider"] == "fusedattn" and r["median_ms"]), None)
    for r in rows:
        r["flash_over_this"] = (r["median_ms"] / ours["median_ms"]
                                if ours and r["median_ms"] and r is not ours else None)
    return rows

