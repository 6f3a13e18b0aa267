"""`scripts/gluon_compile_report.py`'s SASS digest and loop mix, on canned SASS: the digest
is what lets a kernel refactor stand on an earlier GPU tier run (the same instructions in
every configuration), so it must ignore addresses and encodings and see every opcode and
operand."""

from inputs import script

report = script("gluon_compile_report")

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;    /* 0x0000000404027981 */
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ ; /* 0x0 */
        /*0030*/                   LDL R3, [R1+0x2c] ;             /* 0x00002c0001037983 */
        /*0040*/               @P0 BRA 0x10 ;                      /* 0xfffffffc00f08947 */
        /*0050*/                   EXIT ;                          /* 0x000000000000794d */
"""


def test_the_digest_ignores_addresses_and_encodings_but_not_instructions():
    moved = SASS.replace("/*00", "/*01").replace("0x00002c0001037983", "0x1234")
    assert report.sass_digest(moved) == report.sass_digest(SASS)
    assert report.sass_digest(SASS.replace("0x2c]", "0x30]")) != report.sass_digest(SASS)
    assert report.sass_digest(SASS.replace("LDL R3", "LDS R3")) != report.sass_digest(SASS)


def test_the_loop_mix_counts_the_loop_that_holds_the_wgmmas():
    mix = report.loop_mix(SASS)
    # the loop is 0x10..0x40: LDG, HGMMA, LDL and the predicated branch back
    assert mix == {"length": 4, "paths": [4], "LDG.E": 1, "HGMMA.64x64x16.F32.BF16": 1,
                   "LDL": 1, "BRA": 1}
    assert [a for a, _ in report.key_loop(SASS)] == [0x10, 0x20, 0x30, 0x40]
    assert report.loop_mix(SASS.replace("0x10 ;", "0x60 ;")) == {}  # no branch back
    assert report.key_loop(SASS.replace("0x10 ;", "0x60 ;")) == []


def test_the_loop_mix_counts_the_innermost_loop_that_holds_wgmmas():
    # the forward: an item loop (0x10..0x90) around a key loop (0x30..0x60); the item loop
    # holds more wgmmas (its prologue's too), the key tile is the inner loop
    nested = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x0 */
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ ; /* 0x0 */
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ; /* 0x0 */
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ ; /* 0x0 */
        /*0040*/                   MUFU.EX2 R3, R3 ;               /* 0x0 */
        /*0050*/                   FMNMX R4, R3, R4, !PT ;         /* 0x0 */
        /*0060*/               @P0 BRA 0x30 ;                      /* 0x0 */
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ; /* 0x0 */
        /*0080*/                   STG.E desc[UR4][R2.64], R24 ;   /* 0x0 */
        /*0090*/               @P1 BRA 0x10 ;                      /* 0x0 */
        /*00a0*/                   EXIT ;                          /* 0x0 */
"""
    assert report.loop_mix(nested) == {"length": 4, "paths": [4],
                                       "HGMMA.64x64x16.F32.BF16": 1, "MUFU.EX2": 1,
                                       "FMNMX": 1, "BRA": 1}
    assert [len(body) for body in report.wgmma_loops(nested)] == [4]


def test_path_lengths_fork_at_branches_inside_the_loop_and_not_at_retries_outside_it():
    # a key loop 0x10..0x90: a wait whose retry jumps out (0xb0), a masked path
    # (0x40..0x50) that a predicated branch skips, an unconditional jump over one
    # instruction (0x70 -> 0x90)
    forked = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x0 */
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ; /* 0x0 */
        /*0020*/              @!P0 BRA 0xb0 ;                      /* 0x0 */
        /*0030*/               @P1 BRA 0x60 ;                      /* 0x0 */
        /*0040*/                   FSEL R3, R3, -INF, P2 ;         /* 0x0 */
        /*0050*/                   FSEL R4, R4, -INF, P2 ;         /* 0x0 */
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ ; /* 0x0 */
        /*0070*/                   BRA 0x90 ;                      /* 0x0 */
        /*0080*/                   NOP ;                           /* 0x0 */
        /*0090*/               @P3 BRA 0x10 ;                      /* 0x0 */
        /*00a0*/                   EXIT ;                          /* 0x0 */
        /*00b0*/                   BRA 0x10 ;                      /* 0x0 */
