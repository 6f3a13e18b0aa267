"""Launch the Hopper backward (`backward_kernel.py`) on validated `[B, H, S, D]` tensors.

`tiles.flash_bwd.flash_backward` runs it where `dispatch.backward_path` says so, after the
portable preprocess (delta = rowsum(dO * O) - dLSE): one launch for dK, dV and dQ, dQ
summed in an fp32 accumulator that `flash_backward` then casts into dQ. Tiles per head dim
(`TILES`): BLOCK_M query rows a step, BLOCK_N keys a program, STAGES slots of Q and dO.
Shared memory: STAGES * 2 * BLOCK_M * D * 2 bytes of Q and dO, 2 * BLOCK_N * D * 2 of K and
V, 2 * BLOCK_M * BLOCK_N * 2 of P and dS (dS alone with S transposed), DQ_BUFS * BLOCK_M *
D * 4 of dQ, and with LSE_SMEM 2 * STAGES * BLOCK_M * 4 of LSE and delta (D128: 225 KB,
209 KB with S transposed; D64's 128-row steps 226 KB and 194 KB; D256 209 KB)."""

from __future__ import annotations

import functools

import triton

from fusedattn.hopper.forward import _descriptor, _sm_count

# q's head dim (v's its own, at most as wide: `kernel_dims`) -> (BLOCK_M, BLOCK_N,
# STAGES). D64 takes 128 query rows a step (half the steps, so half the barriers and adds
# a key tile): with the TMA adds and LSE rows below, +8 to +24% over 64-row steps in every
# D64 row, the gradients bit-identical (evidence nvidia-h200/20261202T2150Z-bwd-d64-m128;
# with the atomics and LSE from global memory, 0831Z, it had lost 7% under causal masks,
# and ptxas spills 196 B where S is transposed without the LSE rows)
# D256 takes 64 keys a program, each compute warpgroup half of dK's and dV's columns (64
# fp32 registers a thread each, as D128's 128 keys: `backward_kernel._steps`). One slot of
# Q and dO with a whole dQ buffer is 32 KB each of Q, dO, K and V, 16 KB of P and dS and
# 64 KB of dQ, 209 KB (evidence/sm90-compile/20261203T2235Z-bwd-d256; on the H200 its
# loads waited: 2249Z's ncu). So D256 hands dQ over in two halves of 128 columns through a
# 32 KB buffer (`DQ_SPLIT`), which leaves room for a second slot of Q, with dO in a ring of
# one slot of its own (`DO_STAGES`): 208 KB
TILES = {
    64: (128, 128, 2),
    128: (64, 128, 2),
    192: (64, 64, 2),
    256: (64, 64, 2),
}
# head dims the kernel takes in two pieces of columns (Gluon's tensors take power-of-two
# shapes): D192 as 128 + 64, each piece its own descriptors, buffers and accumulators
# (`backward_kernel`'s D2), 64 keys a program as D256. Its tiles are 24 KB, so two slots
# of Q and dO fit: 96 KB of them, 48 KB of K and V, 16 KB of P and dS, 48 KB of one dQ
# buffer, 209 KB (D192 ran padded to D256 before: a third more products, one slot)
PIECES = {192: (128, 64)}
# head dims between the kernel's run padded to the next, as the forward's
# (`forward.kernel_pair`): D65 to D127 as D128, D129 to D191 as D192, D193 to D255 as
# D256. The descriptors keep the tensors' own shapes, so the TMA boxes read zeros past the
# last column (S, dP and every product are exact: the extra columns of dQ, dK and dV are
# zeros) and the stores and dQ's TMA adds stop there. The padding costs its share of the
# products (D96 runs D128's, D160 D192's); `dispatch.HOPPER_BWD_MIN_KEYS` holds the
# portable backward where it wins.
# Needs dQ's TMA adds (the writer's atomics address D columns).
PAD_FROM = 64  # (a head dim under it, or past the last of TILES, runs portable)
# under a softcap, per head dim where it differs (`tiles`): D64 keeps 64-row steps. Its
# 128-row steps compile to a key loop of 2837 instructions with 604 B spilled (not
# transposed; 1408 B transposed), against 1241 and none for 64-row steps (CPU compile
# report, evidence sm90-compile/20261202T2210Z-bwd-d64). Timed since (evidence
# nvidia-h200/20261202T2303Z-bwd-window-softcap-rows): 219 TFLOP/s against 119
SOFTCAP_TILES = {64: (64, 128, 2)}
WRITER_REGS = 24
WRITER_WARPS = 4  # the dQ writer's warps (`backward_kernel._dq_writer`)
# (the loader's work is in the writer's warpgroup: 3 warpgroups, not 4, so that the
# compute warpgroups get 240 registers; with 4, 232: too few for P and dS as register
# operands at D128, where ptxas serialises the wgmmas. The loader warp apart, the A/B
# switch MERGED, was dropped after fe18d37.)
# per head dim, dQ's shared buffers between the compute warps and the writer (D192, D256:
# one, their shared memory, above)
DQ_BUFS = {64: 2, 128: 2, 192: 1, 256: 1}
# per head dim where they differ from STAGES: dO's slots, in a ring of its own (released
# once dV is done, Q's once dK is), and dQ's parts a step, each handed over and added
# apart (`backward_kernel._steps`, `_dq_writer`): D256's second slot of Q (above)
DO_STAGES = {256: 1}
DQ_SPLIT = {256: 2}
DQ_ADDS = True  # False leaves dQ out (wrong dQ): A/Bs alone, to time the rest
# per head dim, the writer adds a step's dQ by one TMA reduction
# (`backward_kernel._tma_add`), not by its threads' atomics (64 a thread a step at D128):
# at D128 +1.6 to +5.8% in every row, at D64's former 64-row steps -5.7 to -0.4%
# (evidence nvidia-h200/20261202T2031Z-bwd-dq-tma); D64's 128-row steps take it with the
# LSE rows (2150Z, above)
DQ_TMA = {64: True, 128: True, 192: True, 256: True}
# per head dim, each step's LSE (base 2) and delta go into shared memory by the writer's
# warps (the loader's work) with its Q and dO, and the compute warps read them
# there, not from global memory at the step's start; not where S is transposed and the
# adds are deterministic (`lse_in_shared`). At D128 against global loads (evidence
# 2049Z): masked rows +2.6 to +5.8%, racing unmasked 551 TFLOP/s (499 without, in 2031Z's
# call), deterministic unmasked -7% at S4096 (-2.4% S2048, +2% S1024, +4% S256); at D64's
# former 64-row steps (the writer's atomics) -3 to -19% (2042Z), with the TMA adds -2.5 to
# +2.2% (2049Z); D64's 128-row steps need them (2150Z)
LSE_SMEM = {64: True, 128: True, 192: True, 256: True}
# per head dim, LSE_SMEM also where S is transposed with no mask under deterministic adds
# (`lse_in_shared`): at D128 it lost 7% there (S4096, evidence 2049Z); D64's 128-row
# steps without it spill 196 B and run at 0.47x (210 TFLOP/s against 443, 2150Z)
LSE_SWAP_DETERMINISTIC = {64: True, 128: False, 192: False, 256: False}
# S^T and dP^T (FA3's swapAB): P and dS the register operands of dV and dK, where the mask
# bounds no key (or SWAP_MASKED) and there is no softcap. Measured at 8cba653 (evidence
# 0813Z): D128 S4096 +4.7%, D64 +1%; under causal masks -19 to -34% (ptxas spills 136
# bytes at D128 causal, against 28), so those keep P and dS in shared memory. Not with 64
# keys a program (D256: S^T's rows are the keys, two warpgroups take 128 at least)
SWAP_SDP = True
# per head dim, S^T under masks too (not under a softcap), where LSE_SMEM is on. D64 (its
# 128-row steps): +10 to +13% on its three causal rows (evidence 2158Z), the gradients
# bit-identical. D128: no gain (-2.4% S4096 causal, -5.1% S16384, evidence 2146Z),
# though the CPU compile report has its causal key loop at 527 instructions and no spills
# against 599 and 52 bytes (sm90-compile/20261202T2140Z-bwd-dq-tma-lse)
SWAP_MASKED = {64: True, 128: False, 192: False, 256: False}
# the deterministic adds' order (`backward_kernel`'s docstring; `order` below): None picks
# by the rule, "down", "up" or "rotated" force one (A/Bs; "rotated" only where it is safe)
ORDER = None
# "up" (causal) launches a head's shortest programs first: with few programs a wave the
# longest ones form a tail, so it needs this many programs an SM (B4 H32 S4096 causal,
# 4096 programs on 132 SMs: 1.25x "down"; evidence 1151Z, 1202Z)
UP_MIN_WAVES = 8
# "up" and "rotated" spread a head's programs over its query tiles where "down" keeps them
# on one: past this many bytes of Q and dO a K/V head (its GQA group's), "down" won (GQA
# 32/8 S8192 D128 causal, 16 MiB: "up" 0.84-0.86x at 1024-2048 programs; at 2 and 8 MiB
# "up" and "rotated" won). The cause is L2 reuse, not a tail: on B4 GQA 32/8 S8192 "up" hit
# L2 47% of the time against 96% and read 17.5x the DRAM bytes, with the SMs 94% active
# under both (evidence/nvidia-h200/20261202T1504Z-train-host-bwd-order)
SPREAD_MAX_BYTES = 8 << 20
# "down" launches key tile 0 of every (batch, K/V head), then key tile 1 of every one, ...
# (`backward_kernel.DOWN_ACROSS`) where programs are few, fewer than ACROSS_MAX_WAVES an
# SM; else, or with this False, a (batch, head)'s programs one after another. Under a
# causal mask a list schedule of B1 H32/8 S8192 D128's 512 programs on 132 SMs ends 1.23x
# its perfect share head by head (the last head's longest program starts last), 1.00x
# across; B2 1.11x, B4 1.05x (`scripts/bwd_order_model.py --makespan`). Measured (evidence
# 2302Z, twice each): B1 440/446 TFLOP/s against 387/385 (+15%), B2 447/448 against
# 429/428 (+4.5%), but B4 427/432 against 449/451 (-4.5%): past the tail's gain, spreading
# a wave over every head costs about 10%: L2 (ncu on an H100, B2 GQA 32/8 S8192 causal,
# evidence 20261206T1728Z-ncu-gqa-across-heads: across, L2 hit 68% and 9.2 GB of DRAM
# traffic, no tail; head by head 96% and 0.95 GB, the SMs idle 12% at the end). Racing
# adds (`deterministic=False`) never go across: on an H100 (evidence
# 20261206T1712Z-bwd-adds-cost-gqa-orders) racing B2 ran at 381 TFLOP/s across against
# 507 head by head, B1 463 both ways, B4 (head by head either way) 502-506; deterministic
# B1 gains from across (415 against 383) and keeps the rule above. Since FRONT_TILES (below)
# head by head beats across from B2 (H100, evidence 20261206T2025Z-bwd-front: B2 448-449
# against 403-412 across; B1 403-405 against 415-418), across only below 4 waves
DOWN_ACROSS_HEADS = True
ACROSS_MAX_WAVES = 4
# "down" head by head launches the last (batch, K/V head)'s first FRONT_TILES key tiles (its
# longest under a causal mask) first, then the rest head by head, so that no head's
# longest program starts last (the tail above) while each head's programs still start
# together and walk its query tiles in step (L2). Across the heads a head's programs do,
# but every head's at once miss L2; the last pairs alone across each other
# (`notes/patches/bwd-across-tail.patch`) started them apart and lost 5-28% on an H100
# (evidence 20261206T1953Z-bwd-across-tail-ab). On a model of L2 (`scripts/bwd_l2_model.py`,
# evidence cpu/20261206T2040Z-bwd-l2-model) 16 keep its hit rate at 96.6% and end GQA 32/8
# S8192 causal 5.6% / 3.2% / 1.7% sooner at B1 / B2 / B4. Measured on an H100 (evidence
# 20261206T2025Z-bwd-front, two calls): racing B1 485-488 against 458-459, B2 525 against
# 510-515, B4 509 against 505-509; deterministic head by head B1 403-405 against 385, B2
# 448-449 against 436, B4 463-470 against 455-458. 0: head by head alone
FRONT_TILES = 16
# dQ's fp32 accumulator and the counters zeroed by the preprocess (`flash_bwd.
# _preprocess_launch`), where False fills them by two `torch.zeros` of their own (as before
# 05db7dd): two launches fewer a backward (the host's cost, issue 31)
ZERO_IN_PREPROCESS = True
# per head dim, varlen launches each sequence's own key tiles x K/V heads, sequence by
# sequence (`backward_kernel._key_tile`'s COMPACT; at most `varlen_programs`), where False
# launches the longest sequence's key tiles for every sequence, most of them empty when
# the lengths differ (issue 33's row: 24 documents of 64-3848 tokens, 744 programs a head,
# 268 with keys). The adds' order is the same either way, so are the gradients' bits.
# Measured on that row, H16, causal, twice each: in the sequences' order (evidence
# 20261203T0058Z-bwd-varlen-compact) D128 2.42 ms against 2.50 (+3.4%), D64 1.68 against
# 1.65 (-1.6%); longest first (VARLEN_LONGEST_FIRST, 0124Z) D128 347-349 TFLOP/s against
# 325 (+7%), D64 250-252 against 246-248 (+1.6%). An empty program costs about 90 ns of an
# SM, so the full grid's 7,616 empties a head are not where the varlen row's gap to FA4 is
VARLEN_COMPACT = {64: True, 128: True, 192: True, 256: True}
# the compact grid takes the sequences most keys first (the preprocess sorts them, up to
# `flash_bwd_kernels.SORT_MAX_DOCS`; more keep their own order), so that no long
# sequence's longest program starts in the launch's last wave: a list schedule of the
# 24-document row's programs on 132 SMs ends 1.05x its perfect share in the documents'
# order, 1.003-1.004x longest first (`scripts/bwd_order_model.py --varlen`, evidence/cpu/
# 20261203T0400Z-bwd-order-model-varlen); measured (evidence
# 20261203T0124Z-bwd-varlen-longest-first) +3.4% at D128 (347 against 335-337 TFLOP/s),
# +3.7% at D64 (250-252 against 241-243). False: their order
VARLEN_LONGEST_FIRST = True
# a tile's mask compares its bounds, less the lane's offset, with constants in a [R, N / 8,
# 4, 2] view of the accumulator (`backward_kernel._masked_p`, as the forward's
# `MASK_FORM`), where False builds the key indices as a [BLOCK_N] tensor. The sm90 compile
# report: D128 causal spills 52/52 -> 28/28 B, its loop's local-memory operations 14 -> 10
# (evidence/sm90-compile/20261203T0935Z-bwd-mask-constants) (A/B)
MASK_CONSTANTS = True
# with one slot of Q and dO (D256 before DQ_SPLIT), the compute warps release it once dV
# and dK are done, not at the step's end, and the writer loads the next step's Q and dO
# then, under the step's dQ product and hand-off, before it waits for the step's dQ
# (`backward_kernel._steps`; +2.5 to +6% on four of seven rows, 2249Z). DQ_SPLIT's rings
# always release early (A/B)
EARLY_FREE = True
# under deterministic TMA adds, the writer gives dQ's buffer back to the compute warps once
# its reduction has read it (`tma.store_wait`), and waits for the reduction's writes
# (`_bulk_wait`) only before it counts; before, the buffer waited for the writes too, and
# with one dQ buffer (D192, D256) the compute warps' next hand-off waited with it: at D192
# the deterministic adds cost 18-21% against racing ones (evidence/nvidia-h200/
# 20261204T1943Z-bwd-d192-adds). On: D192 +8%, causal +11%, D128 and D256 within spread,
# the same bits (1954Z) (A/B)
FREE_ON_READ = True
# where the slot is released at the step's end (not EARLY_FREE, dQ in one part), the loader
# takes it as free once it has the step's dQ, which the compute warps hand over after
# their last read of the slot: one arrival at a step's end, not two. Triton 3.6 lowers each
# single-thread `mbarrier.arrive` to a barrier of the compute partition and one thread's
# arrive, and the second of those barriers ordered nothing (the D128 step's SASS: four
# `BAR.SYNC`s a step, three with this: evidence/sm90-compile/20261206T1220Z-bwd-slot-by-dq).
# On an H100, the same gradients, TFLOP/s on / off (evidence/nvidia-h100/
# 20261206T1332Z-bwd-slot-by-dq-fp8-early-q-free): D64 449 / 435, D192 causal 289 / 286 (both
# spreads apart), S16384 causal 525 / 488 (wide), D128 489 / 487, D64 causal 413 / 416 (A/B)
SLOT_BY_DQ = True
# with SLOT_BY_DQ, dQ's hand-off between the compute warps and the writer by hardware named
# barriers (`backward_kernel._named_barrier`, FA4's form): the compute warps wait at "free"
# (which lines the 8 warps up for the step's end as well) and arrive at "ready" without a
# wait, where Triton lowers each single-thread `mbarrier.arrive` to a barrier of the 8
# warps and one thread's arrive: one 256-thread barrier and one mbarrier wait fewer a step
# (evidence/sm90-compile/20261206T1500Z-bwd-named-handoff). On an H100, the same gradients,
# TFLOP/s on / off (evidence/nvidia-h100/20261206T1612Z-named-handoff-fp8-d256-ab): D64
# 460 / 447 (spreads apart), D128 495 / 484, D128 causal 442 / 446, D192 316 / 317, D64
# causal S8192 419 / 421 (inside the spreads) (A/B)
NAMED_HANDOFF = True


