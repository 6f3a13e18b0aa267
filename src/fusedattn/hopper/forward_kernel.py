"""The Hopper forward kernel (`forward.py` launches it).

A persistent grid: one program (CTA) per SM walks work items, where an item is CONSUMERS x
BLOCK_M query rows of one (batch, head): items t = pid, pid + programs, ... (a fixed share),
or, under causal masks (CLAIM, `forward.claims`), pid first and then each next item claimed
from the launch's counter as the current one starts (`_claim`: FA3's dynamic scheduler), the
loader handing each to the consumers with its Q (`_publish`, `_claimed`). One program an
item (the grid as large as the items) is the third form. A loader and two or three
consumers, partitions of warps, share its shared memory and walk the same items:

    loader (1 warp, few registers)      each item's Q tiles into Q slot items % Q_SLOTS
                                        (once every consumer is done with the slot's last
                                        item), then its K_j and V_j by TMA into a ring of
                                        STAGES slots that runs on across items; Q, K and V
                                        each have a ready and a free mbarrier per slot
    consumer 0, 1 (and 2) (a warpgroup each, BLOCK_M rows each)
        S = Q K_j^T        async wgmma, Q and K from shared memory
        softmax            in registers: the online update of m, l (exp2, scale folded in)
        O = O * alpha + P V_j   async wgmma, P from registers, V from shared memory
        release            K_j once S is done, V_j once P V is: an arrive each
        store              O (normalised) through the warpgroup's Q tile and a TMA store
                           (varlen: a masked store), the LSE; then Q is released

With one Q slot the loader waits at each item's end, until the consumers have stored O
through Q's tiles, before it loads the next item's Q and then its keys; with two, the next
item's Q and first K and V load under this item's last products and stores. An item
outside its sequence (varlen) costs a skip, not a launch. Items are ordered by head, query
tiles of one head together (its K/V stay in L2; with heads first the H200 ran 11-15%
slower at D128, S4096). Causal takes the longest tiles first across a section of heads
whose K and V fit the L2 (`forward.lpt_section`; FA4's order on Hopper): a wave's programs
end together, and the grid's last are its shortest.

The consumer warpgroups run the same loop on their own rows; the tensor cores are
shared, so while one warpgroup runs its softmax the others' products run (FA3's inter-
warpgroup overlap; PINGPONG makes them take turns to issue, in order, by an mbarrier
each). Inside a
warpgroup (FA3's intra-warpgroup overlap), step j issues S_j = Q K_j^T and then
O += P_{j-1} V_{j-1}, waits for S_j only, and runs the softmax of S_j while the second
product runs: P_{j-1} and P_j both live in registers for that while.

Masks are the portable kernels' (`tiles/common`): a key is seen when it is inside the
sequence, no later than pos + right and no earlier than pos - left; a tile is masked
element-wise only where one of those bounds cuts it. Rows that see no key write O = 0 and
LSE = -inf. Varlen: the tensors are `[1, H, total, D]` and sequence b is rows
cu[b]..cu[b+1]; a tile that runs past its sequence reads the next one's rows, which the
masks drop (keys) or the stores skip (queries). Softcap c: scores c * tanh(s / c), the
portable kernels' formula (`_softcap`)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fusedattn.launch import settle_keys


@gluon.jit
def _load_rows(desc, desc2, coord_b, coord_h, row, bar, smem, smem2, D_A: gl.constexpr,
               D_B: gl.constexpr):
    """One tile of rows by TMA onto `bar`: its first D_A columns into `smem`, and with a
    second head-dim piece (D_B > 0) the next D_B into `smem2`."""
    rows: gl.constexpr = desc.block_type.shape[2]
    tma.async_copy_global_to_shared(
        desc, [coord_b, coord_h, row, 0], bar,
        smem._reinterpret(desc.dtype, [1, 1, rows, D_A], desc.layout))
    if D_B > 0:
        tma.async_copy_global_to_shared(
            desc2, [coord_b, coord_h, row, D_A], bar,
            smem2._reinterpret(desc2.dtype, [1, 1, rows, D_B], desc2.layout))


@gluon.jit
def _load_v(desc, desc2, coord_b, coord_h, row, bar, smem, smem2, DV_A: gl.constexpr,
            DV_B: gl.constexpr, FP8: gl.constexpr):
    """V's key tile `row` onto `bar`: its rows (`_load_rows`), or under FP8 its columns of
    V^T (`[.., Dv, S]`: the wgmma takes float8 operands K-major only, and P V's K is the
    key), one [DV_A, BLOCK_N] box."""
    if FP8:
        cols: gl.constexpr = desc.block_type.shape[3]
        tma.async_copy_global_to_shared(
            desc, [coord_b, coord_h, 0, row], bar,
            smem._reinterpret(desc.dtype, [1, 1, DV_A, cols], desc.layout))
    else:
        _load_rows(desc, desc2, coord_b, coord_h, row, bar, smem, smem2, DV_A, DV_B)


@gluon.jit
def _release(bar, THREAD_ARRIVES: gl.constexpr):
    """A consumer warpgroup's arrival on `bar` (a slot freed, a ping-pong turn handed over).
    THREAD_ARRIVES: each of its 128 threads arrives by itself (`cp.async.mbarrier.arrive
    .noinc`, with no cp.async in flight: at once), and the barrier counts 128 a warpgroup.
    Triton 3.6 lowers `mbarrier.arrive` to one thread's arrival behind a `bar.sync` of the
    warpgroup, which lines up its four warps at every release; a thread's own arrival needs
    no such wait, since the phase completes only once every thread has arrived. The lined-up
    warps ran faster (`forward.THREAD_ARRIVES`, off by default): a warpgroup's wgmma issues
    once all four warps reach it."""
    if THREAD_ARRIVES:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _document(t, n_docs, n_heads, p_cu_q, TILE_M: gl.constexpr, WARPS: gl.constexpr,
              p_order=None, ORDERED: gl.constexpr = False):
    """Varlen's item t: (document b, the first item of b). Items run document by document,
    each document's ceil(len / TILE_M) tiles x n_heads of them (FA4's varlen grid: no item
    past a document's end, so at most n_docs - 1 empty items a head at the grid's end,
    whose b is n_docs). b counts the documents whose items all come before t: a prefix sum
    of the item counts, 32 documents a step (`WARPS`: the calling partition's warps).
    ORDERED: the documents run in the order `p_order` lists them, and b is a rank in it."""
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    lane = gl.arange(0, 32, layout=lanes)
    before = t * 0  # items of the documents of the steps before
    b = t * 0
    first = t * 0
    for c in range(0, n_docs, 32):
        i = c + lane
        inside = i < n_docs
        if ORDERED:
            i = gl.load(p_order + i, mask=inside, other=0)
        lo = gl.load(p_cu_q + i, mask=inside, other=0)
        hi = gl.load(p_cu_q + i + 1, mask=inside, other=0)
        items = gl.where(inside, (hi - lo + TILE_M - 1) // TILE_M, 0) * n_heads
        ends = before + gl.associative_scan(items, 0, _add)
        done = inside & (ends <= t)
        b += gl.sum(done.to(gl.int32), 0)
        first = gl.maximum(first, gl.max(gl.where(done, ends, 0), 0))
        before += gl.sum(items, 0)
    return b, first


@gluon.jit
def _claim(p_claim):
    """The next item of a CLAIM launch: a relaxed add on the launch's counter p_claim[0] (by
    one lane; the warp's reduction hands every lane its value)."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_layout)
    got = gl.atomic_add(p_claim + lane * 0, gl.full([32], 1, gl.int32, lane_layout),
                        mask=lane == 0, sem="relaxed")
    return gl.max(gl.where(lane == 0, got, 0), 0)


@gluon.jit
def _claims_done(p_claim, programs):
    """A CLAIM program's last claim is made: count it out on p_claim[1]; the last of the
    `programs` out (every claim made by then: acquire-release) puts both counters back to
    zero, so the next launch on the stream starts from zero."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_layout)
    first = lane == 0
    out = gl.atomic_add(p_claim + 1 + lane * 0, gl.full([32], 1, gl.int32, lane_layout),
                        mask=first, sem="acq_rel")
    if gl.max(gl.where(first, out, 0), 0) == programs - 1:
        zero = gl.full([32], 0, gl.int32, lane_layout)
        gl.atomic_xchg(p_claim + lane * 0, zero, mask=first, sem="relaxed")
        gl.atomic_xchg(p_claim + 1 + lane * 0, zero, mask=first, sem="release")


@gluon.jit
def _publish(slot, t, doc, DOC_ROW: gl.constexpr):
    """The loader's lane 0 writes item t into a Q slot's `claimed` row, before the arrival
    (by that lane) that completes the slot's phase: its release orders the write. DOC_ROW:
    lanes 1-6 write varlen's document of the item (`_doc_bounds`' six values), so that the
    consumers take it from the row and not by `_doc_bounds`' global loads, whose latency
    would fall between an item's Q and its first product (the loader, an item or two ahead,
    hides its own)."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_layout)
    row = gl.full([32], t, gl.int32, lane_layout)
    if DOC_ROW:
        for i in gl.static_range(6):
            row = gl.where(lane == i + 1, doc[i], row)
    slot.store(row)


