"""What the Hopper kernels compile to, without a GPU: build `_flash_fwd_sm90` (or, with
`--backward`, `_flash_bwd_sm90`) for sm_90a with Triton 3.6 and report, per configuration,
its shared memory, its registers and stack (cuobjdump), ptxas' spill bytes and whether it
serialised the wgmmas (its "C7512" note: too few registers), and its SASS counts of the
instructions that matter here (wgmma, TMA loads, mbarrier waits and arrives, named
barriers, spills, exp2, atomics), and a digest of its SASS instructions (`sass_digest`).

    python3 scripts/gluon_compile_report.py [--backward] [--kernel FILE] [--configs JSON]
                                            [--out F] [--loops DIR]

`--loops` writes each configuration's key loop (`key_loop`), an instruction a line.
`--kernel` compiles another version of the kernel file (e.g. `git show REV:path > f`).
A configuration names the kernel's constexprs (`TILE`, the launcher's, fills the rest);
parameters a version lacks are left out, so one report compares versions. This is a
compiler report, not a time."""

import argparse
import collections
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "src/fusedattn/hopper/forward_kernel.py"
BACKWARD = ROOT / "src/fusedattn/hopper/backward_kernel.py"
COUNTED = (r"\b(HGMMA|QGMMA|UTMALDG|SYNCS\.PHASECHK|SYNCS\.ARRIVE|BAR\.SYNC|LDL|STL|MUFU\.EX2|"
           r"REDG\.E\.ADD\.F32|SHFL\.IDX|SHFL\.BFLY|PRMT|F2FP\.SATFINITE\.E4M3)")
# what the launcher (`hopper.forward`) passes by default, beside each configuration's own
DEFAULTS = dict(BLOCK_M=64, STAGES=3, HAS_LEFT=False, HAS_RIGHT=False, BOTTOM_RIGHT=False,
                SOFTCAP=False, VARLEN=False, WRITE_LSE=True, PINGPONG=True, SINKS=False,
                SHARED_KV=False, LOADER_REGS=24, CONSUMER_REGS=240, FP8=False, P_SCALE=256.0,
                THREAD_ARRIVES=False, CONSUMERS=2, LANE_SUM=True, MAX_SPLIT=4, Q_SLOTS=1,
                CLAIM=False, Q_REGS=0, P_SMEM=False)
