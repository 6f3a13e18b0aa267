"""`fusedattn.prebuilt`: kernels compiled ahead of time, shipped in the package and put into
Triton's cache before a first call (issue 31's empty-cache first call).

CPU: packing a cache folder and installing it into another, the refusals (another build,
the switch), a file that is not the one the manifest records, and the shipped manifest's
own files. GPU tier: in a fresh process with an empty cache, a call of a shipped kind
compiles nothing and is right; it fails where a kernel changed after the entries were made
(`bash scripts/h200_round.sh prebuild` makes them anew)."""

import base64
import hashlib
import json
import os
import subprocess
import sys
import zlib

import pytest

from fusedattn import prebuilt
from inputs import ON_HOPPER

KEY_A, KEY_B = hashlib.sha256(b"kernel").hexdigest(), hashlib.sha256(b"module").hexdigest()


def folder(key: str) -> str:
    return base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")


@pytest.fixture
def made(tmp_path):
    """A Triton cache folder as a warmup leaves it (a kernel with its IRs and group, a C
    module), packed into `tmp_path/pack`: (pack folder, manifest)."""
    cache = tmp_path / "made"
    kernel = cache / folder(KEY_A)
    kernel.mkdir(parents=True)
    for name, data in (("k.cubin", b"\x7fELF cubin"), ("k.ptx", b"ptx text"),
                       ("k.ttgir", b"ir")):
        (kernel / name).write_bytes(data)
    (kernel / "k.json").write_text(json.dumps({"name": "k", "target": {
        "backend": "cuda", "arch": 90, "warp_size": 32}}))
    (kernel / "__grp__k.json").write_text(json.dumps({"child_paths": {
        n: str(kernel / n) for n in ("k.cubin", "k.json", "k.ptx", "k.ttgir")}}))
    module = cache / folder(KEY_B)
    module.mkdir()
    (module / "cuda_utils.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF so")
    pack = tmp_path / "pack"
    pack.mkdir()
    return pack, prebuilt.pack(cache, pack, {"commit": "test"})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Triton cache for the test (Triton's knob, in a scope that restores it: a
    process that set the knob before reads no TRITON_CACHE_DIR)."""
    from triton import knobs

    path = tmp_path / "cache"
    monkeypatch.delenv("FUSEDATTN_PREBUILT", raising=False)
    with knobs.cache.scope():
        knobs.cache.dir = str(path)
        yield path


def test_pack_keeps_what_a_hit_reads_under_the_key_triton_names_it_by(made):
    pack, manifest = made
    assert manifest["build"] == prebuilt.build()
    assert [e["key"] for e in manifest["entries"]] == sorted(
        (KEY_A, KEY_B), key=folder)  # (the folders' order)
    kernel = next(e for e in manifest["entries"] if e["key"] == KEY_A)
    assert kernel["group"] == "k.json" and sorted(kernel["files"]) == ["k.cubin", "k.json"]
    assert kernel["arch"] == 90  # (the metadata's target)
    assert next(e for e in manifest["entries"] if e["key"] == KEY_B)["arch"] is None
    stored = sorted(p.name for p in (pack / "entries" / folder(KEY_A)).iterdir())
    assert stored == ["k.cubin.z", "k.json.z"]  # zlib, no IRs
    assert json.loads((pack / "manifest.json").read_text()) == manifest


def test_install_puts_the_entries_where_triton_looks_them_up_once(made, cache):
    # the C modules (arch None) and each architecture's kernels apart: the modules at
    # import, the kernels where the first launch knows the GPU
    from triton.runtime.cache import get_cache_manager

    pack, _ = made
    assert prebuilt.install(pack) == {"installed": 1, "present": 0}
    assert get_cache_manager(KEY_B).get_file("cuda_utils.cpython-312-x86_64-linux-gnu.so")
    assert get_cache_manager(KEY_A).get_group("k.json") is None
    assert prebuilt.install(pack, arch=80) == {"installed": 0, "present": 0}
    assert get_cache_manager(KEY_A).get_group("k.json") is None  # no sm80 kernel
    assert prebuilt.install(pack, arch=90) == {"installed": 1, "present": 0}
    group = get_cache_manager(KEY_A).get_group("k.json")
    assert sorted(group) == ["k.cubin", "k.json"]
    assert open(group["k.cubin"], "rb").read() == b"\x7fELF cubin"
    assert prebuilt.install(pack) == {"installed": 0, "present": 1}
    assert prebuilt.install(pack, arch=90) == {"installed": 0, "present": 1}
    assert not list(cache.rglob("tmp.*"))  # no temporary file left behind


def test_install_refuses_another_build_and_the_switch(made, cache, monkeypatch):
    pack, manifest = made
    for name in ("triton", "python", "platform"):
        other = dict(manifest, build=dict(manifest["build"], **{name: "0.0"}))
        (pack / "manifest.json").write_text(json.dumps(other))
        why = prebuilt.install(pack)["skipped"]
        assert f"built for {name} '0.0'" in why
    (pack / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("FUSEDATTN_PREBUILT", "0")
    assert prebuilt.install(pack) == {"skipped": "FUSEDATTN_PREBUILT=0"}
    assert not cache.exists() or not list(cache.rglob("*.cubin"))


def test_a_file_that_is_not_the_manifests_leaves_its_kernel_unfindable(made, cache):
    from triton.runtime.cache import get_cache_manager

    pack, _ = made
    (pack / "entries" / folder(KEY_A) / "k.cubin.z").write_bytes(
        zlib.compress(b"another kernel"))
    why = prebuilt.install(pack, arch=90)["skipped"]
    assert "k.cubin: not the file the manifest records" in why
    assert get_cache_manager(KEY_A).get_group("k.json") is None  # compiles as before


def test_a_missing_or_unreadable_manifest_is_skipped(tmp_path, cache):
    assert prebuilt.install(tmp_path) == {"skipped": "no prebuilt kernels in this package"}
    (tmp_path / "manifest.json").write_text("{not json")
    assert prebuilt.install(tmp_path)["skipped"].startswith("unreadable manifest")


@pytest.mark.skipif(not prebuilt.MANIFEST.exists(), reason="no prebuilt kernels shipped")
def test_the_shipped_manifest_holds_its_files():
    manifest = json.loads(prebuilt.MANIFEST.read_text())
    assert manifest["entries"] and set(manifest["build"]) == {"triton", "python", "platform"}
    for entry in manifest["entries"]:
        assert prebuilt.key_of(entry["folder"]) == entry["key"]
        assert entry["group"] is None or entry["group"] in entry["files"]
        for name, digest in entry["files"].items():
            data = zlib.decompress(
                (prebuilt.ROOT / "entries" / entry["folder"] / f"{name}.z").read_bytes())
            assert hashlib.sha256(data).hexdigest() == digest, name
    shipped = {p.relative_to(prebuilt.ROOT / "entries").as_posix()
               for p in (prebuilt.ROOT / "entries").rglob("*") if p.is_file()}
    assert shipped == {f"{e['folder']}/{n}.z" for e in manifest["entries"]
                       for n in e["files"]}


@pytest.mark.skipif(not prebuilt.MANIFEST.exists(), reason="no prebuilt kernels shipped")
def test_the_shipped_entries_were_made_for_these_specs():
    # `prebuilt.SPECS` changed (a kind added) without `scripts/prebuild.py` run again: the
    # entries would lack the new kind, whose first call then compiles
    manifest = json.loads(prebuilt.MANIFEST.read_text())

    def canonical(spec):
        return json.dumps({k: list(v) if isinstance(v, tuple | list) else v
                           for k, v in spec.items()}, sort_keys=True)

    made = sorted(canonical(run["spec"]) for run in manifest["made_by"]["warmups"])
    wanted = sorted(canonical(single) for spec in prebuilt.SPECS
                    for single in prebuilt.singles(spec))
    assert made == wanted


@pytest.mark.skipif(not prebuilt.MANIFEST.exists(), reason="no prebuilt kernels shipped")
def test_the_shipped_entries_were_made_from_these_kernel_sources():
    # the CPU's check of what the GPU tier's first-call test finds late: a kernel module
    # edited since `scripts/prebuild.py` made the entries (any line: Triton's key holds the
    # kernel's first line number) leaves every entry behind it unused
    manifest = json.loads(prebuilt.MANIFEST.read_text())
    made = manifest.get("sources")
    assert made, "the manifest records no kernel sources: run scripts/prebuild.py on the GPU"
    now = prebuilt.kernel_sources(prebuilt.shipped_kernels(manifest))
    changed = sorted(p for p in made.keys() | now.keys() if made.get(p) != now.get(p))
    assert not changed, (f"{changed} changed since the prebuilt entries were made: run "
                         "`bash scripts/h200_round.sh prebuild` on the GPU and commit them")


@pytest.mark.skipif(not prebuilt.MANIFEST.exists(), reason="no prebuilt kernels shipped")
def test_kernel_sources_follows_a_kernels_imports_and_no_further():
    found = prebuilt.kernel_sources(["_flash_fwd", "_flash_bwd_sm90"])
    # _flash_fwd's module and common.py (its helpers); the Hopper backward's module and
    # the Hopper forward's (the backward imports its helpers)
    assert set(found) == {"tiles/flash_kernels.py", "tiles/common.py",
                          "hopper/backward_kernel.py", "hopper/forward_kernel.py"}
    assert all(len(h) == 64 for h in found.values())
    assert prebuilt.kernel_sources(["_flash_fwd_sm90"]) == {
        "hopper/forward_kernel.py": found["hopper/forward_kernel.py"]}
    assert prebuilt.kernel_sources(["no_such_kernel"]) == {}
    # decode's kernels are not shipped: an edit to them needs no prebuild
    shipped = prebuilt.shipped_kernels(json.loads(prebuilt.MANIFEST.read_text()))
    assert "_flash_fwd" in shipped and "tiles/splitkv.py" not in prebuilt.kernel_sources(shipped)


KEYS = """
import importlib, sys
from fusedattn import prime
for name in prime.MODULES:
    importlib.import_module(name)

