"""What Triton 3.6's gcc builds cost on this CPU with an empty cache: its `cuda_utils` module
and a kernel launcher of 3 and of 40 arguments (`compile_module_from_src`, as the driver and
`CudaLauncher` call it). A stand-in libcuda.so.1 (an empty shared object) lets the link
succeed where no GPU driver is installed; the built module's import then fails, after the
build, which is what is timed. Run with TRITON_LIBCUDA_PATH pointing at the stand-in's
folder (see gcc-builds-output.txt's first line)."""

import tempfile
import time

from triton import knobs
from triton.backends.nvidia import driver
from triton.runtime.build import compile_module_from_src


def build(src: str, name: str) -> float:
    knobs.cache.dir = tempfile.mkdtemp()
    start = time.perf_counter()
    try:
        compile_module_from_src(src=src, name=name, library_dirs=driver.library_dirs(),
                                include_dirs=driver.include_dirs,
                                libraries=driver.libraries)
    except ImportError:  # the stand-in driver: built, not loadable
        pass
    return time.perf_counter() - start


def main() -> None:
    utils = (driver.Path(driver.dirname) / "driver.c").read_text()
    for _ in range(2):
        print(f"cuda_utils {build(utils, 'cuda_utils'):.3f} s")
    for n in (3, 40):
        signature = {i: "*bf16" if i < 8 else "i32" for i in range(n)}
        src = driver.make_launcher({}, signature, None)
        print(f"launcher of {n} arguments {build(src, '__triton_launcher'):.3f} s")


if __name__ == "__main__":
    main()
