"""The multi-process scaffolding of the distributed tests: one process per rank, gloo on CPUs
in emulation, NCCL with one GPU per rank otherwise. A test hands `spawn` a module-level
`body(rank, world, device, results) -> list[str]` (picklable for the spawned processes) and
gets each rank's lines back; a rank that raised (a line starting with "ERROR") fails the
test there. `spawn_each` runs several bodies on the ranks of one spawn (a spawn's imports
cost about 6.6 s on the 2-core CI machine)."""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fusedattn.mode import DEVICE, EMULATION


def need_gpus(world: int) -> None:
    """Skip (saying why) on a GPU machine with fewer than `world` GPUs."""
    if not EMULATION and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs {world} GPUs, this machine has {torch.cuda.device_count()} "
                    "(the CPU side runs this test with gloo)")


def refusal(label: str, call) -> str:
    """A rank's line for a call that must be refused: "<label> refused <field> <message>",
    or "<label> not-refused"."""
    from fusedattn.problem import ProblemError

    try:
        call()
        return f"{label} not-refused"
    except ProblemError as err:
        return f"{label} refused {err.field} {err}"


def spawn(body, world: int, tmp_path: Path) -> list[list[str]]:
    """Run `body` on `world` ranks; each rank's lines (results under `tmp_path / "r"`)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = str(tmp_path / "r")
    mp.spawn(_rank, args=(body, world, f"file://{tmp_path}/rendezvous", results),
             nprocs=world, join=True)
    ranks = [Path(f"{results}.{rank}").read_text().splitlines() for rank in range(world)]
    for rank, lines in enumerate(ranks):  # (a rank that raised fails the test here)
        assert not any(line.startswith("ERROR") for line in lines), (rank, lines)
    return ranks


def _each(rank: int, world: int, device, results: str, bodies: tuple) -> list[str]:
    """One rank: each (name, body) of `bodies` in turn, in this process group; each body's
    lines prefixed with its name, its results under `results-name`; one that raised says
    so by name, and the rest still run."""
    lines = []
    for name, body in bodies:
        try:
            lines += [f"{name}|{line}" for line in body(rank, world, device,
                                                         f"{results}-{name}")]
        except Exception:
            lines.append(f"ERROR {name}: " + traceback.format_exc().replace("\n", " | "))
    return lines


def spawn_each(bodies: dict, world: int, tmp_path: Path) -> dict[str, list[list[str]]]:
    """`spawn` of the bodies `{name: body}` on the ranks of one spawn, one after another:
    {name: each rank's lines}. A body's results go under `tmp_path / f"r-{name}"`."""
    ranks = spawn(functools.partial(_each, bodies=tuple(bodies.items())), world, tmp_path)
    return {name: [[line.split("|", 1)[1] for line in lines if line.startswith(f"{name}|")]
                   for lines in ranks] for name in bodies}


def _rank(rank: int, body, world: int, init: str, results: str) -> None:
    import torch.distributed as dist

    lines = []
    try:
        device = DEVICE if EMULATION else torch.device("cuda", rank)
        if not EMULATION:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if EMULATION else "nccl", init_method=init, rank=rank,
                                world_size=world)
        lines += body(rank, world, device, results)
        dist.barrier()  # nobody tears gloo down while a peer still talks to it
        dist.destroy_process_group()
    except Exception:
        lines.append("ERROR " + traceback.format_exc().replace("\n", " | "))
    with open(f"{results}.{rank}", "w") as f:
        f.write("\n".join(lines) + "\n")
    # Leave without the interpreter's teardown: about one run in ten, gloo's worker threads
    # aborted the process there ("terminate called without an active exception") after
    # every result above was written; the results, not the teardown, are under test.
    os._exit(0)