def switches() -> tuple:
    """The A/B switches above as they stand: part of the backward's plan key (a plan
    replays the kernel it recorded); the tables live, as `forward.switches`' are."""
    return (WRITER_WARPS, DQ_BUFS, DQ_ADDS, DQ_TMA, LSE_SMEM, LSE_SWAP_DETERMINISTIC,
            SWAP_SDP, SWAP_MASKED, ORDER, UP_MIN_WAVES, SPREAD_MAX_BYTES, DOWN_ACROSS_HEADS,
            ACROSS_MAX_WAVES, FRONT_TILES, ZERO_IN_PREPROCESS, VARLEN_COMPACT,
            VARLEN_LONGEST_FIRST, MASK_CONSTANTS, TILES, SOFTCAP_TILES, EARLY_FREE, PIECES,
            DO_STAGES, DQ_SPLIT, FREE_ON_READ, SLOT_BY_DQ, NAMED_HANDOFF)


def order(tiles_n: int, programs: int, left: int, right: int, sms: int,
          spread_bytes: int) -> str:
    """The deterministic adds' order for a launch of `programs` programs of `tiles_n` key
    tiles a (batch, K/V head) on `sms` SMs, `spread_bytes` of Q and dO a K/V head
    (`backward_kernel`'s docstring has why):

    - a right bound (causal): "up", each key tile a step ahead of the one below it at
      every query tile, where there are UP_MIN_WAVES programs an SM;
    - no bound: "rotated", every program starting on its own query tile, where a head's
      key tiles all fit on the SMs at once (a program may wait on one launched after
      it);
    - else, or past SPREAD_MAX_BYTES, "down" (a left bound alone: its mirror image, each
      key tile ends lower).

    `ORDER` forces one, but "rotated" only where it can run (every program meets every
    query tile, and a head's key tiles fit on the SMs)."""
    rotated = left < 0 and right < 0 and tiles_n <= sms
    if ORDER is not None and (ORDER != "rotated" or rotated):
        return ORDER
    if spread_bytes > SPREAD_MAX_BYTES:
        return "down"
    if right >= 0:
        return "up" if programs >= UP_MIN_WAVES * sms else "down"
    return "rotated" if rotated else "down"


