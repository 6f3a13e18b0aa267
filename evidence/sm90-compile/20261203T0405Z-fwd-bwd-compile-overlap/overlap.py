import sys, time, types, threading, os, shutil
sys.path.insert(0, 'scripts')
import gluon_compile_report as g
for name in ("fusedattn", "fusedattn.hopper"):
    sys.modules.setdefault(name, types.ModuleType(name)).__path__ = []
fk = g._load("fusedattn.hopper.forward_kernel", g.KERNEL)
bk = g._load("kbw", g.BACKWARD)
fcfg = dict(name="D64 causal", D_A=64, D_B=0, BLOCK_N=128, STAGES=4, CONSUMERS=3, CONSUMER_REGS=160, HAS_RIGHT=True)
bcfg = dict(name="bwd D64 causal", D=64, HAS_RIGHT=True)
import triton
def fresh():
    d = f"/tmp/cr/tc-{time.time_ns()}"
    os.environ["TRITON_CACHE_DIR"] = d
    triton.knobs.cache.dir = d
mode = sys.argv[1]
fresh()
t = time.perf_counter()
if mode == "seq":
    g.compile_config(fk._flash_fwd_sm90, fcfg); t1 = time.perf_counter()
    g.compile_config(bk._flash_bwd_sm90, bcfg, True)
else:
    th = threading.Thread(target=lambda: g.compile_config(bk._flash_bwd_sm90, bcfg, True))
    th.start(); g.compile_config(fk._flash_fwd_sm90, fcfg); t1 = time.perf_counter(); th.join()
print(mode, "forward done", round(t1 - t, 2), "all done", round(time.perf_counter() - t, 2))