@gluon.jit
def _claimed_row(slot):
    """A Q slot's `claimed` row and its lanes' indices, read by a consumer warpgroup once the
    slot's phase completed."""
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return slot.load(row_layout), gl.arange(0, 32, layout=row_layout)


@gluon.jit
def _row_entry(row, lane, i):
    """Lane i's entry of a `claimed` row (`_claimed_row`)."""
    return gl.max(gl.where(lane == i, row, 0), 0)


@gluon.jit
def _claimed(slot):
    """The item in a Q slot's `claimed` row (its lane-0 entry)."""
    row, lane = _claimed_row(slot)
    return _row_entry(row, lane, 0)


@gluon.jit
def _claimed_doc(slot):
    """Varlen's document of the item in a Q slot's `claimed` row (`_publish`'s DOC_ROW), from
    one read of the row."""
    row, lane = _claimed_row(slot)
    return (_row_entry(row, lane, 1), _row_entry(row, lane, 2), _row_entry(row, lane, 3),
            _row_entry(row, lane, 4), _row_entry(row, lane, 5), _row_entry(row, lane, 6))


@gluon.jit
def _doc_bounds(t, n_docs, n_heads, p_cu_q, p_cu_k, TILE_M: gl.constexpr, WARPS: gl.constexpr):
    """Varlen's item t: (its document b, b's first item, b's first query row, query rows,
    first key row, keys). b is n_docs for the grid's last, empty items; their bounds are the
    last document's (cu has n_docs + 1 entries)."""
    b, first = _document(t, n_docs, n_heads, p_cu_q, TILE_M, WARPS)
    safe = gl.minimum(b, n_docs - 1)
    q_start = gl.load(p_cu_q + safe)
    k_start = gl.load(p_cu_k + safe)
    return (b, first, q_start, gl.load(p_cu_q + safe + 1) - q_start, k_start,
            gl.load(p_cu_k + safe + 1) - k_start)


