import sys, re
sys.path.insert(0, "/tmp/tk2/wt/scripts"); sys.path.insert(0, "/tmp/tk2/wt/src")
import gluon_compile_report as g
from pathlib import Path
mod = g._load("bk_v2", Path("/tmp/tk2/wt/src/fusedattn/hopper/backward_kernel.py"))
for c in g.BWD_CONFIGS:
    try:
        k = g.compile_config(mod._flash_bwd_sm90, c, backward=True)
        s = k.asm["ptx"]
        n_atom = len(re.findall(r"atom\.global\.gpu\.relaxed\.add\.u32", s))
        print(f"{c['name']:50s} ok, ticket atomics {n_atom}", flush=True)
    except Exception as e:
        print(c["name"], "FAILED", str(e)[-300:], flush=True)