def named_threads(slot_by_dq: bool) -> int:
    """The kernel's DQ_NAMED: the threads of each named barrier of dQ's hand-off (the
    compute warps' 256 and the writer's), where `NAMED_HANDOFF` takes it (with SLOT_BY_DQ
    only); 0, the hand-off by mbarriers, elsewhere."""
    return 256 + 32 * WRITER_WARPS if NAMED_HANDOFF and slot_by_dq else 0


def down_across(programs: int, sms: int, deterministic: bool = True) -> bool:
    """Whether "down" launches across the heads (`DOWN_ACROSS_HEADS`): deterministic adds
    only, where there are fewer than ACROSS_MAX_WAVES programs an SM (racing adds lost more
    to across's L2 misses than they gained from its tail: the comment above)."""
    return DOWN_ACROSS_HEADS and deterministic and programs < ACROSS_MAX_WAVES * sms


@functools.cache
def tma_reduce_available() -> bool:
    """Whether this Triton's Gluon builder has the TMA reduction `backward_kernel._tma_add`
    calls (Triton 3.6 has the op but no Gluon function for it); without it dQ is added by
    the writer's atomics at every head dim."""
    try:
        from triton._C.libtriton import gluon_ir, ir
    except ImportError:
        return False
    return (hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
            and hasattr(ir, "DESCRIPTOR_REDUCE_KIND"))


