"""Every fusedattn kernel launch, and its replay: the host side of a call, paid once per plan.

`launch(kernel, grid, *args, inputs=..., **kwargs)` launches `kernel[grid](*args, **kwargs)`
as Triton does and returns what that returned with a `Replay` of it, or None where it
cannot be replayed. A
`Replay` holds the compiled kernel, its grid and every argument but the tensors, each
tensor arg (and each TMA descriptor's base) recorded as an index into `inputs`, the call's
tensors by identity. `replay(inputs)` then launches the same kernel on another call's
tensors (same shapes, strides, dtypes and 16-byte alignment: the caller's plan key says so)
without Triton's per-call work: its heuristics (one dict of all arguments per heuristic),
its binder and specialisation key, its descriptor checks. On the GPU it calls the compiled
kernel's launcher directly, as `JITFunction.run` does after its cache hit (Triton 3.6's
`CompiledKernel.run`, launch hooks included); in emulation it calls `kernel[grid]` again
with the arguments rebuilt, so the tests check what a replay passes.

A launch is not replayed (None) where a tensor arg is not one of `inputs` (a buffer made
inside the call), under Triton's autotuner, or where this Triton lacks the pieces used.
Callers keep their replays in a `Plans` cache keyed by what decides the launch's
arguments; the key is theirs to make complete (`dispatch.forward`, `flash_bwd`)."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from fusedattn.mode import EMULATION, kernel_launches


class _Descriptor:
    """What Triton's launcher reads of a host TMA descriptor (base, shape, strides,
    padding), without `TensorDescriptor`'s checks, which its plan's key already made."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides, padding):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


def _is_descriptor(value) -> bool:
    return hasattr(value, "block_shape") and hasattr(value, "base")


class Replay:
    """One recorded launch; `replay(inputs)` launches it again on `inputs`. It reads each
    input's address alone (`data_ptr`: Triton's launcher, and the interpreter's loads): the
    shapes and strides are the recorded call's, so an input may be any tensor that starts
    where the recorded one did over the same storage (a view's base: `varlen`)."""

    __slots__ = ("kernel", "compiled", "grid", "names", "args", "slots", "direct")

    def __init__(self, kernel, compiled, grid, names, args, slots):
        self.kernel, self.compiled, self.grid = kernel, compiled, grid
        self.names, self.args, self.slots = names, args, slots
        self.direct = None  # its `DirectLaunch` (False: none), made at the first replay

    def _args(self, inputs) -> list:
        args = list(self.args)
        for position, index, desc in self.slots:
            t = inputs[index]
            args[position] = t if desc is None else _Descriptor(t, *desc)
        return args

    def __call__(self, inputs) -> None:
        if EMULATION:  # the interpreter compiles nothing: it takes the arguments again
            args = self._args(inputs)  # (no TMA descriptors there: Gluon does not run)
            with kernel_launches():
                self.kernel[self.grid](**dict(zip(self.names, args, strict=True)))
            return
        compiled, grid = self.compiled, self.grid
        stream = current_stream()
        enter, leave = _hooks()
        if DIRECT_LAUNCH and enter is None and leave is None:
            if self.direct is None:
                self.direct = DirectLaunch.of(self) or False
            if self.direct:
                self.direct(stream, inputs)
                return
        args = self._args(inputs)
        metadata = (None if enter is None and leave is None
                    else compiled.launch_metadata(grid, stream, *args))
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, metadata, enter, leave, *args)


DIRECT_LAUNCH = True
"""Replays call Triton's compiled launcher themselves (`DirectLaunch`). Its arguments were
checked against Triton 3.6's own launcher on the CPU (`tests/test_plans.py`); on the H200 it
gives the same bits and saves about 30 µs a Hopper forward (`h200_round.sh directab`,
evidence 0829Z). False gives every replay Triton's own launch."""

TMA_MAPS = 64
"""The CUtensorMaps a `DirectLaunch` keeps per descriptor (one per base address seen; all
dropped when one more comes): a model's layers each give their q, k, v and O addresses,
the same ones step after step under torch's caching allocator."""