@gluon.jit
def _item(t, doc, n_items, n_tiles_m, n_heads, group, seq_q, seq_k, left, right, section,
          TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
          HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, VARLEN: gl.constexpr):
    """Work item t: (live, batch row, head, kv head, first q row, first k row, the tile's
    first row in its sequence, Sq, Sk, diagonal offset, key span lo..hi, batch or document
    index). Dense: t = (b * n_heads + h) * n_tiles_m + tile, or under a causal mask the
    tiles heaviest first across sections of `section` heads. VARLEN: `n_tiles_m` is the
    documents' count and items go document by document (`_document`), each document's
    heads one after another; `live` is False for the grid's last, empty items."""
    if VARLEN:  # one batch row, sequences along the rows; `doc` is `_doc_bounds`' (t's)
        b, first, q_start, seq_q, k_start, seq_k = doc
        live = b < n_tiles_m
        tiles = gl.maximum(gl.cdiv(seq_q, TILE_M), 1)
        h = (t - first) // tiles
        tile_m = (t - first) % tiles
        if HAS_RIGHT and not HAS_LEFT:  # causal: the longest tiles of a head first
            tile_m = tiles - 1 - tile_m
        b_row = 0
    elif HAS_RIGHT and not HAS_LEFT:
        # causal: the longest tiles first across a section of `section` (batch, head)
        # pairs, t = (first pair of the section) * n_tiles_m + rank * pairs + pair, rank 0
        # the last tile; the last section may hold fewer pairs. 1: a head's tiles together
        first_bh = t // (section * n_tiles_m) * section
        pairs = gl.minimum(section, n_items // n_tiles_m - first_bh)
        within = t - first_bh * n_tiles_m
        rank = within // pairs
        bh = first_bh + within - rank * pairs
        tile_m = n_tiles_m - 1 - rank
    else:
        bh = t // n_tiles_m
        tile_m = t % n_tiles_m
    if not VARLEN:
        b = bh // n_heads
        h = bh % n_heads
        q_start = 0
        k_start = 0
        b_row = b
    m_start = tile_m * TILE_M
    diag = 0
    if BOTTOM_RIGHT:
        diag = seq_k - seq_q
    # the key tiles this item's rows see (`common._spans`' lo, hi)
    lo = 0
    hi = seq_k
    if HAS_LEFT:
        lo = gl.maximum(m_start + diag - left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = gl.minimum(gl.minimum(m_start + TILE_M, seq_q) - 1 + diag + right + 1, seq_k)
    hi = gl.maximum(hi, lo)
    ok = m_start < seq_q
    if VARLEN:
        ok = ok & live
    return (ok, b_row, h, h // group, q_start, k_start, m_start, seq_q, seq_k, diag, lo, hi, b)


@gluon.jit
def _loader(descs, bufs, args, p_cu_t, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            D_A: gl.constexpr, D_B: gl.constexpr, DV_A: gl.constexpr, DV_B: gl.constexpr,
            STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
            BOTTOM_RIGHT: gl.constexpr, VARLEN: gl.constexpr, SHARED_KV: gl.constexpr,
            FP8: gl.constexpr, CONSUMERS: gl.constexpr, Q_SLOTS: gl.constexpr,
            CLAIM: gl.constexpr, DOC_ROW: gl.constexpr):
    """The producer: per item (its program's share, or under CLAIM the item it claimed as the
    last one's Q went out; under CLAIM or DOC_ROW written into the slot's `claimed` row, with
    DOC_ROW's document, an empty varlen item passed over; at the end n_items, the consumers'
    sign to stop), the consumers' Q tiles into
    Q slot items % Q_SLOTS on that slot's barrier, once all released the slot's last item (with
    two slots the next item's Q loads while the consumers run this one's, and the loader is not
    held at an item's end before it loads the next item's keys), then each key tile's K and V
    into ring slot n % STAGES (n counts this program's key tiles over all its items), each once
    every consumer released the slot's last use (K after its S = Q K^T, V after its P V: K runs
    ahead of V). FP8 with VARLEN: V^T's sequences start at their own columns, `p_cu_t`
    (`transpose.py`). `descs` are Q's, K's and V's descriptors (`_flash_fwd_sm90`), `bufs` and
    `args` the consumers'."""
    q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc = descs
    (q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem, q_bar, q_free, k_bar, v_bar, k_free,
     v_free, o_smem, o_desc, o2_desc, claimed) = bufs
    (p_o, p_lse, p_sinks, p_descale, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, n_items,
     n_tiles_m, n_heads, group, seq_q, seq_k, p_cu_q, p_cu_k, qk_scale, cap, left, right,
     dim_v, section, p_claim) = args
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if D_B > 0
                                                        else 0)
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if D_B > 0
                                                        else 0)
    v_bytes: gl.constexpr = v_desc.block_type.nbytes + (v2_desc.block_type.nbytes if DV_B > 0
                                                        else 0)
    n = 0       # key tiles loaded so far
    items = 0   # live items so far
    t = gl.program_id(0)
    while t < n_items:
        doc = (t, t, t, t, t, t)  # (dense: unread)
        if VARLEN:
            doc = _doc_bounds(t, n_tiles_m, n_heads, p_cu_q, p_cu_k, CONSUMERS * BLOCK_M, 1)
        live, b_row, h, h_kv, q_start, k_start, m_start, sq, sk, diag, lo, hi, b = _item(
            t, doc, n_items, n_tiles_m, n_heads, group, seq_q, seq_k, left, right, section,
            CONSUMERS * BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN)
        t_next = t + gl.num_programs(0)
        if CLAIM and not live:  # (varlen's empty items: claim past them)
            t_next = gl.num_programs(0) + _claim(p_claim)
        if live:
            # a fresh barrier counts as having completed the phase before its first: the
            # first waits on the free barriers pass at once
            qs = items % Q_SLOTS
            mbarrier.wait(q_free.index(qs), ((items // Q_SLOTS) & 1) ^ 1)
            if CLAIM or DOC_ROW:  # the item goes to the consumers with its Q (the expect's
                _publish(claimed.index(qs), t, doc, DOC_ROW)  # arrival)
            mbarrier.expect(q_bar.index(qs), CONSUMERS * q_bytes)
            for c in gl.static_range(CONSUMERS):
                _load_rows(q_desc, q2_desc, b_row, h, q_start + m_start + c * BLOCK_M,
                           q_bar.index(qs), q_smem.index(qs * CONSUMERS + c),
                           q2_smem.index(qs * CONSUMERS + c), D_A, D_B)
            if CLAIM:  # the next item, claimed now: its latency is behind this item's keys
                t_next = gl.num_programs(0) + _claim(p_claim)
            v_start = k_start
            if FP8 and VARLEN:  # V^T's sequence b starts on a 16-byte column of its own
                v_start = gl.load(p_cu_t + b)
            for j in range(gl.cdiv(hi - lo, BLOCK_N)):
                slot = n % STAGES
                phase = ((n // STAGES) & 1) ^ 1
                row = k_start + lo + j * BLOCK_N
                v_row = v_start + lo + j * BLOCK_N
                mbarrier.wait(k_free.index(slot), phase)
                if SHARED_KV:  # K and V of the slot on one barrier, freed together
                    mbarrier.expect(k_bar.index(slot), k_bytes + v_bytes)
                else:
                    mbarrier.expect(k_bar.index(slot), k_bytes)
                _load_rows(k_desc, k2_desc, b_row, h_kv, row, k_bar.index(slot),
                           k_smem.index(slot), k2_smem.index(slot), D_A, D_B)
                if SHARED_KV:
                    _load_v(v_desc, v2_desc, b_row, h_kv, v_row, k_bar.index(slot),
                            v_smem.index(slot), v2_smem.index(slot), DV_A, DV_B, FP8)
                else:
                    mbarrier.wait(v_free.index(slot), phase)
                    mbarrier.expect(v_bar.index(slot), v_bytes)
                    _load_v(v_desc, v2_desc, b_row, h_kv, v_row, v_bar.index(slot),
                            v_smem.index(slot), v2_smem.index(slot), DV_A, DV_B, FP8)
                n += 1
            items += 1
        t = t_next
    if CLAIM or DOC_ROW:
        # no item left: the consumers get n_items for the next slot's item, and under CLAIM
        # the last program out puts the counters back to zero for the next launch
        qs = items % Q_SLOTS
        mbarrier.wait(q_free.index(qs), ((items // Q_SLOTS) & 1) ^ 1)
        _publish(claimed.index(qs), n_items, (0, 0, 0, 0, 0, 0), False)
        mbarrier.arrive(q_bar.index(qs), count=1)
        if CLAIM:
            _claims_done(p_claim, gl.num_programs(0))


@gluon.jit
def _softcap(x):
    """tanh(x), as the portable kernels' `_scores` computes it: the Taylor series to x^9
    for |x| < 0.3, 1 - 2 / (exp(2x) + 1) elsewhere."""
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    exp_form = 1.0 - 2.0 / (gl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)
    return gl.where(gl.abs(x) < 0.3, series, exp_form)


@gluon.jit
def _softmax_tile(s, m_i, l_i, start_n, pos, first_pos, last_pos, seq_k, qk_scale, cap, left,
                  right, BLOCK_N: gl.constexpr, col_s: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, LANE_SUM: gl.constexpr,
                  MAX_SPLIT: gl.constexpr, P_OFFSET: gl.constexpr, MASK_FORM: gl.constexpr):
    """The online-softmax step of one tile of raw scores `s` (keys start_n ...): the mask
    where a bound cuts the tile, then (p, m, l, alpha) in base 2, the scale folded into the
    exponent (m is kept scaled). SOFTCAP: the scores are cap * tanh(s * qk_scale) first
    (`common.Mask.kernel_args`: qk_scale = scale / c, cap = c * log2(e)). LANE_SUM: l is
    `_lane_sums`' [BLOCK_M, 4], each of a row's four lanes summing its own columns (no
    shuffles a tile; `_row_sums` adds them once, after the loop). MAX_SPLIT: the row max's
    chains a thread (`_row_max`). P_OFFSET: p is 2^P_OFFSET times the softmax's (FP8's P
    scale, folded into the exponent's subtraction; l carries it too). MASK_FORM (`forward.
    MASK_FORM`): 0 the key indices a [BLOCK_N] tensor, 1 the bounds against constants
    (`_masked`), 2 as 1 with the row max taken once, after the mask's branch."""
    if SOFTCAP:
        s = _softcap(s * qk_scale) * cap
        scale = 1.0
    else:
        scale = qk_scale
    edge = start_n + BLOCK_N > seq_k
    if HAS_RIGHT:
        edge = edge | (start_n + BLOCK_N - 1 > first_pos + right)
    if HAS_LEFT:
        edge = edge | (start_n < last_pos - left)
    if MASK_FORM == 2:  # the row max once, after the branch (one copy in the loop)
        if edge:
            s = _masked(s, start_n, pos, seq_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        m_new = gl.maximum(m_i, _row_max(s, BLOCK_N, MAX_SPLIT) * scale)
        # a row that has seen no key (only where a tile was masked) keeps m = -inf:
        # subtract 0 instead (no -inf - -inf)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    elif edge:
        if MASK_FORM == 1:
            s = _masked(s, start_n, pos, seq_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        else:
            cols = start_n + gl.arange(0, BLOCK_N, layout=col_s)
            valid = gl.expand_dims(cols < seq_k, 0)
            if HAS_RIGHT:
                valid = valid & (gl.expand_dims(cols, 0) <= gl.expand_dims(pos + right, 1))
            if HAS_LEFT:
                valid = valid & (gl.expand_dims(cols, 0) >= gl.expand_dims(pos - left, 1))
            s = gl.where(valid, s, float("-inf"))
        m_new = gl.maximum(m_i, _row_max(s, BLOCK_N, MAX_SPLIT) * scale)
        # a row that has seen no key keeps m = -inf: subtract 0 instead (no -inf - -inf)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, _row_max(s, BLOCK_N, MAX_SPLIT) * scale)
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    if P_OFFSET != 0.0:
        p = gl.exp2(s * scale - gl.expand_dims(m_use - P_OFFSET, 1))
    else:
        p = gl.exp2(s * scale - gl.expand_dims(m_use, 1))
    if LANE_SUM:
        lane_alpha = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout),
                                       assert_trivial=True)
        l_i = l_i * gl.expand_dims(lane_alpha, 1) + _lane_sums(p, BLOCK_N)
    else:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _index_view(x):
    """A wgmma accumulator `x` [R, N] as [R, N / 8, 4, 2], with its column indices split in
    two: `const` [1, N / 8, 1, 2], 8j + e, a constant in each register, and `lane` [1, 1, 4,
    1], 2(lane % 4), one value a thread (column = const + lane). Compares against a bound
    written as a limit on `const` then hold no register of column indices (`_masked`,
    `backward_kernel._masked_p`)."""
    R: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    x4 = gl.reshape(x, [R, N // 8, 4, 2])
    l4: gl.constexpr = x4.type.layout
    l3: gl.constexpr = gl.SliceLayout(3, l4)
    l2: gl.constexpr = gl.SliceLayout(2, l3)
    j = gl.arange(0, N // 8, layout=gl.SliceLayout(0, l2)) * 8
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3))) * 2
    e = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, l4))))
    const = gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 0), 2), 3) + gl.expand_dims(
        gl.expand_dims(gl.expand_dims(e, 0), 1), 2)
    lane = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 3)
    return x4, const, lane


@gluon.jit
def _masked(s, start_n, pos, seq_k, left, right, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
            HAS_RIGHT: gl.constexpr):
    """`s` (a wgmma accumulator of keys start_n ...) with -inf where a key is out of bounds:
    at or past seq_k, past pos + right (HAS_RIGHT), before pos - left (HAS_LEFT). Each
    bound is compared in `_index_view`'s split, with constants, where a [BLOCK_N] tensor of
    key indices (`gl.arange`) is a register a key held across the key loop."""
    M: gl.constexpr = s.shape[0]
    s4, const, lane = _index_view(s)
    l3: gl.constexpr = gl.SliceLayout(3, s4.type.layout)
    rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l3))
    # each bound as a limit on the constants: key < seq_k <=> 8j + e < seq_k - start_n - 2 lane
    limit = seq_k - start_n - lane
    valid = const < limit
    if HAS_RIGHT:
        top = gl.convert_layout(pos + right - start_n, rows)
        top4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(top, 1), 2), 3) - lane
        valid = valid & (const <= top4)
    if HAS_LEFT:
        bottom = gl.convert_layout(pos - left - start_n, rows)
        bottom4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(bottom, 1), 2), 3) - lane
        valid = valid & (const >= bottom4)
    s4 = gl.where(valid, s4, float("-inf"))
    return gl.convert_layout(gl.reshape(s4, [M, BLOCK_N]), s.type.layout, assert_trivial=True)