def tma_adds(dim: int) -> bool:
    """Whether the writer adds dQ by TMA reductions (`DQ_TMA`, where this Triton has them):
    then dQ's accumulator may take any layout its descriptor can (q's), else it must be
    contiguous (the atomics' addresses). `dim` as q's (`kernel_dim`'s table)."""
    return DQ_TMA[kernel_dim(dim)] and tma_reduce_available()


def lse_in_shared(dim: int, unmasked_swap: bool, deterministic: bool) -> bool:
    """Whether a launch takes LSE and delta through shared memory (`LSE_SMEM`): at D128
    not with S transposed and no mask (`unmasked_swap`) under deterministic adds, where it
    lost 7% (a step's start then waits on the writer's last adds, its rows coming after
    them; `LSE_SWAP_DETERMINISTIC`)."""
    dim = kernel_dim(dim)
    return LSE_SMEM[dim] and (LSE_SWAP_DETERMINISTIC[dim]
                              or not (unmasked_swap and deterministic))


def kernel_dim(dim: int) -> int | None:
    """The kernel's head dim (its tiles' width, the key of every per-head-dim table here)
    for a head dim of q, k and v: itself in `TILES`, the next of them for one between
    PAD_FROM and the last (padded), else None (the portable backward's)."""
    if dim in TILES:
        return dim
    return next((d for d in sorted(TILES) if d > dim), None) if dim > PAD_FROM else None