class DirectLaunch:
    """A replay as Triton 3.6's launcher runs it, less the work that repeats. Triton's
    `CompiledKernel.run` (`backends/nvidia/driver.py`'s `CudaLauncher`) makes its scratch
    allocator closures, and its `wrap_handle_tensordesc` turns each TMA descriptor into a
    CUtensorMap by a driver call (`fill_tma_descriptor`, cuTensorMapEncodeTiled) followed by
    its shape and strides, before the compiled launcher, which asks the driver for each
    tensor's device pointer (`cuPointerGetAttribute`, skipped for an int). A replay's
    shapes, strides and block boxes are fixed, so this keeps the argument list with every
    fixed value in place, passes each tensor's address as an int (a CUDA tensor's
    `data_ptr` is its device address), keeps each descriptor's map per base address
    (`TMA_MAPS`), and calls the compiled launcher. A map is passed by value (a kernel
    parameter), so one kept for an address serves any tensor that starts there.

    `DirectLaunch.of(replay)` is None (Triton's own launch) unless the Triton is 3.6 and its
    launcher is as read: no scratch; where the kernel takes descriptors, the wrapper's
    closure holds the replay's descriptor positions and the compiled launcher, and the
    descriptors' metadata is there (no fp4 padding)."""

    __slots__ = ("raw", "head", "template", "tensors", "maps", "fill")

    def __init__(self, raw, head, template, tensors, maps, fill):
        self.raw, self.head, self.template = raw, head, template
        self.tensors, self.maps, self.fill = tensors, maps, fill

    @staticmethod
    def of(replay) -> DirectLaunch | None:
        compiled = replay.compiled
        positions = {position for position, _, desc in replay.slots if desc is not None}
        metas = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None) or []
        if (not _triton_36() or len(metas) != len(positions)
                or any(meta.get("fp4_padded") for meta in metas)):
            return None
        try:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            from triton.runtime.driver import driver

            launcher = compiled.run
            raw = launcher.launch
            cells = dict(zip(getattr(getattr(raw, "__code__", None), "co_freevars", ()),
                             (cell.cell_contents for cell in getattr(raw, "__closure__", None)
                              or ()), strict=True))
            if positions:  # `wrap_handle_tensordesc`'s closure over the compiled launcher
                if set(cells.get("tensordesc_indices", ())) != positions:
                    return None
                raw = cells["launcher"]
            elif "tensordesc_indices" in cells:
                return None
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                return None
            head = (*replay.grid, None, compiled.function, launcher.launch_cooperative_grid,
                    launcher.launch_pdl, None, None, compiled.packed_metadata, None, None,
                    None)
            fill = driver.active.utils.fill_tma_descriptor if positions else None
        except (AttributeError, ImportError, KeyError, TypeError, ValueError):
            return None
        return DirectLaunch._built(replay, raw, head, metas, fill, TMA_DTYPE_DEVICE_TO_HOST)

    @staticmethod
    def _built(replay, raw, head, metas, fill, host_dtypes) -> DirectLaunch:
        """The argument list with its fixed values in place: each tensor slot (position,
        input index) and each descriptor's (position, input index, the encoder's other
        arguments, its maps by address) to fill per launch."""
        at = {position: (index, desc) for position, index, desc in replay.slots}
        template, tensors, maps, metas = [], [], [], iter(metas)
        for position, value in enumerate(replay.args):
            if position not in at:  # (a buffer the plan owns: its address; the replay's
                template.append(value.data_ptr() if isinstance(value, torch.Tensor)  # args
                                else value)                          # keep it alive)
                continue
            index, desc = at[position]
            if desc is None:
                tensors.append((len(template), index))
                template.append(None)
                continue
            meta, (shape, strides, padding) = next(metas), desc
            encode = (meta["swizzle"], meta["elem_size"], host_dtypes[meta["elem_type"]],
                      meta["block_size"], shape, strides, 1 if padding == "nan" else 0)
            maps.append((len(template), index, encode, {}))
            template += [None, *shape, *strides]
        return DirectLaunch(raw, head, template, tuple(tensors), tuple(maps), fill)

    def __call__(self, stream, inputs) -> None:
        args = list(self.template)
        for at, index in self.tensors:
            args[at] = inputs[index].data_ptr()
        for at, index, encode, kept in self.maps:
            base = inputs[index].data_ptr()
            found = kept.get(base)
            if found is None:
                if len(kept) >= TMA_MAPS:
                    kept.clear()
                found = kept[base] = self.fill(base, *encode)
            args[at] = found
        head = self.head
        self.raw(head[0], head[1], head[2], stream, *head[4:], *args)


def _hooks() -> tuple:
    """Triton's launch hooks (enter, exit) as its launcher takes them, an empty chain as
    None: Triton 3.6 keeps each in a `HookChain`, never None, so its own launches build the
    hooks' metadata (a `LazyDict`) and call two empty chains every launch. A replay passes
    None for an empty chain, which the launcher skips; a registered hook (a profiler, the
    tests' `Launches`) still sees every replay."""
    runtime = _RUNTIME or _runtime()
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    if enter is not None and getattr(enter, "calls", None) == []:
        enter = None
    if leave is not None and getattr(leave, "calls", None) == []:
        leave = None
    return enter, leave


_RUNTIME = None  # Triton's `knobs.runtime`, taken at the first replay
_DRIVERS = None  # Triton's `driver` (its `DriverConfig`), taken at the first replay
_STREAM = (None, None, None)  # (the active driver, its device and stream getters)