def kernel(spec):
    module, name = spec.split(":")
    fn = getattr(importlib.import_module(module), name)
    while not hasattr(fn, "cache_key"):  # (under triton.heuristics)
        fn = fn.fn
    return fn

for spec in sys.argv[1].split(","):  # hashed first, in this order
    kernel(spec).cache_key
for spec in sys.argv[2].split(","):
    print(spec, kernel(spec).cache_key)
"""
SHOWN = ("fusedattn.hopper.backward_kernel:_flash_bwd_sm90,fusedattn.hopper.forward_kernel:"
         "_flash_fwd_sm90,fusedattn.tiles.flash_bwd_kernels:_flash_bwd_dq,"
         "fusedattn.tiles.flash_kernels:_flash_fwd")


def test_a_kernels_cache_key_does_not_hang_on_the_order_of_hashing():
    # `launch.settle_keys`: Triton 3.6 merged a callee's constexpr globals into its
    # caller's key only where the callee had been hashed first, so the Hopper backward had
    # three keys for one source (evidence/cpu/20261203T1110Z-key-order), and the prebuilt
    # entries missed. Fresh processes (outside emulation: the kernels' own keys), helpers
    # hashed first in one, the kernels themselves in the other
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSEDATTN_PRIME"] = "0"
    keys = []
    for first in ("fusedattn.hopper.backward_kernel:_steps,fusedattn.hopper.backward_kernel:"
                  "_masked_p", SHOWN):
        proc = subprocess.run([sys.executable, "-c", KEYS, first, SHOWN], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        keys.append(proc.stdout)
    assert keys[0] == keys[1] and keys[0].count("\n") == 4, keys


FIRST_CALL = """
import json, sys, torch, triton
compiles = []
triton.knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, \\
    cache_hit: None if cache_hit else compiles.append(metadata["name"])