def kernel_dims(dim: int, dim_v: int) -> tuple[int, int] | None:
    """The kernel's head dims (q and k's, v's: `kernel_dim` of each) for q/k's head dim
    `dim` and v's `dim_v`, or None where the kernel cannot take the pair (the portable
    backward's). V's may be its own (MLA's 192/128, 128/64: dP's products, dV's
    accumulators and V's and dO's tiles take its width, `backward_kernel._steps`), up to
    q's: the tiles, the register budget and the shared memory are sized by q's head dim,
    and V is in two pieces only as q is (D192's: V's 192 beside q's 192 alone)."""
    kdim, kdim_v = kernel_dim(dim), kernel_dim(dim_v)
    if kdim is None or kdim_v is None or kdim_v > kdim:
        return None
    if kdim_v != kdim and kdim_v in PIECES:
        return None
    return kdim, kdim_v


def padded_refusal(dim: int) -> str | None:
    """Why a padded head dim cannot take the kernel here (None where it can): its extra
    columns are dropped by the TMA adds, which the writer's atomics do not do."""
    kdim = kernel_dim(dim)
    if kdim not in (None, dim) and not tma_adds(dim):
        return (f"head dim {dim} runs padded to {kdim} only where dQ is added by TMA "
                "reductions (DQ_TMA on, and a Triton with them)")
    if kdim in PIECES and not tma_adds(dim):  # (the writer's atomics take one piece)
        return (f"head dim {dim} runs in pieces of {PIECES[kdim]} columns only where dQ is "
                "added by TMA reductions (DQ_TMA on, and a Triton with them)")
    return None


