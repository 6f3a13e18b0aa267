"""Where the warpgroup `bar.sync` at the top of the forward's key loop comes from: copies of
`src/fusedattn/hopper/forward_kernel.py` with the key loop's arrivals and waits cut out,
each compiled (D128, THREAD_ARRIVES=True: no `bar.sync` before the arrivals), the key
loop's barriers and waits listed. The copies compute nothing right: they only show what
Triton 3.6 puts around which operation. No GPU.

    PYTHONPATH=src python evidence/sm90-compile/20261204T2245Z-named-turns/cutdown.py > cutdown.json
"""
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import gluon_compile_report as g  # noqa: E402
import triton  # noqa: E402

ARRIVE_V = '''                    if SHARED_KV:
                        _release(k_free.index(prev), THREAD_ARRIVES)
                    else:
                        _release(v_free.index(prev), THREAD_ARRIVES)
'''
ARRIVE_K = '''                    if not SHARED_KV:
                        _release(k_free.index(slot), THREAD_ARRIVES)
                    p, m_i, l_i, alpha = _softmax_tile(
                        s, m_i, l_i, lo + i * BLOCK_N'''
ARRIVE_TURN = '''                    if PINGPONG:
                        _release(next_turn, THREAD_ARRIVES)
'''
WAIT_KV = '''                    mbarrier.wait(k_bar.index(slot), ((n + i) // STAGES) & 1)
                    if not SHARED_KV:  # else V_{i-1} came with K_{i-1}
                        mbarrier.wait(v_bar.index(prev), ((n + i - 1) // STAGES) & 1)
'''
WAIT_V = '''                    if not SHARED_KV:  # else V_{i-1} came with K_{i-1}
                        mbarrier.wait(v_bar.index(prev), ((n + i - 1) // STAGES) & 1)
'''
WAIT_TURN = ("                    if PINGPONG:  # this warpgroup's turn to issue (the "
             "other's softmax runs)\n"
             "                        mbarrier.wait(my_turn, (turns + i - 1) & 1)\n")
NO_ARRIVES = [(ARRIVE_V, ""), (ARRIVE_K, ARRIVE_K.split("\n", 2)[2]), (ARRIVE_TURN, "")]
VARIANTS = {
    "as committed": [],
    "no arrival in the loop": NO_ARRIVES,
    "no arrival, no wait": NO_ARRIVES + [(WAIT_KV, ""), (WAIT_TURN, "")],
    "no arrival, the turn's wait alone": NO_ARRIVES + [(WAIT_KV, "")],
    "no arrival, K's wait alone": NO_ARRIVES + [(WAIT_TURN, ""), (WAIT_V, "")],
}

source = (ROOT / "src/fusedattn/hopper/forward_kernel.py").read_text()
tools = Path(triton.__file__).parent / "backends/nvidia/bin"
rows = []
for name, cuts in VARIANTS.items():
    text = source
    for old, new in cuts:
        assert old in text, (name, old[:50])
        text = text.replace(old, new, 1)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    module = g._load("cut_" + str(len(rows)), Path(f.name))
    config = dict(name=name, D_A=128, D_B=0, BLOCK_N=128, THREAD_ARRIVES=True)
    _, sass = g.cubin_facts(tools, g.compile_config(module._flash_fwd_sm90, config))
    body = g.key_loop(sass)
    rows.append(dict(variant=name, loop=len(body), sync=[
        t for _, t in body if re.search(r"BAR\.SYNC|TRYWAIT|ARRIVES", t)]))
print(json.dumps(rows, indent=1))
