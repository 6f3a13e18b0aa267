"""Micro-kernels: where Triton 3.6 puts `bar.sync`s among mbarrier operations (README.md)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@gluon.jit
def _setup():
    """Three two-slot mbarriers, a shared buffer, and a vector to store into it."""
    a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    buf = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(2):
        mbarrier.init(a.index(i), count=1)
        mbarrier.init(b.index(i), count=1)
        mbarrier.init(c.index(i), count=1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return a, b, c, buf, gl.arange(0, 128, layout=layout).to(gl.float32)


@gluon.jit
def k1(p, n, VARIANT: gl.constexpr):
    a, b, c, buf, x = _setup()
    for t in range(n):
        s = t % 2
        mbarrier.wait(a.index(s), (t // 2) & 1)
        if VARIANT == 0:   # wait; arrive b
            mbarrier.arrive(b.index(s), count=1)
        elif VARIANT == 1:  # wait; arrive b; arrive c
            mbarrier.arrive(b.index(s), count=1)
            mbarrier.arrive(c.index(s), count=1)
        elif VARIANT == 2:  # store buf; barrier; arrive b
            buf.store(x + t)
            gl.thread_barrier()
            mbarrier.arrive(b.index(s), count=1)
        elif VARIANT == 3:  # store buf; fence; barrier; arrive b
            buf.store(x + t)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(b.index(s), count=1)


@gluon.jit
def k2(p, n, VARIANT: gl.constexpr):
    """The backward's step in small: `a` the slot's ready, `c` dQ's buffer's free, `b` dQ's
    hand-off."""
    a, b, c, buf, x = _setup()
    if VARIANT == 1:
        if n > 0:
            mbarrier.wait(a.index(0), 0)
    for t in range(n):
        s = t % 2
        if VARIANT == 0:  # the slot's wait; dS's barrier; the buffer's wait; store; hand-off
            mbarrier.wait(a.index(s), (t // 2) & 1)
            y = x + t
            gl.thread_barrier()
            mbarrier.wait(c.index(s), (t // 2) & 1)
            buf.store(y)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(b.index(s), count=1)
        else:  # the next slot's wait moved before the hand-off's barrier
            y = x + t
            gl.thread_barrier()
            mbarrier.wait(c.index(s), (t // 2) & 1)
            buf.store(y)
            fence_async_shared()
            if t + 1 < n:
                mbarrier.wait(a.index((t + 1) % 2), ((t + 1) // 2) & 1)
            gl.thread_barrier()
            mbarrier.arrive(b.index(s), count=1)


@gluon.jit
def _named(lanes, bar, count, SYNC: gl.constexpr):
    if SYNC:
        gl.inline_asm_elementwise("bar.sync $1, $2; mov.u32 $0, 0;", "=r,r,r",
                                  [lanes + bar, lanes + count], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive $1, $2; mov.u32 $0, 0;", "=r,r,r",
                                  [lanes + bar, lanes + count], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def k3(p, n, VARIANT: gl.constexpr):
    """The named hand-off in small: `a` the slot's ready; named 10+s free, 8+s ready."""
    a, b, c, buf, x = _setup()
    lanes = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0])) * 0
    if VARIANT == 2:
        if n > 0:
            mbarrier.wait(a.index(0), 0)
    for t in range(n):
        s = t % 2
        if VARIANT != 2:
            mbarrier.wait(a.index(s), (t // 2) & 1)
        y = x + t
        gl.thread_barrier()  # dS's
        _named(lanes, 10 + s, 256, True)
        buf.store(y)
        fence_async_shared()
        if VARIANT == 2:
            if t + 1 < n:
                mbarrier.wait(a.index((t + 1) % 2), ((t + 1) // 2) & 1)
        if VARIANT != 1:
            _named(lanes, 8 + s, 256, False)