def tiles(dim: int, softcap: bool) -> tuple:
    """(BLOCK_M, BLOCK_N, STAGES) for a head dim (`kernel_dim`'s), with or without a
    softcap."""
    dim = kernel_dim(dim)
    return SOFTCAP_TILES.get(dim, TILES[dim]) if softcap else TILES[dim]


def counters(batch: int, heads: int, seq_q: int, dim: int, softcap: bool = False,
             varlen=None) -> int:
    """How many int32s the launch's counters buffer holds: a counter (zeros) per (batch,
    head, query tile) for the deterministic adds; varlen: batch the sequences, seq_q the
    longest, and on the compact grid the sequences' order after the counters (one int
    each, `sequence_order`)."""
    order = batch if compact(varlen, dim) else 0
    return batch * heads * triton.cdiv(seq_q, tiles(dim, softcap)[0]) + order


def compact(varlen, dim: int) -> bool:
    """Whether a (varlen) launch takes the compact grid (`VARLEN_COMPACT`)."""
    return varlen is not None and VARLEN_COMPACT[kernel_dim(dim)]


def sequence_order(varlen, dim: int):
    """The preprocess's part in the compact grid: (cu_k, the sequences' count, whether to
    sort them: `VARLEN_LONGEST_FIRST` up to SORT_MAX_DOCS) for it to write the order the
    grid takes them in after the counters; None without the compact grid."""
    from fusedattn.tiles.flash_bwd_kernels import SORT_MAX_DOCS

    if not compact(varlen, dim):
        return None
    return (varlen.cu_k, varlen.batch,
            int(VARLEN_LONGEST_FIRST and varlen.batch <= SORT_MAX_DOCS.value))


