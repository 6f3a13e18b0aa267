"""The Hopper backward's design measurements on the GPU, in one call (its correctness is the
GPU tier's, `tests/test_hopper_backward.py`; the bench rows of record are `fusedattn bench
--suite train-bf16`'s): issue 33's rows, the backward alone (one forward, its graph kept,
then `autograd.grad` timed), each provider's gradients checked against the first's:

    hopper        the Hopper backward, deterministic (the default)
    hopper-race   the same with the dQ adds racing (`attention(..., deterministic=False)`)
    hopper-*      A/Bs of `hopper.backward`'s switches (the dQ writer's: PROVIDERS)
    portable      the portable kernels (two passes)
    cudnn, fa4    SDPA's cuDNN backend; FlashAttention-4 where it imports

    python3 scripts/hopper_bwd_check.py [--out DIR] [--only A,B] [--rows all|quick|I,J]

A row is (B, H, H_kv, S, D, causal[, options]): B "varlen" for 24 packed documents, and
options `attention`'s window or softcap (cuDNN then sits out; FA4 takes them by its names),
or `dim_v`, V's head dim where it is not D (MLA's 192/128).

TFLOP/s by FlashAttention's convention (2.5x the forward's FLOPs, 2 S^2 (D + Dv) a head,
halved under causal).
Prints one line per row; writes `hopper_bwd_check.json` under --out."""

import argparse
import sys
import time

import torch
import triton

from fusedattn import attention, attention_varlen
from fusedattn.dispatch import use_backend
from fusedattn.hopper import backward as knobs
from fusedattn.varlen import offsets_of
from fusedattn_lab.evidence import REPO, environment, sha256_file, write_json
from fusedattn_lab.timing import time_gpu

