"""The Hopper backward kernel (`backward.py` launches it): dK, dV and dQ in one pass.

One program (CTA) per key tile of BLOCK_N keys of one (batch, K/V head); two partitions of
warps share its shared memory:

    compute (8 warps: 2 warpgroups,  per step, a query tile of BLOCK_M rows of one head:
      240 registers)
        S  = Q K^T, dP = dO V^T       async wgmmas, S and dP split by keys over the two
                                     warpgroups (each its 64 keys)
        P  = exp2(S * scale - LSE)    the forward's LSE (base 2), masked on the mask's edges
        dV += P^T dO                  P through shared memory (wgmma's A operand, transposed)
        dS = P (dP - delta)           times the softcap's derivative where there is one
        dK += dS^T Q                  dS through shared memory
        dQ  = dS K                    each warpgroup half of dQ's columns, scaled, into one
                                     of DQ_BUFS shared buffers for the writer
      or, SWAP_SDP (`_steps`),        S^T = K Q^T and dP^T = V dO^T, each warpgroup its 64
                                     keys' rows: P^T and dS^T are dV's and dK's A operands
                                     from registers, and dS^T goes through shared memory
                                     for dQ alone (one barrier a step, not two)
    loader and dQ writer (a          the tile's K and V once, each step's Q and dO by TMA
      warpgroup, 24 registers)       into a ring of STAGES slots (one ready and one free
                                     mbarrier per slot) and, LSE_SMEM, its LSE (base 2)
                                     and delta into the slot's two rows of shared memory
                                     (loaded a step ahead); and each step's dQ added into
                                     an fp32 accumulator in global memory, off the compute
                                     warps' path: by one TMA reduction (DQ_TMA, `_tma_add`)
                                     or by the warps' atomics
    and at the end dK (scaled) and dV go out through K's and V's shared tiles by TMA.

So P and dP are computed once (5 GEMMs a step, the FLOP convention's count), where the
portable backward's two passes compute them twice (7). Each query tile is taken for every
query head of the GQA group in turn (dK and dV sum over the group in registers).

Determinism (DETERMINISTIC): the adds into a (batch, head, query tile)'s dQ are made in a
fixed order of the key tiles (CUTLASS's semaphore): a counter each; the writer of key tile
n waits until the counter shows that the key tiles before it in that order have added,
adds, and counts itself (a release after a barrier of its warps). The same inputs give the
same bits on every run; without it the adds race (fp32 sums in any order: bits may differ
by run). `order` (`backward.py` picks it) chooses the order so that a key tile's turn comes
about when its program gets there anyway:

    "up"       each program walks its query tiles up from its first, and the adds into a
               query tile go from the highest key tile that reaches it down (`last` - n
               before key tile n). Under a causal mask key tile n + 1 starts BLOCK_N /
               BLOCK_M query tiles higher, so it is that many steps ahead of key tile n at
               every query tile: no waiting once the programs run. Programs of a (batch,
               head) launch highest key tile first, so a program only waits on programs
               launched before it (no deadlock whatever the residency), and the shortest
               programs (causal) go first: a tail where programs are few.
    "rotated"  (no mask) key tile i of N starts at query tile i * T // N of T and wraps
               around, so the programs of a head start on different query tiles and each
               reaches a tile after the ones that started at or below it, the highest
               first, then the ones above it, the highest first: that order, with no wait
               at a program's start. A program can wait on one launched after it, so all
               the key tiles of a head must be resident at once: the launcher takes it
               only where N is at most the SM count (one program an SM).
    "down"     from the last query tile down, the adds from the lowest key tile up (n -
               `first`), key tile 0 launched first. Under a causal mask every program
               starts at the last query tile and waits there on all the lower key tiles'
               adds (ncu at 5803e75, D128 S4096 causal: compute warps waiting for the
               writer's buffers in 14% of the samples); unmasked, key tile n waits on n
               others at its first tile. Launched across the heads (DOWN_ACROSS, where
               programs are few: `backward.down_across`): key tile 0 of every (batch,
               head) first, then key tile 1 of every one, ..., so under a causal mask the
               longest programs of every head go first (no tail of one head's longest
               program), and a program's lower key tiles, launched before it, are far
               ahead of it by then; it still waits on programs launched before it alone.
               Head by head with DOWN + 4 f: the last (batch, head)'s first f key tiles
               go first, in the first wave together (so they walk its query tiles in step
               and share them in L2), then every other program head by head; each still
               comes after its own head's lower key tiles."""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fusedattn.hopper.forward_kernel import _document, _index_view, _load_rows, _softcap
from fusedattn.launch import settle_keys

