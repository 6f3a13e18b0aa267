"""The portable kernel's launcher source from its signature alone (`launch.launcher_source`)
against Triton 3.6's `make_launcher` on the kernel compiled for sm90 (no GPU needed; run
without TRITON_INTERPRET, with Triton 3.6, from the repo root: PYTHONPATH=src)."""
import sys

sys.path.insert(0, "scripts")
import portable_compile_report as report  # noqa: E402
from triton.backends.nvidia import driver as nvidia  # noqa: E402

from fusedattn import launch  # noqa: E402

compiled = report.compile_row("bf16", 64, True)
print("portable bf16 D64 causal, sm90: tensordesc_meta", compiled.metadata.tensordesc_meta,
      "; launcher_source equals make_launcher:",
      launch.launcher_source(compiled.src.signature) == nvidia.make_launcher(
          compiled.src.constants, compiled.src.signature, compiled.metadata.tensordesc_meta))
