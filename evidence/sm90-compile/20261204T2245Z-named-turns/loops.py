"""Every innermost wgmma loop of the Hopper forward under the configurations given (a
JSON list, `gluon_compile_report`'s form): length, paths and the barrier/wait instructions
in it, with the kernel's spills and SASS digest. No GPU: a compiler report.

    PYTHONPATH=src python evidence/sm90-compile/20261204T2245Z-named-turns/loops.py \
        KERNEL_FILE 'CONFIGS_JSON' > OUT.json
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import gluon_compile_report as g  # noqa: E402
import triton  # noqa: E402

kernel, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
module = g._load("kernel_under_report", kernel)
tools = Path(triton.__file__).parent / "backends/nvidia/bin"
rows = []
for config in configs:
    facts, sass = g.cubin_facts(tools, g.compile_config(module._flash_fwd_sm90, config))
    loops = [dict(start=f"{body[0][0]:05x}", length=len(body), paths=g.path_lengths(body),
                  sync=[t for _, t in body if re.search(r"BAR\.|TRYWAIT|ARRIVES", t)])
             for body in g.wgmma_loops(sass) if sum("GMMA" in t for _, t in body) >= 8]
    rows.append(dict(name=config["name"], **facts, sass_digest=g.sass_digest(sass),
                     loops=loops))
print(json.dumps(dict(kernel=str(kernel), rows=rows), indent=1))
