"""The committed prebuilt entries: their files' sizes, stored (zlib) and whole, and the time
to decompress them all (median of 5). Run from the repo root: python3 measure.py"""
import json
import statistics
import time
import zlib
from pathlib import Path

root = Path("src/fusedattn/prebuilt")
stored = [p.read_bytes() for p in (root / "entries").rglob("*.z")]
manifest = json.loads((root / "manifest.json").read_text())
times = []
for _ in range(5):
    t = time.perf_counter()
    whole = sum(len(zlib.decompress(b)) for b in stored)
    times.append(time.perf_counter() - t)
print(f"entries {len(manifest['entries'])}, files {len(stored)}, stored "
      f"{sum(map(len, stored)) / 1e6:.2f} MB, whole {whole / 1e6:.2f} MB, decompress all "
      f"{statistics.median(times) * 1e3:.0f} ms (median of 5: "
      f"{', '.join(f'{x * 1e3:.0f}' for x in times)})")
