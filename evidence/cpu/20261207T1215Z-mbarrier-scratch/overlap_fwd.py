import re, sys
sys.path.insert(0, "/work/main/scripts"); sys.path.insert(0, "/work/main/src")
import gluon_compile_report as g
from pathlib import Path
mod = g._load("fk", Path("/work/main/src/fusedattn/hopper/forward_kernel.py"))
fn = [getattr(mod, n) for n in dir(mod) if n.startswith("_flash_fwd")]
print([f.fn.__name__ if hasattr(f,'fn') else f for f in fn][:5])
for c in g.CONFIGS:
    try:
        k = g.compile_config(mod._flash_fwd_sm90 if hasattr(mod, "_flash_fwd_sm90") else fn[0], dict(c))
    except Exception as e:
        print(c["name"], "ERR", str(e)[:150]); continue
    s = k.asm["ptx"]
    defs = {}
    for m in re.finditer(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", s):
        defs.setdefault(m.group(1), int(m.group(3)))
    inits = sorted({defs.get(m.group(1)) for m in re.finditer(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", s)} - {None})
    offs = set(int(x) for x in re.findall(r"(?:ld|st)\.shared\.[a-z0-9.]+ \t?\[global_smem\+(\d+)\]", s))
    offs |= set(int(x) for x in re.findall(r"(?:ld|st)\.shared\.[a-z0-9.]+ \t%r\d+, \[global_smem\+(\d+)\]", s))
    for m in re.finditer(r"(?:ld|st)\.shared\.[a-z0-9.]+ \[ ?(%r\d+) ?\+ 0 ?\]", s):
        if defs.get(m.group(1)) is not None: offs.add(defs[m.group(1)])
    hits = sorted(o for o in offs if any(b <= o < b + 8 for b in inits))
    print(c["name"], k.metadata.shared, len(inits), s.count("mbarrier.inval"), hits, flush=True)