"""
    (body,) = report.wgmma_loops(forked)
    assert [a for a, _ in body] == list(range(0x10, 0xa0, 0x10))
    # skipping the mask: TRYWAIT, BRA, BRA, HGMMA, BRA, back edge; through it two FSELs more
    assert report.path_lengths(body) == [6, 8]
    assert report.loop_mix(forked)["paths"] == [6, 8]


def test_the_source_summary_reads_one_kernel_and_shares_its_key_loops_samples(tmp_path):
    # `scripts/ncu_source_summary.py`: ncu's source page lists each kernel in turn; the key
    # loop is the innermost loop that holds a wgmma, its samples shared out by kind
    summary = script("ncu_source_summary")
    columns = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'

    def kernel(name, lines):
        return f'"Kernel Name","{name}",\n{columns}\n' + "".join(
            f'"0x{a:x}","{src}","{n}","1"\n' for a, src, n in lines)
    text = kernel("_transpose_v", [(0x100, "LDG.E R2, desc[UR4][R4.64]", 9)]) + kernel(
        "_flash_fwd_sm90", [
            (0x1000, "MOV R1, c[0x0][0x28]", 1),
            (0x1010, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR24], RZ", 5),  # outer only
            (0x1020, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 7),        # key loop
            (0x1030, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR24], RZ", 3),
            (0x1040, "FMNMX R4, R24, R25, !PT", 11),
            (0x1050, "MUFU.EX2 R5, R5", 13),
            (0x1060, "@P1 PRMT R6, R7, 0x5410, R8", 2),
            (0x1070, "@P0 BRA 0x1020", 1),
            (0x1080, "@P2 BRA 0x1010", 1)])
    path = tmp_path / "src.csv"
    path.write_text(text)
    header, rows = summary.read(str(path), "_flash_fwd_sm90")
    assert [r[1] for r in rows][0] == "MOV R1, c[0x0][0x28]" and len(rows) == 9
    loops, kinds = summary.key_loops(header, rows)
    assert loops == [(0x20, 0x70)]
    assert kinds == {"waits (mbarriers, turn, bar.sync)": 8, "wgmma issue and waits": 3,
                     "row max": 11, "exp2 and the sums": 13, "P's conversion": 2}
    assert len(summary.read(str(path), "_transpose_v")[1]) == 1


def test_the_transpose_report_tells_store_widths_apart():
    # `scripts/transpose_compile_report.py`: a byte store is not a 16-byte one (what showed
    # why the FP8 relabel lost, evidence/sm90-compile/20261202T1422Z-fp8-transpose-stores)
    import collections
    import re

    transpose = script("transpose_compile_report")
    sass = SASS + """
        /*0060*/                   STG.E.U8 desc[UR4][R2.64], R5 ;  /* 0x0 */
        /*0070*/                   STG.E.128 desc[UR4][R2.64], R8 ; /* 0x0 */
        /*0080*/                   STS.U16 [R3], R6 ;              /* 0x0 */
"""
    found = collections.Counter(re.findall(transpose.MEMORY, sass))
    assert found == {"LDG.E": 1, "STG.E.U8": 1, "STG.E.128": 1, "STS.U16": 1}
    # and it takes the kernel alone from a transpose.py (no torch import needed there)
    fn = transpose._kernel(transpose.ROOT / "src/fusedattn/hopper/transpose.py")
    assert fn.arg_names[:2] == ["p_v", "p_vt"]


def test_the_reports_configurations_take_the_launchers_q_slots():
    # the report names Q_SLOTS per configuration (it compiles without the launcher); where a
    # configuration is a table entry's build, its slots must be the ones `q_slots` gives
    from fusedattn.hopper import forward as knobs

    checked = 0
    for c in report.CONFIGS:
        c = report.DEFAULTS | c
        fp8 = c["FP8"]
        pair = (c["D_A"] + c["D_B"], c.get("DV_A", c["D_A"]) + c.get("DV_B", c["D_B"]))
        tables = [knobs.FP8_TILES] if fp8 else [knobs.TILES, knobs.PERSISTENT_TILES]
        tiles = [t[pair] for t in tables
                 if pair in t and t[pair][5:] == (c["BLOCK_N"], c["STAGES"])]
        if not tiles:
            continue  # not a table entry's tile (an A/B's candidate)
        assert c["Q_SLOTS"] == knobs.q_slots(tiles[0], c["CONSUMERS"], fp8), c["name"]
        checked += 1
    assert checked >= 8