ROWS = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True),
        (1, 32, 32, 16384, 128, True), (2, 32, 32, 8192, 64, True),
        (1, 32, 8, 8192, 128, True), (4, 32, 32, 4096, 64, False),
        # short rows, 16k tokens a call: where the Hopper backward starts to pay
        (16, 16, 16, 1024, 128, True), (32, 16, 16, 512, 64, False),
        (64, 16, 16, 256, 128, False),
        # issue 33's varlen row: 24 documents (`serving._lengths`, the varlen suite's
        # batch), H16 D128, causal; B is the count and S the longest
        ("varlen", 16, 16, 0, 128, True),
        # GQA causal at more programs a wave (B1 above: 512 programs on 132 SMs), where
        # `hopper.backward.order` turns from "down" to "up" (UP_MIN_WAVES)
        (2, 32, 8, 8192, 128, True), (4, 32, 8, 8192, 128, True),
        # between the short rows and S4096, where HOPPER_BWD_MIN_KEYS was 4096 at D128 and
        # 2048 at D64 before 1335Z's run retuned it; 16k-32k tokens a call
        (16, 16, 16, 1024, 128, False), (8, 16, 16, 2048, 128, False),
        (8, 16, 16, 2048, 128, True), (16, 16, 16, 1024, 64, True),
        (8, 16, 16, 2048, 64, True),
        # masks and softcaps (a 7th item: `attention`'s options; TFLOP/s of the pairs the
        # window keeps): issue 33's window row, D64's window, softcap (D64 keeps 64-row
        # steps there) and varlen rows
        (1, 32, 32, 8192, 128, True, dict(window=(1024, 0))),
        (2, 32, 32, 8192, 64, True, dict(window=(1024, 0))),
        (4, 32, 32, 4096, 64, True, dict(softcap=30.0)),
        (4, 32, 32, 4096, 128, True, dict(softcap=30.0)),
        ("varlen", 16, 16, 0, 64, True),
        # under HOPPER_BWD_MIN_KEYS (D64 512, D128 256; set against D64's 64-row steps):
        # does the Hopper backward (forced) pay from fewer keys? 16-32k tokens a call
        (64, 16, 16, 256, 64, False), (64, 16, 16, 256, 64, True),
        (128, 16, 16, 128, 128, False), (128, 16, 16, 128, 64, False),
        # head dims padded to 128 (`hopper.backward.PAD_TO`), against the portable passes:
        # long rows, then shorter ones (where does the padded kernel stop paying?)
        (4, 32, 32, 4096, 96, False), (4, 32, 32, 4096, 96, True),
        (4, 32, 32, 4096, 80, True), (4, 32, 32, 4096, 112, True),
        ("varlen", 16, 16, 0, 96, True), (8, 16, 16, 2048, 96, True),
        (16, 16, 16, 1024, 80, False), (64, 16, 16, 256, 96, False),
        (64, 16, 16, 256, 80, True),
        # D256 (64 keys a program, dK/dV split by columns, one slot) and D192 padded to it:
        # issue 33's D192 target row, then causal, GQA, varlen and shorter rows (where
        # does it stop paying? HOPPER_BWD_MIN_KEYS[256])
        (2, 16, 16, 4096, 256, False), (2, 16, 16, 4096, 256, True),
        (4, 32, 32, 4096, 192, False), (4, 32, 32, 4096, 192, True),
        (1, 32, 8, 8192, 256, True), ("varlen", 16, 16, 0, 256, True),
        (8, 16, 16, 1024, 256, True), (32, 16, 16, 512, 256, False),
        (64, 16, 16, 256, 192, False),
        # under HOPPER_BWD_MIN_KEYS[256]: S256 causal, S128 (16k tokens a call)
        (64, 16, 16, 256, 256, True), (128, 16, 16, 128, 256, False),
        (128, 16, 16, 128, 192, True),
        # V's head dim its own (issue 34): MLA's 192/128 (q and k in two pieces, v in one),
        # 128/64, causal and not, then a 192/128 GQA row
        (4, 32, 32, 4096, 192, False, dict(dim_v=128)),
        (4, 32, 32, 4096, 192, True, dict(dim_v=128)),
        (4, 32, 32, 4096, 128, False, dict(dim_v=64)),
        (4, 32, 32, 4096, 128, True, dict(dim_v=64)),
        (2, 32, 8, 8192, 192, True, dict(dim_v=128)),
        # D192 at S1024 (16k tokens a call), beside row 37's S4096: do the deterministic
        # adds cost more of a shorter program (issue 33's chain-latency question)?
        (16, 32, 32, 1024, 192, False),
        # short sliding windows (gpt-oss's 128-key layers, GQA), where the forward's Hopper
        # kernel lost to the portable one under 512 keys a row
        # (evidence/nvidia-h100/20261205T1813Z-window-paths): does the backward's too?
        (1, 64, 8, 8192, 64, True, dict(window=(128, 0))),
        (1, 32, 8, 8192, 128, True, dict(window=(128, 0))),
        (1, 32, 8, 8192, 128, True, dict(window=(256, 0))),
        (1, 32, 8, 8192, 128, True, dict(window=(512, 0)))]


def sources() -> dict:
    """sha256 of the kernels' sources behind the figures (the Hopper and portable
    backward, the forward the backward starts from)."""
    return {str(p.relative_to(REPO)): sha256_file(p) for p in sorted(
        [*REPO.glob("src/fusedattn/hopper/*.py"), REPO / "src/fusedattn/tiles/flash_bwd.py",
         REPO / "src/fusedattn/tiles/flash_bwd_kernels.py"])}


def _ours(backend, deterministic=True, **switches):
    """Our backward on `backend`, with `hopper.backward`'s A/B switches set for the call."""
    def make(q, k, v, dout, causal, packed=None, **options):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with use_backend(backend):
            if packed is not None:  # [total, H, D] and (cu_seqlens, longest)
                if not deterministic:
                    return None  # (attention_varlen has no racing option)
                cu, longest = packed
                out = attention_varlen(*leaves, cu, cu, longest, longest, is_causal=causal,
                                       **options)
            else:
                out = attention(*leaves, is_causal=causal,
                                enable_gqa=q.shape[1] != k.shape[1],
                                deterministic=deterministic, **options)

        def call():
            before = {name: getattr(knobs, name) for name in switches}
            for name, value in switches.items():
                setattr(knobs, name, value)
            try:
                return torch.autograd.grad(out, leaves, dout, retain_graph=True)
            finally:
                for name, value in before.items():
                    setattr(knobs, name, value)
        return call
    return make


