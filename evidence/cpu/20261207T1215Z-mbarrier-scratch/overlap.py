import re, sys, json
sys.path.insert(0, "/work/main/scripts"); sys.path.insert(0, "/work/main/src")
import gluon_compile_report as g
from pathlib import Path
src = sys.argv[1]; tag = sys.argv[2]
mod = g._load("bk_"+tag, Path(src))
out = []
for c in g.BWD_CONFIGS:
    if not c.get("DETERMINISTIC", True):
        pass
    try:
        k = g.compile_config(mod._flash_bwd_sm90, dict(c), backward=True)
    except Exception as e:
        out.append((c["name"], "ERR " + str(e)[:200])); continue
    s = k.asm["ptx"]
    defs = {}
    for m in re.finditer(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", s):
        defs.setdefault(m.group(1), int(m.group(3)))
    inits = sorted({defs.get(m.group(1)) for m in re.finditer(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", s)} - {None})
    # plain shared accesses at known offsets
    offs = set(int(x) for x in re.findall(r"(?:ld|st)\.shared\.[a-z0-9.]+ \t?\[global_smem\+(\d+)\]", s))
    offs |= set(int(x) for x in re.findall(r"(?:ld|st)\.shared\.[a-z0-9.]+ \t%r\d+, \[global_smem\+(\d+)\]", s))
    for m in re.finditer(r"(?:ld|st)\.shared\.[a-z0-9.]+ \[ ?(%r\d+) ?\+ 0 ?\]", s):
        if defs.get(m.group(1)) is not None: offs.add(defs[m.group(1)])
    hits = sorted(o for o in offs if any(b <= o < b + 8 for b in inits))
    out.append((c["name"], k.metadata.shared, len(inits), s.count("mbarrier.inval"), hits))
for o in out: print(tag, o)