import fusedattn
from fusedattn.reference import attention_ref
q, k, v = (torch.randn(1, 8, 1000, 128, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
out = fusedattn.attention(q, k, v, is_causal=True)
out.backward(torch.ones_like(out))
with torch.no_grad():  # an inference call: its kernels write no LSE, kernels of their own
    again = fusedattn.attention(q, k, v, is_causal=True)
err = (out.double() - attention_ref(q, k, v, causal=True, device="cuda")).abs().max().item()
err = max(err, (again.double() - out.double()).abs().max().item())
# the same inference call's first CUDA-graph capture: a capture's launch form (one program an
# item, not claimed items) is a kernel of its own, shipped too (`hopper.forward.as_captured`)
graph = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(graph):
    captured = fusedattn.attention(q.detach(), k.detach(), v.detach(), is_causal=True)
graph.replay()
torch.cuda.synchronize()
err = max(err, (captured.double() - again.double()).abs().max().item())
# GQA (8 query heads to 2 K/V heads): its training step, the backward's GQA kernel
kg, vg = (torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16,
                      requires_grad=True) for _ in range(2))
gqa = fusedattn.attention(q, kg, vg, is_causal=True, enable_gqa=True)
gqa.backward(torch.ones_like(gqa))
ref = attention_ref(q, kg, vg, causal=True, device="cuda")
err = max(err, (gqa.double() - ref).abs().max().item())
print(json.dumps(dict(compiles=compiles, err=err, prebuilt=fusedattn.prebuilt.ensure(90))))
"""


@pytest.mark.gpu_only("the prebuilt kernels are sm90 cubins")
@pytest.mark.skipif(not prebuilt.MANIFEST.exists(), reason="no prebuilt kernels shipped")
def test_a_first_call_of_a_shipped_kind_compiles_nothing(tmp_path):
    if not ON_HOPPER:
        pytest.skip("not an sm90 GPU")
    why = prebuilt.refusal(json.loads(prebuilt.MANIFEST.read_text()))
    if why:
        pytest.skip(f"the shipped kernels are not for this process: {why}")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("FUSEDATTN_PREBUILT", None)
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["prebuilt"].get("installed"), got["prebuilt"]
    assert got["compiles"] == [], (
        f"compiled {got['compiles']}: a kernel changed after the prebuilt entries were made "
        "(bash scripts/h200_round.sh prebuild makes them anew)")
    assert got["err"] < 2e-2
