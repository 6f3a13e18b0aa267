import sys, re, json
sys.path.insert(0, "/work/main/scripts"); sys.path.insert(0, "/work/main/src")
import gluon_compile_report as g
from pathlib import Path
mod = g._load("bk_all", Path(sys.argv[1]))
out = {}
for c in g.BWD_CONFIGS:
    if not c.get("DETERMINISTIC", True):
        continue
    try:
        k = g.compile_config(mod._flash_bwd_sm90, c, backward=True)
    except Exception as e:
        print(c["name"], "FAILED", str(e)[:200]); continue
    s = k.asm["ptx"]
    defs = {}
    for m in re.finditer(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", s):
        defs.setdefault(m.group(1), int(m.group(3)))
    inits = [(defs.get(m.group(1)), int(m.group(2))) for m in
             re.finditer(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], (\d+);", s)]
    spins = set()
    for m in re.finditer(r"ld\.global\.gpu\.acquire\.b32[^\n]*\n(?:[^\n]*\n){0,4}?[^\n]*st\.shared\.b32 \[ (%r\d+) \+ 0 \]", s):
        spins.add(defs.get(m.group(1)))
    full = backward = g.backward_constexprs(c)
    hit = [(off, [i for i, b in enumerate(inits) if b[0] is not None and b[0] <= off < b[0] + 8]) for off in spins]
    print(f"{c['name']:50s} DQ_NAMED={full.get('DQ_NAMED')} EARLY_FREE={full.get('EARLY_FREE')} DQ_SPLIT={full.get('DQ_SPLIT')} DQ_BUFS={full.get('DQ_BUFS')} STAGES={full.get('STAGES')} scratch->mbarrier#{hit}", flush=True)
    open(f"/tmp/tk/all-{re.sub('[^a-zA-Z0-9]+','_',c['name'])}.ptx","w").write(s)