LOG2E = gl.constexpr(1.4426950408889634)
# the deterministic adds' orders (`order`, the module docstring), a runtime argument: which
# one a call takes changes with its sizes, and a new size must compile nothing
DOWN = gl.constexpr(0)
UP = gl.constexpr(1)
ROTATED = gl.constexpr(2)
# "down" with its programs launched across the heads: key tile 0 of every (batch, K/V
# head), then key tile 1 of every one, ... (`_key_tile`); the adds' order is "down"'s
DOWN_ACROSS = gl.constexpr(3)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared tile `src` into the descriptor's block at `coord` by one TMA reduction
    (`cp.reduce.async.bulk.tensor...add`), as `tma.async_copy_shared_to_global` stores one:
    Gluon 3.6's builder has the op (`create_async_tma_reduce`, which `tl`'s descriptor
    atomics lower to) but no function for it. Completion as a store's (`tma.store_wait`,
    or `_bulk_wait` for the adds' results)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _bulk_wait(x):
    """Wait until this thread's TMA stores and reductions are complete, their writes done
    (`cp.async.bulk.wait_group 0`); `tma.store_wait` waits for their reads of shared memory
    alone (`.read`), which frees the buffer but orders nothing after the writes. `x` (any
    int32) is there because an inline asm takes an argument; returns it."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.b32 $0, $1;", "=r,r",
                                     [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _key_tile(n_tiles_n, n_heads_kv, seq_q, seq_k, p_cu_q, p_cu_k, p_order, left, right,
              order, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
              COMPACT: gl.constexpr, WARPS: gl.constexpr):
    """This program's (key tile n, sequence b, its batch row, kv head, first key k0 in the
    sequence, the sequence's first query and key rows, Sq, Sk, diagonal offset, query rows
    m_lo..m_hi that see any of its keys, m_lo a multiple of BLOCK_M, and under "rotated"
    the query tile its steps start from, `rot`). VARLEN: sequence b is rows cu[b]..cu[b+1]
    of batch row 0, and a key tile past its sequence's end sees no query (m_hi = m_lo: no
    steps, nothing loaded or stored). COMPACT (varlen): `n_tiles_n` is the sequences'
    count, and the programs run sequence by sequence in the order `p_order` lists them
    (the preprocess's: the most keys first), each sequence's own key tiles x K/V heads of
    them (`forward_kernel._document` over cu_k, by these WARPS warps), so that no program
    sits past its sequence's keys but the grid's last (rank = the count: dead). Within a
    sequence the programs keep the full grid's order, and no two sequences share a
    counter, so each program still waits only on programs launched before it."""
    pid = gl.program_id(0)
    q_start = 0
    k_start = 0
    if VARLEN and COMPACT:
        # the sequences in the preprocess's order (`p_order`, longest first), r-th = rank r
        rank, first = _document(pid, n_tiles_n, n_heads_kv, p_cu_k, BLOCK_N, WARPS, p_order,
                                True)
        safe = gl.load(p_order + gl.minimum(rank, n_tiles_n - 1))
        q_start = gl.load(p_cu_q + safe)
        seq_q = gl.load(p_cu_q + safe + 1) - q_start
        k_start = gl.load(p_cu_k + safe)
        seq_k = gl.load(p_cu_k + safe + 1) - k_start
        seq_k = seq_k * (rank < n_tiles_n).to(gl.int32)  # past the last sequence: dead
        tiles = gl.maximum(gl.cdiv(seq_k, BLOCK_N), 1)
        h_kv = gl.minimum((pid - first) // tiles, n_heads_kv - 1)
        n = (pid - first) % tiles
        n = gl.where(order == DOWN, n, tiles - 1 - n)  # (not DOWN_ACROSS: `backward`)
        b = safe  # (for a dead program, the last rank's: it loads and adds nothing)
        b_row = b * 0
    else:
        # DOWN_ACROSS: key tile n of every (batch, head) before any key tile n + 1 (the
        # launch index turned into the head-by-head one)
        n_bh = gl.num_programs(0) // n_tiles_n
        pid = gl.where(order == DOWN_ACROSS, pid % n_bh * n_tiles_n + pid // n_bh, pid)
        # DOWN + 4 f (`backward.FRONT_TILES`): head by head, but the last (batch, head)'s
        # first f key tiles (its longest under a causal mask) launched first, together
        front = order // 4
        last = (n_bh - 1) * n_tiles_n
        pid = gl.where(pid < front, last + pid, gl.where(pid - front < last, pid - front, pid))
        n = pid % n_tiles_n
        # a (batch, head)'s programs one after another, its last key tile first, but in
        # the order "down"
        n = gl.where((order % 4 == DOWN) | (order == DOWN_ACROSS), n, n_tiles_n - 1 - n)
        bh = pid // n_tiles_n
        b = bh // n_heads_kv
        h_kv = bh % n_heads_kv
        b_row = b
        if VARLEN:
            q_start = gl.load(p_cu_q + b)
            seq_q = gl.load(p_cu_q + b + 1) - q_start
            k_start = gl.load(p_cu_k + b)
            seq_k = gl.load(p_cu_k + b + 1) - k_start
            b_row = b * 0
    k0 = n * BLOCK_N
    diag = 0
    if BOTTOM_RIGHT:
        diag = seq_k - seq_q
    # query i sees key j when j <= i + diag + right and j >= i + diag - left
    m_lo = 0
    m_hi = seq_q
    if HAS_RIGHT:
        m_lo = gl.maximum(k0 - diag - right, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        m_hi = gl.minimum(k0 + BLOCK_N + left - diag, seq_q)
    if VARLEN:  # (0 past the sequence's keys: then m_hi = m_lo below)
        m_hi = m_hi * (k0 < seq_k).to(gl.int32)
    m_hi = gl.maximum(m_hi, m_lo)
    # "rotated" (no mask: m_lo = 0, m_hi = Sq): the query tile its steps start from
    rot = n * gl.cdiv(seq_q, BLOCK_M) // gl.maximum(gl.cdiv(seq_k, BLOCK_N), 1)
    rot = gl.where(order == ROTATED, rot, 0)
    return n, b, b_row, h_kv, k0, diag, m_lo, m_hi, q_start, k_start, seq_q, seq_k, rot


@gluon.jit
def _step(t, group, GQA: gl.constexpr):
    """Step t's (query tile j, head hh of the group): with GQA each query tile for every
    head of the group in turn; else the query tiles alone (no division: one head)."""
    if GQA:
        return t // group, t % group
    return t, 0


@gluon.jit
def _step_row(m_lo, n_steps, j, rot, order, BLOCK_M: gl.constexpr):
    """The first query row of a program's j-th query tile (the module docstring): "up" from
    its first, "rotated" from its `rot`-th round to the first, "down" from the last."""
    turned = rot + j
    turned = gl.where(turned >= n_steps, turned - n_steps, turned)
    tile = gl.where(order == UP, j, gl.where(order == ROTATED, turned, n_steps - 1 - j))
    return m_lo + tile * BLOCK_M


@gluon.jit
def _dq_order(p_sem, t, n, b, h_kv, group, n_heads, n_tiles_m, m_lo, n_steps, rot, order,
              diag, left, right, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, GQA: gl.constexpr):
    """Step t's counter (batch, head, query tile) and how many key tiles add before this
    one (the module docstring): "up", last - n, `last` the highest key tile that reaches
    the query tile; "rotated", n's place in the order the programs reach it; "down", n -
    first, `first` the lowest key tile that reaches it."""
    j, hh = _step(t, group, GQA)
    m0 = _step_row(m_lo, n_steps, j, rot, order, BLOCK_M)
    bh = b.to(gl.int64) * n_heads + h_kv * group + hh
    counter = p_sem + bh * n_tiles_m + m0 // BLOCK_M
    n_tiles = gl.cdiv(seq_k, BLOCK_N)  # this sequence's
    # "up": key tile n reaches the tile when n * BLOCK_N <= m0 + BLOCK_M - 1 + diag + right
    # (`_key_tile`'s m_lo)
    last = n_tiles - 1
    if HAS_RIGHT:
        last = gl.minimum(last, (m0 + BLOCK_M - 1 + diag + right) // BLOCK_N)
    # "rotated": key tile i starts at query tile i * T // N (T = n_steps: every query tile),
    # so tile m meets first those that start at or below it, the highest (`mine`) first,
    # then those above it, the highest first
    mine = gl.minimum(n_tiles - 1, gl.cdiv((m0 // BLOCK_M + 1) * n_tiles, n_steps) - 1)
    turned = gl.where(n <= mine, mine - n, mine + n_tiles - n)
    # "down"
    first = 0
    if HAS_LEFT:
        first = gl.maximum(m0 + diag - left, 0) // BLOCK_N
    return counter, gl.where(order == UP, last - n,
                             gl.where(order == ROTATED, turned, n - first))


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, b_row, h_kv, k_start, k0, seq_k, two,
             D: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr, DV2: gl.constexpr):
    """The program's K and V tiles, once (varlen: a tile past its sequence's keys loads
    nothing); with a second head-dim piece (D2 > 0, and DV2 > 0 for V's) its columns D..
    from `two`'s descriptors into its buffers (`_flash_bwd_sm90`)."""
    k2_desc, v2_desc, k2_smem, v2_smem = two[1], two[2], two[8], two[9]
    if k0 < seq_k:
        if DV2 > 0:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes
                            + k2_desc.block_type.nbytes + v2_desc.block_type.nbytes)
        elif D2 > 0:  # (V in one piece of its own head dim)
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes
                            + k2_desc.block_type.nbytes)
        else:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _load_rows(k_desc, k2_desc, b_row, h_kv, k_start + k0, kv_bar, k_smem, k2_smem, D, D2)
        _load_rows(v_desc, v2_desc, b_row, h_kv, k_start + k0, kv_bar, v_smem, v2_smem, DV,
                   DV2)