def _cudnn(q, k, v, dout, causal, packed=None, **options):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if packed is not None or options:  # (SDPA has no window or softcap)
        return None
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if q.shape[1] != k.shape[1]:  # cuDNN's SDPA takes GQA as repeated heads here
        return None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _fa4(q, k, v, dout, causal, packed=None, window=None, softcap=None):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    extra = {}  # FA4's names for our options
    if window is not None:
        extra["window_size"] = window
    if softcap is not None:
        extra["softcap"] = softcap
    if packed is not None:  # FA4's packed layout is ours: [total, H, D]
        cu, longest = packed
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=longest, max_seqlen_k=longest, causal=causal,
                                     **extra)
        out = out[0] if isinstance(out, tuple) else out
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=causal, **extra)
    out = out[0] if isinstance(out, tuple) else out
    d = dout.transpose(1, 2).contiguous()

    def call():
        return [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, d,
                                                                retain_graph=True)]
    return call


PROVIDERS = {"hopper": _ours("hopper"), "hopper-race": _ours("hopper", deterministic=False),
             # A/Bs: P and dS through shared memory (S not transposed); the writer on
             # two warps; no adds (dQ wrong: the rest's time, its error not checked)
             "hopper-smem": _ours("hopper", SWAP_SDP=False),
             "hopper-w2": _ours("hopper", WRITER_WARPS=2),
             # D64 as before 2150Z: 64-row steps, the writer's atomics, LSE loaded
             "hopper-d64m64": _ours("hopper", TILES={**knobs.TILES, 64: (64, 128, 2)},
                                    DQ_TMA={**knobs.DQ_TMA, 64: False},
                                    LSE_SMEM={**knobs.LSE_SMEM, 64: False}),
             # D64 under a softcap on 128-row steps too (`SOFTCAP_TILES` emptied; the
             # compile report has them spilling 604 B: sm90-compile 2210Z)
             "hopper-softcap-m128": _ours("hopper", SOFTCAP_TILES={}),
             "hopper-nodq": _ours("hopper", deterministic=False, DQ_ADDS=False),
             # dQ added by the writer's threads' atomics at every head dim, not by one
             # TMA reduction a step (`hopper.backward.DQ_TMA`, on at both)
             "hopper-atomics": _ours("hopper", DQ_TMA=dict.fromkeys(knobs.TILES, False)),
             "hopper-race-atomics": _ours("hopper", deterministic=False,
                                          DQ_TMA=dict.fromkeys(knobs.TILES, False)),
             # LSE and delta from global memory at every head dim, not through shared
             # memory (`hopper.backward.LSE_SMEM`, on at both)
             "hopper-nolse": _ours("hopper", LSE_SMEM=dict.fromkeys(knobs.TILES, False)),
             # S transposed under masks at every head dim, or at none
             "hopper-swap-masked": _ours("hopper", SWAP_MASKED=dict.fromkeys(knobs.TILES, True)),
             "hopper-swap-unmasked": _ours("hopper", SWAP_MASKED=dict.fromkeys(knobs.TILES, False)),
             # the mask's key indices a [BLOCK_N] tensor, not constants
             # (`hopper.backward.MASK_CONSTANTS`)
             "hopper-mask-indices": _ours("hopper", MASK_CONSTANTS=False),
             # the deterministic adds' orders forced (`hopper.backward.order`)
             "hopper-down": _ours("hopper", ORDER="down"),
             # "down" with a (batch, head)'s programs launched one after another, as
             # before DOWN_ACROSS_HEADS
             "hopper-down-heads": _ours("hopper", ORDER="down", DOWN_ACROSS_HEADS=False),
             "hopper-up": _ours("hopper", ORDER="up"),
             # head by head without the last head's longest key tiles first, as before
             # `hopper.backward.FRONT_TILES` (its A/B: "hopper-down-heads" against this)
             "hopper-nofront": _ours("hopper", FRONT_TILES=0),
             "hopper-down-heads-nofront": _ours("hopper", ORDER="down",
                                                DOWN_ACROSS_HEADS=False, FRONT_TILES=0),
             "hopper-race-nofront": _ours("hopper", deterministic=False, FRONT_TILES=0),
             # other counts of the front's key tiles (16: the L2 model's pick; a launch
             # argument, nothing compiles again)
             **{f"hopper{race}-front{f}": _ours("hopper", deterministic=not race,
                                                 FRONT_TILES=f)
                for f in (8, 32) for race in ("", "-race")},
             # the same orders with racing adds (GQA across the heads: L2 misses, ncu
             # evidence 20261206T1728Z-ncu-gqa-across-heads)
             "hopper-race-up": _ours("hopper", deterministic=False, ORDER="up"),
             "hopper-race-down-heads": _ours("hopper", deterministic=False, ORDER="down",
                                             DOWN_ACROSS_HEADS=False),
             "hopper-rotated": _ours("hopper", ORDER="rotated"),
             # varlen over the longest sequence's key tiles for every sequence (most
             # programs empty where lengths differ), or over each sequence's own, at
             # every head dim (`hopper.backward.VARLEN_COMPACT`)
             "hopper-fullgrid": _ours("hopper", VARLEN_COMPACT=dict.fromkeys(knobs.TILES, False)),
             "hopper-compact": _ours("hopper", VARLEN_COMPACT=dict.fromkeys(knobs.TILES, True)),
             # the compact grid with the sequences in their own order, not longest first
             "hopper-given": _ours("hopper", VARLEN_COMPACT=dict.fromkeys(knobs.TILES, True),
                                   VARLEN_LONGEST_FIRST=False),
             # D256 with one slot of Q and dO and a whole dQ buffer, as before DQ_SPLIT,
             # its slot released once dV and dK are done (`hopper.backward.EARLY_FREE`) or
             # at the step's end
             "hopper-one-slot": _ours("hopper", TILES={**knobs.TILES, 256: (64, 64, 1)},
                                      DO_STAGES={}, DQ_SPLIT={}),
             "hopper-late-free": _ours("hopper", TILES={**knobs.TILES, 256: (64, 64, 1)},
                                       DO_STAGES={}, DQ_SPLIT={}, EARLY_FREE=False),
             # dQ's buffer back to the compute warps only once the deterministic adds'
             # writes are done, as before `hopper.backward.FREE_ON_READ`
             "hopper-free-after-adds": _ours("hopper", FREE_ON_READ=False),
             # the slot released by an arrival of its own beside dQ's hand-off at a step's
             # end, as before `hopper.backward.SLOT_BY_DQ`
             "hopper-two-arrives": _ours("hopper", SLOT_BY_DQ=False),
             # dQ's hand-off by mbarriers, as before `hopper.backward.NAMED_HANDOFF`
             "hopper-mbarrier": _ours("hopper", NAMED_HANDOFF=False),
             "hopper-race-mbarrier": _ours("hopper", deterministic=False,
                                           NAMED_HANDOFF=False),
             # D192 (and D129-D191) padded to D256's kernel, as before `PIECES`
             "hopper-pad256": _ours("hopper", PIECES={},
                                    TILES={d: t for d, t in knobs.TILES.items() if d != 192}),
             "portable": _ours("portable"), "cudnn": _cudnn, "fa4": _fa4}
