"""Where the Hopper forward's barrier stalls come from, without a GPU: compile a two-partition
Gluon kernel for sm_90a and print its PTX's barriers and mbarrier operations.

    python3 scripts/gluon_barrier_probe.py        # Triton 3.6 with Gluon's Hopper API

A 4-warp partition that waits on one mbarrier and arrives on another in a loop gets a
`bar.sync 0, 128` (the warpgroup's named barrier) before each wait and each arrive, with one
allocation for both barriers or one each; a 1-warp partition doing the same gets none. So
in the forward's consumer warpgroups every mbarrier operation lines up the warpgroup's
four warps first (evidence/nvidia-h200/20261201T1426Z-ncu-hopper-vs-fa4: barrier stalls
2.3-3.0 cycles per issue against FA4's 0.3-0.6)."""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@gluon.jit
def _waits_then_arrives(b0, b1, n):
    for i in range(n):
        mbarrier.wait(b0, i & 1)
        mbarrier.arrive(b1, count=1)


@gluon.jit
def _arrives_then_waits(b0, b1, n):
    for i in range(n):
        mbarrier.arrive(b0, count=1)
        mbarrier.wait(b1, i & 1)


@gluon.jit
def _probe(n):
    b0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    b1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(b0, count=1)
    mbarrier.init(b1, count=1)
    fence_async_shared()
    # the default partition has the launch's 4 warps; the worker 1 warp
    gl.warp_specialize([(_waits_then_arrives, (b0, b1, n)), (_arrives_then_waits, (b0, b1, n))],
                       [1], [24])


def main() -> None:
    source = GluonASTSource(_probe, {"n": "i32"}, {})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    for line in kernel.asm["ptx"].splitlines():
        if re.search(r"bar\.sync|barrier\.sync|mbarrier\.(arrive|try_wait)", line):
            print(line.strip())


if __name__ == "__main__":
    main()
