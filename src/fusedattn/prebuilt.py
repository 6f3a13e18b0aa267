"""Kernels compiled ahead of time and shipped in the package (issue 31: a first call with an
empty Triton cache).

A first call in a fresh container compiles its kernels: the Gluon forward alone took 3.0-3.8 s
on the H200's host, against a target of 1 s for the whole call. `fusedattn.warmup` fills
Triton's cache where a deployment runs it; this module is the same cache, filled once on the
H200 by `scripts/prebuild.py` for the common calls (`SPECS`), and kept in the package under
`prebuilt/`: each entry the files a cache hit reads at run time (a kernel's `.cubin` and its
`.json` metadata; a C module's `.so`: Triton's `cuda_utils` and the kernels' launchers), under
Triton's own key, each file zlib-compressed (`FILE.z`: 5.3 MB where the files are 21.3 MB;
all of them decompress in 54 ms on the development CPU: evidence/cpu/
20261203T1200Z-prebuilt-zlib).

`install` copies the entries a cache lacks into it, through Triton's cache manager (each file
written whole, then renamed, as Triton writes its own; a kernel's group file last, which is
what Triton looks up). A process does it once for the C modules, on the thread
`fusedattn.prime` starts at import (Triton's driver builds `cuda_utils` as it starts), and
once for the kernels of its GPU's architecture, at its first GPU launch
(`launch.build_launchers_ahead`: the thread makes no CUDA call, so it cannot know the GPU; a
copy of the cubins there costs milliseconds). It installs only where the build matches:
Triton's version, CPython's version and the platform of `scripts/prebuild.py`'s run, as the
manifest records them. Even then an entry is only found by the key Triton computes for a call: the
hash of Triton's own build (`triton_key`), the kernel's source and constants, the target GPU,
ptxas's version and the options. A kernel changed since the entries were made, another GPU or
another Triton build computes another key and compiles as before; a shipped entry can never
stand in for another kernel. `FUSEDATTN_PREBUILT=0` turns it off.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import itertools
import json
import os
import re
import sys
import threading
import zlib
from pathlib import Path

ROOT = Path(__file__).parent / "prebuilt"
MANIFEST = ROOT / "manifest.json"

SPECS = [  # `fusedattn.warmup`'s arguments for the calls the shipped kernels serve
    dict(head_dims=(64, 128), heads=(8,), dtypes=("bf16", "fp16"), causal=(True, False),
         training=True, max_len=4096),
    dict(head_dims=(64, 128), heads=(8,), dtypes=("bf16", "fp16"), causal=(True, False),
         training=False, max_len=4096),
    # GQA (most models: Llama, Mistral, Qwen): the Hopper backward compiles per `GQA`, so a
    # GQA model's first training step compiled its backward (training warms the no-grad
    # forward too)
    dict(head_dims=(64, 128), heads=(8,), heads_kv=(2,), dtypes=("bf16", "fp16"),
         causal=(True, False), training=True, max_len=4096),
]
SPLIT = ("dtypes", "head_dims", "causal")  # a spec's keys split into one warmup each


def singles(spec: dict) -> list[dict]:
    """`spec` as one spec per dtype, head dim and mask (`scripts/prebuild.py` warms each in
    a process of its own; the manifest records them)."""
    values = [spec[k] for k in SPLIT]
    return [dict(spec, **{k: (v,) for k, v in zip(SPLIT, combo, strict=True)})
            for combo in itertools.product(*values)]


KEEP = (".cubin", ".json", ".so")  # a cache entry's files a hit reads (not its IRs)

_DONE: dict = {}  # `ensure`'s answers by architecture (None: the C modules), once a process
_LOCK = threading.Lock()


def build() -> dict:
    """This process's build, as the manifest records it: Triton's version, CPython's
    (major.minor) and Triton's platform key (`triton.runtime.build.platform_key`)."""
    import triton
    from triton.runtime.build import platform_key

    return {"triton": triton.__version__, "python": "{}.{}".format(*sys.version_info[:2]),
            "platform": platform_key()}


_JIT = re.compile(rb"^@\S*jit\b", re.M)  # a kernel's decorator: triton's, gluon's, shape_jit


def kernel_sources(kernels) -> dict[str, str]:
    """SHA-256 of each package module that kernels named `kernels` compile from, by its
    path in the package: the modules that define them (under a `...jit` decorator) and the
    kernel modules those import from, and so on. Triton's key for a kernel hashes its
    source and its first line's number, so any edit to such a module, even one above a
    kernel and outside it, can move an entry's key (b0c161c's six lines in
    `tiles/common.py` did: 20261205T190716Z's tier). `pack` records them for the shipped
    kernels; the CPU test `test_the_shipped_entries_were_made_from_these_kernel_sources`
    compares. A kernel module no shipped kernel uses (decode's) is not among them."""
    package = ROOT.parent
    modules = {}  # the package's kernel modules: dotted name -> (path, tree)
    for path in sorted(package.rglob("*.py")):
        data = path.read_bytes()
        if _JIT.search(data):
            name = ".".join((package.name, *path.relative_to(package).with_suffix("").parts))
            modules[name] = (path, ast.parse(data))
    wanted = set(kernels)
    todo = [name for name, (_, tree) in modules.items()
            if any(isinstance(node, ast.FunctionDef) and node.name in wanted
                   for node in tree.body)]
    found = {}
    while todo:
        name = todo.pop()
        path, tree = modules[name]
        rel = path.relative_to(package).as_posix()
        if rel in found:
            continue
        found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        todo += [node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module in modules]
    return dict(sorted(found.items()))