@gluon.jit
def _row_max(s, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr):
    """The row max of a wgmma accumulator `s`, as `gl.max(s, axis=1)` lays it out. A thread holds
    BLOCK_N / 4 columns of each of its two rows, and `gl.max` folds them one after another: a
    chain of BLOCK_N / 4 dependent FMNMXs a row. SPLIT > 1 folds each row in SPLIT chains of
    BLOCK_N / 8 / SPLIT after a first step of independent pairs (the columns as
    `_lane_sums` reshapes them, the split on the highest bits), then the chains' ends and the
    four lanes: the same FMNMXs and shuffles, a shorter critical path."""
    if SPLIT > 1:
        gl.static_assert(BLOCK_N // 8 % SPLIT == 0)
        M: gl.constexpr = s.shape[0]
        x = gl.max(gl.reshape(s, [M, SPLIT, BLOCK_N // 8 // SPLIT, 4, 2]), axis=4)
        x = gl.max(gl.max(x, axis=2), axis=1)
        return gl.convert_layout(gl.max(x, axis=1), gl.SliceLayout(1, s.type.layout),
                                 assert_trivial=True)
    return gl.max(s, axis=1)


@gluon.jit
def _lane_sums(p, BLOCK_N: gl.constexpr):
    """A wgmma accumulator's [BLOCK_M, BLOCK_N] summed along its rows within each thread:
    [BLOCK_M, 4], the four lanes that share a row keeping their own sums. The accumulator
    gives a lane columns 8j + 2(lane % 4) + {0, 1}, so the reshape's axes 1 and 3 are the
    thread's own registers and axis 2 the lanes."""
    return gl.sum(gl.sum(gl.reshape(p, [p.shape[0], BLOCK_N // 8, 4, 2]), axis=3), axis=1)


@gluon.jit
def _row_sums(l_i, row_layout: gl.constexpr, LANE_SUM: gl.constexpr):
    """l as `[BLOCK_M]` in `row_layout`: LANE_SUM's four lanes' sums added (2 shuffles)."""
    if LANE_SUM:
        l_i = gl.convert_layout(gl.sum(l_i, axis=1), row_layout, assert_trivial=True)
    return l_i


@gluon.jit
def _p_operand(p, layout: gl.constexpr, dtype: gl.constexpr, FP8: gl.constexpr,
               P_SCALE: gl.constexpr, FP8_PACK: gl.constexpr):
    """P as the P V wgmma takes it from registers: in the inputs' dtype, or under FP8 times
    P_SCALE rounded to e4m3 (the portable kernel's `_p_as`; O's epilogue divides it out).
    FP8_PACK: p comes scaled (`_softmax_tile`'s P_OFFSET), and each four of a thread's
    values go to e4m3 into one register by two `cvt.rn.satfinite.e4m3x2.f32` (`_e4m3x4`)."""
    if FP8:
        if not FP8_PACK:
            p = p * P_SCALE
        # keys relabelled within each 16 (`transpose.py` writes V^T's columns in this
        # order): k = a0 + 2 a1 + 4 a2 + 8 a3 becomes a0 + 2 a3 + 4 a1 + 8 a2, so that the
        # keys each thread holds in the accumulator are the ones the float8 operand layout
        # wants of it (the accumulator: a0, a3 in registers, a1, a2 the lane's; the
        # operand: its two low key bits in registers, the next two the lane's)
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p = p.reshape([M, N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([M, N])
        # (in fp32: the layouts now differ by the order of a thread's registers alone;
        # Triton 3.6's `.to` then still unpacks and repacks the float8 bytes: at D128 a key
        # tile's loop held 85 PRMTs and 64 LOP3s for 64 values a thread, FP8_PACK's asm
        # packs them itself)
        p = gl.convert_layout(p, layout)
        if FP8_PACK:
            return _e4m3x4(p)
        return p.to(dtype)
    return gl.convert_layout(p.to(dtype), layout)


@gluon.jit
def _p_carried(p, layout: gl.constexpr, dtype: gl.constexpr, FP8: gl.constexpr,
               P_SCALE: gl.constexpr, FP8_PACK: gl.constexpr):
    """What the key loop carries of a step's P to the next step's P V: its operand
    (`_p_operand`), or under FP8_PACK p itself, in float32, made the operand at its use
    (`_p_at_use`). Triton 3.6 carries float8 values over a loop's back edge as bytes: each
    packed register was taken apart at the step's end and put together again at the
    next one's start (PRMTs and LOP3s), whatever made it."""
    if FP8_PACK:  # (one return: Gluon wants a function's returns of one type)
        kept = p
    else:
        kept = _p_operand(p, layout, dtype, FP8, P_SCALE, FP8_PACK)
    return kept


@gluon.jit
def _p_at_use(p_op, layout: gl.constexpr, dtype: gl.constexpr, FP8: gl.constexpr,
              P_SCALE: gl.constexpr, FP8_PACK: gl.constexpr):
    """P V's operand from what `_p_carried` kept."""
    if FP8_PACK:
        operand = _p_operand(p_op, layout, dtype, FP8, P_SCALE, FP8_PACK)
    else:
        operand = p_op
    return operand


@gluon.jit
def _e4m3x4(p):
    """float32 p to float8 e4m3 (round to nearest, saturating, as `.to` rounds), four of a
    thread's consecutive values a 32-bit register: in the P V operand's layout (k_width 4)
    those are the four keys one operand register holds, lowest first."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _wait_pv(acc_tok, p_op, v_tile, FP8: gl.constexpr):
    """O after its P V wgmma (one piece), holding P's registers and V's slot until it is
    done. Not FP8's P: Triton 3.6 cannot hold 8-bit registers across the wait ("Unexpected
    bitwidth in WGMMAWaitGroupOp"); ptxas keeps a wgmma's register operands until its
    wait_group by itself, and P's next value is a new register tensor."""
    if FP8:
        acc = warpgroup_mma_wait(0, deps=[acc_tok, v_tile])[0]
    else:
        acc = warpgroup_mma_wait(0, deps=[acc_tok, p_op, v_tile])[0]
    return acc


@gluon.jit
def _v_operand(tile, FP8: gl.constexpr):
    """A V slot as P V's B operand, `[BLOCK_N, Dv]`: the slot itself, or under FP8 the
    transpose of its V^T tile (K-major, as float8 wgmmas need)."""
    operand = tile
    if FP8:
        operand = tile.permute((1, 0))
    return operand


@gluon.jit
def _store_piece(out, o_desc, tile, p_o, o_base, so_s, so_d, b_row, h, q_start, first, col0,
                 seq_q, dim_v, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr, VARLEN: gl.constexpr,
                 VARLEN_TMA: gl.constexpr):
    """Columns col0 ... col0 + WIDTH of a warpgroup's normalised O tile `out`, through the
    warpgroup's Q tile (done with): a TMA store clipped at Sq and at O's last column, or
    (varlen, where rows past the sequence belong to the next one) a masked store of it read
    back in rows of 16 bytes a thread (from registers straight, its 64-bit addresses
    spilled), of O's columns under dim_v. VARLEN_TMA: a varlen tile whose rows all lie in
    its sequence (all but a sequence's last) goes out by the TMA store too, at its rows in
    the packed tensor (q_start + first)."""
    tile.store(out)
    # (q_start is 0 where not VARLEN; the constexprs decide the condition where they can)
    if VARLEN and not (VARLEN_TMA and first + BLOCK_M <= seq_q):
        _store_rows(tile, p_o, o_base, so_s, so_d, first, col0, seq_q, dim_v, BLOCK_M, WIDTH)
    else:
        _store_tma(out, o_desc, tile, b_row, h, q_start + first, col0, BLOCK_M, WIDTH)


@gluon.jit
def _store_tma(out, o_desc, tile, b_row, h, row, col0, BLOCK_M: gl.constexpr,
               WIDTH: gl.constexpr):
    """`_store_piece`'s TMA store of the tile at O's row `row` (clipped at O's bounds)."""
    fence_async_shared()
    tma.async_copy_shared_to_global(
        o_desc, [b_row, h, row, col0],
        tile._reinterpret(out.dtype, [1, 1, BLOCK_M, WIDTH], o_desc.layout))


@gluon.jit
def _store_rows(tile, p_o, o_base, so_s, so_d, first, col0, seq_q, dim_v, BLOCK_M: gl.constexpr,
                WIDTH: gl.constexpr):
    """`_store_piece`'s masked store: the tile read back in rows of 16 bytes a thread, rows
    under seq_q and columns under dim_v."""
    TPC: gl.constexpr = 32 if WIDTH >= 256 else WIDTH // 8  # threads across a row
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [4, 1], [1, 0])
    vals = tile.load(rows_layout)
    rows_o = first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    cols_o = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, rows_layout))
    offs = gl.expand_dims(rows_o * so_s, 1) + gl.expand_dims(cols_o * so_d, 0)
    # (columns from dim_v on are the padding of a head dim the kernel runs padded)
    gl.store(p_o + o_base + offs, vals, mask=gl.expand_dims(rows_o < seq_q, 1)
             & gl.expand_dims(cols_o < dim_v, 0))


@gluon.jit
def _free_late(pending, q_free):
    """LATE_FREE: the Q slot `pending` (>= 0) of the item before, whose O went out through
    its tiles, released once that TMA store has read them (by now: a step of this item has
    been issued since), so that the consumers do not wait on the store's read at each item's
    end; -1 after (nothing pending)."""
    if pending >= 0:
        tma.store_wait(0)
        gl.thread_barrier()
        mbarrier.arrive(q_free.index(pending), count=1)
    return pending * 0 - 1


@gluon.jit
def _consumer(bufs, args, c: gl.constexpr, my_turn, next_turn, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, DV_A: gl.constexpr,
              DV_B: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
              VARLEN: gl.constexpr, WRITE_LSE: gl.constexpr, PINGPONG: gl.constexpr,
              SINKS: gl.constexpr, SHARED_KV: gl.constexpr, FP8: gl.constexpr,
              P_SCALE: gl.constexpr, THREAD_ARRIVES: gl.constexpr, CONSUMERS: gl.constexpr,
              LANE_SUM: gl.constexpr, MAX_SPLIT: gl.constexpr, FP8_PACK: gl.constexpr,
              MASK_FORM: gl.constexpr, Q_SLOTS: gl.constexpr, CLAIM: gl.constexpr,
              DOC_ROW: gl.constexpr, VARLEN_TMA: gl.constexpr, LATE_FREE: gl.constexpr,
              EARLY_FREE: gl.constexpr, Q_REGS: gl.constexpr):
    """Warpgroup c's BLOCK_M rows of each item (the item's rows c * BLOCK_M ...; the items of
    its program's share, or under CLAIM or DOC_ROW those the loader publishes in each Q slot's
    `claimed` row, up to n_items):
    the key loop and the stores. With a second head-dim piece (D_B > 0) each product is two
    wgmmas: S = Q_a K_a^T + Q_b K_b^T; V's and O's pieces (DV_A, DV_B > 0) are their own: O_a =
    P V_a, O_b = P V_b apart, O stored through Q's tiles (DV_A <= D_A, DV_B <= D_B:
    `forward.TILES`). FP8 (float8 e4m3 q, k, v; one head-dim piece): the scores are the float8
    products times `p_descale`'s factors for q and k, P goes in float8 (`_p_operand`), V's slots
    hold V^T tiles (`_v_operand`), and O (bfloat16) goes out through `o_smem`. Q_REGS: Q's
    first Q_REGS pieces (0, 1 or 2) read into registers once an item's Q is in, S's products
    then take them from there (wgmma's register operand) and read only K's from shared
    memory. `bufs` and `args` are the kernel's shared buffers and barriers and its runtime
    arguments (`_flash_fwd_sm90`); the ping-pong waits on `my_turn` and hands `next_turn`
    over."""
    (q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem, q_bar, q_free, k_bar, v_bar, k_free,
     v_free, o_smem, o_desc, o2_desc, claimed) = bufs
    (p_o, p_lse, p_sinks, p_descale, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, n_items,
     n_tiles_m, n_heads, group, seq_q, seq_k, p_cu_q, p_cu_k, qk_scale, cap, left, right,
     dim_v, section, p_claim) = args
    # a wgmma's K: 32 bytes (16 halves, 32 float8s); a register operand packs 4 bytes
    INSTR_K: gl.constexpr = 32 if FP8 else 16
    # FP8_PACK: P's scale in the exponent (2^8 = P_SCALE), divided out of l after the loop
    P_OFFSET: gl.constexpr = 8.0 if FP8 and FP8_PACK else 0.0
    if FP8 and FP8_PACK:
        gl.static_assert(P_SCALE == 256.0, "P_OFFSET is log2(P_SCALE)")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV_A, INSTR_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=4 if FP8 else 2)
    if Q_REGS > 0:  # (the register operand of S's products, Q's either piece)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                     k_width=4 if FP8 else 2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if DV_B > 0:
        o2_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV_B, 16])
        p2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o2_layout,
                                                      k_width=2)
        row_o2: gl.constexpr = gl.SliceLayout(1, o2_layout)
    dtype: gl.constexpr = q_smem.dtype
    PIECES: gl.constexpr = 2 if DV_B > 0 else 1  # wgmmas of P V
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    n = 0       # key tiles consumed so far (the loader's ring counter)
    items = 0   # live items so far (Q's phase)
    turns = 0   # ping-pong hand-overs so far
    t = gl.program_id(0)
    pending = t * 0 - 1  # LATE_FREE: the Q slot to release once its O's store read it
    if CLAIM or DOC_ROW:  # the item that comes with the first Q slot
        mbarrier.wait(q_bar.index(0), 0)
        t = _claimed(claimed.index(0))
    while t < n_items:
        doc = (t, t, t, t, t, t)  # (dense: unread)
        if VARLEN:
            if DOC_ROW:  # (every published item is live, its row this slot's)
                doc = _claimed_doc(claimed.index(items % Q_SLOTS))
            else:
                doc = _doc_bounds(t, n_tiles_m, n_heads, p_cu_q, p_cu_k, CONSUMERS * BLOCK_M,
                                  4)
        live, b_row, h, h_kv, q_start, k_start, m_start, sq, sk, diag, lo, hi, b = _item(
            t, doc, n_items, n_tiles_m, n_heads, group, seq_q, seq_k, left, right, section,
            CONSUMERS * BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN)
        if live:
            # this item's Q slot (`_loader`); O's pieces go out through its Q tiles (their
            # first bytes, where V's head dim is less), FP8's O (bfloat16, twice Q's bytes)
            # through a tile of its own
            qs = items % Q_SLOTS
            q_tile = q_smem.index(qs * CONSUMERS + c)
            q2_tile = q2_smem.index(qs * CONSUMERS + c)
            o_tile = q_tile
            if FP8:
                o_tile = o_smem.index(c)
            elif DV_A != D_A:
                o_tile = q_tile._reinterpret(
                    dtype, [BLOCK_M, DV_A],
                    gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV_A], dtype))
            o2_tile = q2_tile
            if DV_B > 0 and DV_B != D_B:
                o2_tile = q2_tile._reinterpret(
                    dtype, [BLOCK_M, DV_B],
                    gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV_B], dtype))
            item_scale = qk_scale
            if FP8:  # the factors of this head's q and of its kv head's k
                item_scale = (qk_scale * gl.load(p_descale + h)
                              * gl.load(p_descale + n_heads + h_kv))
            first = m_start + c * BLOCK_M
            rows = first + gl.arange(0, BLOCK_M, layout=row_s)
            pos = rows + diag
            first_pos = first + diag
            last_pos = gl.minimum(first + BLOCK_M - 1, sq - 1) + diag
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            if LANE_SUM:
                l_i = _lane_sums(zero_s, BLOCK_N)
            else:
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, DV_A], gl.float32, layout=o_layout)
            if DV_B > 0:
                acc2 = gl.zeros([BLOCK_M, DV_B], gl.float32, layout=o2_layout)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            if not (CLAIM or DOC_ROW):  # (else waited for with the item)
                mbarrier.wait(q_bar.index(qs), (items // Q_SLOTS) & 1)
            q_a = q_tile  # S's operands: Q's tiles, or under Q_REGS their registers
            q_b = q2_tile
            if Q_REGS > 0:
                q_a = q_tile.load(q_layout)
            if Q_REGS > 1:
                q_b = q2_tile.load(q_layout)
            # what S's waits hold: FP8's register Q not (Triton 3.6 cannot hold 8-bit
            # registers across a wait, as `_wait_pv` says of P; ptxas keeps them itself)
            q_held = q_tile if FP8 else q_a
            q2_held = q2_tile if FP8 else q_b
            if n_tiles > 0:
                # tile 0: S_0 and its softmax; its P waits for the loop's first P V
                slot = n % STAGES
                mbarrier.wait(k_bar.index(slot), (n // STAGES) & 1)
                s_tok = warpgroup_mma(q_a, k_smem.index(slot).permute((1, 0)), zero_s,
                                      use_acc=False, is_async=True)
                if D_B > 0:
                    s_tok = warpgroup_mma(q_b, k2_smem.index(slot).permute((1, 0)),
                                          s_tok, is_async=True)
                if LATE_FREE:  # the item before's Q slot, under this item's first product
                    pending = _free_late(pending, q_free)
                s = warpgroup_mma_wait(0, deps=[s_tok, q_held, k_smem.index(slot), q2_held,
                                                k2_smem.index(slot)])[0]
                if not SHARED_KV:  # else the slot is freed with its V, after P V
                    _release(k_free.index(slot), THREAD_ARRIVES)
                p, m_i, l_i, alpha = _softmax_tile(
                    s, m_i, l_i, lo, pos, first_pos, last_pos, sk, item_scale, cap, left,
                    right, BLOCK_N, col_s, HAS_LEFT, HAS_RIGHT, SOFTCAP, LANE_SUM, MAX_SPLIT,
                    P_OFFSET, MASK_FORM)
                p_op = _p_carried(p, p_layout, dtype, FP8, P_SCALE, FP8_PACK)
                for i in range(1, n_tiles):
                    # issue S_i = Q K_i^T, then O += P_{i-1} V_{i-1}; the softmax of S_i
                    # runs while the second product does
                    p_use = _p_at_use(p_op, p_layout, dtype, FP8, P_SCALE, FP8_PACK)
                    slot = (n + i) % STAGES
                    prev = (n + i - 1) % STAGES
                    mbarrier.wait(k_bar.index(slot), ((n + i) // STAGES) & 1)
                    if not SHARED_KV:  # else V_{i-1} came with K_{i-1}
                        mbarrier.wait(v_bar.index(prev), ((n + i - 1) // STAGES) & 1)
                    k_tile = k_smem.index(slot)
                    k2_tile = k2_smem.index(slot)
                    if PINGPONG:  # this warpgroup's turn to issue (the other's softmax runs)
                        mbarrier.wait(my_turn, (turns + i - 1) & 1)
                    s_tok = warpgroup_mma(q_a, k_tile.permute((1, 0)), zero_s,
                                          use_acc=False, is_async=True)
                    if D_B > 0:
                        s_tok = warpgroup_mma(q_b, k2_tile.permute((1, 0)), s_tok,
                                              is_async=True)
                    acc_tok = warpgroup_mma(p_use, _v_operand(v_smem.index(prev), FP8), acc,
                                            is_async=True)
                    if DV_B > 0:
                        acc2_tok = warpgroup_mma(gl.convert_layout(p_use, p2_layout),
                                                 v2_smem.index(prev), acc2, is_async=True)
                    if PINGPONG:
                        _release(next_turn, THREAD_ARRIVES)
                    s = warpgroup_mma_wait(PIECES, deps=[s_tok, q_held, k_tile, q2_held,
                                                         k2_tile])[0]
                    if not SHARED_KV:
                        _release(k_free.index(slot), THREAD_ARRIVES)
                    p, m_i, l_i, alpha = _softmax_tile(
                        s, m_i, l_i, lo + i * BLOCK_N, pos, first_pos, last_pos, sk,
                        item_scale, cap, left, right, BLOCK_N, col_s, HAS_LEFT, HAS_RIGHT,
                        SOFTCAP, LANE_SUM, MAX_SPLIT, P_OFFSET, MASK_FORM)
                    if DV_B > 0:
                        both = warpgroup_mma_wait(0, deps=[acc_tok, acc2_tok, p_use,
                                                           v_smem.index(prev),
                                                           v2_smem.index(prev)])
                        acc = both[0]
                        acc2 = both[1]
                        acc2 = acc2 * gl.expand_dims(gl.convert_layout(alpha, row_o2), 1)
                    else:
                        acc = _wait_pv(acc_tok, p_use, v_smem.index(prev), FP8)
                    if SHARED_KV:
                        _release(k_free.index(prev), THREAD_ARRIVES)
                    else:
                        _release(v_free.index(prev), THREAD_ARRIVES)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    p_op = _p_carried(p, p_layout, dtype, FP8, P_SCALE, FP8_PACK)
                last = (n + n_tiles - 1) % STAGES
                if not SHARED_KV:
                    mbarrier.wait(v_bar.index(last), ((n + n_tiles - 1) // STAGES) & 1)
                p_use = _p_at_use(p_op, p_layout, dtype, FP8, P_SCALE, FP8_PACK)
                acc_tok = warpgroup_mma(p_use, _v_operand(v_smem.index(last), FP8), acc,
                                        is_async=True)
                if DV_B > 0:
                    acc2_tok = warpgroup_mma(gl.convert_layout(p_use, p2_layout),
                                             v2_smem.index(last), acc2, is_async=True)
                    both = warpgroup_mma_wait(0, deps=[acc_tok, acc2_tok, p_use,
                                                       v_smem.index(last),
                                                       v2_smem.index(last)])
                    acc = both[0]
                    acc2 = both[1]
                else:
                    acc = _wait_pv(acc_tok, p_use, v_smem.index(last), FP8)
                if SHARED_KV:
                    _release(k_free.index(last), THREAD_ARRIVES)
                else:
                    _release(v_free.index(last), THREAD_ARRIVES)
            if EARLY_FREE:  # Q's tiles read for the last time (O has tiles of its own)
                mbarrier.arrive(q_free.index(qs), count=1)
            n += n_tiles
            turns += gl.maximum(n_tiles - 1, 0)
            items += 1

            if P_OFFSET != 0.0:  # exact: a power of two
                l_i = l_i * (1.0 / P_SCALE)
            l_i = _row_sums(l_i, row_s, LANE_SUM)
            # rows that saw no key: l = 0, O = 0, LSE = -inf
            o_base = (b_row.to(gl.int64) * so_b + h.to(gl.int64) * so_h
                      + q_start.to(gl.int64) * so_s)
            l_safe = gl.where(l_i == 0.0, 1.0, l_i)
            if SINKS:  # the head's sink joins each row's sum (`flash_kernels._add_sinks`)
                sink = gl.load(p_sinks + h) * 1.4426950408889634  # log2(e)
                m_new = gl.maximum(m_i, sink)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                sink_alpha = gl.exp2(m_i - m_use)
                l_i = l_i * sink_alpha + gl.exp2(sink - m_use)
                m_i = m_new
                l_safe = gl.where(l_i == 0.0, 1.0, l_i) / sink_alpha
            if FP8:  # O = (P8 V8) * descale_v / P_SCALE / l
                l_safe = l_safe * (P_SCALE / gl.load(p_descale + n_heads + n_heads // group
                                                      + h_kv))
            out = (acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)).to(
                o_tile.dtype)
            if EARLY_FREE:  # the item before's O left the tile (its store read it)
                tma.store_wait(0)
                gl.thread_barrier()
            _store_piece(out, o_desc, o_tile, p_o, o_base, so_s, so_d, b_row, h, q_start,
                         first, 0, sq, dim_v, BLOCK_M, DV_A, VARLEN, VARLEN_TMA)
            if DV_B > 0:
                out2 = (acc2 / gl.expand_dims(gl.convert_layout(l_safe, row_o2), 1)).to(
                    o2_tile.dtype)
                _store_piece(out2, o2_desc, o2_tile, p_o, o_base, so_s, so_d, b_row, h,
                             q_start, first, DV_A, sq, dim_v, BLOCK_M, DV_B, VARLEN, VARLEN_TMA)
            if LATE_FREE:  # (an item without keys: its first product is not there)
                pending = _free_late(pending, q_free)
                pending = pending * 0 + qs  # released under the next item's first product
            elif not EARLY_FREE:
                if VARLEN_TMA or not VARLEN:
                    tma.store_wait(0)
                # O went out through Q's tiles: once every thread of the warpgroup is past
                # its reads of them (one thread arrives), the slot's next item's Q may load
                gl.thread_barrier()
                mbarrier.arrive(q_free.index(qs), count=1)
            if WRITE_LSE:
                lse_base = (b_row.to(gl.int64) * sl_b + h.to(gl.int64) * sl_h
                            + q_start.to(gl.int64) * sl_s)
                lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
                gl.store(p_lse + lse_base + rows.to(gl.int64) * sl_s, lse, mask=rows < sq)
        if CLAIM or DOC_ROW:  # the next slot's item (n_items: none left)
            mbarrier.wait(q_bar.index(items % Q_SLOTS), (items // Q_SLOTS) & 1)
            t = _claimed(claimed.index(items % Q_SLOTS))
        else:
            t += gl.num_programs(0)
    if LATE_FREE:  # the last item's O store read, its slot given back
        pending = _free_late(pending, q_free)
    if EARLY_FREE:  # the last item's O store read before the program ends
        tma.store_wait(0)


# Sizes that change from call to call, left unspecialised (Triton would compile again for
# each new pattern of "== 1" and "% 16 == 0" among them): TMA bounds the tiles' loads and
# stores, so the lengths only enter the last tile's mask and loop bounds; the counts, a
# division per item; the LSE's strides, one float per row (issue 31: a new length, batch or
# head count compiles nothing)
UNSPECIALISED = ("sl_b", "sl_h", "n_items", "n_tiles_m", "n_heads", "group", "seq_q", "seq_k",
                 "left", "right", "section")


@gluon.jit(do_not_specialize=UNSPECIALISED)
def _flash_fwd_sm90(q_desc, k_desc, v_desc, o_desc, q2_desc, k2_desc, v2_desc, o2_desc, p_o,
                    p_lse, p_cu_q, p_cu_k, p_sinks, p_descale, p_cu_t, so_b, so_h, so_s, so_d, sl_b,
                    sl_h, sl_s,
                    n_items, n_tiles_m, n_heads, group, seq_q, seq_k, qk_scale, cap, left, right,
                    dim_v, section, p_claim,
                    D_A: gl.constexpr, D_B: gl.constexpr, DV_A: gl.constexpr,
                    DV_B: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
                    SOFTCAP: gl.constexpr, VARLEN: gl.constexpr, WRITE_LSE: gl.constexpr,
                    PINGPONG: gl.constexpr, SINKS: gl.constexpr, SHARED_KV: gl.constexpr,
                    LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    FP8: gl.constexpr, P_SCALE: gl.constexpr, THREAD_ARRIVES: gl.constexpr,
                    CONSUMERS: gl.constexpr, LANE_SUM: gl.constexpr, MAX_SPLIT: gl.constexpr,
                    FP8_PACK: gl.constexpr, MASK_FORM: gl.constexpr, Q_SLOTS: gl.constexpr,
                    CLAIM: gl.constexpr, DOC_ROW: gl.constexpr, VARLEN_TMA: gl.constexpr,
                    LATE_FREE: gl.constexpr, EARLY_FREE: gl.constexpr,
                    Q_REGS: gl.constexpr = 0):
    """Grid (programs,): n_items = n_tiles_m (query tiles of CONSUMERS * BLOCK_M rows) x batch x
    heads work items (`_item`). A window side `left`/`right` >= 0 bounds the keys (causal: right =
    0); BOTTOM_RIGHT places query i at i + Sk - Sq. VARLEN: sequence b is rows cu[b]..cu[b+1] of the
    packed `[1, H, total, D]` tensors, seq_q the longest. SINKS: `p_sinks[h]` (float32, natural-log
    units) joins each row's denominator and LSE. The head dim is D_A + D_B, both powers of two (TMA
    boxes and Gluon's tensors are): 96 = 64 + 32 and 192 = 128 + 64 are two pieces, each with its
    own descriptors (`*2_desc`, columns D_A on) and shared buffers; D_B = 0 is one piece (the `*2`
    descriptors None, constexprs never read; the `*2` shared buffers stand for the first's). V's and
    O's head dim is DV_A + DV_B, D_A + D_B unless it differs (MLA's 192 and 128). FP8: q, k in
    float8 e4m3 and v_desc over V^T (`[B, H_kv, Dv, S]`, its boxes [DV_A, BLOCK_N]), `p_descale` the
    factors (`api.fp8_descale`: q's per head, then k's and v's per kv head), O bfloat16; one
    head-dim piece; with VARLEN, `p_cu_t` the sequences' first columns of V^T. `dim_v` is O's head
    dim: less than DV_A + DV_B where the kernel runs a head dim padded (`forward.kernel_pair`; the
    descriptors' boxes read zeros past the last column, and their stores stop there). VARLEN:
    n_tiles_m is the documents' count and n_items a bound on their tiles x heads (`_document`).
    Q_SLOTS: the consumers' Q tiles of one item or of two in turn (`_loader`). `section`: the
    (batch, head) pairs a causal launch takes its tiles across, the longest first (`_item`;
    1 for any other launch). CLAIM: the programs claim items from `p_claim`'s counter (`_claim`);
    DOC_ROW (VARLEN only): the loader hands each live item and its document to the consumers
    (`_publish`), who take their items from it as under CLAIM. VARLEN_TMA (VARLEN only): O's
    tiles whose rows all lie in their sequence go out by TMA stores (`_store_piece`).
    LATE_FREE (two Q slots; VARLEN only with VARLEN_TMA): a consumer releases an item's Q slot
    under the next item's first product, not once its O's TMA store has read the slot's
    tiles (`_free_late`). EARLY_FREE (FP8, whose O goes out through tiles of its own): a
    consumer releases an item's Q slot once its last product of Q is done, before the item's
    epilogue, and waits for its last O store to have read its O tile only before it writes
    the tile again (the next item's epilogue). Q_REGS: S's products take Q's first Q_REGS
    pieces from registers, each item's tiles read into them once (`_consumer`)"""
    gl.static_assert(not DOC_ROW or VARLEN, "DOC_ROW: a varlen launch's")
    gl.static_assert(not VARLEN_TMA or VARLEN, "VARLEN_TMA: a varlen launch's")
    # LATE_FREE: a slot's release waits for the next item, held in the other slot
    gl.static_assert(not LATE_FREE or (Q_SLOTS == 2 and (VARLEN_TMA or not VARLEN)))
    # EARLY_FREE: O not through Q's tiles (FP8's own), and one release an item
    gl.static_assert(not EARLY_FREE or (FP8 and not LATE_FREE))
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(
        dtype, [Q_SLOTS * CONSUMERS, BLOCK_M, D_A],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_A], dtype))
    k_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, D_A], gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_A],
                                                                            dtype))
    if FP8:  # V^T tiles; O (bfloat16) staged apart from Q's float8 tiles
        gl.static_assert(D_B == 0 and DV_B == 0)
        v_smem = gl.allocate_shared_memory(
            dtype, [STAGES, DV_A, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([DV_A, BLOCK_N], dtype))
        o_smem = gl.allocate_shared_memory(
            o_desc.dtype, [CONSUMERS, BLOCK_M, DV_A],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV_A], o_desc.dtype))
    else:
        v_smem = gl.allocate_shared_memory(
            dtype, [STAGES, BLOCK_N, DV_A],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV_A], dtype))
        o_smem = q_smem  # O goes out through Q's tiles: never read
    # one piece: the second piece's buffer names stand for the first's, never read
    q2_smem = q_smem
    k2_smem = k_smem
    v2_smem = v_smem
    if D_B > 0:
        q2_smem = gl.allocate_shared_memory(
            dtype, [Q_SLOTS * CONSUMERS, BLOCK_M, D_B],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_B], dtype))
        k2_smem = gl.allocate_shared_memory(
            dtype, [STAGES, BLOCK_N, D_B],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_B], dtype))
    if DV_B > 0:
        v2_smem = gl.allocate_shared_memory(
            dtype, [STAGES, BLOCK_N, DV_B],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV_B], dtype))
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # ping-pong: warpgroup c issues its products of a step once the other issued its own
    # of the step before (turn c completes a phase per hand-over; warpgroup 0 starts)
    # (one allocation each: Triton's barrier analysis then sees the wait on one and the
    # arrival on the other as no hazard, and puts no `bar.sync` between them)
    turn0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # CLAIM, DOC_ROW: each Q slot's item, as the loader claimed or took it (`_publish`,
    # `_claimed`), and under DOC_ROW its document
    claimed = q_bar  # (a stand-in the partitions never read)
    if CLAIM or DOC_ROW:
        claimed = gl.allocate_shared_memory(gl.int32, [Q_SLOTS, 32],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
    turn1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn2 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(Q_SLOTS):
        mbarrier.init(q_bar.index(s), count=1)
        mbarrier.init(q_free.index(s), count=CONSUMERS)  # every consumer releases Q
    # a consumer warpgroup's arrivals (`_release`): one, or one a thread
    ARRIVALS: gl.constexpr = 128 if THREAD_ARRIVES else 1
    mbarrier.init(turn0, count=ARRIVALS)
    mbarrier.init(turn1, count=ARRIVALS)
    mbarrier.init(turn2, count=ARRIVALS)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(s), count=1)
        mbarrier.init(v_bar.index(s), count=1)
        # every consumer releases a slot
        mbarrier.init(k_free.index(s), count=CONSUMERS * ARRIVALS)
        mbarrier.init(v_free.index(s), count=CONSUMERS * ARRIVALS)
    fence_async_shared()
    if PINGPONG:
        mbarrier.arrive(turn0, count=ARRIVALS)

    # the consumers' arguments are spelled out for each: constexprs passed inside a tuple
    # held in a variable reach the partition as tensors (Triton 3.6); the rest travel as two
    # tuples. Consumer c waits on its turn and hands the next one over (c + 1, cyclically)
    bufs = (q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem, q_bar, q_free, k_bar, v_bar,
            k_free, v_free, o_smem, o_desc, o2_desc, claimed)
    args = (p_o, p_lse, p_sinks, p_descale, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, n_items,
            n_tiles_m, n_heads, group, seq_q, seq_k, p_cu_q, p_cu_k, qk_scale, cap, left, right,
            dim_v, section, p_claim)
    descs = (q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (bufs, args, 0, turn0, turn1, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                         STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, VARLEN, WRITE_LSE,
                         PINGPONG, SINKS, SHARED_KV, FP8, P_SCALE, THREAD_ARRIVES, CONSUMERS,
                         LANE_SUM, MAX_SPLIT, FP8_PACK, MASK_FORM, Q_SLOTS, CLAIM, DOC_ROW,
                         VARLEN_TMA, LATE_FREE, EARLY_FREE, Q_REGS)),
            (_consumer, (bufs, args, 1, turn1, turn2, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                         STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, VARLEN, WRITE_LSE,
                         PINGPONG, SINKS, SHARED_KV, FP8, P_SCALE, THREAD_ARRIVES, CONSUMERS,
                         LANE_SUM, MAX_SPLIT, FP8_PACK, MASK_FORM, Q_SLOTS, CLAIM, DOC_ROW,
                         VARLEN_TMA, LATE_FREE, EARLY_FREE, Q_REGS)),
            (_consumer, (bufs, args, 2, turn2, turn0, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                         STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, VARLEN, WRITE_LSE,
                         PINGPONG, SINKS, SHARED_KV, FP8, P_SCALE, THREAD_ARRIVES, CONSUMERS,
                         LANE_SUM, MAX_SPLIT, FP8_PACK, MASK_FORM, Q_SLOTS, CLAIM, DOC_ROW,
                         VARLEN_TMA, LATE_FREE, EARLY_FREE, Q_REGS)),
            (_loader, (descs, bufs, args, p_cu_t, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                       STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN, SHARED_KV, FP8,
                       CONSUMERS, Q_SLOTS, CLAIM, DOC_ROW)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (bufs, args, 0, turn0, turn1, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                         STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, VARLEN, WRITE_LSE,
                         PINGPONG, SINKS, SHARED_KV, FP8, P_SCALE, THREAD_ARRIVES, CONSUMERS,
                         LANE_SUM, MAX_SPLIT, FP8_PACK, MASK_FORM, Q_SLOTS, CLAIM, DOC_ROW,
                         VARLEN_TMA, LATE_FREE, EARLY_FREE, Q_REGS)),
            (_consumer, (bufs, args, 1, turn1, turn0, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                         STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, SOFTCAP, VARLEN, WRITE_LSE,
                         PINGPONG, SINKS, SHARED_KV, FP8, P_SCALE, THREAD_ARRIVES, CONSUMERS,
                         LANE_SUM, MAX_SPLIT, FP8_PACK, MASK_FORM, Q_SLOTS, CLAIM, DOC_ROW,
                         VARLEN_TMA, LATE_FREE, EARLY_FREE, Q_REGS)),
            (_loader, (descs, bufs, args, p_cu_t, BLOCK_M, BLOCK_N, D_A, D_B, DV_A, DV_B,
                       STAGES, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT, VARLEN, SHARED_KV, FP8,
                       CONSUMERS, Q_SLOTS, CLAIM, DOC_ROW)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


settle_keys(__name__)  # (`launch.settle_keys`: one cache key a kernel, whatever the order)
