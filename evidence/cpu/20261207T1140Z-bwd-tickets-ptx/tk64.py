import sys, re
sys.path.insert(0, "/work/main/scripts"); sys.path.insert(0, "/work/main/src")
import gluon_compile_report as g
from pathlib import Path
mod = g._load("bk_t", Path("/tmp/tk/backward_kernel.py"))
for c in [dict(name="D64 causal", D=64, HAS_RIGHT=True, TICKETS=True), dict(name="D128 causal", D=128, HAS_RIGHT=True, TICKETS=True), dict(name="D256", D=256, TICKETS=True), dict(name="D192", D=192, TICKETS=True)]:
    k = g.compile_config(mod._flash_bwd_sm90, c, backward=True)
    s = k.asm["ptx"]
    defs = {}
    for m in re.finditer(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", s):
        defs.setdefault(m.group(1), int(m.group(3)))
    inits = [(defs.get(m.group(1)), int(m.group(2))) for m in re.finditer(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], (\d+);", s)]
    m = re.search(r"atom\.global\.gpu\.relaxed\.add\.u32[^\n]*\n(?:[^\n]*\n){0,3}?[^\n]*st\.shared\.b32 \[ (%r\d+) \+ 0 \]", s)
    off = defs.get(m.group(1)) if m else None
    reads = re.findall(r"ld\.shared\.b32 \t%r\d+, \[global_smem\+(\d+)\]", s)
    print(c["name"], "ticket scratch", off, "mbarriers", inits, "smem scalar reads", sorted(set(reads)))