def varlen_programs(total_k: int, batch: int, block_n: int) -> int:
    """An upper bound on the key tiles of `batch` sequences of `total_k` keys in all, each
    sequence's counted apart (the sum of ceil(len / block_n) is at most this): the compact
    varlen grid's programs a K/V head, known without reading the lengths."""
    return (total_k + batch * (block_n - 1)) // block_n


def hopper_backward_launch(dout, q, k, v, lse, delta, dq_acc, sem, dk, dv, *, scale, mask,
                           deterministic: bool = True, varlen=None):
    """The Gluon kernel's launch as (kernel, grid, args, keyword args), for
    `flash_backward` to run (and record): `dq_acc` the fp32 zeros shaped as q (any layout
    with TMA adds, `tma_adds`; contiguous with atomics) it adds dQ into, scaled; `sem`
    `counters(...)` int32 zeros (both zeroed by the preprocess launched before it,
    `flash_bwd._preprocess_launch`). dO, like q, k and v, must be TMA-ready
    (`dispatch._tma_ready`). `deterministic`: the dQ adds in key-tile order
    (`backward_kernel`: the same bits every run); False races them (fp32 atomics in any
    order: faster, bits may differ by run). `varlen` (`tiles.common.Varlen`): the packed
    `[1, H, total, D]` views of its sequences."""
    from fusedattn.hopper import backward_kernel as kernel

    rows_b, heads, rows_q, dim = q.shape
    heads_kv, dim_v = k.shape[1], v.shape[-1]
    if varlen is not None:
        batch, seq_q, seq_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
        cu_q, cu_k = varlen.cu_q, varlen.cu_k
    else:
        batch, seq_q, seq_k = rows_b, rows_q, k.shape[2]
        cu_q = cu_k = sem  # unused pointers
    qk_scale, cap, left, right = mask.kernel_args(scale)
    why = padded_refusal(dim)
    if why is not None:
        raise ValueError(why)
    dims = kernel_dims(dim, dim_v)  # (the tiles' widths: the next of TILES where padded)
    if dims is None:
        raise ValueError(f"head dims {dim} (q, k) and {dim_v} (v): not a pair the kernel "
                         "takes (`kernel_dims`)")
    kdim, kdim_v = dims
    block_m, block_n, stages = tiles(dim, cap > 0)
    unmasked = left < 0 and right < 0
    swap = (SWAP_SDP and block_n >= 128 and cap == 0
            and (unmasked or (SWAP_MASKED[kdim] and LSE_SMEM[kdim])))
    first, second = PIECES.get(kdim, (kdim, 0))
    first_v, second_v = PIECES.get(kdim_v, (kdim_v, 0))  # (V's, dO's and dV's pieces)
    split = DQ_SPLIT.get(kdim, 1)  # (dQ's accumulator in blocks of its parts' width)
    # (tensor, rows of a block, its first piece's columns, its second's), in the kernel's
    # order of the descriptors
    operands = ((q, block_m, first, second), (k, block_n, first, second),
                (v, block_n, first_v, second_v), (dout, block_m, first_v, second_v),
                (dk, block_n, first, second), (dv, block_n, first_v, second_v),
                (dq_acc, block_m, first // split, second))
    descs = [_descriptor(t, rows, width) for t, rows, width, _ in operands]
    # the second piece's (columns `first` on), in the kernel's order of *2_desc; None
    # where there is none (V's, where V's head dim is one piece beside Q's two)
    descs2 = [_descriptor(t, rows, width) if width else None for t, rows, _, width in operands]
    tiles_n = triton.cdiv(seq_k, block_n)
    tiles_m = triton.cdiv(seq_q, block_m)
    if not tma_adds(dim) and not dq_acc.is_contiguous():
        raise ValueError("dQ's accumulator must be contiguous where the writer adds by "
                         "atomics (DQ_TMA off, or no TMA reduction in this Triton)")
    grid_compact = compact(varlen, dim)
    need = counters(batch, heads, seq_q, dim, cap > 0, varlen)
    if sem.numel() < need:  # (the adds' counters, one a query tile, and the order's)
        raise ValueError(f"{sem.numel()} counters for {need} (query tiles and sequences): "
                         f"size them by counters(..., softcap={cap > 0}, varlen=)")
    if grid_compact:  # `n_tiles_n` is then the sequences' count (`backward_kernel._key_tile`)
        grid = (max(varlen_programs(k.shape[2], batch, block_n), 1) * heads_kv,)
    else:
        grid = (tiles_n * batch * heads_kv,)
    sms = _sm_count(q.device)
    how = order(tiles_n, grid[0], left, right, sms,
                spread_bytes=(heads // heads_kv) * seq_q * (dim + dim_v) * q.element_size())
    # (the compact grid has no across-the-heads launch: its heads' tiles differ in count)
    across = down_across(grid[0], sms, deterministic) and not grid_compact
    early_free = not swap and ((EARLY_FREE and stages == 1) or split > 1)
    slot_by_dq = SLOT_BY_DQ and not early_free and split == 1
    code = {"down": kernel.DOWN_ACROSS if across else kernel.DOWN,
            "up": kernel.UP, "rotated": kernel.ROTATED}[how].value
    if how == "down" and not across and varlen is None and min(tiles_n, batch * heads_kv) > 1:
        code += 4 * min(FRONT_TILES, tiles_n)  # the last head's longest key tiles first
    args = (*descs[:6], dk, dv, lse, delta, dq_acc, descs[6], sem, cu_q, cu_k, dk.stride(1),
            dk.stride(2), dv.stride(1), dv.stride(2), lse.stride(0), lse.stride(1),
            batch if grid_compact else tiles_n,
            tiles_m, heads_kv, heads // heads_kv, seq_q, seq_k, rows_q, dim, scale, qk_scale,
            cap, left, right, code, *descs2, dim_v)
    kwargs = dict(D=first, D2=second, DV=first_v, DV2=second_v, BLOCK_M=block_m,
                  BLOCK_N=block_n, STAGES=stages,
                  HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, BOTTOM_RIGHT=mask.bottom_right,
                  SOFTCAP=cap > 0, DETERMINISTIC=deterministic,
                  WRITER_REGS=WRITER_REGS, WRITER_WARPS=WRITER_WARPS, DQ_BUFS=DQ_BUFS[kdim],
                  DQ_ADDS=DQ_ADDS, DQ_TMA=tma_adds(dim),
                  LSE_SMEM=lse_in_shared(dim, swap and unmasked, deterministic), SWAP_SDP=swap,
                  GQA=heads != heads_kv, VARLEN=varlen is not None, COMPACT=grid_compact,
                  MASK_CONSTANTS=MASK_CONSTANTS,
                  EARLY_FREE=early_free, DO_STAGES=DO_STAGES.get(kdim, stages), DQ_SPLIT=split,
                  FREE_ON_READ=FREE_ON_READ,
                  SLOT_BY_DQ=slot_by_dq,
                  DQ_NAMED=named_threads(slot_by_dq),
                  num_warps=8)
    return kernel._flash_bwd_sm90, grid, args, kwargs