CONFIGS = [  # D_A/D_B: Q's and K's pieces; DV_A/DV_B: V's and O's (default: Q's); Q_SLOTS
    # as `hopper.forward.q_slots` gives (two where the shared memory holds them)
    dict(name="D128", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=2),  # PERSISTENT_TILES
    dict(name="D128 causal", D_A=128, D_B=0, BLOCK_N=128, HAS_RIGHT=True),
    dict(name="D128 causal sinks", D_A=128, D_B=0, BLOCK_N=128, HAS_RIGHT=True, SINKS=True),
    dict(name="D128 causal shared-kv", D_A=128, D_B=0, BLOCK_N=128, HAS_RIGHT=True,
         SHARED_KV=True),
    dict(name="D64 2wg", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128, STAGES=4),
    # three consumer warpgroups (`hopper.forward.WARPGROUPS`)
    dict(name="D64", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128, STAGES=4, CONSUMERS=3,
         CONSUMER_REGS=160),
    dict(name="D64 causal", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128, STAGES=4, CONSUMERS=3,
         CONSUMER_REGS=160, HAS_RIGHT=True),
    dict(name="D64 varlen causal sinks softcap", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128,
         STAGES=4, CONSUMERS=3, CONSUMER_REGS=160, HAS_RIGHT=True, VARLEN=True, SINKS=True,
         SOFTCAP=True),
    # varlen's causal launches claim (`hopper.forward.claims`); the documents handed over
    # with the items (`hopper.forward.DOC_ROWS`, every varlen launch) or found again by each
    # consumer
    dict(name="D64 varlen causal claims", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128, STAGES=4,
         HAS_RIGHT=True, VARLEN=True, CLAIM=True, DOC_ROW=True),
    dict(name="D64 varlen causal claims no doc row", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128,
         STAGES=4, HAS_RIGHT=True, VARLEN=True, CLAIM=True, DOC_ROW=False),
    dict(name="D128 varlen causal claims", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=2,
         HAS_RIGHT=True, VARLEN=True, CLAIM=True, DOC_ROW=True),
    dict(name="D192", D_A=128, D_B=64, BLOCK_N=64),
    dict(name="D192/128 causal", D_A=128, D_B=64, DV_A=128, DV_B=0, BLOCK_N=64,
         HAS_RIGHT=True),
    dict(name="D128/64 varlen", Q_SLOTS=2, D_A=128, D_B=0, DV_A=64, DV_B=0, BLOCK_N=128,
         VARLEN=True, HAS_RIGHT=True, BOTTOM_RIGHT=True),
    dict(name="D128 varlen", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=2, VARLEN=True,
         DOC_ROW=True),
    dict(name="D128 varlen no doc row", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=2,
         VARLEN=True, DOC_ROW=False),
    dict(name="D128 varlen masked stores", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=2,
         VARLEN=True, VARLEN_TMA=False),
    # FP8 (`hopper.forward.FP8_TILES`): float8 q, k and V^T, O bfloat16
    dict(name="FP8 D128", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=4, FP8=True),
    dict(name="FP8 D128 causal", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=4, FP8=True,
         HAS_RIGHT=True),
    dict(name="FP8 D64 causal", Q_SLOTS=2, D_A=64, D_B=0, BLOCK_N=128, STAGES=4, FP8=True,
         HAS_RIGHT=True),
    dict(name="FP8 D256", D_A=256, D_B=0, BLOCK_N=128, STAGES=2, FP8=True),  # one Q slot
    dict(name="FP8 D256 causal", D_A=256, D_B=0, BLOCK_N=128, STAGES=2, FP8=True,
         HAS_RIGHT=True, CLAIM=True),
    dict(name="FP8 D128 varlen causal", Q_SLOTS=2, D_A=128, D_B=0, BLOCK_N=128, STAGES=4,
         FP8=True, VARLEN=True, HAS_RIGHT=True),
]


# the backward's launcher's (`hopper.backward`) defaults and configurations
BWD_DEFAULTS = dict(BLOCK_N=128, STAGES=2, HAS_LEFT=False, HAS_RIGHT=False,
                    BOTTOM_RIGHT=False, SOFTCAP=False, DETERMINISTIC=True,
                    WRITER_REGS=24, WRITER_WARPS=4, DQ_BUFS=2, DQ_ADDS=True, GQA=False,
                    VARLEN=False, COMPACT=False, MASK_CONSTANTS=True)