def _runtime():
    global _RUNTIME
    from triton import knobs

    _RUNTIME = knobs.runtime
    return _RUNTIME


def current_stream() -> int:
    """The current CUDA stream's handle, as Triton's launch takes it (its active driver's
    `get_current_stream(get_current_device())`), with the getters kept while that driver
    stays the active one. Where the device's is torch's `torch.cuda.current_device`, as
    in Triton 3.6's CUDA driver, its C getter stands for it (the Python wrapper
    initialises CUDA, which a replay's first launch already did)."""
    global _DRIVERS, _STREAM
    if _DRIVERS is None:
        from triton.runtime.driver import driver

        _DRIVERS = driver
    active = _DRIVERS.active
    if _STREAM[0] is not active:
        device = active.get_current_device
        if device is torch.cuda.current_device:
            device = torch._C._cuda_getDevice
        _STREAM = (active, device, active.get_current_stream)
    return _STREAM[2](_STREAM[1]())


def _jit_and_kwargs(kernel, args, kwargs):
    """(the JITFunction under `kernel`'s heuristics, the keyword arguments with the
    heuristics' values added, as `Heuristics.run` adds them); None under an autotuner."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    kwargs = dict(kwargs)
    while isinstance(kernel, Heuristics):
        for name, rule in kernel.values.items():
            kwargs[name] = rule({**dict(zip(kernel.arg_names, args, strict=False)), **kwargs})
        kernel = kernel.fn
    return (None, None) if isinstance(kernel, Autotuner) else (kernel, kwargs)


def _capture(kernel, compiled, grid, args, kwargs, inputs, owned=()) -> Replay | None:
    jit, full = _jit_and_kwargs(kernel, args, kwargs)
    if jit is None or not hasattr(jit, "arg_names"):
        return None
    names = list(jit.arg_names)
    bound = dict(zip(names, args, strict=False))
    bound.update((n, full[n]) for n in names[len(args):] if n in full)
    defaults = inspect.signature(jit.fn).parameters
    values = []
    for name in names:
        if name not in bound and defaults[name].default is inspect.Parameter.empty:
            return None
        values.append(bound[name] if name in bound else defaults[name].default)
    if not EMULATION and (compiled is None or not hasattr(compiled, "run")):
        return None
    ids = {id(t): i for i, t in enumerate(inputs) if t is not None}
    kept = {id(t) for t in owned}
    slots = []
    for position, value in enumerate(values):
        desc = value if _is_descriptor(value) else None
        tensor = value.base if desc is not None else value
        if isinstance(tensor, torch.Tensor):
            if desc is None and id(tensor) in kept:
                continue  # the plan's own buffer: the replay passes it, and keeps it alive
            if id(tensor) not in ids:
                return None  # a buffer made inside the call: not replayable
            # a descriptor's shape, strides and padding only: the replay keeps no tensor
            # of the call it was recorded from alive
            slots.append((position, ids[id(tensor)], None if desc is None else (
                list(desc.shape), list(desc.strides), desc.padding)))
            values[position] = None
    return Replay(jit, compiled, tuple(grid) + (1,) * (3 - len(grid)), names, values,
                  tuple(slots))


def launch(kernel, grid, *args, inputs=(), owned=(), **kwargs):
    """`kernel[grid](*args, **kwargs)` (grid a tuple): (what it returned, the compiled
    kernel on the GPU; its `Replay` over `inputs`, the call's tensors, which its tensor
    args must be among, or None). `owned`: tensors the replay passes as they are, every
    time (buffers of the plan's own, as `Recording.own` declares them)."""
    if not EMULATION:
        build_launchers_ahead()
    with kernel_launches():
        try:
            compiled = kernel[grid](*args, **kwargs)
        except TypeError as e:
            why = launcher_mismatch(e) if "arguments" in str(e) else None
            if why is None:
                raise
            raise LauncherMismatch(why) from e
    try:
        return compiled, _capture(kernel, compiled, grid, args, kwargs, inputs, owned)
    except (AttributeError, TypeError, KeyError, IndexError):
        return compiled, None  # a Triton whose internals differ: Triton's launches only


def _launcher_key(src, meta) -> str:
    """The key Triton 3.6's `CudaLauncher` files a kernel's launcher module under
    (`module_key` of the source it makes from the kernel's signature, constants and
    descriptors' metadata)."""
    from triton.backends.nvidia.driver import make_launcher

    names = src.fn.arg_names
    constants = {(names.index(k),) if isinstance(k, str) else k: value
                 for k, value in getattr(src, "constants", {}).items()}
    return module_key(make_launcher(constants, dict(src.signature), meta))


def module_key(source: str) -> str:
    """The key Triton 3.6 files a C module of this source under (`compile_module_from_src`:
    the source's hash with the platform's)."""
    from triton.runtime.build import platform_key

    return hashlib.sha256((source + platform_key()).encode("utf-8")).hexdigest()


class LauncherMismatch(RuntimeError):
    """Triton's launcher module for a kernel took another argument list than the kernel's
    metadata made (`launcher_mismatch` says which module and which source)."""


def launcher_mismatch(error: TypeError) -> str | None:
    """What a `TypeError` out of Triton 3.6's launch ("function takes exactly N arguments (M
    given)") says about the launcher module that raised it, or None where the error did
    not come from a compiled kernel's launcher. Seen four times, each in one GPU tier and
    gone in the next (evidence/nvidia-h200/20261202T050921Z-gpu-tier, the portable fp32
    backward; evidence/nvidia-h100/20261205T155218Z-gpu-tier, a D72 forward on a warm
    cache; evidence/nvidia-h100/20261207T1449Z-fp8-claimed-turns-by-dim, the portable fp32
    `_flash_bwd_dq` with another kernel's module; evidence/nvidia-h100/20261207T161043Z-gpu-tier,
    `_flash_bwd_dkdv`, with files loaded once but a name left in `sys.modules`), each time
    "another kernel's launcher": CPython's second load of a launcher's file, racing another
    thread's (`load_modules_once`, which prevents it). The message names the
    kernel, the descriptors' metadata, the module's file and whether its folder is the
    key of the source Triton makes from that metadata (Triton keys a launcher module by
    its source: another key means another kernel's module was loaded; the same key, that
    the file under it was built from another source)."""
    compiled = None
    tb = error.__traceback__
    while tb is not None:  # the innermost frame holding a compiled kernel (`JITFunction.run`'s)
        found = tb.tb_frame.f_locals.get("kernel")
        if hasattr(found, "metadata") and hasattr(found, "src"):
            compiled = found
        tb = tb.tb_next
    if compiled is None:
        return None
    meta = getattr(compiled.metadata, "tensordesc_meta", None)
    try:
        from triton.runtime.cache import _base32  # (Triton's folder name for a key)

        folder = _base32(_launcher_key(compiled.src, meta))
        launch = compiled.run.launch
        cells = dict(zip(getattr(getattr(launch, "__code__", None), "co_freevars", ()),
                         (c.cell_contents for c in getattr(launch, "__closure__", None) or ()),
                         strict=True))
        module = getattr(cells.get("launcher", launch), "__self__", None)
        path = getattr(module, "__file__", "?")
    except Exception as e:  # noqa: BLE001 (the report is best-effort; the error stands)
        return f"{error} (and its report failed: {type(e).__name__}: {e})"
    same = Path(path).parent.name == folder
    descs = "none" if meta is None else ", ".join("TMA" if m else "pointer" for m in meta)
    return (f"{error}: Triton's launcher for {compiled.name} takes another argument list "
            f"than its metadata makes (descriptors: {descs}). The module loaded is {path}; "
            "its folder is " + ("the key of the metadata's launcher source, so the file there "
                                "was built from another source" if same else
                                f"not {folder}, that source's: another kernel's launcher")
            + ". Emptying Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache) builds "
            "it again; please report this message to fusedattn.")


_AHEAD = False  # True once `build_launchers_ahead` has run in this process
_AHEAD_LOCK = threading.Lock()  # (threads making their first launches at once install once)


def build_launchers_ahead() -> None:
    """Install `launcher_ahead` as Triton's `jit_cache_hook` (once a process, on the first
    GPU launch; a hook already there is called after it, and its answer kept), and start
    Triton's key on a thread (`_triton_key`). Triton builds a kernel's launcher, a C
    module, after the kernel has compiled: a host compiler run, 0.37 s of the D128
    forward's empty-cache first call on the H200
    (evidence/nvidia-h200/20261203T0528Z-first-call-empty-cache, under cProfile). Its
    source depends on the kernel's signature alone, which the hook is given before the
    compile starts, so it is built on a thread meanwhile, into Triton's cache, where the
    launch then finds it. First the package's prebuilt C modules and the kernels of this
    GPU's architecture go into Triton's cache (`prebuilt.ensure`; the modules by
    `fusedattn.prime`'s thread where it ran), so that no launch looks one up before they
    are in."""
    global _AHEAD
    if _AHEAD:  # (done: a later call costs a read)
        return
    from fusedattn import prime

    prime.settle()  # (its imports and Triton's key first: a compile imports Triton's too)
    import torch
    from triton import knobs

    from fusedattn import prebuilt

    with _AHEAD_LOCK:
        if _AHEAD:
            return
        prebuilt.ensure()
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            prebuilt.ensure(10 * major + minor)
        load_modules_once()  # (before the threads below and `precompile_backward`'s load any)
        _AHEAD = True
        knobs.runtime.jit_cache_hook = launcher_ahead(knobs.runtime.jit_cache_hook)
        ahead(_triton_key)


_LOADED: dict[str, object] = {}  # a C module's file -> the module its first load made
_LOADED_LOCK = threading.Lock()


def load_modules_once() -> None:
    """Make Triton load each of its C modules' files once a process (its
    `runtime.build._load_module_from_path`, through which `compile_module_from_src` loads a
    kernel's launcher), and the same module object for that file every time after.

    Why: every launcher module is named `__triton_launcher`, and it initialises once
    (single-phase). When CPython loads such a file a second time, it does not make a new
    module: it hands back the module `sys.modules` holds under that name (the last one
    loaded, whatever its file) with that file's first dict copied into it
    (`tests/test_plans.py` shows it with two small C modules). Until the caller has read
    `launch` off it, another thread's second load of another file can overwrite the same
    object's dict, and the kernel gets another kernel's launcher. Our launches build
    launchers ahead on threads (`build_launcher`) and `precompile_backward` loads them on
    a pool beside the main thread, so this happened: the `LauncherMismatch` of three GPU
    tiers (`launcher_mismatch`), and a fourth with files loaded once (the tier of
    evidence/nvidia-h100/20261207T161043Z-gpu-tier): a file loaded before
    this was installed (a kernel launched by Triton before fusedattn's first launch) is
    not among the loads remembered here, so its second load came through. Hence the
    name's entry in `sys.modules` goes before and after each load, under the lock: a
    second load, whoever makes it, then makes a module of its own, and no module handed
    out is one a later load can write into."""
    try:
        from triton.runtime import build
    except ImportError:
        return
    original = getattr(build, "_load_module_from_path", None)
    if original is None or getattr(original, "loads_once", False):
        return

    def load(name, path):
        with _LOADED_LOCK:
            module = _LOADED.get(path)
            if module is None:  # (a failed load raises, and Triton builds the file again)
                sys.modules.pop(name, None)
                try:
                    module = _LOADED[path] = original(name, path)
                finally:
                    sys.modules.pop(name, None)
            return module

    load.loads_once, load.__wrapped__ = True, original
    build._load_module_from_path = load


def ahead(fn, *args) -> None:
    """`fn(*args)` on a thread of its own that ends with it (no pool keeps threads alive
    after the work: a process that forks later has none of ours), its errors dropped."""
    threading.Thread(target=_quietly, args=(fn, *args), name="fusedattn-ahead").start()


def _triton_key() -> None:
    """Triton's cache key (`remember_triton_key`'s, computed `once`), on a thread while the
    first launch makes Triton's driver (a host compiler run for its `cuda_utils` on an
    empty cache, 0.42 s; the key's hashing, 0.43 s, comes after it in that launch:
    evidence/nvidia-h200/20261203T0528Z-first-call-empty-cache)."""
    from triton.runtime import cache

    if getattr(cache.triton_key, "remembered", False):  # (Triton's own would be computed
        cache.triton_key()                               # by the launch again, meanwhile)


def launcher_ahead(previous):
    """A `jit_cache_hook` (Triton calls it before each compile, with the kernel and its
    signature) that starts a fusedattn kernel's launcher build (`build_launcher`) on a
    thread, then answers as `previous` does (None: compile). It never raises: a build that
    fails or guesses another source costs a host compiler run, nothing else."""

    def hook(**kwargs):
        try:
            if str(kwargs["fn"].module).startswith("fusedattn"):
                ahead(build_launcher, kwargs["compile"]["signature"])
        except Exception:  # noqa: BLE001 (a hook that raised would fail the compile)
            pass
        return previous(**kwargs) if previous is not None else None

    return hook


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 (Triton builds its launcher itself, as ever)
        pass


def build_launcher(signature: dict) -> None:
    """Triton 3.6's launcher module for a kernel of this signature, built into its cache
    (`compile_module_from_src`, keyed by the source) as `CudaLauncher` would build it
    after the compile. Its source reads the descriptors' metadata only for whether each
    is there; on sm90 each host descriptor has it (a TMA map), so one stands for all."""
    if not _triton_36():
        return
    import sysconfig

    from triton.backends.nvidia import driver as nvidia
    from triton.runtime.build import compile_module_from_src, get_cache_manager

    if nvidia.PyCUtensorMap is None:  # a launcher's module reads it once, as it loads:
        return  # loaded before Triton's driver sets it, every later load would keep None
    source, name = launcher_source(signature), "__triton_launcher"
    # (in the cache already, as after `warmup`: not loaded here, the launch loads it)
    key = module_key(source)
    if get_cache_manager(key).get_file(name + sysconfig.get_config_var("EXT_SUFFIX")):
        return
    compile_module_from_src(src=source, name=name, library_dirs=nvidia.library_dirs(),
                            include_dirs=nvidia.include_dirs, libraries=nvidia.libraries)


def _triton_36() -> bool:
    """Whether this Triton is 3.6, whose launcher internals `DirectLaunch` and
    `build_launcher` were read from (elsewhere both leave Triton's own way in place)."""
    import triton

    return triton.__version__.startswith("3.6.")


def launcher_source(signature: dict) -> str:
    """The C source of Triton 3.6's launcher for a kernel of this signature (its
    `make_launcher`, with a stand-in metadata entry for each descriptor)."""
    from triton.backends.nvidia import driver as nvidia

    descriptors = sum(isinstance(ty, str) and ty.startswith("tensordesc")
                      for ty in signature.values())
    return nvidia.make_launcher(None, signature, [{}] * descriptors or None)


class Plan:
    """A call's launches (`Replay`s) and the scratch tensors they share (made per call,
    empty: buffers one launch writes and a later one reads).

    The scratch is one allocation a call, the buffers at `SCRATCH_ALIGN`-byte offsets in
    it: on the GPU each is passed as its address (`Address`: a replay reads nothing else
    of it), in emulation as a view of its dtype and shape. Split decode's two partials had
    been two `torch.empty`s, the largest own time of a decode call under cProfile
    (evidence/nvidia-h200/20261203T1444Z-host-profile). The allocation is freed when the
    call returns, after its launches are queued: torch's caching allocator gives it to a
    later allocation only in the stream's order, as for any temporary."""

    __slots__ = ("replays", "scratch", "offsets", "size")

    def __init__(self, replays, scratch):
        self.replays, self.scratch = tuple(replays), tuple(scratch)
        self.offsets, self.size = [], 0
        for shape, dtype, _ in self.scratch:
            self.offsets.append(self.size)
            size = math.prod(shape) * dtype.itemsize
            self.size += -(-size // SCRATCH_ALIGN) * SCRATCH_ALIGN
        if len({device for _, _, device in self.scratch}) > 1:
            self.size = None  # (one buffer per tensor, each on its device)

    def __call__(self, inputs) -> None:
        if self.scratch:
            inputs = (*inputs, *self.made())
        for replay in self.replays:
            replay(inputs)

    def made(self) -> tuple:
        """This call's scratch buffers, in the order the recording declared them."""
        if self.size is None:
            return tuple(torch.empty(shape, dtype=dtype, device=device)
                         for shape, dtype, device in self.scratch)
        buffer = torch.empty(self.size, dtype=torch.uint8, device=self.scratch[0][2])
        if EMULATION:  # (the interpreter reads tensors)
            return tuple(buffer[at:at + math.prod(shape) * dtype.itemsize].view(dtype)
                         .view(shape) for at, (shape, dtype, _) in zip(
                             self.offsets, self.scratch, strict=True))
        base = buffer.data_ptr()
        return tuple(Address(base + at, buffer) for at in self.offsets)


SCRATCH_ALIGN = 256  # bytes between a plan's scratch buffers (Triton specialises on 16)


class Address:
    """A device address where a launch takes a tensor: Triton's launchers, ours
    (`DirectLaunch`) and its own, read a pointer argument's `data_ptr()` alone. It keeps
    the allocation it points into alive (`owner`)."""

    __slots__ = ("address", "owner")

    def __init__(self, address: int, owner: torch.Tensor):
        self.address, self.owner = address, owner

    def data_ptr(self) -> int:
        return self.address


class Recording:
    """What a call launches, as it launches it (`launch`): the `Plan` of the call, or None
    where a launch could not be replayed. `inputs`: the call's tensors (the plan's
    replays take the next call's, in the same order); `scratch(*tensors)` declares the
    buffers the call makes itself, which a replay makes anew."""

    def __init__(self, inputs=()):
        self.inputs, self.replays, self._scratch = tuple(inputs), [], []
        self._owned = []

    def own(self, *tensors: torch.Tensor) -> None:
        """Declare buffers the plan keeps for good, passed to every replay as they are (the
        Hopper forward's claim counter, `hopper.forward.claim_counter`): a replay's launch
        uses them where the recorded one did, so two replays of the plan must not overlap
        (`dispatch.plan_context` keys a plan by stream)."""
        self._owned += tensors

    def scratch(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not t.is_contiguous():
                self.unreplayable()  # a replay makes contiguous buffers only
            self._scratch.append((t.shape, t.dtype, t.device))
        self.inputs += tensors

    def unreplayable(self) -> None:
        """A launch made outside `launch` (the autotuner's): the call gets no plan."""
        self.replays.append(None)

    def launch(self, kernel, grid, *args, **kwargs):
        """`launch` over this call's inputs and scratch; returns what Triton returned."""
        compiled, replay = launch(kernel, grid, *args, inputs=self.inputs, owned=self._owned,
                                  **kwargs)
        self.replays.append(replay)
        return compiled

    def plan(self) -> Plan | None:
        if not self.replays or None in self.replays:
            return None
        return Plan(self.replays, self._scratch)


def tensor_key(t):
    """What of a tensor decides a launch, for plan keys: shape, strides, dtype, device and
    16-byte alignment (Triton specialises pointers on it; TMA and the portable kernels'
    ALIGN need it); None for None. `api.call_key` lays the same parts out flat, inline
    (a call a tensor fewer on every call's path), each tensor's followed by whether it
    requires grad: a part added here goes there too."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def inputs_key(inputs) -> tuple:
    """A plan key's part for the call's tensors: each one's `tensor_key`, and which of them
    are one object (`aliases`)."""
    return (*map(tensor_key, inputs), aliases(inputs))


def aliases(tensors) -> int | tuple:
    """Which of `tensors` are one object: for each, the position of its first occurrence
    (None skipped), or, where all are apart, their count.
    A replay finds its tensors by position, recorded by identity: a plan recorded on
    `attention(x, x, x)` maps q, k and v to one position, and must not serve a call with
    three tensors."""
    ids = [id(t) for t in tensors if t is not None]
    if len({*ids}) == len(ids):  # the common case, all apart: their count (never a tuple)
        return len(ids)
    first: dict[int, int] = {}  # id -> its first position (`setdefault` keeps the first)
    return tuple(map(first.setdefault, ids, range(len(ids))))


class Plans:
    """A bounded, thread-safe map of plan keys to what a call decided (its replays and
    whatever else the caller keeps), least recently used first out."""

    def __init__(self, size: int = 1024):
        self._size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key):
        # held by the key's hash, beside the key: a key of 50 parts is hashed once a
        # lookup, not again to move it (a tuple keeps no hash); a hash two keys share
        # holds the last one put, and the other's lookup misses
        found = self._items.get(at := hash(key))  # (each a single step under the GIL: no
        if found is None or found[0] != key:      # lock, which a call's lookup would pay;
            return None                           # a `put` evicting the key meanwhile
        try:                                      # leaves nothing to move)
            self._items.move_to_end(at)
        except KeyError:
            pass
        return found[1]

    def put(self, key, plan) -> None:
        at = hash(key)
        with self._lock:
            self._items[at] = (key, plan)
            self._items.move_to_end(at)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


class KeptPlan:
    """A plan an entry point keeps for one of its call keys, with the context it was made in
    (`dispatch.plan_context`): the call key settles the dispatch's plan key but for that
    context, so a call of the key replays the plan while the context is unchanged, with no
    other key to make (`api.attention`, `attention_varlen`, `attention_with_kvcache`). One
    attribute holds both: a thread that replaces them replaces them together."""

    __slots__ = ("_kept",)

    def __init__(self):
        self._kept = None

    def get(self, context):
        """The plan kept under `context`, or None."""
        kept = self._kept
        return kept[1] if kept is not None and kept[0] == context else None

    def keep(self, context, plans: list) -> None:
        """Keep the plan that `dispatch.forward(keep=plans)` gave under `context`, if any
        (the context `frozen`: its live tables copied, to compare with later)."""
        if plans:
            self._kept = (frozen(context), plans[0])


def _tables(context, as_):
    """`context` (tuples nesting values and dicts: `dispatch.plan_context`, the A/B
    switches' tables) with each dict `as_(dict)`."""
    if isinstance(context, tuple):
        return tuple(_tables(part, as_) for part in context)
    return as_(context) if isinstance(context, dict) else context


def frozen(context):
    """`context` with each dict copied. A copy compares equal (`==`) to the live table
    until the table changes, in place or replaced, so a context taken each call holds the
    tables themselves, and costs no copy (issue 31)."""
    return _tables(context, dict)


def hashable(context):
    """`context` with each dict as the tuple of its items: what a plan key holds."""
    return _tables(context, lambda table: tuple(table.items()))


# Triton's cache key starts with `triton_key()`, a hash of its own sources and of libtriton
# that each process computes on its first compile or cache lookup: 0.35 s of a first call
# on the H200 (evidence/nvidia-h200/20261201T1725Z-first-call). The key only changes with
# those files, so it is kept in Triton's cache folder under a fingerprint of their names,
# sizes and modification times (a few ms to take), and computed again, by Triton, when the
# fingerprint differs (Triton's own warmup pool hands its workers the key the same way).
TRITON_KEY_FILE = "fusedattn-triton-key.json"


def _triton_fingerprint(root: Path) -> str:
    """A hash of the names, sizes and modification times of what `triton_key` reads
    (a superset: every .py under compiler/, backends/ and language/, runtime/cache.py,
    libtriton) and of Triton's version."""
    import triton

    parts = [triton.__version__]
    files = [root / "runtime" / "cache.py", *sorted((root / "_C").glob("libtriton*"))]
    for sub in ("compiler", "backends", "language"):
        files += sorted(p for p in (root / sub).rglob("*.py"))
    for path in files:
        stat = path.stat()
        parts.append(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def remembered_triton_key(compute, folder: Path, root: Path) -> str:
    """`compute()` (Triton's `triton_key`) as kept in `folder`/TRITON_KEY_FILE under the
    fingerprint of `root` (Triton's package folder): read where the fingerprint matches,
    else computed and written whole (a temporary file renamed over it) where the folder
    lets it. An unreadable or foreign file is computed over, never trusted."""
    fingerprint = _triton_fingerprint(root)
    path = folder / TRITON_KEY_FILE
    try:
        saved = json.loads(path.read_text())
        if saved["fingerprint"] == fingerprint and isinstance(saved["key"], str):
            return saved["key"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    key = compute()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "key": key}))
        os.replace(tmp, path)
    except OSError:  # a read-only or full cache: the next process computes it again
        try:
            tmp.unlink(missing_ok=True)  # (no partial file left behind)
        except OSError:
            pass
    return key


def settle_keys(module: str) -> None:
    """Compute the cache keys of module `module`'s Triton and Gluon functions, each after
    the keys of the functions it calls (post-order, as Triton's own hash walk finds them).
    Triton 3.6's key of a function takes in the constexpr globals its callees read, merged
    from each callee before that callee's key is computed (`DependenciesFinder.
    _update_hash`; 3.9 computes it first): a callee not hashed yet adds none. So a kernel's
    key hung on which kernels a process had hashed before it. `_flash_bwd_sm90` had three
    keys for one source (evidence/cpu/20261203T1110Z-key-order), and the prebuilt kernels
    (`fusedattn.prebuilt`) made by warmups missed where a first call hashed in another
    order. Settled callees first, every process computes the one key Triton 3.9 would.
    Called by each kernel module as it is imported, outside emulation; a function that
    Triton cannot hash is left to raise where it launches."""
    if EMULATION:
        return
    try:
        import inspect
        import sys

        from triton.runtime.jit import DependenciesFinder, JITCallable
    except ImportError:
        return

    class Callees(DependenciesFinder):
        """Triton's walk of a function's source, recording what it would hash."""

        def __init__(self, fn):
            super().__init__(name=fn._fn_name, globals=fn.__globals__,
                             nonlocals=inspect.getclosurevars(fn.fn).nonlocals, src=fn.src)
            self.found = []

        def _update_hash(self, func):
            self.found.append(func)

    seen = set()

    def settle(fn):
        if id(fn) in seen or fn.hash is not None:
            return
        seen.add(id(fn))
        finder = Callees(fn)
        finder.visit(fn.parse())
        for callee in finder.found:
            settle(callee)
        fn.cache_key  # noqa: B018 (computed and kept by Triton)

    for value in list(vars(sys.modules[module]).values()):
        if isinstance(value, JITCallable) and getattr(value, "__module__", None) == module:
            try:
                settle(value)
            except Exception:  # noqa: BLE001 (Triton's own hash raises it at the launch)
                pass


def remember_triton_key() -> None:
    """Put `remembered_triton_key` in place of `triton.runtime.cache.triton_key` (once a
    process; a Triton without it is left alone). FUSEDATTN_TRITON_KEY=compute leaves
    Triton's own."""
    if os.environ.get("FUSEDATTN_TRITON_KEY") == "compute":
        return
    try:
        import triton
        from triton import knobs
        from triton.runtime import cache
    except ImportError:
        return
    original = getattr(cache, "triton_key", None)
    if original is None or getattr(original, "remembered", False):
        return

    def remembered() -> str:
        try:
            return remembered_triton_key(original, Path(knobs.cache.dir),
                                         Path(triton.__file__).parent)
        except Exception:  # a Triton laid out otherwise: its own key
            return original()

    triton_key = once(remembered)
    triton_key.remembered, triton_key.original = True, original
    cache.triton_key = triton_key


def once(compute):
    """`compute()`'s value, computed by the first caller and kept (`cache_clear()` forgets
    it). A caller that comes while another thread computes it waits for that value, where
    `functools.cache` would let each compute it (0.43 s of hashing each on the H200's
    host): `build_launchers_ahead` starts Triton's key on a thread at the first GPU launch,
    and the launch's compile asks for it soon after. A raise keeps nothing: the next caller
    computes again."""
    lock, kept = threading.Lock(), []

    def value():
        if not kept:
            with lock:
                if not kept:
                    kept.append(compute())
        return kept[0]

    value.cache_clear = kept.clear
    return value


remember_triton_key()