def shipped_kernels(manifest: dict) -> list[str]:
    """The kernel names of `manifest`'s entries (a C module's entry names none)."""
    return sorted({e["group"].removesuffix(".json") for e in manifest["entries"] if e["group"]})


def key_of(folder: str) -> str:
    """The hex key behind a cache folder's name (Triton names it by the key's base32)."""
    return base64.b32decode(folder + "=" * (-len(folder) % 8)).hex()


def pack(cache: Path, out: Path, made_by: dict) -> dict:
    """The entries of Triton cache folder `cache` (filled by `fusedattn.warmup` from empty)
    as `out`/entries/FOLDER/FILE.z (zlib) and `out`/manifest.json (each file's SHA-256, of
    the file itself) and the kernel modules' hashes (`kernel_sources`); returns the
    manifest. A kernel's
    entry keeps its cubin and metadata, a module's its `.so`; `made_by` (the commit, the GPU,
    the specs) goes into the manifest as it is."""
    entries = []
    for folder in sorted(p for p in cache.iterdir() if p.is_dir()):
        files = sorted(p for p in folder.iterdir()
                       if p.suffix in KEEP and not p.name.startswith("__grp__"))
        groups = [p.name.removeprefix("__grp__") for p in folder.glob("__grp__*.json")]
        if not files:
            continue
        if len(groups) > 1:
            raise ValueError(f"{folder}: {len(groups)} groups; a kernel's entry has one")
        entry = {"folder": folder.name, "key": key_of(folder.name),
                 "group": groups[0] if groups else None, "arch": None, "files": {}}
        if entry["group"]:  # a kernel: the architecture its metadata names
            meta = json.loads((folder / entry["group"]).read_text())
            entry["arch"] = meta.get("target", {}).get("arch")
        for path in files:
            data = path.read_bytes()
            entry["files"][path.name] = hashlib.sha256(data).hexdigest()
            target = out / "entries" / folder.name / f"{path.name}.z"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zlib.compress(data, 9))
        if entry["group"] and entry["group"] not in entry["files"]:
            raise ValueError(f"{folder}: group {entry['group']} without its metadata")
        entries.append(entry)
    manifest = {"build": build(), "made_by": made_by, "entries": entries}
    manifest["sources"] = kernel_sources(shipped_kernels(manifest))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def refusal(manifest: dict) -> str | None:
    """Why this process must not install `manifest`'s entries, or None."""
    if os.environ.get("FUSEDATTN_PREBUILT", "1") == "0":
        return "FUSEDATTN_PREBUILT=0"
    here, there = build(), manifest.get("build", {})
    for name, value in here.items():
        if there.get(name) != value:
            return f"built for {name} {there.get(name)!r}, this process has {value!r}"
    return None


def install(root: Path = ROOT, arch: int | None = None) -> dict:
    """Copy the entries of `root`'s manifest that Triton's cache lacks into it: the C
    modules (arch None), or the kernels for GPU architecture `arch` (90: sm90); returns
    {"installed": n, "present": n} or {"skipped": why}. Never raises: a cache it cannot
    write is left to compile as before."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except FileNotFoundError:
        return {"skipped": "no prebuilt kernels in this package"}
    except (OSError, ValueError) as e:
        return {"skipped": f"unreadable manifest: {e}"}
    try:
        why = refusal(manifest)
        if why:
            return {"skipped": why}
        from triton.runtime.cache import get_cache_manager

        installed = present = 0
        for entry in manifest["entries"]:
            if entry["arch"] != arch:
                continue
            cache = get_cache_manager(entry["key"])
            group = entry["group"]
            if (cache.get_group(group) if group else
                    all(cache.get_file(name) for name in entry["files"])):
                present += 1
                continue
            paths = {}
            for name, digest in entry["files"].items():
                data = zlib.decompress((root / "entries" / entry["folder"] /
                                        f"{name}.z").read_bytes())
                if hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError(f"{entry['folder']}/{name}: not the file the manifest "
                                     "records")
                paths[name] = cache.put(data, name, binary=True)
            if group:  # the metadata's group last: what a lookup finds
                cache.put_group(group, paths)
            installed += 1
        return {"installed": installed, "present": present}
    except Exception as e:  # noqa: BLE001 (a cache it cannot fill compiles as before)
        return {"skipped": f"{type(e).__name__}: {e}"}


def ensure(arch: int | None = None) -> dict:
    """`install(arch=arch)`'s answer, installed once a process: the C modules by
    `fusedattn.prime`'s thread at import or else by the first GPU launch, the kernels of
    the GPU's architecture by the first GPU launch (`launch.build_launchers_ahead`), which
    waits for the thread's install where it runs (a lookup before it ends would compile)."""
    with _LOCK:
        if arch not in _DONE:
            _DONE[arch] = install(arch=arch)
        return _DONE[arch]