# (EARLY_FREE: the launcher's rule, one slot and S not transposed, in `backward_constexprs`)
BWD_CONFIGS = [
    dict(name="bwd D128", D=128),
    dict(name="bwd D128 causal", D=128, HAS_RIGHT=True),
    dict(name="bwd D128 causal GQA", D=128, HAS_RIGHT=True, GQA=True),
    dict(name="bwd D128 racing", D=128, DETERMINISTIC=False),
    # dQ's hand-off by mbarriers, as before `hopper.backward.NAMED_HANDOFF`
    dict(name="bwd D128 mbarrier hand-off", D=128, DQ_NAMED=0),
    dict(name="bwd D128 causal mbarrier hand-off", D=128, HAS_RIGHT=True, DQ_NAMED=0),
    dict(name="bwd D64 causal mbarrier hand-off", D=64, HAS_RIGHT=True, DQ_NAMED=0),
    dict(name="bwd D192 mbarrier hand-off", D=192, DQ_NAMED=0),
    dict(name="bwd D128 causal, dQ by atomics", D=128, HAS_RIGHT=True, DQ_TMA=False),
    dict(name="bwd D128 causal, LSE from global memory", D=128, HAS_RIGHT=True,
         LSE_SMEM=False),
    dict(name="bwd D128, LSE in shared memory", D=128, LSE_SMEM=True),
    dict(name="bwd D128 softcap", D=128, SOFTCAP=True),
    dict(name="bwd D128 P and dS in shared memory", D=128, SWAP_SDP=False),
    dict(name="bwd D128 causal, S transposed", D=128, HAS_RIGHT=True, SWAP_SDP=True),
    dict(name="bwd D64 causal", D=64, HAS_RIGHT=True),
    dict(name="bwd D128 causal varlen", D=128, HAS_RIGHT=True, VARLEN=True, COMPACT=True),
    dict(name="bwd D128 causal varlen, the full grid", D=128, HAS_RIGHT=True, VARLEN=True),
    dict(name="bwd D64 window bottom-right", D=64, HAS_LEFT=True, HAS_RIGHT=True,
         BOTTOM_RIGHT=True),
    dict(name="bwd D128 causal window softcap, S transposed", D=128, HAS_LEFT=True,
         HAS_RIGHT=True, SOFTCAP=True, SWAP_SDP=True),
    dict(name="bwd D64 softcap varlen GQA", D=64, SOFTCAP=True, VARLEN=True, GQA=True,
         COMPACT=True),
    dict(name="bwd D128 varlen GQA (S transposed)", D=128, VARLEN=True, GQA=True,
         COMPACT=True),
    dict(name="bwd D256", D=256),
    dict(name="bwd D256 causal", D=256, HAS_RIGHT=True),
    dict(name="bwd D256 racing", D=256, DETERMINISTIC=False),
    dict(name="bwd D256 causal window softcap varlen GQA", D=256, HAS_LEFT=True,
         HAS_RIGHT=True, SOFTCAP=True, VARLEN=True, GQA=True, COMPACT=True),
    # D192 in two head-dim pieces, 128 + 64 (`hopper.backward.PIECES`)
    dict(name="bwd D192", D=192),
    dict(name="bwd D192 causal", D=192, HAS_RIGHT=True),
    dict(name="bwd D192 causal window softcap varlen GQA", D=192, HAS_LEFT=True,
         HAS_RIGHT=True, SOFTCAP=True, VARLEN=True, GQA=True, COMPACT=True),
    # V's head dim its own (`hopper.backward.kernel_dims`; V: v's kernel head dim)
    dict(name="bwd D192/128", D=192, V=128),
    dict(name="bwd D192/128 causal", D=192, V=128, HAS_RIGHT=True),
    dict(name="bwd D192/128 causal varlen GQA", D=192, V=128, HAS_RIGHT=True, VARLEN=True,
         GQA=True, COMPACT=True),
    dict(name="bwd D128/64", D=128, V=64),
    dict(name="bwd D128/64 causal", D=128, V=64, HAS_RIGHT=True),
    dict(name="bwd D128/64 causal varlen GQA (S transposed)", D=128, V=64, VARLEN=True,
         GQA=True, COMPACT=True),
    dict(name="bwd D256/128 causal", D=256, V=128, HAS_RIGHT=True),
]
SECOND = ("q2_desc", "k2_desc", "v2_desc", "do2_desc", "dk2_desc", "dv2_desc", "dq2_desc")
SECOND_V = ("v2_desc", "do2_desc", "dv2_desc")  # (V's pieces: DV2)


def _desc(rows: int, dim: int, fp8: bool = False, fp32: bool = False):
    from triton.experimental.gluon import language as gl

    block = [1, 1, rows, dim]
    name, element = (("fp8e4nv", gl.float8e4nv) if fp8 else ("fp32", gl.float32) if fp32
                     else ("bf16", gl.bfloat16))
    return (f"tensordesc<{name}{block},"
            f"{gl.NVMMASharedLayout.get_default_for(block, element)!r}>")