UNCHECKED = ("hopper-nodq",)


# a provider whose gradients differ from the first provider's by more than this share of
# their largest magnitude computed something else: its time is no peer's figure (FA4
# 4.0.0b36's non-causal 128/64 backward differed by 460, evidence 20261204T2124Z-bwd-mla,
# where cuDNN's differed by 0.001)
WRONG_SHARE = 0.05


def disagrees(err: float, largest: float) -> bool:
    """Whether a provider's max abs difference `err` from the first provider's gradients,
    whose largest magnitude is `largest`, marks its gradients as wrong (`WRONG_SHARE`)."""
    return not err <= WRONG_SHARE * largest


def head_pairs(s: int, causal: bool, window=None) -> float:
    """The (query, key) pairs of one S x S head the FLOPs count: S^2, halved under causal
    (FA's convention), and under a window (left, right) the pairs it keeps (key j for
    query i where i - left <= j <= i + right; causal: right 0; None: unbounded)."""
    if window is None:
        return s * s / (2 if causal else 1)
    left, right = (s if w is None else w for w in window)
    if causal:
        right = 0
    i = torch.arange(s, dtype=torch.int64)
    return float(((i + right).clamp(max=s - 1) - (i - left).clamp(min=0) + 1).sum())


def bench(rows, only=()):
    results = []
    for row in rows:
        b, h, hk, s, d, causal = row[:6]
        options = dict(row[6]) if len(row) > 6 else {}
        dv = options.pop("dim_v", d)
        g = torch.Generator(device="cuda").manual_seed(1)
        packed = None
        if b == "varlen":
            from fusedattn_lab.serving import _lengths

            lengths = _lengths(24, 32768, 0)
            b, s = len(lengths), max(lengths)
            cu = offsets_of(lengths, "cuda")
            packed = (cu, s)
            shapes = ((sum(lengths), h, d), (sum(lengths), hk, d), (sum(lengths), hk, dv),
                      (sum(lengths), h, dv))
            pairs = sum(head_pairs(n, causal, options.get("window")) for n in lengths)
        else:
            shapes = ((b, h, s, d), (b, hk, s, d), (b, hk, s, dv), (b, h, s, dv))
            pairs = b * head_pairs(s, causal, options.get("window"))
        q = torch.randn(*shapes[0], device="cuda", generator=g, dtype=torch.bfloat16)
        k, v, dout = (torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
                      for shape in shapes[1:])
        flops = 2.5 * 2 * h * pairs * (d + dv)
        ref = None
        line = {}
        for name, make in PROVIDERS.items():
            if only and name not in only:
                continue
            try:
                call = make(q, k, v, dout, causal, packed, **options)
                if call is None:
                    continue
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                grads = call()
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
            except Exception as e:  # a peer that refuses the row
                line[name] = f"refused: {type(e).__name__}: {str(e)[:120]}"
                continue
            if ref is None:
                ref = [x.float() for x in grads]
                largest = max(r.abs().max().item() for r in ref)
            if name in UNCHECKED:  # dQ left out: dK and dV alone
                grads, ref_ = grads[1:], ref[1:]
            else:
                ref_ = ref
            err = max((x.float() - r).abs().max().item() for x, r in zip(grads, ref_, strict=True))
            ms = time_gpu(call, warmup=5, repeat=30)
            again = call()[1:] if name in UNCHECKED else call()
            err2 = max((x.float() - r).abs().max().item() for x, r in zip(again, ref_,
                                                                             strict=True))
            line[name] = dict(ms=ms.median_ms, spread=[ms.min_ms, ms.max_ms],
                              tflops=flops / ms.median_ms / 1e9, err=max(err, err2),
                              peak_mib=extra, wrong=disagrees(max(err, err2), largest))
            del call, grads
        results.append(dict(row=[b, h, hk, s, d, causal], varlen=packed is not None,
                            options=options, dim_v=dv, **line))
        cells = " ".join((f"{n}={v['tflops']:.0f}" + (" (WRONG gradients)" if v["wrong"]
                                                         else ""))
                         if isinstance(v, dict) else f"{n}=-" for n, v in line.items())
        print(f"{'varlen ' if packed else ''}B{b} H{h}/{hk} S{s} D{d}"
              f"{f'/{dv}' if dv != d else ''} causal={causal}"
              f"{' ' + str(options) if options else ''}: "
              f"{cells}", flush=True)
        for n, v in line.items():
            if not isinstance(v, dict):
                print(f"  {n}: {v}")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="", help="providers, comma-separated")
    ap.add_argument("--rows", default="all", help="all, quick (the first two) or indices "
                    "into ROWS, comma-separated")
    args = ap.parse_args()
    t0 = time.time()
    rows = {"all": ROWS, "quick": ROWS[:2]}.get(args.rows) or [
        ROWS[int(i)] for i in args.rows.split(",")]
    results = bench(rows, only=tuple(filter(None, args.only.split(","))))
    write_json(f"{args.out}/hopper_bwd_check.json", dict(
        bench=results, environment=environment(), command=" ".join(sys.argv),
        sources=sources(), seconds=time.time() - t0, triton=triton.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
