"""Launch the Hopper forward (`forward_kernel.py`) on validated `[B, H, S, D]` tensors.

Q, K and V reach the kernel as TMA descriptors over their own strides (4-D: batch, head,
row, head dim), so `[B, S, H, D]` views need no copy. The grid is persistent (one program per
SM walks the work items: query tiles x batch x heads), except under a plain causal mask,
where each item is a program of its own. Tiles per pair of head dims (`TILES`): two
consumer warpgroups (three where `WARPGROUPS` says) of BLOCK_M = 64 rows each, BLOCK_N keys
per step, STAGES slots of K and V in shared memory, within the 227 KB an SM gives one
program."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton

from fusedattn.launch import Recording
from fusedattn.tiles.common import FP8_P_SCALE

# (Q/K head dim, V head dim) -> (D_A, D_B, DV_A, DV_B, BLOCK_M per warpgroup, BLOCK_N,
# STAGES): each head dim in one or two power-of-two pieces (TMA boxes and Gluon's tensors
# are powers of two; 80 = 64 + 16, 96 = 64 + 32 and 192 = 128 + 64 take two wgmmas per
# product instead of padding to 96, 128 and 256). Shared memory is 2 * BLOCK_M * D * 2
# bytes of Q plus STAGES * BLOCK_N * (D + Dv) * 2 of K and V. V's head dim may be less
# than Q's (DeepSeek's MLA: 192 and 128; 128 and 64), each of its pieces no wider than
# Q's: O goes out through Q's shared tiles
TILES = {
    (64, 64): (64, 0, 64, 0, 64, 128, 4),
    (80, 80): (64, 16, 64, 16, 64, 128, 4),
    (96, 96): (64, 32, 64, 32, 64, 128, 3),
    (128, 128): (128, 0, 128, 0, 64, 128, 3),
    (192, 192): (128, 64, 128, 64, 64, 64, 3),
    (256, 256): (256, 0, 256, 0, 64, 64, 2),
    # 192/128: 128-key steps, two stages (FA4's tile there; 213,456 bytes, no spills:
    # evidence/sm90-compile/20261204T2215Z-fa4-vs-ours-forward-loops). H100 A/B at
    # c2c2874 (evidence/nvidia-h100/20261205T1548Z-mla-128-keys): 593 -> 718 TFLOP/s
    # non-causal, 541 -> 614 causal; without turns 704 and 614, so the turns stay.
    (192, 128): (128, 64, 128, 0, 64, 128, 2),
    (128, 64): (128, 0, 64, 0, 64, 128, 3),
}
# Entries that replace `TILES`' on the persistent grid (every launch but a plain causal
# mask's, `hopper_forward`), where an item's consumers take two Q slots in turn: D128 at two
# stages has room for two (`q_slots`), so the next item's Q and first keys load while this
# one runs, which three stages' 224 KB kept it from. On an H100, the same bits, TFLOP/s
# three stages / two (evidence/nvidia-h100/20261206T0549Z-short-row-tiles): B64 H16 S256
# 301 / 349, S1024 551 / 615, S2048 640 / 674, B4 H32 S4096 641 / 651 (an earlier round
# 648 / 637), varlen 536 / 565. D192 at two 64-key stages: S256 336 / 341, S1024 572 / 594,
# S2048 616 / 622, S4096 613 / 612 (within the rounds' spread: not taken). A plain causal
# mask's launches (one program an item, Q slots unused) keep three stages: S4096 584 / 558
# and 550 in one process
PERSISTENT_TILES = {
    (128, 128): (128, 0, 128, 0, 64, 128, 2),
}
# Entries that replace `TILES`' (and `PERSISTENT_TILES`') where a launch runs three consumer
# warpgroups (`WARPGROUPS`), as FA3 runs head dims 65-96 and FA4 ran D80 (192-row tiles).
# At three's 160 registers a thread their 128-key steps spill and serialise the wgmmas
# (D80: 96 B and C7512); 64-key steps fit with none, the key loop 411 (D80) and 427 (D96)
# instructions a step against 673 and 680 for two warpgroups' 128 keys (sm90 compile report,
# evidence/sm90-compile/20261207T2050Z-d80-d96-three-warpgroups). Used only where `WARPGROUPS` names
# the pair, which it does not: on an H100 three warpgroups with these entries lost to two on
# all twelve pairs, both orders (D80 -2.6 to -7.7%, D96 -4.8 to -12.3%; evidence/nvidia-h100/
# 20261207T2202Z-d80-d96-three-warpgroups-ab). Kept as the A/B switch
THREE_TILES = {
    (80, 80): (64, 16, 64, 16, 64, 64, 6),
    (96, 96): (64, 32, 64, 32, 64, 64, 5),
}
# FP8 (float8 e4m3 q, k, v): one head-dim piece each, V's tiles V^T's [Dv, BLOCK_N] boxes
# (`transpose.py`). Shared memory: Q's 2 * BLOCK_M * D bytes, STAGES * BLOCK_N * 2 * D of K
# and V^T, and O's bfloat16 staging, 2 * BLOCK_M * D * 2 (it cannot go through Q's tiles)
FP8_TILES = {
    (64, 64): (64, 0, 64, 0, 64, 128, 4),
    (128, 128): (128, 0, 128, 0, 64, 128, 4),
    # D256: 128-key steps, two stages (FA3's step there). H100 fp8check at 6160a49
    # (evidence/nvidia-h100/20261205T1554Z-fp8check): 959 -> 1206 TFLOP/s non-causal,
    # 834 -> 961 causal, where 64-key steps at three or four stages gave 959-980; at
    # 642ec2b (20261205T1805Z-fp8check) 937 -> 1129 and 846 -> 957
    (256, 256): (256, 0, 256, 0, 64, 128, 2),
}
# the head dims the kernel's pieces make; one over 64 between them runs padded to the next.
# 80 = 64 + 16: padded to 96 before, D80 ran 6.6-7.5% slower in one process, every round
# (evidence/nvidia-h200/20261203T1419Z-d80-lse-ahead-ab, 20261203T1435Z-d80-ab-again); the
# sm90 compile report has it spill nothing, its key loop 673 instructions against D96's
# 681 (A/B: without 80, D65-80 run as 96)
KERNEL_DIMS = (64, 80, 96, 128, 192, 256)


def _padded(dim: int) -> int:
    return dim if dim <= 64 else next((d for d in KERNEL_DIMS if d >= dim), dim)


def kernel_pair(dim: int, dim_v: int, fp8: bool = False) -> tuple[int, int] | None:
    """The pair of `TILES` (`FP8_TILES` under fp8: exact pairs only) that serves head dims
    (dim, dim_v), or None. A head dim over 64 that the kernel's pieces do not make runs
    padded up to the next of `KERNEL_DIMS` (D72 as D80, D112 as D128, D200 as D256): the
    descriptors keep the tensors' own shapes, so the TMA boxes read zeros past the last
    column (the scores and P V are exact) and the stores stop there. Padding costs its
    share of the products (D112 runs D128's), which the portable kernel's rate at these dims
    leaves room for: D112 ran 403 TFLOP/s portable and 564 padded (bench-prefill 042422Z).
    The constexprs are the padded pair's; O's head dim enters as an int (`dim_v`), so a
    head dim that is not a multiple of 16 (D200) compiles apart, the same code."""
    if fp8:
        return (dim, dim_v) if (dim, dim_v) in FP8_TILES else None
    pair = (_padded(dim), _padded(dim_v))
    return pair if pair in TILES else None


# consumer warpgroups per pair (2 where not listed). Three (192-row items, as FA3 and FA4
# run D64) fit at 160 registers a thread (3 x 128 x 160 + 32 x 24 <= 64K) at D64, causal
# spilling 312 bytes on its diagonal tiles, D96 and softcap spilling more
# (`scripts/gluon_compile_report.py`). On the H200 three ran D64 at 485 against 411 TFLOP/s
# and causal 436 against 393 (evidence/nvidia-h200/20261202T0453Z-hopper-ab; the A/B of
# 0412Z had replayed one plan, `switches`); other head dims are not measured. Only where
# Sq (varlen: the longest) is at least WARPGROUPS_MIN_ROWS: a short one wastes more of a
# 192-row item (B64 S256: 158 against 205)
WARPGROUPS: dict[tuple[int, int], int] = {(64, 64): 3}
# FP8's (float8 e4m3), where no mask bounds the keys: three at D64 compile at 160
# registers without spilling in the key loop; at D128 they serialise the wgmmas
# (`scripts/gluon_compile_report.py`, evidence/sm90-compile/20261202T1700Z-fp8-d64-3wg). On
# the H200 three ran FP8 D64 at 565 TFLOP/s against 478, but causal at 344 against 404
# (evidence/nvidia-h200/20261202T1700Z-fp8-3wg-ab; the diagonal tiles' path spills 88
# bytes at three, why it lost is not profiled), so masked FP8 runs two (A/B)
FP8_WARPGROUPS: dict[tuple[int, int], int] = {(64, 64): 3}
WARPGROUPS_MIN_ROWS = 2048
# Where a causal mask or a window bounds a dense call's keys, three only from this many
# query rows: a causal item's diagonal steps and its one-program-an-item grid weigh more in
# 192-row items. On an H100, D64 H16 causal, the same bits, TFLOP/s three / two consumer
# warpgroups (evidence/nvidia-h100/20261206T0549Z-short-row-tiles): B8 S2048 268 / 301 (and
# 268 / 299 in another call), B4 S4096 347 / 358 (357 / 355), B2 H32 S8192 450 / 414 (three
# again in another call: 450, 453)
WARPGROUPS_MIN_ROWS_BOUNDED = 8192
# Varlen's causal calls: three from this many rows in the longest document. Before the
# claims and DOC_ROWS they kept WARPGROUPS_MIN_ROWS (the varlen suite's 24 documents, the
# longest 3848 rows, ran 286 with three against 276 with two); since, on an H100 at 9fed27c,
# the same bits, TFLOP/s with 2048 / 4096 here (evidence/nvidia-h100/20261206T1013Z-varlen-
# warpgroups): that row 322 / 328, 16k tokens of 1024-2048-row documents 247 / 279, of
# 2048-4096 362 / 362 (three either way). Non-causal varlen keeps WARPGROUPS_MIN_ROWS
# (not measured)
WARPGROUPS_MIN_ROWS_VARLEN_BOUNDED = 4096
# Under a window of fewer keys a row than this, two consumer warpgroups: three lost at every
# window measured, where a row's window holds up to 1025 keys (H100, D64 H64/8 S8192 causal:
# 1025 keys 0.503 ms against 0.430 with two, 513 keys 0.345 against 0.293, 129 keys 0.306
# against 0.220; evidence/nvidia-h100/20261205T1813Z-window-paths, ab2.jsonl), while under a plain
# causal mask (4096 keys a row on average at S8192) three won. Between them, on an H200
# (evidence/nvidia-h200/20261205T1913Z-window-paths): two and three within 1.3% from 1025 to
# 2049 keys a row, three 2.3% ahead at 4097
WARPGROUPS_MIN_SPAN = 2048
LOADER_REGS = 24
CONSUMER_REGS = {2: 240, 3: 160}  # registers a consumer thread, by consumer warpgroups
PINGPONG = True  # the consumers' explicit turns (`forward_kernel`); False for A/Bs
# whether a launch that claims its items (causal on the persistent grid, `claims`) at two
# consumer warpgroups takes turns too (`takes_turns`), by its kind: "dense" (16-bit),
# "varlen" (16-bit), "fp8" (dense or varlen). Dense, on an H100 at
# 632f0d3, the same bits, TFLOP/s with turns / without (evidence/nvidia-h100/
# 20261207T0807Z-pingpong-shared-kv-ring-ab): D192 causal 549 / 560, 548 / 566, 547 / 554;
# D128 causal 609 / 619, 575 / 615; MLA 192/128 causal 622 / 632, each inside its rounds'
# 5-10% spread; where turns won (D64 causal at three warpgroups 488 / 468, unmasked D96
# 560 / 544) they stay. Again at 5c8e236 with this switch, both orders, one process each
# (evidence/nvidia-h100/20261207T0834Z-turns-by-launch-d256-pieces-ab): D192 causal 559 /
# 573, 560 / 583; D128 causal 625 / 637, 593 / 604; MLA causal 632 / 643, 599 / 635; the
# unmasked control (not claimed) 591 / 591, 587 / 580. Varlen's and FP8's at c22c3d5, turns
# / none, both orders (evidence/nvidia-h100/20261207T0856Z-claimed-turns-varlen-fp8): varlen
# D128 causal 524 / 523, 525 / 522; varlen D64 causal 346 / 347, 348 / 346 (even); FP8 D128
# causal 739 / 755, 744 / 756 (none ahead); FP8 D64 causal 475 / 468, 474 / 467 (turns
# ahead; both FP8 rows' rounds apart in the second order): split by head dim, so a kind may
# take an entry of its own per kernel head dim, (kind, dim), over the kind's (A/B). FP8
# D128's entry at 8432765, with / without turns, both orders (evidence/nvidia-h100/
# 20261207T1449Z-fp8-claimed-turns-by-dim): 741 / 758, 747 / 757
CLAIMED_TURNS = {"dense": False, "varlen": True, "fp8": True, ("fp8", 128): False}
SHARED_KV = False  # K and V of a slot on one mbarrier, freed together (A/B)
# each consumer thread arrives on a freed slot by itself (`forward_kernel._release`), where
# False has one thread arrive behind a bar.sync of its warpgroup. False ran faster in 25 of
# 30 hopper_check rows over three runs (D128 +2 to +10% in each; D96 and D192 within noise
# either way: evidence/nvidia-h200/20261202T0446Z-hopper-ab, 0453Z, 0508Z): the warps'
# lining up at each release pays (A/B)
THREAD_ARRIVES = False
# the row sums kept per lane through the key loop, their shuffles once at the end
# (`forward_kernel._lane_sums`, as FA4's softmax defers its row sum's all-reduce). Faster
# in 10 of 10 hopper_check rows at 892cb05 and 7 of 10 in the other order at 5e881fb,
# about +2%, each row within a run's noise alone (evidence/nvidia-h200/
# 20261202T0616Z-hopper-ab, 20261202T0626Z-ab) (A/B)
LANE_SUM = True
# varlen under a plain causal mask launches one program per item too (the dense causal
# rule below), where False keeps the persistent grid. ncu of the varlen row at f8dfd10
# (24 documents of 64-3848 tokens, H16 D128): the SMs were active 88% of the kernel's
# cycles against FA4's 98%, the persistent grid's fixed shares ending apart
# (evidence/nvidia-h200/20261202T1348Z-ncu-varlen-vs-fa4). Over max_seqlen's tiles for
# every document, one program per item lost 10% at D128 and gained 5% at D64
# (evidence/nvidia-h200/20261202T1354Z-varlen-grid-ab): most of its programs were empty.
# Items now go document by document over the documents' own tiles (`forward_kernel.
# _document`, FA4's varlen grid), at most one empty item a document and head (A/B)
VARLEN_DYNAMIC = True
# the row max of a tile folded in MAX_SPLIT chains a thread (`forward_kernel._row_max`), not
# one: the same FMNMXs, a critical path of 7 dependent ones a row at BLOCK_N 128 against 32.
# The ncu source view of the FP8 forward at D128 put 17% of the key loops' samples on the
# row max, after P's conversion (30%) and the exp2s with the sums (22%)
# (evidence/nvidia-h200/20261202T1629Z-ncusrc-fp8, `ncu_source_summary --key-loops`).
# In one process it changed nothing measurable: ten bf16 rows within -0.7% to +4.1% of one
# chain, FP8 within 1.5% (evidence/nvidia-h200/20261202T1646Z-fp8-pack-ab) (A/B; 1 is the
# kernel as before)
MAX_SPLIT = 4
# FP8's P made e4m3 by `forward_kernel._e4m3x4` (two cvt.rn.satfinite.e4m3x2.f32 a packed
# register) at its use, its scale P_SCALE folded into the exponent, where False multiplies p
# by P_SCALE and takes Triton's `.to` at the step's end: the compile report's key loop at
# D128 went from 902 instructions to 677 (bf16's: 667), 85 PRMTs, 64 LOP3s, 32 SHFs and 64
# FMULs fewer (evidence/sm90-compile/20261202T1638Z-fp8-pack), and every FP8 row ran 7-26%
# faster in one process, D128 793 against 665 TFLOP/s (evidence/nvidia-h200/
# 20261202T1646Z-fp8-pack-ab) (A/B)
FP8_PACK = True
# how `forward_kernel._softmax_tile` masks a tile a bound cuts: 0 compares a [BLOCK_N]
# tensor of key indices (32 registers a thread, held across the key loop) with the bounds;
# 1 compares the bounds, less the lane's offset, with constants in `_lane_sums`' [M,
# BLOCK_N / 8, 4, 2] view (`_masked`); 2 is 1 with the row max taken once after the branch,
# not once in each of its arms. The sm90 compile report (evidence/sm90-compile/
# 20261203T0910Z-mask-constants): at 1, D64 causal (three warpgroups) spills 336/424 -> 80/80
# B and its key loop loses 5 STL + 5 LDL, D128 causal's spills 8/16 -> 0, every key loop
# 9-51 instructions shorter; 2 shortens them by 43-81 more (A/B: 0 is the kernel as before).
# In one process on the H200 (evidence/nvidia-h200/20261203T1112Z-mask-form-ab, 3 rounds),
# against 0: D64 causal +4% (2) and +2% (1) in every round, varlen D64 causal +7% (2) and
# +9% (1); D128 causal, S16384 causal, GQA, the window and varlen D128 within the rounds'
# spread; but D128 without a mask -6% (2) and -3% (1) in every round, though its loop is
# 110 instructions shorter at 2. So MASK_FORM serves launches where a causal or window
# bound cuts tiles, and MASK_FORM_EDGE those where only the keys' end can (A/B)
MASK_FORM = 2
MASK_FORM_EDGE = 0
# Q slots an item's consumers take in turn (`forward_kernel._loader`), up to this many where
# the shared memory holds them (`q_slots`): with two, the next item's Q (and its first keys)
# loads while the consumers run this one; with one the loader waits at every item's end for
# the consumers to store O through Q's tiles, and an item's first products wait for its
# loads, a cost per item that short rows pay most (A/B: 1 is the kernel as before). On an
# H100, the same bits (evidence/nvidia-h100/20261206T0453Z-q-slots, TFLOP/s, one slot / two):
# D64 S256 208 / 274, S1024 361 / 403, D96 S512 367 / 428; at S4096 D64 516 / 514, D96
# 541 / 547, D80 515 / 502. D128's three stages leave no room (224 KB with one slot):
# on the persistent grid it runs two (`PERSISTENT_TILES`)
Q_SLOTS = 2
SHARED_BYTES = 232448  # what an sm90 block may take (227 KB), the kernel's whole allocation
# beside the buffers: Triton's own scratch (layout conversions, reductions). The sm90 compile
# report put D128's three stages at 229,840 bytes, 328 over its buffers and barriers
SCRATCH_BYTES = 1024
# Causal calls of fewer query rows than this take the persistent grid with fixed shares
# (items p, p + programs, ...: no claims), not CAUSAL_CLAIMS' grid or one program per item
# (A/B; 0: never). Before the claims, on an H100
# (evidence/nvidia-h100/20261206T0453Z-q-slots, TFLOP/s, one program an item against
# persistent): D64 S256 89 / 98 and S1024 228 / 238 (two Q slots), but S8192 453 / 424, and
# D128 (one slot) S256 141 / 134, S1024 354 / 317. Where it gained, the portable kernel,
# which serves those rows under "auto" (`dispatch.HOPPER_MIN_KEYS`), ran faster still
# (S256 150, S1024 257), so it stays off
CAUSAL_PERSISTENT_ROWS = 0
# causal items the longest first across a section of heads (`lpt_section`), where False
# takes a head's tiles together, the longest first (A/B: False is the kernel's order before).
# A section holds as many kv heads' K and V as the L2 (at most LPT_L2_BYTES) takes, a power
# of two of them, and their query heads (FA4's Hopper order, `SingleTileLPTScheduler`).
# With one program an item, on an H100 (evidence/nvidia-h100/20261206T0652Z-lpt-order, the
# same bits): +2-6% on long causal rows (GQA B1 H32/8 S8192 645 / 607 TFLOP/s), at FA4's
# 50 MB -3-5% on short D128 rows (B16 S1024 337 / 349), which 8 MB brings within 1% (350)
LPT_SECTIONS = True
LPT_L2_BYTES = 8 * 1024 * 1024
# causal launches on the persistent grid, each program claiming its next item from a counter
# of the launch's plan when it starts an item (FA3's dynamic scheduler), where False gives
# one program an item (the hardware hands them out as SMs free up; A/B). Claims keep the
# longest-first order and balance the SMs as that grid does, and a program's next Q and
# first keys load under its current item (two Q slots), which one program an item cannot.
# The counter is the plan's own (`claim_counter`), and a plan is one stream's
# (`dispatch.plan_context`): launches that share a counter run one after another. Under a
# CUDA graph's capture the launch takes one program an item (a replay of the graph on
# another stream could overlap another's). On an H100, the same bits, TFLOP/s claims / one
# program an item (evidence/nvidia-h100/20261206T0703Z-causal-claims): B4 H32 S4096 D128
# 613 / 596, B1 H32 S16384 674 / 622, GQA 670 / 651, B2 H32 S8192 D64 503 / 484, D80 469 /
# 432, B16 S1024 D128 409 / 351, B64 S256 D128 168 / 132
CAUSAL_CLAIMS = True
# varlen's causal launches claim their items too (the documents' items in their order, an
# empty item claimed past), where False gives them one program an item (A/B). On an H100,
# the same bits, TFLOP/s claims / one program an item (evidence/nvidia-h100/
# 20261206T0810Z-varlen-claims): 24 documents of 30.8k tokens, H16 causal, D128 492 / 427,
# D64 304 / 284
VARLEN_CLAIMS = True
# a varlen launch's loader hands the consumers each live item and its document (its bounds,
# `forward_kernel._publish`) with the item's Q, as a claiming launch hands its items; False
# has each consumer warpgroup walk the items itself and find each document again by
# `_doc_bounds`' global loads once the item's Q is in, latency between an item's Q and its
# first product (A/B)
DOC_ROWS = True
# a varlen launch stores each O tile whose rows all lie in its sequence by a TMA store, as a
# dense launch stores every tile, and only a sequence's last, ragged tile by masked stores
# from registers (the tile read back out of shared memory), where False stores every varlen
# tile that way (A/B)
VARLEN_TMA_STORE = True
# with two Q slots, where O goes out by TMA stores (dense, or varlen under VARLEN_TMA_STORE),
# a consumer releases an item's Q slot under the next item's first product (FA3's epilogue:
# its TMA store is waited for before the next store, not at once), where False waits at the
# item's end for the store to read O out of the slot's tiles before it releases it (A/B).
# FP8's O goes out through tiles of its own, not Q's: there it is kept where the launch
# claims its items (causal) only (`releases_late`)
LATE_Q_FREE = True
# FP8 with one Q slot (D256; O goes out through tiles of its own, not Q's): a consumer
# releases the item's Q slot once its last product of Q is done, before the item's epilogue,
# so the loader's next Q load overlaps the epilogue; the O store is waited for only before
# the next item writes its tile. Where two slots fit (late or at the item's end) it lost
# 2.6-3.6% (A/B 1332Z); at D256 on an H100, the same bits: 1140 against 1111 TFLOP/s,
# causal 964 against 921 (evidence/nvidia-h100/20261206T1612Z-named-handoff-fp8-d256-ab) (A/B)
FP8_EARLY_Q_FREE = True
# head-dim pairs (`TILES`' keys) whose S products take Q from registers (wgmma's register
# operand, read from Q's tiles once an item) instead of shared memory: "all" of Q, the
# "first" of its two pieces (where `tile_entry` gives two), or all of Q where the launch
# does not claim its items ("unclaimed": the claimed causal launches spilled with it,
# sm90 compile report). A wgmma with both operands in shared memory reads A (Q's 64 x 16)
# and B (N keys x 16) an instruction: at N = 64 (D192's and D256's 64-key steps), by a
# count of bytes and clocks (not measured), 4 KB per 32 tensor clocks, the 128 bytes a clock
# an SM's shared memory gives, before the TMA writes and P V's reads of V. From registers,
# S's products read K alone. It costs Q's registers a thread for the whole
# item (D192: 48; D256's 64 spill, its first 128 columns' 32 do not) (A/B). On an H100,
# the same bits (evidence/nvidia-h100/20261207T0639Z-q-registers-ab): D192 B4 H32 S4096
# +4.7 to +5.9% in three runs, S1024 +2.8 to +3.3%; its claimed causal launch -4.2% with
# "all" (it spills); MLA's 192/128, D128, D96 and D80 inside their spreads
Q_REGISTERS: dict = {(192, 192): "unclaimed"}
# the same for FP8 launches (`FP8_TILES`' keys; one piece). sm90 compile report: D128 and
# D64 keep no spills with it; D256 spills, and D128's claimed causal launch spills 188 bytes
# against 32 without (A/B). On an H100 (0639Z, the same bits): D128 -3.8 and -4.0% (rounds
# apart), D64 and D64 causal even: empty
FP8_Q_REGISTERS: dict = {}


def q_registers(pair: tuple[int, int], entry: tuple[int, ...], fp8: bool, consumers: int,
                claim: bool) -> int:
    """The pieces of Q (0, 1 or 2; kernel constexpr Q_REGS) whose S products take it from
    registers (`Q_REGISTERS`, under fp8 `FP8_Q_REGISTERS`) for the tile `entry`
    (`tile_entry`'s), at two consumer warpgroups (at three, 160 registers a thread, D64's
    kernel spills and ptxas serialises its wgmmas: sm90 compile report); `claim`: whether
    the launch claims its items."""
    which = (FP8_Q_REGISTERS if fp8 else Q_REGISTERS).get(pair) if consumers == 2 else None
    pieces = 2 if entry[1] > 0 else 1  # (D_B: Q in two pieces)
    if which == "all" or (which == "unclaimed" and not claim):
        return pieces
    return int(which == "first" and pieces == 2)


_AS_CAPTURED = threading.local()


def capturing() -> bool:
    """Whether this thread's launches take a CUDA graph capture's form (one program an item,
    no claims): the current stream is capturing, or `as_captured` holds. The plan context
    (`dispatch.plan_context`) reads it too, so a plan of one form never serves the other."""
    return getattr(_AS_CAPTURED, "on", False) or torch._C._cuda_isCurrentStreamCapturing()


@contextlib.contextmanager
def as_captured():
    """Within it, this thread's launches take a capture's form with no capture, so that
    `fusedattn.warmup` compiles (and `scripts/prebuild.py` ships) the kernels a causal
    call's first CUDA-graph capture would otherwise compile then."""
    before = getattr(_AS_CAPTURED, "on", False)
    _AS_CAPTURED.on = True
    try:
        yield
    finally:
        _AS_CAPTURED.on = before


def claims(mask, varlen) -> bool:
    """Whether a causal launch for `mask` (`tiles.common.Mask`; `varlen` None for a dense
    call) claims its items on the persistent grid (`CAUSAL_CLAIMS`, `VARLEN_CLAIMS`): a
    causal right edge (causal, or a window (None, 0)) with no left one. The one rule: the
    launch (`hopper_forward`, which also gives a launch under a CUDA graph's capture one
    program an item) and the dispatch's thresholds (`dispatch.HOPPER_MIN_KEYS_CLAIMED`,
    `HOPPER_MIN_KEYS_VARLEN`) read it."""
    _, _, left, right = mask.kernel_args(1.0)
    return claims_edges(left, right, varlen)


def claims_edges(left: int, right: int, varlen) -> bool:
    """`claims` for the mask's edges as `Mask.kernel_args` gives them (a launch has them
    already)."""
    return (right == 0 and left < 0 and CAUSAL_CLAIMS
            and (varlen is None or (VARLEN_DYNAMIC and VARLEN_CLAIMS)))


def switches() -> tuple:
    """The A/B switches above as they stand: part of the forward's plan key
    (`dispatch.forward`), so that a plan recorded under one setting does not replay under
    another (before 2026-12-02 the key held PINGPONG and SHARED_KV only, so the A/Bs of
    THREAD_ARRIVES and WARPGROUPS in `scripts/hopper_check.py` replayed the default's
    plan: evidence/nvidia-h200/20261202T0412Z-hopper-ab measured one kernel twice). The
    tables are the live dicts (taking them costs a call nothing): a kept plan compares
    them with its copies (`launch.KeptPlan`), a plan key takes their items
    (`launch.hashable`), so a table changed in place counts as changed."""
    return (PINGPONG, CLAIMED_TURNS, SHARED_KV, THREAD_ARRIVES, WARPGROUPS, FP8_WARPGROUPS,
            WARPGROUPS_MIN_ROWS, WARPGROUPS_MIN_ROWS_BOUNDED, WARPGROUPS_MIN_ROWS_VARLEN_BOUNDED,
            WARPGROUPS_MIN_SPAN, LANE_SUM,
            VARLEN_DYNAMIC, MAX_SPLIT, FP8_PACK, MASK_FORM, MASK_FORM_EDGE, KERNEL_DIMS, TILES,
            FP8_TILES, Q_SLOTS, CAUSAL_PERSISTENT_ROWS, PERSISTENT_TILES, THREE_TILES,
            LPT_SECTIONS,
            LPT_L2_BYTES, CAUSAL_CLAIMS, VARLEN_CLAIMS, DOC_ROWS, VARLEN_TMA_STORE,
            LATE_Q_FREE, FP8_EARLY_Q_FREE, Q_REGISTERS, FP8_Q_REGISTERS)


def tile_entry(pair: tuple[int, int], fp8: bool, persistent: bool,
               consumers: int = 2) -> tuple[int, ...]:
    """The tile of head dims `pair` (`kernel_pair`'s): `FP8_TILES`' under fp8, else
    `THREE_TILES`' at three consumer warpgroups where it has one, else `PERSISTENT_TILES`'
    on the persistent grid where it has one, else `TILES`'."""
    if fp8:
        return FP8_TILES[pair]
    return ((consumers == 3 and THREE_TILES.get(pair))
            or (persistent and PERSISTENT_TILES.get(pair)) or TILES[pair])


def q_slots(tile: tuple[int, ...], consumers: int, fp8: bool) -> int:
    """Q slots for a `TILES` (`FP8_TILES`) entry at `consumers` warpgroups: `Q_SLOTS` where
    the kernel's buffers (Q's slots, the K and V ring, FP8's O tiles, the barriers) fit
    `SHARED_BYTES`, else fewer. D128's three stages (224 KB with one slot) keep one, its two
    (`PERSISTENT_TILES`) take two."""
    d_a, d_b, dv_a, dv_b, block_m, block_n, stages = tile
    size = 1 if fp8 else 2
    ring = stages * block_n * (d_a + d_b + dv_a + dv_b) * size
    o_tiles = consumers * block_m * dv_a * 2 if fp8 else 0
    barriers = 8 * (4 * stages + 2 * Q_SLOTS + 3) + SCRATCH_BYTES
    q_tile = consumers * block_m * (d_a + d_b) * size
    fits = (SHARED_BYTES - ring - o_tiles - barriers) // q_tile
    return max(1, min(Q_SLOTS, fits))


def releases_late(slots: int, fp8: bool, claim: bool, varlen: bool) -> bool:
    """Whether a launch's consumers give each item's Q slot back under the next item's first
    product (`LATE_Q_FREE`): with two slots, where O goes out by TMA stores (dense, or varlen
    under `VARLEN_TMA_STORE`). FP8 launches only where they claim their items: on an H100 in
    one process, the same bits, TFLOP/s late / at the item's end (evidence/nvidia-h100/
    20261206T1127Z-late-q-free-fp8): B4 H32 S4096 D128 815 / 844, D64 538 / 572, D128 causal
    744 / 724, D64 causal 476 / 480. FP8's O goes out through tiles of its own, not the Q
    slot's, so there the late release moves only the wait for O's store; why that costs the
    non-causal launches is not profiled."""
    return (LATE_Q_FREE and slots == 2 and (not varlen or VARLEN_TMA_STORE)
            and (not fp8 or claim))


def takes_turns(claim: bool, consumers: int, fp8: bool, varlen: bool, dim: int) -> bool:
    """Whether a launch's consumer warpgroups take turns to issue (kernel constexpr
    PINGPONG): `PINGPONG`, and for a launch that claims its items at two consumer
    warpgroups also `CLAIMED_TURNS` of its kind ("fp8" for any FP8 launch, varlen too,
    else "varlen" or "dense") at its kernel head dim `dim` (q's) where the table has that
    entry, else of its kind."""
    if claim and consumers == 2:
        kind = "fp8" if fp8 else "varlen" if varlen else "dense"
        return PINGPONG and CLAIMED_TURNS.get((kind, dim), CLAIMED_TURNS[kind])
    return PINGPONG


def releases_early(slots: int, fp8: bool) -> bool:
    """Whether a consumer gives an item's Q slot back once its last product of Q is done
    (kernel constexpr EARLY_FREE): FP8 only, whose O goes out through tiles of its own, and
    with one slot only (D256), where the loader's next Q load then overlaps the epilogue.
    With two slots it lost 2.6-3.6% to the release at the item's end (FP8 D64 and D128, A/B
    1332Z), which leaves the slot free for the load all the same."""
    return FP8_EARLY_Q_FREE and fp8 and slots == 1


@functools.cache
def _layout(block: tuple[int, ...], dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
               torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The persistent grid's size: one program per SM (one fits, by its shared memory)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def lpt_section(seq_k: int, dims: int, element: int, group: int, l2: int) -> int:
    """(batch, head) pairs a causal launch takes its tiles across, the longest first: the
    largest power of two of kv heads whose K and V (`seq_k` keys of `dims` (D + Dv)
    elements of `element` bytes) fit `l2` bytes (at least one), times the `group` query
    heads of each; 1 (a head's tiles together) without LPT_SECTIONS."""
    if not LPT_SECTIONS:
        return 1
    fit = max(1, l2 // max(1, seq_k * dims * element))
    return (1 << (fit.bit_length() - 1)) * group


def claim_counter(device: torch.device) -> torch.Tensor:
    """A CLAIM launch's counters (the next item, the programs done), zero: the kernel puts
    them back to zero as its last program ends (`forward_kernel._claims_done`). One a
    recorded launch, kept by its plan: the plan's launches, one stream's, never overlap."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def _descriptor(t: torch.Tensor, rows: int, dim: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = (1, 1, rows, dim)  # (FP8's V^T: Dv rows of BLOCK_N keys)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block),
                            _layout(block, t.dtype))


def consumer_warpgroups(pair: tuple[int, int], fp8: bool, softcap: bool, seq_q: int,
                        bounded: bool, span: int | None = None, varlen: bool = False
                        ) -> int:
    """The kernel's consumer warpgroups for head dims `pair` (`kernel_pair`'s): `WARPGROUPS`
    from WARPGROUPS_MIN_ROWS query rows (varlen: the longest sequence's), from
    WARPGROUPS_MIN_ROWS_BOUNDED where a mask bounds a dense call's keys (`bounded`: causal
    or a window), WARPGROUPS_MIN_ROWS_VARLEN_BOUNDED a varlen call's, else two; two with
    softcap (its tanh spilled 2.8 KB at 160 registers) and where a window bounds a row to
    fewer than `WARPGROUPS_MIN_SPAN` keys (`span`: `Mask.span`). Under fp8,
    `FP8_WARPGROUPS`, and two where a mask bounds the keys."""
    least_bounded = WARPGROUPS_MIN_ROWS_VARLEN_BOUNDED if varlen else WARPGROUPS_MIN_ROWS_BOUNDED
    if softcap or seq_q < WARPGROUPS_MIN_ROWS or (fp8 and bounded) \
            or (bounded and seq_q < least_bounded) \
            or (span is not None and span < WARPGROUPS_MIN_SPAN):
        return 2
    return (FP8_WARPGROUPS if fp8 else WARPGROUPS).get(pair, 2)


def hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor,
                   lse: torch.Tensor | None, scale: float, mask, varlen=None,
                   recording: Recording | None = None, sinks: torch.Tensor | None = None,
                   descale: torch.Tensor | None = None):
    """Write `out` (and `lse`, `[B, H, Sq]` natural-log float32) for the mask (`common.Mask`)
    and, with `varlen`, the packed batch (`[1, H, total, D]` views, lse
    `[1, H, total_q]`); `sinks` (`[H]` float32) as `flash.flash_forward` takes them;
    `descale` (float8 q, k, v: `FP8_TILES`) their factors (`api.fp8_descale`), `out`
    bfloat16. The caller checked `dispatch.hopper_refusal`. `recording`
    (`launch.Recording`) records the launch for the caller's plan."""
    from fusedattn.hopper.forward_kernel import _flash_fwd_sm90

    heads, dim = q.shape[1], q.shape[3]
    group = heads // k.shape[1]
    fp8 = descale is not None
    cu_t = None
    pair = kernel_pair(dim, v.shape[3], fp8)
    recording = recording or Recording((q, k, v, out, lse, sinks, descale))
    if fp8:
        from fusedattn.hopper.transpose import v_transposed

        v, cu_t = v_transposed(v, recording, varlen)  # V^T: its boxes are [Dv, BLOCK_N]
    if varlen is not None:
        batch, seq_q, seq_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
        cu_q, cu_k = varlen.cu_q, varlen.cu_k
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
        cu_q = cu_k = None
    qk_scale, cap, left, right = mask.kernel_args(scale)
    # causal: items claimed on the persistent grid (CAUSAL_CLAIMS), or one program per item,
    # which the hardware hands out as SMs free up (varlen where VARLEN_DYNAMIC says, and a
    # launch a CUDA graph captures); a persistent grid's fixed share per program (items p,
    # p + programs, ...) gave some programs a fifth more work (S4096: 0.85x FA4, against 0.92x)
    dynamic = (right == 0 and left < 0 and (varlen is None or VARLEN_DYNAMIC)
               and seq_q >= CAUSAL_PERSISTENT_ROWS)
    # a causal launch on the persistent grid, its programs claiming items in turn
    claim = dynamic and claims_edges(left, right, varlen) and not capturing()
    dynamic = dynamic and not claim
    consumers = consumer_warpgroups(pair, fp8, cap > 0, seq_q, left >= 0 or right >= 0,
                                    mask.span(), varlen is not None)
    entry = tile_entry(pair, fp8, persistent=not dynamic, consumers=consumers)
    d_a, d_b, dv_a, dv_b, block_m, block_n, stages = entry
    lse_strides = (0, 0, 0) if lse is None else (lse.stride(0), lse.stride(1), lse.stride(2))
    firsts = [(q, block_m, d_a), (k, block_n, d_a),
              (v, dv_a, block_n) if fp8 else (v, block_n, dv_a), (out, block_m, dv_a)]
    # the second head-dim pieces' descriptors (columns d_a / dv_a on); None for a head dim
    # in one piece (a constexpr the kernel never reads: Triton's launcher then encodes four
    # TMA descriptors a call, not eight, issue 31)
    seconds = [(t, rows, second) if second else None for (t, rows, _), second in
               zip(firsts, (d_b, d_b, dv_b, dv_b), strict=True)]
    descs = [None if d is None else _descriptor(*d) for d in firsts + seconds]
    tile = consumers * block_m
    tiles_m = triton.cdiv(seq_q, tile)
    items = tiles_m * batch * heads
    if varlen is not None:
        # items document by document (`forward_kernel._document`): at most (total + B * (tile
        # - 1)) // tile tiles a head over all documents, so at most B - 1 empty items a head;
        # the kernel takes the documents' count where the dense grid takes tiles_m
        tiles_m = batch
        items = (q.shape[2] + batch * (tile - 1)) // tile * heads
    programs = items if dynamic else min(items, _sm_count(q.device))
    counter = None
    if claim:
        counter = claim_counter(q.device)
        recording.own(counter)
    section = 1
    if right >= 0 and left < 0 and varlen is None:  # (the kernel's causal order)
        section = min(batch * heads, lpt_section(seq_k, dim + out.shape[3], k.element_size(),
                                                 group, min(LPT_L2_BYTES, _l2_bytes(q.device))))
    slots = q_slots(entry, consumers, fp8)
    recording.launch(
        _flash_fwd_sm90, (programs,), *descs, out, lse, cu_q, cu_k, sinks, descale, cu_t,
        *out.stride(),
        *lse_strides,
        items, tiles_m, heads, group, seq_q, seq_k, qk_scale, cap, left, right, out.shape[3],
        section, counter,
        D_A=d_a, D_B=d_b, DV_A=dv_a, DV_B=dv_b, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, BOTTOM_RIGHT=mask.bottom_right,
        SOFTCAP=cap > 0, VARLEN=varlen is not None, WRITE_LSE=lse is not None,
        PINGPONG=takes_turns(claim, consumers, fp8, varlen is not None, pair[0]),
        SINKS=sinks is not None, SHARED_KV=SHARED_KV, LOADER_REGS=LOADER_REGS,
        CONSUMER_REGS=CONSUMER_REGS[consumers], FP8=fp8, P_SCALE=FP8_P_SCALE,
        THREAD_ARRIVES=THREAD_ARRIVES, CONSUMERS=consumers, LANE_SUM=LANE_SUM,
        MAX_SPLIT=MAX_SPLIT, FP8_PACK=FP8_PACK and fp8,
        MASK_FORM=MASK_FORM if left >= 0 or right >= 0 else MASK_FORM_EDGE,
        Q_SLOTS=slots, CLAIM=claim, DOC_ROW=DOC_ROWS and varlen is not None,
        VARLEN_TMA=VARLEN_TMA_STORE and varlen is not None,
        LATE_FREE=releases_late(slots, fp8, claim, varlen is not None),
        EARLY_FREE=releases_early(slots, fp8),
        Q_REGS=q_registers(pair, entry, fp8, consumers, claim),
        num_warps=4)
    return out