def _backward_types(c: dict) -> dict:
    bm, bn, d, d2, dv, dv2 = (c[n] for n in ("BLOCK_M", "BLOCK_N", "D", "D2", "DV", "DV2"))
    second = {}
    if d2:  # the second head-dim piece's descriptors (else None: constexprs)
        second = {"q2_desc": _desc(bm, d2), "k2_desc": _desc(bn, d2),
                  "dk2_desc": _desc(bn, d2), "dq2_desc": _desc(bm, d2, fp32=True)}
    if dv2:  # (V's: as Q's where V has one)
        second |= {"do2_desc": _desc(bm, dv2), "v2_desc": _desc(bn, dv2),
                   "dv2_desc": _desc(bn, dv2)}
    return {**second, "q_desc": _desc(bm, d), "do_desc": _desc(bm, dv), "k_desc": _desc(bn, d),
            "v_desc": _desc(bn, dv), "dk_desc": _desc(bn, d), "dv_desc": _desc(bn, dv),
            "dq_desc": _desc(bm, d // c["DQ_SPLIT"], fp32=True),
            "p_lse": "*fp32", "p_delta": "*fp32", "p_dq": "*fp32", "p_sem": "*i32",
            "p_dk": "*bf16", "p_dv": "*bf16", "p_cu_q": "*i32", "p_cu_k": "*i32",
            "scale": "fp32", "qk_scale": "fp32", "cap": "fp32"}


def backward_constexprs(config: dict) -> dict:
    """A backward configuration's constexprs, those it leaves out as `hopper.backward`'s
    launcher picks them by default (this runs without torch, so the rule is written again
    here; `tests/test_hopper_backward.py` checks it against the launcher's)."""
    c = {k: v for k, v in config.items() if k != "name"}
    v_dim = c.pop("V", c["D"])  # (V's kernel head dim: one piece where it is not q's)
    if v_dim != c["D"]:
        c |= dict(DV=v_dim, DV2=0)
    if c["D"] == 256:  # 64 keys a program, two slots of Q, one of dO, dQ in two halves
        c = dict(BLOCK_N=64, STAGES=2, DO_STAGES=1, DQ_SPLIT=2, DQ_BUFS=1, SWAP_SDP=False) | c
    if c["D"] == 192:  # two pieces, 128 + 64, 64 keys, two slots, one dQ buffer
        c = dict(BLOCK_N=64, STAGES=2, DQ_BUFS=1, SWAP_SDP=False) | c | dict(D=128, D2=64)
    c = BWD_DEFAULTS | dict(D2=0) | c
    c.setdefault("DV", c["D"])
    c.setdefault("DV2", c["D2"])
    if not c["D2"]:
        c |= dict.fromkeys(SECOND)  # (None: one piece)
    if not c["DV2"]:
        c |= dict.fromkeys(SECOND_V)
    # D64: 128-row steps, but 64 under a softcap (`TILES`, `SOFTCAP_TILES`)
    c.setdefault("BLOCK_M", 128 if c["D"] == 64 and not c["SOFTCAP"] else 64)
    unmasked = not (c["HAS_LEFT"] or c["HAS_RIGHT"])
    # S transposed where there is no softcap and, at D128, no mask bounds a key
    c.setdefault("SWAP_SDP", (unmasked or c["D"] == 64) and not c["SOFTCAP"])
    # dQ by TMA reductions and LSE through shared memory, the latter at D128 not with S
    # transposed and no mask under deterministic adds (`DQ_TMA`, `lse_in_shared`)
    c.setdefault("DQ_TMA", True)
    c.setdefault("LSE_SMEM", c["D"] == 64
                 or not (c["SWAP_SDP"] and unmasked and c["DETERMINISTIC"]))
    c.setdefault("DO_STAGES", c["STAGES"])
    c.setdefault("DQ_SPLIT", 1)
    c.setdefault("EARLY_FREE", not c["SWAP_SDP"] and (c["STAGES"] == 1 or c["DQ_SPLIT"] > 1))
    c.setdefault("FREE_ON_READ", True)
    # the launcher's `SLOT_BY_DQ and not early_free and split == 1`
    c.setdefault("SLOT_BY_DQ", not c["EARLY_FREE"] and c["DQ_SPLIT"] == 1)
    # the launcher's `256 + 32 * WRITER_WARPS if NAMED_HANDOFF and slot_by_dq else 0`
    c.setdefault("DQ_NAMED", 256 + 32 * c["WRITER_WARPS"] if c["SLOT_BY_DQ"] else 0)
    return c


def compile_config(fn, config: dict, backward: bool = False):
    """The compiled kernel for one configuration (bf16, or float8 under FP8)."""
    if backward:
        c = backward_constexprs(config)
        return _compile(fn, c, _backward_types(c), 8)
    c = DEFAULTS | {k: v for k, v in config.items() if k != "name"}
    c.setdefault("FP8_PACK", c["FP8"])  # the launcher's `FP8_PACK and fp8`
    # the launcher's MASK_FORM where a causal or window bound cuts tiles, else MASK_FORM_EDGE
    c.setdefault("MASK_FORM", 2 if c["HAS_LEFT"] or c["HAS_RIGHT"] else 0)
    c.setdefault("DV_A", c["D_A"])
    c.setdefault("DV_B", c["D_B"])
    c.setdefault("DOC_ROW", c["VARLEN"])  # the launcher's `DOC_ROWS and varlen`
    c.setdefault("VARLEN_TMA", c["VARLEN"])  # `VARLEN_TMA_STORE and varlen`
    # the launcher's `FP8_EARLY_Q_FREE and fp8 and slots == 1`
    c.setdefault("EARLY_FREE", c["FP8"] and c["Q_SLOTS"] == 1)
    # the launcher's `forward.releases_late(slots, fp8, claim, varlen)`
    c.setdefault("LATE_FREE", c["Q_SLOTS"] == 2 and (not c["VARLEN"] or c["VARLEN_TMA"])
                 and (not c["FP8"] or c["CLAIM"]))
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    pieces = {"q": (bm, "D"), "k": (bn, "D"), "v": (bn, "DV"), "o": (bm, "DV")}
    types = {}
    for t, (rows, which) in pieces.items():
        fp8 = c["FP8"] and t != "o"
        for suffix, width in (("", c[f"{which}_A"]), ("2", c[f"{which}_B"])):
            if not width:  # one piece: no second descriptor (None, as the launcher passes)
                c[f"{t}{suffix}_desc"] = None
                continue
            shape = (width, rows) if fp8 and t == "v" else (rows, width)  # FP8: V^T's boxes
            types[f"{t}{suffix}_desc"] = _desc(*shape, fp8)
    types |= {"p_o": "*bf16", "p_lse": "*fp32", "p_cu_q": "*i32", "p_cu_k": "*i32",
              "p_sinks": "*fp32", "p_descale": "*fp32", "p_cu_t": "*i32", "qk_scale": "fp32",
              "cap": "fp32", "p_claim": "*i32"}
    if not c.get("CLAIM"):  # (the launcher's None: no counter)
        c["p_claim"] = None
    return _compile(fn, c, types, 4)


def _compile(fn, c: dict, types: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in c:
            signature[name] = "constexpr"
            constants[(i,)] = c[name]
        else:  # strides i64, counts and window sides i32 (as the launcher's values are)
            wide = name[:3] in ("so_", "sl_", "sdk", "sdv")
            signature[name] = types.get(name, "i64" if wide else "i32")
            if signature[name].startswith("*"):  # 16-byte aligned, as torch allocates and
                # the launch specialises (the dQ adds then compile to 16-byte reds, as on
                # the GPU; without it they were scalar here alone)
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _ptxas(tools: Path, ptx: str) -> dict:
    """ptxas' own word on the PTX: spill bytes, and whether it serialised the wgmmas."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        info = subprocess.run([tools / "ptxas", "-arch=sm_90a", "-v", src, "-o",
                               Path(tmp) / "k.cubin"], capture_output=True, text=True,
                              check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return dict(spill_stores=int(spills[1]), spill_loads=int(spills[2]),
                wgmma_serialised=bool(re.search(r"C751\d", info)))


def cuobjdump(tools: Path, cubin: str | Path) -> tuple[dict, str]:
    """A cubin file's registers and stack (cuobjdump's resource usage), and its SASS."""
    usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin],
                           capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tools / "cuobjdump", "--dump-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return dict(registers=int(regs[1]), stack=int(regs[2])), sass


def sass_counts(sass: str) -> dict:
    """The SASS's instruction count, the partitions' register counts (setmaxnreg: loader,
    writer, consumers, as the SASS sets them) and the counts of `COUNTED`."""
    return dict(instructions=len(_instructions(sass)),
                setmaxnreg=sorted({int(x, 16) for x in re.findall(
                    r"USETMAXREG\.\S+ (?:UP0, )?(0x[0-9a-f]+)", sass)}),
                **collections.Counter(re.findall(COUNTED, sass)))


def scratch_on_mbarriers(ptx: str) -> list[int]:
    """The shared-memory offsets that a plain `ld.shared`/`st.shared` of the PTX reads or
    writes inside an mbarrier's 8 bytes (the offsets its `mbarrier.init`s take): scratch
    that Triton's allocator put on an mbarrier it counted dead. PTX gives an mbarrier's
    bytes no other use until `mbarrier.inval`; the backward's spin broke that and hung
    (issue 33, evidence/cpu/20261207T1215Z-mbarrier-scratch). Empty where none does."""
    at = {}  # registers defined as the shared base plus a constant
    for m in re.finditer(r"add\.s32 \t(%r\d+), %r\d+, (\d+);", ptx):
        at.setdefault(m[1], int(m[2]))
    bars = {at[m[1]] for m in re.finditer(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", ptx)
            if m[1] in at}
    offsets = {int(x) for x in re.findall(
        r"(?:ld|st)\.shared\.[a-z0-9.]+ \t?(?:%r\d+, )?\[global_smem\+(\d+)\]", ptx)}
    offsets |= {at[m[1]] for m in re.finditer(
        r"(?:ld|st)\.shared\.[a-z0-9.]+ \[ ?(%r\d+) ?\+ 0 ?\]", ptx) if m[1] in at}
    return sorted(o for o in offsets if any(b <= o < b + 8 for b in bars))


def cubin_facts(tools: Path, compiled) -> tuple[dict, str]:
    """A compiled kernel's shared memory, registers and stack (`cuobjdump`), ptxas' spills
    and wgmma note (`_ptxas`), and its SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage, sass = cuobjdump(tools, cubin.name)
    return dict(shared=compiled.metadata.shared, **usage,
                **_ptxas(tools, compiled.asm["ptx"])), sass


def report(kernel_file: Path, configs: list[dict], backward: bool = False,
           loops: Path | None = None) -> list[dict]:
    """One row per configuration (`cubin_facts`, the SASS counts, the key loop's mix);
    `loops`: a folder that receives each configuration's key loop (`key_loop`) as text,
    `<name>.sass`, an address and an instruction a line."""
    import types

    import triton

    if backward:  # its import of the forward's helpers, without the packages' __init__
        for name in ("fusedattn", "fusedattn.hopper"):  # (their submodules still import)
            folder = ROOT / "src" / name.replace(".", "/")
            sys.modules.setdefault(name, types.ModuleType(name)).__path__ = [str(folder)]
        _load("fusedattn.hopper.forward_kernel", KERNEL)
    module = _load("kernel_under_report", kernel_file)
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    rows = []
    fn = module._flash_bwd_sm90 if backward else module._flash_fwd_sm90
    for config in configs:
        # (V: the backward's V head dim, which the kernel takes as DV, `backward_constexprs`)
        missing = sorted(set(config) - {"name"} - set(fn.arg_names)
                         - ({"V"} if "DV" in fn.arg_names else set()))
        if missing:  # a configuration of a parameter this version does not have
            rows.append(dict(name=config["name"], skipped=f"no {', '.join(missing)}"))
            continue
        compiled = compile_config(fn, config, backward)
        facts, sass = cubin_facts(tools, compiled)
        if loops is not None:
            loops.mkdir(parents=True, exist_ok=True)
            (loops / (re.sub(r"[^\w.-]+", "_", config["name"]) + ".sass")).write_text(
                "".join(f"{a:05x} {t}\n" for a, t in key_loop(sass)))
        rows.append(dict(name=config["name"], **facts, **sass_counts(sass),
                         sass_digest=sass_digest(sass), loop=loop_mix(sass)))
    return rows


def _instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every SASS instruction."""
    return [(int(m[1], 16), m[2].strip()) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _target(text: str) -> int | None:
    """A branch's target address, None for any other instruction."""
    b = re.search(r"BRA (?:`\(\.L_x_\d+\) )?(?:P\d, )?0x([0-9a-f]+)", text)
    return int(b[1], 16) if b else None


def wgmma_loops(sass: str, marker: str = "GMMA") -> list[list[tuple[int, str]]]:
    """The loops that hold a wgmma (an instruction naming `marker`: "MMA" takes mma.sync's
    HMMA too) and no other such loop inside them, each as its instructions (address,
    text), in address order. A loop is a predicated branch back to a lower address; an
    unconditional one is a jump back from code placed at the end (an mbarrier wait's
    retry)."""
    ins = _instructions(sass)
    loops = [(target, addr) for addr, text in ins
             if text.startswith("@") and (target := _target(text)) is not None
             and target < addr]

    def wgmmas(lo: int, hi: int) -> int:
        return sum(marker in t for a, t in ins if lo <= a <= hi)

    holding = [se for se in loops if wgmmas(*se)]
    innermost = sorted({(lo, hi) for lo, hi in holding
                        if not any((lo, hi) != (a, b) and lo <= a and b <= hi
                                   for a, b in holding)})
    return [[(a, t) for a, t in ins if lo <= a <= hi] for lo, hi in innermost]


def key_loop(sass: str, marker: str = "GMMA") -> list[tuple[int, str]]:
    """The key loop's instructions as (address, text): of `wgmma_loops`, the one with the
    most wgmmas (the forward's key tile, masked and unmasked paths both, not the item loop
    around it; the backward's step); [] where there is none. Before 2026-12-02 `loop_mix`
    took the loop with the most wgmmas, in the forward the persistent item loop."""
    loops = wgmma_loops(sass, marker)
    return max(loops, key=lambda body: sum(marker in t for _, t in body)) if loops else []


def path_lengths(body: list[tuple[int, str]]) -> list[int]:
    """The instruction counts of a loop body's paths from its top to its back edge, fewest
    first (the forward's unmasked tile and its masked one, where the loop has both): a
    branch to an address inside the body forks the path (an unpredicated one jumps), a
    branch out of it (an mbarrier wait's retry, placed at the end) is taken as not taken."""
    at = {a: n for n, (a, _) in enumerate(body)}
    lengths, todo = set(), [(0, 0)]
    while todo:
        n, count = todo.pop()
        while n < len(body) - 1:
            text = body[n][1]
            target = _target(text)
            count += 1
            if target in at and at[target] > n:  # a forward branch inside the loop
                if not text.startswith("@"):
                    n = at[target]
                    continue
                todo.append((at[target], count))
            n += 1
        lengths.add(count + 1)  # the back edge
    return sorted(lengths)


def opcodes(body: list[tuple[int, str]]) -> collections.Counter:
    """A run of instructions' counts by opcode (a predicate left out)."""
    return collections.Counter(t.split()[1] if t.startswith("@") else t.split()[0]
                               for _, t in body)


def loop_mix(sass: str) -> dict:
    """The key loop's (`key_loop`) instruction mix: its length, its paths' lengths
    (`path_lengths`) and its counts by opcode (what a step costs each warp, spills
    included: LDL/STL inside the loop); {} where there is no such loop."""
    body = key_loop(sass)
    ops = opcodes(body)
    return (dict(length=sum(ops.values()), paths=path_lengths(body), **dict(ops.most_common()))
            if ops else {})


def sass_digest(sass: str) -> str:
    """sha256 (16 hex digits) of the SASS instructions alone, addresses and encodings
    left out: two versions of a kernel file with the same digest in every configuration
    compile to the same machine code (a refactor that needs no new GPU run)."""
    import hashlib

    ins = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line.split(";")[0]).strip()
           for line in sass.splitlines() if "/*" in line and ";" in line]
    return hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backward", action="store_true", help="the backward kernel")
    ap.add_argument("--kernel", type=Path, default=None)
    ap.add_argument("--configs", default="", help="a JSON list of configurations")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--loops", type=Path, default=None,
                    help="write each configuration's key loop (SASS) into this folder")
    args = ap.parse_args()
    args.kernel = args.kernel or (BACKWARD if args.backward else KERNEL)
    configs = (json.loads(args.configs) if args.configs
               else BWD_CONFIGS if args.backward else CONFIGS)
    rows = report(args.kernel, configs, args.backward, args.loops)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(dict(kernel=str(args.kernel), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