@gluon.jit
def _load_step(t, q_desc, do_desc, q_smem, do_smem, ready, free, b_row, h_kv, group, q_start,
               m_lo, n_steps, rot, order, two, BLOCK_M: gl.constexpr, D: gl.constexpr,
               D2: gl.constexpr, DV: gl.constexpr, DV2: gl.constexpr, STAGES: gl.constexpr,
               GQA: gl.constexpr, WAIT_FREE: gl.constexpr):
    """Step t's Q and dO into slot t % STAGES, once the compute partition released the
    slot's last use (dO in V's head-dim pieces, DV and DV2): WAIT_FREE by the slot's free
    barrier, else the caller knows it (SLOT_BY_DQ: it waited for step t - STAGES's dQ)."""
    j, hh = _step(t, group, GQA)
    m0 = _step_row(m_lo, n_steps, j, rot, order, BLOCK_M)
    h = h_kv * group + hh
    slot = t % STAGES
    if WAIT_FREE:  # a fresh barrier counts as having completed the phase before its first
        mbarrier.wait(free.index(slot), ((t // STAGES) & 1) ^ 1)
    if DV2 > 0:  # (a second head-dim piece: `two`'s descriptors and buffers, columns D..)
        q2_desc, do2_desc, q2_smem, do2_smem = two[0], two[3], two[7], two[10]
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + q2_desc.block_type.nbytes + do2_desc.block_type.nbytes)
        _load_rows(q_desc, q2_desc, b_row, h, q_start + m0, ready.index(slot),
                   q_smem.index(slot), q2_smem.index(slot), D, D2)
        _load_rows(do_desc, do2_desc, b_row, h, q_start + m0, ready.index(slot),
                   do_smem.index(slot), do2_smem.index(slot), DV, DV2)
    elif D2 > 0:  # Q's second piece alone (dO in one piece of V's head dim)
        q2_desc, q2_smem = two[0], two[7]
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + q2_desc.block_type.nbytes)
        _load_rows(q_desc, q2_desc, b_row, h, q_start + m0, ready.index(slot),
                   q_smem.index(slot), q2_smem.index(slot), D, D2)
        _load_rows(do_desc, do_desc, b_row, h, q_start + m0, ready.index(slot),
                   do_smem.index(slot), do_smem.index(slot), DV, 0)
    else:
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _load_rows(q_desc, q_desc, b_row, h, q_start + m0, ready.index(slot),
                   q_smem.index(slot), q_smem.index(slot), D, 0)
        _load_rows(do_desc, do_desc, b_row, h, q_start + m0, ready.index(slot),
                   do_smem.index(slot), do_smem.index(slot), DV, 0)


@gluon.jit
def _step_rows(t, valid, group, m_lo, n_steps, rot, order, b_row, h_kv, sl_b, sl_h, q_start,
               p_lse, p_delta, seq_q, layout: gl.constexpr, BLOCK_M: gl.constexpr,
               GQA: gl.constexpr, FIRST_ROW: gl.constexpr):
    """Step t's rows' LSE (base 2) and delta from global memory, as `layout`'s [BLOCK_M]
    vectors, none where not `valid` (a step past the last): rows past Sq (zeros from TMA;
    varlen: the next sequence's) and rows that saw no key (LSE = -inf) get LSE = +inf, so
    P = 0. Loaded by the writer's warps for `_put_rows` (LSE_SMEM), else by the compute
    warps at the step's start (loaded at the end of the step before, they spilled more
    and ran 3-6% slower: evidence/nvidia-h200/20261203T1419Z-d80-lse-ahead-ab,
    notes/patches/bwd-lse-ahead.patch). FIRST_ROW: the tile's first row a scalar and the
    rows offsets from it (S transposed, 16 queries a thread: each address a register and a
    constant, each mask a 32-bit compare; with the rows' indices ptxas made 64-bit sums of
    each once the orders changed m0's form, a longer loop in the CPU compile report, not
    committed); else the rows' indices (2 a thread, where the first form compiled to a
    longer loop)."""
    j, hh = _step(t, group, GQA)
    m0 = _step_row(m_lo, n_steps, j, rot, order, BLOCK_M)
    h = h_kv * group + hh
    rows = gl.arange(0, BLOCK_M, layout=layout)
    if FIRST_ROW:
        here = (rows < seq_q - m0) & valid
        base = b_row.to(gl.int64) * sl_b + h.to(gl.int64) * sl_h + q_start + m0
        offs = rows
    else:
        offs = m0 + rows
        here = (offs < seq_q) & valid
        base = b_row.to(gl.int64) * sl_b + h.to(gl.int64) * sl_h + q_start
    lse = gl.load(p_lse + base + offs, mask=here, other=float("inf"))
    delta = gl.load(p_delta + base + offs, mask=here, other=0.0)
    return gl.where(lse == float("-inf"), float("inf"), lse) * LOG2E, delta


@gluon.jit
def _put_rows(t, lse, delta, rows_smem, ready, STAGES: gl.constexpr):
    """`_step_rows`' values into slot t % STAGES's two rows of `rows_smem`, then an arrival
    of their own on the slot's ready barrier (which counts two under LSE_SMEM: TMA's and
    this)."""
    slot = t % STAGES
    rows_smem.index(2 * slot).store(lse)
    rows_smem.index(2 * slot + 1).store(delta)
    gl.thread_barrier()  # every thread's stores are in (one thread arrives for all)
    mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _load_one(t, desc, smem, ready, free, b_row, h_kv, group, q_start, m_lo, n_steps, rot,
              order, BLOCK_M: gl.constexpr, D: gl.constexpr, SLOTS: gl.constexpr,
              GQA: gl.constexpr):
    """Step t's tile of Q or of dO (`desc`) into slot t % SLOTS of its own ring (DO_STAGES:
    Q's and dO's rings of different depths), once the compute partition released the
    slot's last use."""
    j, hh = _step(t, group, GQA)
    m0 = _step_row(m_lo, n_steps, j, rot, order, BLOCK_M)
    slot = t % SLOTS
    mbarrier.wait(free.index(slot), ((t // SLOTS) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    _load_rows(desc, desc, b_row, h_kv * group + hh, q_start + m0, ready.index(slot),
               smem.index(slot), smem.index(slot), D, 0)


# DQ_NAMED: dQ's hand-overs by hardware named barriers, ids DQ_BARRIER + buffer ("ready")
# and DQ_BARRIER + DQ_BUFS + buffer ("free"), clear of the ids Triton 3.6 gives its
# partitions' barriers (0-2 in these kernels' SASS)
DQ_BARRIER = gl.constexpr(8)


@gluon.jit
def _named_barrier(lanes, bar, count, SYNC: gl.constexpr):
    """This partition at named barrier `bar` of `count` threads: SYNC waits there (`bar.sync`)
    until `count` threads have come, else it arrives and goes on (`bar.arrive`). `lanes` is
    a tensor of one element a thread (zeros), so that each thread runs the instruction once
    (`bar` may be a value of the step's: PTX takes the id from a register).
    Gluon 3.6 has no named-barrier operation; Triton's own barrier analysis does not see
    these (FA4's dQ hand-over: the compute warps and the writer meet at named barriers, and
    the compute warps never wait on "ready")."""
    if SYNC:
        gl.inline_asm_elementwise("bar.sync $1, $2; mov.u32 $0, 0;", "=r,r,r",
                                  [lanes + bar, lanes + count], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive $1, $2; mov.u32 $0, 0;", "=r,r,r",
                                  [lanes + bar, lanes + count], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _dq_handoff(dq, dq_smem, dq_ready, dq_free, n, DQ_BUFS: gl.constexpr,
                DQ_TMA: gl.constexpr):
    """The compute warps' n-th hand-off of a part of dQ (`dq`, scaled) to the writer (DQ_SPLIT
    parts a step), into buffer n % DQ_BUFS once the writer is done with its last one."""
    buf = n % DQ_BUFS
    mbarrier.wait(dq_free.index(buf), ((n // DQ_BUFS) & 1) ^ 1)
    dq_smem.index(buf).store(dq)
    if DQ_TMA:  # (the writer's TMA reads it)
        fence_async_shared()
    gl.thread_barrier()  # every warp's stores are in (one thread arrives for all)
    mbarrier.arrive(dq_ready.index(buf), count=1)


@gluon.jit
def _dq_writer(dq_smem, dq_ready, dq_free, p_dq, dq_desc, p_sem, p_cu_q, p_cu_k, p_order,
               n_tiles_n, n_tiles_m, n_heads_kv, group, seq_q, seq_k, rows_q, left, right,
               order, q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem,
               kv_bar, ready, free, rows_smem, p_lse, p_delta, sl_b, sl_h, two, do_ring,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, D2: gl.constexpr,
               DV: gl.constexpr, DV2: gl.constexpr, STAGES: gl.constexpr,
               HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
               BOTTOM_RIGHT: gl.constexpr, DETERMINISTIC: gl.constexpr,
               DQ_BUFS: gl.constexpr, WARPS: gl.constexpr, DQ_ADDS: gl.constexpr,
               GQA: gl.constexpr, VARLEN: gl.constexpr, COMPACT: gl.constexpr,
               DQ_TMA: gl.constexpr, LSE_SMEM: gl.constexpr, EARLY_FREE: gl.constexpr,
               DO_STAGES: gl.constexpr, DQ_SPLIT: gl.constexpr, FREE_ON_READ: gl.constexpr,
               SLOT_BY_DQ: gl.constexpr, DQ_NAMED: gl.constexpr):
    """Each step's dQ (fp32, scaled, in `dq_smem`) added into the accumulator in global
    memory, off the compute warps' path: DQ_TMA by one TMA reduction (`dq_desc`), else
    ROWS rows at a time by atomics; DETERMINISTIC: after the key tiles before this one (the
    module docstring), then counted (after the reduction's writes are done). These warps
    are the loader too (one warpgroup for both, so that the compute warpgroups get 240
    registers): K, V and the first STAGES steps' Q and dO up front, then step t + STAGES's
    as soon as step t is done (its slot is free then), before step t's adds; LSE_SMEM the
    steps' LSE and delta rows too, loaded a step ahead. DO_STAGES < STAGES: dO in a ring of
    its own (`do_ring`: its ready and free barriers), each step's loaded once its slot is
    released. DQ_SPLIT > 1: a step's dQ comes in that many parts of D / DQ_SPLIT columns,
    each added by its own TMA reduction, the counter's turn awaited before the first and
    counted after the last. FREE_ON_READ (DETERMINISTIC with DQ_TMA): dQ's buffer goes back
    to the compute warps once the reduction has read it, and the writer then waits for the
    reduction's writes before it counts (the count orders the adds, the buffer does not);
    else the buffer waits for the writes too. SLOT_BY_DQ (not EARLY_FREE, DQ_SPLIT = 1):
    a slot is known free once its step's dQ has been handed over, the compute warps'
    one arrival at a step's end, so they arrive on no free barrier (`_steps`). DQ_NAMED
    (SLOT_BY_DQ; the threads of both partitions, 0: off): dQ's buffer "ready" and "free" by
    named barriers (`_named_barrier`), each phase the compute warps' 256 threads and this
    partition's; "free" given once ahead for each buffer's first use, then after a use only
    where a later one follows, so that no phase is left open when the program ends."""
    gl.static_assert(not (SLOT_BY_DQ and (EARLY_FREE or DQ_SPLIT > 1)))
    gl.static_assert(not DQ_NAMED or SLOT_BY_DQ)
    EARLY_DQ_FREE: gl.constexpr = FREE_ON_READ and DETERMINISTIC and DQ_TMA
    SPLIT_RINGS: gl.constexpr = DO_STAGES != STAGES
    DH: gl.constexpr = D // DQ_SPLIT  # (a part of dQ's columns)
    if DQ_SPLIT > 1:
        gl.static_assert(EARLY_FREE and DQ_TMA and D2 == 0)
    gl.static_assert(DQ_SPLIT > 1 or not SPLIT_RINGS)  # (the compute warps' rule: `_steps`)
    do_ready, do_free = do_ring
    # chunks of ROWS x COLS: the swizzle pattern's rows, a 128-byte row of it (fp32), so a
    # thread holds 8 values (the partition has few registers)
    ROWS: gl.constexpr = 16 if WARPS == 4 else 8
    COLS: gl.constexpr = 32
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])  # LSE_SMEM's rows
    n, b, b_row, h_kv, k0, diag, m_lo, m_hi, q_start, k_start, seq_q, seq_k, rot = _key_tile(
        n_tiles_n, n_heads_kv, seq_q, seq_k, p_cu_q, p_cu_k, p_order, left, right, order, BLOCK_M,
        BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN, COMPACT, WARPS)
    n_heads = n_heads_kv * group
    n_steps = gl.cdiv(m_hi - m_lo, BLOCK_M)
    n_total = n_steps * group if GQA else n_steps
    _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, b_row, h_kv, k_start, k0, seq_k, two, D,
             D2, DV, DV2)
    for t in gl.static_range(STAGES):
        if t < n_total:
            if SPLIT_RINGS:  # Q's ring alone here, dO's below
                _load_one(t, q_desc, q_smem, ready, free, b_row, h_kv, group, q_start, m_lo,
                          n_steps, rot, order, BLOCK_M, D, STAGES, GQA)
            else:
                _load_step(t, q_desc, do_desc, q_smem, do_smem, ready, free, b_row, h_kv,
                           group, q_start, m_lo, n_steps, rot, order, two, BLOCK_M, D, D2,
                           DV, DV2, STAGES, GQA, not SLOT_BY_DQ)
            if LSE_SMEM:
                lse, delta = _step_rows(t, True, group, m_lo, n_steps, rot, order, b_row, h_kv,
                                        sl_b, sl_h, q_start, p_lse, p_delta, seq_q, vec,
                                        BLOCK_M, GQA, True)
                _put_rows(t, lse, delta, rows_smem, ready, STAGES)
    if SPLIT_RINGS:
        for t in gl.static_range(DO_STAGES):
            if t < n_total:
                _load_one(t, do_desc, do_smem, do_ready, do_free, b_row, h_kv, group, q_start,
                          m_lo, n_steps, rot, order, BLOCK_M, DV, DO_STAGES, GQA)
    if LSE_SMEM:  # step STAGES's rows, which the loop's first turn stores
        lse, delta = _step_rows(STAGES, STAGES < n_total, group, m_lo, n_steps, rot, order,
                                b_row, h_kv, sl_b, sl_h, q_start, p_lse, p_delta, seq_q, vec,
                                BLOCK_M, GQA, True)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    offs = (gl.expand_dims(rows * D, 1)
            + gl.expand_dims(gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)), 0))
    if DQ_NAMED:
        lanes = gl.arange(0, 32 * WARPS, layout=vec) * 0  # one element a thread
        for buf0 in gl.static_range(DQ_BUFS):  # each buffer's first use: free
            if buf0 < n_total:
                _named_barrier(lanes, DQ_BARRIER + DQ_BUFS + buf0, DQ_NAMED, False)
    for t in range(n_total):
        j, hh = _step(t, group, GQA)
        m0 = _step_row(m_lo, n_steps, j, rot, order, BLOCK_M)
        # the accumulator's rows (rows_q a head: Sq, or the packed total)
        row_bh = (b_row * n_heads + h_kv * group + hh).to(gl.int64)
        buf = t % DQ_BUFS
        again = t + DQ_BUFS < n_total  # (DQ_NAMED: the buffer has a later use)
        if DQ_NAMED:
            _named_barrier(lanes, DQ_BARRIER + buf, DQ_NAMED, True)
        elif not EARLY_FREE:
            mbarrier.wait(dq_ready.index(buf), (t // DQ_BUFS) & 1)
        if SPLIT_RINGS:  # dO's slot first: the compute warps release it before Q's
            if t + DO_STAGES < n_total:
                _load_one(t + DO_STAGES, do_desc, do_smem, do_ready, do_free, b_row, h_kv,
                          group, q_start, m_lo, n_steps, rot, order, BLOCK_M, DV, DO_STAGES,
                          GQA)
            if t + STAGES < n_total:
                _load_one(t + STAGES, q_desc, q_smem, ready, free, b_row, h_kv, group,
                          q_start, m_lo, n_steps, rot, order, BLOCK_M, D, STAGES, GQA)
        elif t + STAGES < n_total:  # (EARLY_FREE: once the compute warps release the slot,
            # before their dQ is ready; SLOT_BY_DQ: step t's dQ, waited for above, came
            # after the compute warps' last read of the slot)
            _load_step(t + STAGES, q_desc, do_desc, q_smem, do_smem, ready, free, b_row, h_kv,
                       group, q_start, m_lo, n_steps, rot, order, two, BLOCK_M, D, D2, DV, DV2,
                       STAGES, GQA, not SLOT_BY_DQ)
        if LSE_SMEM:  # step t + STAGES's rows (loaded a turn ago: their latency is behind
            # the last step's adds), then step t + STAGES + 1's loaded. The slot is free:
            # the compute warps are done with step t. (Loaded and stored here at once, the
            # loads' latency was on the writer's path every step; stored after this step's
            # adds, the compute warps waited on the adds at the start of a step, not its
            # end: deterministic and unmasked, 0.89x both ways, evidence 2042Z, 2045Z.)
            if t + STAGES < n_total:
                _put_rows(t + STAGES, lse, delta, rows_smem, ready, STAGES)
            lse, delta = _step_rows(t + STAGES + 1, t + STAGES + 1 < n_total, group, m_lo,
                                    n_steps, rot, order, b_row, h_kv, sl_b, sl_h, q_start,
                                    p_lse, p_delta, seq_q, vec, BLOCK_M, GQA, True)
        if EARLY_FREE and DQ_SPLIT == 1:
            mbarrier.wait(dq_ready.index(buf), (t // DQ_BUFS) & 1)
        if DETERMINISTIC:
            counter, need = _dq_order(p_sem, t, n, b, h_kv, group, n_heads, n_tiles_m, m_lo,
                                      n_steps, rot, order, diag, left, right, seq_k, BLOCK_M,
                                      BLOCK_N, HAS_LEFT, HAS_RIGHT, GQA)
            seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            while seen != need:
                seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        base = p_dq + (row_bh * rows_q + q_start + m0) * D
        tile = dq_smem.index(buf)
        if DQ_SPLIT > 1:  # the step's parts, each a hand-off of its own (`_dq_handoff`)
            for h in gl.static_range(DQ_SPLIT):
                n_part = t * DQ_SPLIT + h
                part = n_part % DQ_BUFS
                mbarrier.wait(dq_ready.index(part), (n_part // DQ_BUFS) & 1)
                if DQ_ADDS:
                    _tma_add(dq_desc, [b_row, h_kv * group + hh, q_start + m0, h * DH],
                             dq_smem.index(part)._reinterpret(gl.float32, [1, 1, BLOCK_M, DH],
                                                              dq_desc.layout))
                if DETERMINISTIC and h == DQ_SPLIT - 1 and not EARLY_DQ_FREE:
                    t = _bulk_wait(t)  # every part's adds done
                else:  # the buffer read
                    tma.store_wait(0)
                gl.thread_barrier()  # (the partition's waits)
                if DETERMINISTIC and h == DQ_SPLIT - 1 and not EARLY_DQ_FREE:
                    gl.atomic_add(counter, 1, sem="release", scope="gpu")
                mbarrier.arrive(dq_free.index(part), count=1)
                if DETERMINISTIC and h == DQ_SPLIT - 1 and EARLY_DQ_FREE:
                    t = _bulk_wait(t)  # every part's adds done, after the buffer went back
                    gl.thread_barrier()
                    gl.atomic_add(counter, 1, sem="release", scope="gpu")
        elif DQ_ADDS and DQ_TMA:  # the tile in one TMA reduction; rows past the accumulator's
            # end are dropped, and varlen's rows past a sequence's end (the next sequence's)
            # get its zeros (P = 0 there), which change no bits whatever the order
            _tma_add(dq_desc, [b_row, h_kv * group + hh, q_start + m0, 0],
                     tile._reinterpret(gl.float32, [1, 1, BLOCK_M, D], dq_desc.layout))
            if D2 > 0:  # the second head-dim piece, columns D..
                dq2_desc = two[6]
                _tma_add(dq2_desc, [b_row, h_kv * group + hh, q_start + m0, D],
                         two[11].index(buf)._reinterpret(gl.float32, [1, 1, BLOCK_M, D2],
                                                         dq2_desc.layout))
            if DETERMINISTIC and not EARLY_DQ_FREE:  # the adds done before the count says so
                t = _bulk_wait(t)
            else:  # the buffer read (EARLY_DQ_FREE: the writes awaited below)
                tma.store_wait(0)
        elif DQ_ADDS:  # (False for A/Bs alone: dQ left out, to time the rest)
            gl.static_assert(D2 == 0, "a second head-dim piece adds dQ by TMA only")
            for r in gl.static_range(0, BLOCK_M, ROWS):
                keep = gl.expand_dims(m0 + r + rows < seq_q, 1)
                for c in gl.static_range(0, D, COLS):
                    vals = tile.slice(r, ROWS, dim=0).slice(c, COLS, dim=1).load(layout)
                    gl.atomic_add(base + r * D + c + offs, vals, mask=keep,
                                  sem="relaxed", scope="gpu")
        if DQ_SPLIT == 1 and EARLY_DQ_FREE:
            if DQ_NAMED:  # (the phase waits for every thread: the one that read it too)
                if again:
                    _named_barrier(lanes, DQ_BARRIER + DQ_BUFS + buf, DQ_NAMED, False)
            else:
                gl.thread_barrier()  # the partition's reads of the buffer are done
                mbarrier.arrive(dq_free.index(buf), count=1)
            t = _bulk_wait(t)  # the adds done before the count says so
            gl.thread_barrier()
            gl.atomic_add(counter, 1, sem="release", scope="gpu")
        elif DQ_SPLIT == 1:
            gl.thread_barrier()  # the partition's adds and reads of the buffer are done
            if DETERMINISTIC:
                gl.atomic_add(counter, 1, sem="release", scope="gpu")
            if DQ_NAMED:
                if again:
                    _named_barrier(lanes, DQ_BARRIER + DQ_BUFS + buf, DQ_NAMED, False)
            else:
                mbarrier.arrive(dq_free.index(buf), count=1)


@gluon.jit
def _key_mask(keys, qpos, seq_k, left, right, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr):
    """Which (key, query) pairs of a tile the mask keeps: `keys` and `qpos` (the queries'
    positions among the keys) expanded along S's two axes. The rule of the portable
    kernels' `tiles.common._visible` (a `triton.jit` function, which Gluon cannot call);
    the forward kernel has it inline (moving it here changed the forward's SASS in 5 of 16
    configurations, not run on a GPU)."""
    valid = keys < seq_k
    if HAS_RIGHT:
        valid = valid & (keys <= qpos + right)
    if HAS_LEFT:
        valid = valid & (keys >= qpos - left)
    return valid


@gluon.jit
def _masked_p(p, k0, q0, seq_k, left, right, QX: gl.constexpr, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr):
    """`p` with 0 where the mask drops a (key, query) pair: keys k0 + i along axis QX, the
    queries' positions among the keys q0 + i along the other (`_key_mask`'s rule). Axis 1 is
    compared in `forward_kernel._index_view`'s split, as the forward's `_masked` does: no
    register a key or query held for the compares."""
    R: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    p4, const, lane = _index_view(p)
    l2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, p4.type.layout))
    r = gl.arange(0, R, layout=gl.SliceLayout(1, l2))
    r4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 1), 2), 3)
    if QX == 1:  # p is [queries, keys]: key k0 + n, query position q0 + r
        valid = const < seq_k - k0 - lane
        if HAS_RIGHT:
            valid = valid & (const <= (q0 + right - k0 + r4) - lane)
        if HAS_LEFT:
            valid = valid & (const >= (q0 - left - k0 + r4) - lane)
    else:  # p is [keys, queries] (S^T): key k0 + r, query position q0 + n
        valid = k0 + r4 < seq_k
        if HAS_RIGHT:  # key <= q0 + n + right
            valid = valid & (const >= (k0 - q0 - right + r4) - lane)
        if HAS_LEFT:  # key >= q0 + n - left
            valid = valid & (const <= (k0 - q0 + left + r4) - lane)
    p4 = gl.where(valid, p4, 0.0)
    return gl.convert_layout(gl.reshape(p4, [R, N]), p.type.layout, assert_trivial=True)


@gluon.jit
def _steps(q_smem, k_smem, v_smem, do_smem, p_smem, ds_smem, dq_smem, rows_smem, kv_bar, ready,
           free, dq_ready, dq_free, p_lse, p_delta, sl_b, sl_h, p_cu_q, p_cu_k, p_order, n_tiles_n,
           n_heads_kv, group, seq_q, seq_k, scale, qk_scale, cap, left, right, order, two, outs,
           do_ring, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
           D2: gl.constexpr, DV: gl.constexpr, DV2: gl.constexpr, STAGES: gl.constexpr,
           HAS_LEFT: gl.constexpr,
           HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
           DQ_BUFS: gl.constexpr, GQA: gl.constexpr, VARLEN: gl.constexpr,
           COMPACT: gl.constexpr, SWAP_SDP: gl.constexpr, DQ_TMA: gl.constexpr,
           LSE_SMEM: gl.constexpr, MASK_CONSTANTS: gl.constexpr, EARLY_FREE: gl.constexpr,
           DO_STAGES: gl.constexpr, DQ_SPLIT: gl.constexpr, SLOT_BY_DQ: gl.constexpr,
           DQ_NAMED: gl.constexpr):
    """The 8 warps' steps (the module docstring). Returns dK, dV. LSE_SMEM: the step's LSE
    and delta from the slot's rows of `rows_smem` (the loader's), not from global memory.
    D2 > 0 (D192: pieces of 128 and 64 columns, 64 keys, S not transposed): `two`'s second
    pieces of Q, K, V, dO and dQ's buffer, S and dP two products each, dV, dK and dQ two
    accumulators each; the second pieces of dK and dV go out here, after the steps, by
    `outs` (`_store_piece`), and the first pieces' are returned. V's head dim its own
    (DV, DV2: V's, dO's and dV's pieces): dP's products and dV's accumulators take V's
    pieces, the rest Q's; V in two pieces only as Q's (DV2 = 0, or DV = D and DV2 = D2).
    DQ_SPLIT > 1 (D256 with two slots of Q and one of dO, `do_ring`): dO's slot is released
    once dV is done, Q's once dK is, and dQ is made and handed over in DQ_SPLIT parts of
    D / DQ_SPLIT columns, each from its own columns of K (`_dq_handoff`), so that one
    buffer a part fits.
    EARLY_FREE (one slot, P and dS in shared memory): the slot is released once dV and dK
    are done, before dQ's product is waited for, so that the next step's Q and dO load
    under it (`_dq_writer` loads then, before it waits for the step's dQ). Else the slot
    is released at the step's end, with its dQ: SLOT_BY_DQ by dQ's hand-off alone (one
    arrival, not two: Triton lowers each single-thread arrive to a barrier of the 8 warps
    and one thread's arrive, and the second barrier ordered nothing). DQ_NAMED (the
    threads of both partitions, 0: off): the hand-off by named barriers (`_dq_writer`'s):
    "free" waited for, which lines the 8 warps up as the step's end must (every product of
    the step done before the next step's dS stores), and "ready" arrived at without a wait.

    S, dP, P, dS: [BLOCK_M queries, BLOCK_N keys], each warpgroup BLOCK_N / 2 keys'
    columns, P and dS through shared memory for their products. SWAP_SDP (FA3's
    SdP_swapAB): S^T = K Q^T and dP^T = V dO^T, [BLOCK_N keys, BLOCK_M queries], each
    warpgroup its keys' rows, so that P^T and dS^T are the A operands of dV += P^T dO and
    dK += dS^T Q straight from registers; dS^T goes through shared memory for dQ = dS K
    alone (one barrier a step)."""
    if SWAP_SDP:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_M, 16])
    else:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    QX: gl.constexpr = 0 if SWAP_SDP else 1  # the axis a query vector is expanded along
    row_layout: gl.constexpr = gl.SliceLayout(QX, s_layout)  # a query vector's
    gl.static_assert(DV2 == 0 or (DV == D and DV2 == D2))
    if BLOCK_N >= 128:  # dK, dV: [BLOCK_N keys, D], each warpgroup BLOCK_N / 2 keys
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, D, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, DV, 16])
    else:  # 64 keys (D256): each warpgroup half of dK's and dV's columns, D / 4 registers
        # a thread each, not D / 2 (a wgmma's 64 rows are one warpgroup's least)
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DV // 2, 16])
    # the register operands of dK's products (dS^T) and of dV's (P^T) (the same where DV = D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout,
                                                  k_width=2)
    pv_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                  k_width=2)
    # a step's dQ: [BLOCK_M, D], each warpgroup D / 2 columns
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    dtype: gl.constexpr = q_smem.dtype
    if DQ_SPLIT > 1:  # a part of dQ, each warpgroup half of its columns
        gl.static_assert(D2 == 0 and not SWAP_SDP and EARLY_FREE and DO_STAGES == 1)
        DH: gl.constexpr = D // DQ_SPLIT
        dqh_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DH // 2, 16])
        do_ready, do_free = do_ring
    if D2 > 0:  # the second piece's accumulators, each warpgroup half of their columns
        gl.static_assert(BLOCK_N < 128 and not SWAP_SDP and not EARLY_FREE)
        kv2_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D2 // 2, 16])
        q2_smem, k2_smem, v2_smem, do2_smem, dq2_smem = two[7], two[8], two[9], two[10], two[11]

    n, b, b_row, h_kv, k0, diag, m_lo, m_hi, q_start, k_start, seq_q, seq_k, rot = _key_tile(
        n_tiles_n, n_heads_kv, seq_q, seq_k, p_cu_q, p_cu_k, p_order, left, right, order, BLOCK_M,
        BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN, COMPACT, 8)
    dk = gl.zeros([BLOCK_N, D], gl.float32, layout=kv_layout)
    dv = gl.zeros([BLOCK_N, DV], gl.float32, layout=dv_layout)
    if D2 > 0:
        dk2 = gl.zeros([BLOCK_N, D2], gl.float32, layout=kv2_layout)
    if DV2 > 0:
        dv2 = gl.zeros([BLOCK_N, DV2], gl.float32, layout=kv2_layout)
    live = k0 < seq_k  # (varlen: False past the sequence's keys, with no steps)
    if live:
        mbarrier.wait(kv_bar, 0)
    if DQ_NAMED:
        gl.static_assert(SLOT_BY_DQ)  # (the slot freed by the hand-off alone)
        lanes = gl.arange(0, 256, layout=gl.BlockedLayout([1], [32], [8], [0])) * 0
    n_steps = gl.cdiv(m_hi - m_lo, BLOCK_M)
    for t in range(n_steps * group if GQA else n_steps):
        j, hh = _step(t, group, GQA)
        m0 = _step_row(m_lo, n_steps, j, rot, order, BLOCK_M)
        slot = t % STAGES
        queries = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        if not LSE_SMEM:
            lse, delta = _step_rows(t, True, group, m_lo, n_steps, rot, order, b_row, h_kv,
                                    sl_b, sl_h, q_start, p_lse, p_delta, seq_q, row_layout,
                                    BLOCK_M, GQA, SWAP_SDP)
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        if LSE_SMEM:  # (delta at its use, below)
            lse = rows_smem.index(2 * slot).load(row_layout)
        q_t = q_smem.index(slot)
        if DQ_SPLIT > 1:  # (dO's own ring of DO_STAGES slots, waited for below)
            do_slot = t % DO_STAGES
            do_t = do_smem.index(do_slot)
        else:
            do_t = do_smem.index(slot)
        if D2 > 0:
            q2_t = q2_smem.index(slot)
        if DV2 > 0:
            do2_t = do2_smem.index(slot)
        # (the zeros made here, not before the loop: no registers held for them)
        if SWAP_SDP:
            zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
            s_tok = warpgroup_mma(k_smem, q_t.permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            dp_tok = warpgroup_mma(v_smem, do_t.permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
        else:
            zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            s_tok = warpgroup_mma(q_t, k_smem.permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            if D2 > 0:  # (the second piece's columns into the same S)
                s_tok = warpgroup_mma(q2_t, k2_smem.permute((1, 0)), s_tok, is_async=True)
            if DQ_SPLIT > 1:  # (S issued before dO's wait: its load may be the later)
                mbarrier.wait(do_ready.index(do_slot), (t // DO_STAGES) & 1)
            dp_tok = warpgroup_mma(do_t, v_smem.permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            if DV2 > 0:
                dp_tok = warpgroup_mma(do2_t, v2_smem.permute((1, 0)), dp_tok, is_async=True)
        if DV2 > 0:  # (S's two products done; dP's two in flight)
            s = warpgroup_mma_wait(2, deps=[s_tok, q_t, k_smem, q2_t, k2_smem])[0]
        elif D2 > 0:  # (S's two products done; dP's one, V's head dim, in flight)
            s = warpgroup_mma_wait(1, deps=[s_tok, q_t, k_smem, q2_t, k2_smem])[0]
        else:
            s = warpgroup_mma_wait(1, deps=[s_tok, q_t, k_smem])[0]
        if SOFTCAP:  # base-2 capped scores (the forward's `_softmax_tile`)
            s = _softcap(s * qk_scale) * cap
        else:
            s = s * qk_scale
        p = gl.exp2(s - gl.expand_dims(lse, QX))
        pos = m0 + diag  # the tile's first query's position among the keys
        edge = k0 + BLOCK_N > seq_k
        if HAS_RIGHT:
            edge = edge | (k0 + BLOCK_N - 1 > pos + right)
        if HAS_LEFT:
            edge = edge | (k0 < pos + BLOCK_M - 1 - left)
        if edge:
            if MASK_CONSTANTS:
                p = _masked_p(p, k0, pos, seq_k, left, right, QX, HAS_LEFT, HAS_RIGHT)
            else:  # (the key indices made here: no registers held for them)
                keys = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1 - QX, s_layout))
                p = gl.where(_key_mask(gl.expand_dims(keys, 1 - QX),
                                       gl.expand_dims(queries + diag, QX), seq_k, left, right,
                                       HAS_LEFT, HAS_RIGHT), p, 0.0)
        if SWAP_SDP:
            p_op = gl.convert_layout(p.to(dtype), pv_layout)
            dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
        else:
            p_smem.store(p.to(dtype))
            fence_async_shared()
            dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do_t, dv, is_async=True)
            if DV2 > 0:
                dv2_tok = warpgroup_mma(p_smem.permute((1, 0)), do2_t, dv2, is_async=True)
        if DV2 > 0:  # (dP's two products done; dV's two in flight)
            dp = warpgroup_mma_wait(2, deps=[dp_tok, do_t, v_smem, do2_t, v2_smem])[0]
        else:
            dp = warpgroup_mma_wait(1, deps=[dp_tok, do_t, v_smem])[0]
        if LSE_SMEM:
            delta = rows_smem.index(2 * slot + 1).load(row_layout)
        ds = p * (dp - gl.expand_dims(delta, QX))
        if SOFTCAP:  # times d(cap tanh(x)) / dx = 1 - tanh^2, tanh = s / cap
            th = s / cap
            ds = ds * (1.0 - th * th)
        zero_dq = gl.zeros([BLOCK_M, D], gl.float32, layout=dq_layout)
        if SWAP_SDP:
            ds = ds.to(dtype)
            ds_smem.store(ds)
            ds_op = gl.convert_layout(ds, op_layout)
            dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
            fence_async_shared()
            gl.thread_barrier()  # both warpgroups' dS^T are in (dQ takes every key)
            dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False,
                                   is_async=True)
            done = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok, p_op, ds_op, ds_smem,
                                               q_t, do_t, k_smem])
        else:
            ds_smem.store(ds.to(dtype))
            fence_async_shared()
            dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_t, dk, is_async=True)
            if DQ_SPLIT > 1:  # dQ in two parts: products by K's columns, handed over in turn
                gl.static_assert(DQ_SPLIT == 2)
                zero_h = gl.zeros([BLOCK_M, DH], gl.float32, layout=dqh_layout)
                dq0_tok = warpgroup_mma(ds_smem, k_smem.slice(0, DH, dim=1), zero_h,
                                        use_acc=False, is_async=True)
                dq1_tok = warpgroup_mma(ds_smem, k_smem.slice(DH, DH, dim=1), zero_h,
                                        use_acc=False, is_async=True)
                # (they retire in order) dV done: dO read; dK done: Q and its rows read
                dv_tok = warpgroup_mma_wait(3, deps=[dv_tok, p_smem, do_t])[0]
                gl.thread_barrier()  # both warpgroups' (one thread arrives for all)
                mbarrier.arrive(do_free.index(do_slot), count=1)
                dk_tok = warpgroup_mma_wait(2, deps=[dk_tok, q_t])[0]
                gl.thread_barrier()
                mbarrier.arrive(free.index(slot), count=1)
                dq0 = warpgroup_mma_wait(1, deps=[dq0_tok, ds_smem, k_smem])[0]
                _dq_handoff(dq0 * scale, dq_smem, dq_ready, dq_free, 2 * t, DQ_BUFS, DQ_TMA)
                dq1 = warpgroup_mma_wait(0, deps=[dq1_tok, ds_smem, k_smem])[0]
                _dq_handoff(dq1 * scale, dq_smem, dq_ready, dq_free, 2 * t + 1, DQ_BUFS,
                            DQ_TMA)
                done = (dv_tok, dk_tok)
            else:
                dq_tok = warpgroup_mma(ds_smem, k_smem, zero_dq, use_acc=False,
                                       is_async=True)
                if D2 > 0:
                    dk2_tok = warpgroup_mma(ds_smem.permute((1, 0)), q2_t, dk2,
                                            is_async=True)
                    zero_dq2 = gl.zeros([BLOCK_M, D2], gl.float32, layout=kv2_layout)
                    dq2_tok = warpgroup_mma(ds_smem, k2_smem, zero_dq2, use_acc=False,
                                            is_async=True)
                    if DV2 > 0:
                        done2 = warpgroup_mma_wait(0, deps=[dv2_tok, dk2_tok, dq2_tok, dv_tok,
                                                            dk_tok, dq_tok, p_smem, ds_smem,
                                                            q_t, do_t, k_smem, q2_t, do2_t,
                                                            k2_smem])
                        dv2 = done2[0]
                        dk2 = done2[1]
                        dq2 = done2[2]
                        dv_tok = done2[3]
                        dk_tok = done2[4]
                        dq_tok = done2[5]
                    else:  # (dV in one piece of V's head dim)
                        done2 = warpgroup_mma_wait(0, deps=[dk2_tok, dq2_tok, dv_tok, dk_tok,
                                                            dq_tok, p_smem, ds_smem, q_t, do_t,
                                                            k_smem, q2_t, k2_smem])
                        dk2 = done2[0]
                        dq2 = done2[1]
                        dv_tok = done2[2]
                        dk_tok = done2[3]
                        dq_tok = done2[4]
                if EARLY_FREE:  # dV and dK done (the wgmmas retire in order): Q and dO read
                    kv = warpgroup_mma_wait(1, deps=[dv_tok, dk_tok, p_smem, q_t, do_t])
                    dv_tok = kv[0]
                    dk_tok = kv[1]
                    gl.thread_barrier()  # both warpgroups' (one thread arrives for all)
                    mbarrier.arrive(free.index(slot), count=1)
                done = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok, p_smem, ds_smem,
                                                   q_t, do_t, k_smem])
        dv = done[0]
        dk = done[1]
        if DQ_SPLIT == 1:  # this step's dQ to the writer, once it is done with its last
            buf = t % DQ_BUFS
            if DQ_NAMED:  # (every thread comes here: the 8 warps lined up as well)
                _named_barrier(lanes, DQ_BARRIER + DQ_BUFS + buf, DQ_NAMED, True)
            else:
                mbarrier.wait(dq_free.index(buf), ((t // DQ_BUFS) & 1) ^ 1)
            dq_smem.index(buf).store(done[2] * scale)
            if D2 > 0:
                dq2_smem.index(buf).store(dq2 * scale)
            if DQ_TMA:  # (the writer's TMA reads it)
                fence_async_shared()
            if DQ_NAMED:  # every thread past its products and its stores: no wait
                _named_barrier(lanes, DQ_BARRIER + buf, DQ_NAMED, False)
            else:
                # every warp is past its products' reads of the slot, P and dS, and its dQ
                # stores (one thread arrives for all)
                gl.thread_barrier()
                mbarrier.arrive(dq_ready.index(buf), count=1)
            if not (EARLY_FREE or SLOT_BY_DQ):
                mbarrier.arrive(free.index(slot), count=1)
    if D2 > 0:
        if live:  # the second pieces of dK and dV, columns D.. (dV's where V has one)
            p_dk, p_dv, sdk_h, sdk_s, sdv_h, sdv_s, dim, dim_v = outs
            if DV2 > 0:
                _store_piece(dk2, dv2, k2_smem, v2_smem, two[4], two[5], p_dk + D, p_dv + D,
                             sdk_h, sdk_s, sdv_h, sdv_s, b, h_kv, k_start, k0, seq_k, dim - D,
                             dim_v - D, scale, D, BLOCK_N, D2, DV2, VARLEN)
            else:
                _store_piece(dk2, dk2, k2_smem, k2_smem, two[4], two[4], p_dk + D, p_dk + D,
                             sdk_h, sdk_s, sdk_h, sdk_s, b, h_kv, k_start, k0, seq_k, dim - D,
                             0, scale, D, BLOCK_N, D2, 0, VARLEN)
    return dk, dv


@gluon.jit
def _store_piece(dk, dv, k_tile, v_tile, dk_desc, dv_desc, p_dk, p_dv, sdk_h, sdk_s, sdv_h,
                 sdv_s, b, h_kv, k_start, k0, seq_k, n_cols, n_cols_v, scale,
                 COL: gl.constexpr, BLOCK_N: gl.constexpr, W: gl.constexpr, WV: gl.constexpr,
                 VARLEN: gl.constexpr):
    """dK (scaled) and dV of one head-dim piece, W columns of dK and WV of dV (0: none, V's
    head dim has no such piece) from COL (`p_dk`, `p_dv` point at column COL), out through
    K's and V's shared tiles of the piece (every warp is done reading them): by TMA, or
    varlen by masked stores (rows past the sequence's keys are the next sequence's;
    `n_cols` and `n_cols_v` of the tensors' columns from COL, fewer where a head dim runs
    padded)."""
    dtype: gl.constexpr = k_tile.dtype
    gl.thread_barrier()
    k_tile.store((dk * scale).to(dtype))
    if WV > 0:
        v_tile.store(dv.to(dtype))
    if VARLEN:
        _store_rows(k_tile, p_dk + h_kv.to(gl.int64) * sdk_h, sdk_s, k_start + k0, seq_k - k0,
                    n_cols, BLOCK_N, W)
        if WV > 0:
            _store_rows(v_tile, p_dv + h_kv.to(gl.int64) * sdv_h, sdv_s, k_start + k0,
                        seq_k - k0, n_cols_v, BLOCK_N, WV)
    else:
        fence_async_shared()
        tma.async_copy_shared_to_global(
            dk_desc, [b, h_kv, k0, COL], k_tile._reinterpret(dtype, [1, 1, BLOCK_N, W],
                                                             dk_desc.layout))
        if WV > 0:
            tma.async_copy_shared_to_global(
                dv_desc, [b, h_kv, k0, COL], v_tile._reinterpret(dtype, [1, 1, BLOCK_N, WV],
                                                                 dv_desc.layout))
        tma.store_wait(0)


@gluon.jit
def _compute(q_smem, k_smem, v_smem, do_smem, p_smem, ds_smem, dq_smem, rows_smem, kv_bar,
             ready, free, dq_ready, dq_free, dk_desc, dv_desc, p_dk, p_dv, sdk_h, sdk_s, sdv_h,
             sdv_s, p_lse, p_delta, sl_b, sl_h, p_cu_q, p_cu_k, p_order, n_tiles_n, n_heads_kv,
             group, seq_q, seq_k, dim, dim_v, scale, qk_scale, cap, left, right, order, two,
             do_ring, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
             D2: gl.constexpr, DV: gl.constexpr, DV2: gl.constexpr, STAGES: gl.constexpr,
             HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
             BOTTOM_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, DQ_BUFS: gl.constexpr,
             GQA: gl.constexpr, VARLEN: gl.constexpr, COMPACT: gl.constexpr,
             SWAP_SDP: gl.constexpr, DQ_TMA: gl.constexpr, LSE_SMEM: gl.constexpr,
             MASK_CONSTANTS: gl.constexpr, EARLY_FREE: gl.constexpr, DO_STAGES: gl.constexpr,
             DQ_SPLIT: gl.constexpr, SLOT_BY_DQ: gl.constexpr, DQ_NAMED: gl.constexpr):
    """The 8 warps' steps, then dK and dV's stores (a second head-dim piece's: `_steps`)."""
    outs = (p_dk, p_dv, sdk_h, sdk_s, sdv_h, sdv_s, dim, dim_v)
    dk, dv = _steps(q_smem, k_smem, v_smem, do_smem, p_smem, ds_smem, dq_smem, rows_smem,
                    kv_bar, ready, free, dq_ready, dq_free, p_lse, p_delta, sl_b, sl_h, p_cu_q,
                    p_cu_k, p_order, n_tiles_n, n_heads_kv, group, seq_q, seq_k, scale,
                    qk_scale, cap, left, right, order, two, outs, do_ring, BLOCK_M, BLOCK_N, D,
                    D2, DV, DV2, STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, DQ_BUFS, GQA,
                    VARLEN, COMPACT, SWAP_SDP, DQ_TMA, LSE_SMEM, MASK_CONSTANTS, EARLY_FREE,
                    DO_STAGES, DQ_SPLIT, SLOT_BY_DQ, DQ_NAMED)
    n, b, b_row, h_kv, k0, diag, m_lo, m_hi, q_start, k_start, seq_q, seq_k, rot = _key_tile(
        n_tiles_n, n_heads_kv, seq_q, seq_k, p_cu_q, p_cu_k, p_order, left, right, order, BLOCK_M,
        BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN, COMPACT, 8)
    if k0 < seq_k:  # (varlen: a tile past its sequence's keys has none)
        _store_piece(dk, dv, k_smem, v_smem, dk_desc, dv_desc, p_dk, p_dv, sdk_h, sdk_s, sdv_h,
                     sdv_s, b, h_kv, k_start, k0, seq_k, dim, dim_v, scale, 0, BLOCK_N, D, DV,
                     VARLEN)


@gluon.jit
def _store_rows(tile, p_head, s_row, first, n_rows, n_cols, ROWS: gl.constexpr,
                D: gl.constexpr):
    """The compute warps' shared `tile` ([ROWS, D]) into rows first.. of a head (`p_head`,
    rows `s_row` apart, columns contiguous), its rows from n_rows on and its columns from
    n_cols on (a padded head dim's) left out: 16 bytes a thread."""
    TPC: gl.constexpr = D // 8  # threads across a row
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [8, 1], [1, 0])
    gl.thread_barrier()  # every warp's store into the tile is done
    vals = tile.load(layout)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims((first + rows).to(gl.int64) * s_row, 1) + gl.expand_dims(cols, 0)
    gl.store(p_head + offs, vals,
             mask=gl.expand_dims(rows < n_rows, 1) & gl.expand_dims(cols < n_cols, 0))


# sizes that change with the call, unspecialised (the forward's `UNSPECIALISED`: a new
# length, batch or head count compiles nothing)
UNSPECIALISED = ("sl_b", "sl_h", "sdk_h", "sdk_s", "sdv_h", "sdv_s", "n_tiles_n", "n_tiles_m",
                 "n_heads_kv", "group", "seq_q", "seq_k", "rows_q", "dim", "left", "right",
                 "order", "dim_v")


@gluon.jit(do_not_specialize=UNSPECIALISED)
def _flash_bwd_sm90(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, p_dk, p_dv, p_lse,
                    p_delta, p_dq, dq_desc, p_sem, p_cu_q, p_cu_k, sdk_h, sdk_s, sdv_h, sdv_s, sl_b,
                    sl_h, n_tiles_n, n_tiles_m, n_heads_kv, group, seq_q, seq_k, rows_q,
                    dim, scale, qk_scale, cap, left, right, order, q2_desc, k2_desc, v2_desc,
                    do2_desc, dk2_desc, dv2_desc, dq2_desc, dim_v, D: gl.constexpr,
                    D2: gl.constexpr, DV: gl.constexpr, DV2: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                    BOTTOM_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                    DETERMINISTIC: gl.constexpr, WRITER_REGS: gl.constexpr,
                    WRITER_WARPS: gl.constexpr,
                    DQ_BUFS: gl.constexpr, DQ_ADDS: gl.constexpr, GQA: gl.constexpr,
                    VARLEN: gl.constexpr, COMPACT: gl.constexpr, SWAP_SDP: gl.constexpr,
                    DQ_TMA: gl.constexpr, LSE_SMEM: gl.constexpr,
                    MASK_CONSTANTS: gl.constexpr, EARLY_FREE: gl.constexpr,
                    DO_STAGES: gl.constexpr, DQ_SPLIT: gl.constexpr,
                    FREE_ON_READ: gl.constexpr, SLOT_BY_DQ: gl.constexpr,
                    DQ_NAMED: gl.constexpr):
    """Grid (n_tiles_n x batch x K/V heads,), 8 warps. Q, dO `[B, H, Sq, D]`; K, V, dK, dV
    `[B, H_kv, Sk, D]` (TMA descriptors, blocks of one tile's rows); LSE and delta
    `[B, H, Sq]` float32 (strides sl_b, sl_h, 1); `p_dq` the fp32 dQ accumulator
    `[B, H, Sq, D]` (zeros, scaled in here; contiguous for the atomics, any layout its
    descriptor takes with DQ_TMA), `dq_desc` its TMA descriptor
    (blocks `[1, 1, BLOCK_M, D]`, for DQ_TMA); `p_sem` int32 zeros
    `[B, H, n_tiles_m]` (DETERMINISTIC). The mask as the forward's (`left`/`right` >= 0
    bound the keys; qk_scale and cap from `common.Mask.kernel_args`); `scale` is the
    softmax scale dK and dQ take. VARLEN: sequence b is rows cu[b]..cu[b+1] (`p_cu_q`,
    `p_cu_k`) of the packed `[1, H, total, D]` tensors, seq_q and seq_k the longest; dK and
    dV go out by masked stores (`p_dk`, `p_dv`, head and row strides `sdk_*`, `sdv_*`, the
    tensors' `dim` columns: D is the tiles' width, more where the head dim runs padded) and
    dQ's accumulator has `rows_q` rows a head (Sq, or the packed total). COMPACT (varlen):
    the grid is each sequence's own key tiles x K/V heads (at most), sequence by sequence,
    and `n_tiles_n` the sequences' count (`_key_tile`). D2 > 0: the head dim in two pieces
    of D and D2 columns (D192: 128 + 64; Gluon's tensors take power-of-two shapes), the
    `*2_desc` descriptors over the same tensors with blocks D2 wide, loaded and stored at
    column D, each piece its own shared buffers; None where D2 = 0. DO_STAGES: dO's slots
    (STAGES, or fewer in a ring of its own); DQ_SPLIT: dQ handed over in that many parts
    of D / DQ_SPLIT columns (`dq_desc`'s blocks that wide); SLOT_BY_DQ: a slot free once
    its step's dQ is handed over (`_dq_writer`), with no arrival of its own; DQ_NAMED (with
    SLOT_BY_DQ): that hand-off by named barriers of that many threads (the compute warps'
    and the writer's; 0: by mbarriers). V's head dim its own (`dim_v` columns, MLA's
    192/128): V, dO and dV in pieces of DV and DV2 columns (`_steps`), Q, K, dK and dQ in D
    and D2."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype))
    do_smem = gl.allocate_shared_memory(
        dtype, [DO_STAGES, BLOCK_M, DV],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV], dtype))
    k_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, D], gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
    v_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, DV], gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], dtype))
    if SWAP_SDP:  # dS^T alone (P stays in registers)
        ds_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_N, BLOCK_M],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        p_smem = ds_smem  # (unused)
    else:
        p_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        ds_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
    dq_smem = gl.allocate_shared_memory(
        gl.float32, [DQ_BUFS, BLOCK_M, D // DQ_SPLIT],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, D // DQ_SPLIT], gl.float32))
    # the second head-dim piece's buffers (D2 > 0); else the first's names, never read
    q2_smem = q_smem
    do2_smem = do_smem
    k2_smem = k_smem
    v2_smem = v_smem
    dq2_smem = dq_smem
    if D2 > 0:  # (V's second piece, DV2, is Q's where V has one)
        q2_smem = gl.allocate_shared_memory(
            dtype, [STAGES, BLOCK_M, D2],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, D2], dtype))
        if DV2 > 0:
            do2_smem = gl.allocate_shared_memory(
                dtype, [STAGES, BLOCK_M, D2],
                gl.NVMMASharedLayout.get_default_for([BLOCK_M, D2], dtype))
        k2_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_N, D2], gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype))
        if DV2 > 0:
            v2_smem = gl.allocate_shared_memory(
                dtype, [BLOCK_N, D2], gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2],
                                                                           dtype))
        dq2_smem = gl.allocate_shared_memory(
            gl.float32, [DQ_BUFS, BLOCK_M, D2],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, D2], gl.float32))
    two = (q2_desc, k2_desc, v2_desc, do2_desc, dk2_desc, dv2_desc, dq2_desc, q2_smem, k2_smem,
           v2_smem, do2_smem, dq2_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    # LSE_SMEM: each slot's LSE and delta, two rows a slot, written by the loader's work in
    # the writer's warpgroup
    rows_smem = gl.allocate_shared_memory(
        gl.float32, [2 * STAGES if LSE_SMEM else 2, BLOCK_M],
        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_free.index(i), count=1)
    for s in gl.static_range(STAGES):
        # LSE_SMEM: the loader's arrival after its rows' stores, beside TMA's
        mbarrier.init(ready.index(s), count=2 if LSE_SMEM else 1)
        mbarrier.init(free.index(s), count=1)
    # dO's ring of its own (DO_STAGES < STAGES), else the names of Q's (one ring for both)
    do_ready = ready
    do_free = free
    if DO_STAGES != STAGES:
        do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
        do_free = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(DO_STAGES):
            mbarrier.init(do_ready.index(s), count=1)
            mbarrier.init(do_free.index(s), count=1)
    do_ring = (do_ready, do_free)
    fence_async_shared()
    # COMPACT: the sequences' launch order, after the counters (`_bwd_preprocess`'s)
    p_order = p_sem + n_tiles_n.to(gl.int64) * n_heads_kv * group * n_tiles_m
    gl.warp_specialize([
        (_compute, (q_smem, k_smem, v_smem, do_smem, p_smem, ds_smem, dq_smem, rows_smem,
                    kv_bar, ready, free, dq_ready, dq_free, dk_desc, dv_desc, p_dk, p_dv,
                    sdk_h, sdk_s, sdv_h, sdv_s, p_lse, p_delta, sl_b, sl_h, p_cu_q, p_cu_k, p_order,
                    n_tiles_n, n_heads_kv, group, seq_q, seq_k, dim, dim_v, scale, qk_scale, cap,
                    left, right, order, two, do_ring, BLOCK_M, BLOCK_N, D, D2, DV, DV2, STAGES,
                    HAS_LEFT,
                    HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, DQ_BUFS, GQA, VARLEN, COMPACT, SWAP_SDP,
                    DQ_TMA, LSE_SMEM, MASK_CONSTANTS, EARLY_FREE, DO_STAGES, DQ_SPLIT,
                    SLOT_BY_DQ, DQ_NAMED)),
        # the writer's warpgroup is the loader too (`_dq_writer`)
        (_dq_writer, (dq_smem, dq_ready, dq_free, p_dq, dq_desc, p_sem, p_cu_q, p_cu_k, p_order,
                      n_tiles_n, n_tiles_m, n_heads_kv, group, seq_q, seq_k, rows_q, left,
                      right, order, q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem,
                      do_smem, kv_bar, ready, free, rows_smem, p_lse, p_delta, sl_b, sl_h, two,
                      do_ring, BLOCK_M, BLOCK_N, D, D2, DV, DV2, STAGES, HAS_LEFT, HAS_RIGHT,
                      BOTTOM_RIGHT, DETERMINISTIC, DQ_BUFS, WRITER_WARPS, DQ_ADDS, GQA, VARLEN,
                      COMPACT, DQ_TMA, LSE_SMEM, EARLY_FREE, DO_STAGES, DQ_SPLIT,
                      FREE_ON_READ, SLOT_BY_DQ, DQ_NAMED)),
    ], [WRITER_WARPS], [WRITER_REGS])
    # every mbarrier invalidated once both partitions are done: PTX allows an mbarrier's
    # bytes no other use until it is invalidated, and Triton's allocator gives an mbarrier's
    # bytes to scratch once it has no later use. Without this, the writer's spin
    # broadcast its counter through an mbarrier unused in the configuration (dQ's "ready"
    # under named barriers), and the deterministic backward hung, or stopped on an illegal
    # instruction or address, beside other processes' kernels (issue 33: evidence
    # 20261207T1012Z, T1147Z, T1157Z)
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(DQ_BUFS):
        mbarrier.invalidate(dq_ready.index(i))
        mbarrier.invalidate(dq_free.index(i))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(free.index(s))
    if DO_STAGES != STAGES:
        for s in gl.static_range(DO_STAGES):
            mbarrier.invalidate(do_ready.index(s))
            mbarrier.invalidate(do_free.index(s))


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
