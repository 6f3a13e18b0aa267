"""A Hugging Face model's training step under context parallelism: 2 gloo processes (NCCL
on a machine with 2 GPUs), each with a shard of the sequence, through `sequence_parallel`
and the "fusedattn" attention implementation, against one process on the whole sequence
with the same weights: Llama over the ring (zigzag shards), Mistral's sliding window over
Ulysses (contiguous shards; with its all-to-alls overlapped in two head groups too)."""

import pytest
import torch
import torch.distributed

from ranks import need_gpus, spawn, spawn_each

transformers = pytest.importorskip(
    "transformers", reason="the [hf] extra is not installed: pip install -e '.[hf]'")

import fusedattn  # noqa: E402,F401  (fix the mode before the workers are spawned)
from fusedattn.mode import EMULATION  # noqa: E402

SEQ, BATCH, VOCAB = 16, 2, 64


def _model(device, kind="ring"):
    import fusedattn.integrations.transformers  # noqa: F401  (registers "fusedattn")

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "ulysses-overlap":  # 4 query and 2 K/V heads a rank: two head groups
        sizes.update(hidden_size=128, num_attention_heads=8, num_key_value_heads=4)
    config = (transformers.MistralConfig(sliding_window=6, **sizes)
              if kind.startswith("ulysses") else transformers.LlamaConfig(**sizes))
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="fusedattn").to(device)


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)  # shifted once
    return ids, labels, torch.arange(SEQ).expand(BATCH, SEQ)


def _loss_sum(model, ids, labels, positions, **kw):
    logits = model(ids, position_ids=positions, **kw).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                             ignore_index=-100, reduction="sum")


def _step(rank: int, world: int, device, results: str, kind: str, **kw) -> list[str]:
    """One rank: a training step on its shard; loss and gradients summed over ranks. `kw`
    goes to the model (use_cache=False: no cache, so transformers reads each jump in a
    zigzag shard's positions as a new packed document and makes a mask of it)."""
    from fusedattn.distributed import contiguous_shard, zigzag_shard
    from fusedattn.integrations.transformers import sequence_parallel

    model = _model(device, kind)
    if kind == "usp":  # a 2x2 DeviceMesh: dim 0 Ulysses, dim 1 the ring
        from torch.distributed.device_mesh import init_device_mesh

        from fusedattn.distributed import usp_shard

        mesh = init_device_mesh(device.type, (2, world // 2))
        shards = [usp_shard(t, rank // (world // 2), 2, rank % (world // 2), world // 2,
                            dim=1).contiguous().to(device) for t in _data()]
        context = sequence_parallel(mesh=mesh)
    else:
        shard = zigzag_shard if kind == "ring" else contiguous_shard
        shards = [shard(t, rank, world, dim=1).contiguous().to(device) for t in _data()]
        context = (sequence_parallel(kind="ulysses", chunks=2) if kind == "ulysses-overlap"
                   else sequence_parallel(kind=kind))
    return _sharded_step(model, shards, context, rank, results, **kw)


def _sharded_step(model, shards, context, rank: int, results: str, **kw) -> list[str]:
    """A training step of `model` on this rank's `shards` (ids, labels, positions) inside
    `context`: the loss summed over ranks and the gradients all-reduced, saved for the
    test to compare with one process."""
    import torch.distributed as dist

    with context:
        loss = _loss_sum(model, *shards, **kw)
    loss.backward()
    dist.all_reduce(loss.detach())
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(grads)
    torch.save({"loss": loss.detach().cpu(), "grads": grads.cpu()}, f"{results}.{rank}.pt")
    return []


def _ring_step(rank, world, device, results):
    return _step(rank, world, device, results, "ring")


def _ulysses_step(rank, world, device, results):
    return _step(rank, world, device, results, "ulysses")


def _ulysses_overlap_step(rank, world, device, results):
    return _step(rank, world, device, results, "ulysses-overlap")


def _ring_step_without_cache(rank, world, device, results):
    return _step(rank, world, device, results, "ring", use_cache=False)


def _usp_step_without_cache(rank, world, device, results):
    return _step(rank, world, device, results, "usp", use_cache=False)


def _matches_one_process(results, kind: str, data) -> None:
    """A step's result on the ranks (`results`: rank 0's file) against one process's on the
    whole `data`: the loss and every parameter's gradient. fp32 on both sides; the ring
    merges partial softmaxes in another order (Ulysses runs the same kernels on the whole
    sequence)."""
    got = torch.load(results)
    from fusedattn.mode import DEVICE
    device = DEVICE if EMULATION else torch.device("cuda", 0)
    model = _model(device, kind)
    loss = _loss_sum(model, *(t.to(device) for t in data))
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
    assert torch.allclose(got["loss"], loss.detach().cpu(), rtol=1e-5, atol=1e-4), kind
    assert torch.allclose(got["grads"], grads, rtol=1e-4, atol=1e-5), \
        (kind, float((got["grads"] - grads).abs().max()))


def test_sequence_parallel_takes_known_kinds_only():
    from fusedattn.integrations.transformers import sequence_parallel
    from fusedattn.problem import ProblemError

    for bad in ([0.0, 4.0], [2, 6], [0, 8, 4], [0], torch.zeros(2, 2, dtype=torch.int32), "0,8"):
        with pytest.raises(ProblemError, match="cu_seqlens"):
            with sequence_parallel(cu_seqlens=bad):
                pass

    with pytest.raises(ProblemError, match="kind"):
        with sequence_parallel(kind="tree"):
            pass
    for chunks, kw in ((0, {}), (True, {}), (2, {}), (2, dict(cu_seqlens=DOCS))):
        with pytest.raises(ProblemError, match="chunks"):  # (the ring takes no head groups)
            with sequence_parallel(chunks=chunks, **kw):
                pass
    with pytest.raises(ProblemError, match="mesh"):
        with sequence_parallel(object(), mesh=object()):
            pass


DOCS = [0, 8, 12, 16]  # packed documents' offsets: lengths 8, 4, 4 (each a multiple of 2P)


def _packed_data():
    """One row of packed documents: ids, labels shifted within each document (-100 at its
    last token, as DataCollatorWithFlattening makes them) and positions from 0 each."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    labels = torch.full((1, SEQ), -100)
    positions = torch.zeros(1, SEQ, dtype=torch.long)
    for a, b in zip(DOCS[:-1], DOCS[1:], strict=True):
        labels[0, a:b - 1] = ids[0, a + 1:b]
        positions[0, a:b] = torch.arange(b - a)
    return ids, labels, positions


def _packed_step(rank: int, world: int, device, results: str, kind: str) -> list[str]:
    """One rank: a training step on its rows of the packed documents
    (`sequence_parallel(cu_seqlens=...)`), loss and gradients summed over ranks."""
    from fusedattn.distributed import contiguous_shard, varlen_shard
    from fusedattn.integrations.transformers import sequence_parallel

    model = _model(device, kind)
    if kind == "usp":  # a 2x2 DeviceMesh: dim 0 Ulysses, dim 1 the ring
        from torch.distributed.device_mesh import init_device_mesh

        from fusedattn.distributed import usp_varlen_shard

        ring = world // 2
        shards = [usp_varlen_shard(t[0], DOCS, rank // ring, 2, rank % ring, ring)[None]
                  for t in _packed_data()]
        context = sequence_parallel(mesh=init_device_mesh(device.type, (2, ring)),
                                    cu_seqlens=DOCS)
    else:
        shard = ((lambda x: varlen_shard(x, DOCS, rank, world)) if kind == "ring"
                 else (lambda x: contiguous_shard(x, rank, world, dim=0)))
        shards = [shard(t[0])[None] for t in _packed_data()]
        context = (sequence_parallel(kind="ulysses", cu_seqlens=DOCS, chunks=2)
                   if kind == "ulysses-overlap" else sequence_parallel(kind=kind,
                                                                       cu_seqlens=DOCS))
    shards = [t.contiguous().to(device) for t in shards]
    return _sharded_step(model, shards, context, rank, results)


def _packed_ring_step(rank, world, device, results):
    return _packed_step(rank, world, device, results, "ring")


def _packed_ulysses_step(rank, world, device, results):
    return _packed_step(rank, world, device, results, "ulysses")


def _packed_ulysses_overlap_step(rank, world, device, results):
    return _packed_step(rank, world, device, results, "ulysses-overlap")


def _packed_usp_step(rank, world, device, results):
    return _packed_step(rank, world, device, results, "usp")


# name: (kind, the ranks' step, world, packed documents?)
STEPS = {
    "ring": ("ring", _ring_step, 2, False),
    "ulysses": ("ulysses", _ulysses_step, 2, False),
    "ulysses-overlap": ("ulysses-overlap", _ulysses_overlap_step, 2, False),
    "ring-without-cache": ("ring", _ring_step_without_cache, 2, False),
    "usp-without-cache": ("usp", _usp_step_without_cache, 4, False),
    # one process runs the packed row through position_ids that restart (attention_varlen
    # per document; Mistral's window per document under Ulysses)
    "packed-ring": ("ring", _packed_ring_step, 2, True),
    "packed-ulysses": ("ulysses", _packed_ulysses_step, 2, True),
    "packed-ulysses-overlap": ("ulysses-overlap", _packed_ulysses_overlap_step, 2, True),
    "packed-usp": ("usp", _packed_usp_step, 4, True),
}


@pytest.mark.parametrize("world", [2, 4])
def test_training_steps_over_sequence_shards_match_one_process(tmp_path, world):
    # every step of `STEPS` at this world size, plain and packed, on the ranks of one spawn
    names = tuple(name for name, step in STEPS.items() if step[2] == world)
    need_gpus(world)
    ranks = spawn_each({name: STEPS[name][1] for name in names}, world, tmp_path)
    for name in names:
        assert not any(ranks[name]), (name, ranks[name])
        kind, _, _, packed = STEPS[name]
        _matches_one_process(tmp_path / f"r-{name}.0.pt", kind,
                             _packed_data() if packed else _data())


def _refusals(rank: int, world: int, device, results: str) -> list[str]:
    """One rank: calls under `sequence_parallel` that every rank must refuse together."""
    from fusedattn.distributed import zigzag_shard
    from fusedattn.integrations.transformers import sequence_parallel
    from ranks import refusal

    model = _model(device)
    ids, _, positions = (zigzag_shard(t, rank, world, dim=1).contiguous().to(device)
                         for t in _data())
    two_docs = torch.arange(SEQ).remainder(SEQ // 2).expand(BATCH, SEQ)  # restarts at 0
    padding = torch.ones(BATCH, SEQ // world, dtype=torch.long, device=device)
    padding[0, :2] = 0 if rank == 1 else 1  # left padding in one rank's shard only
    calls = {
        # packed documents: positions that restart (with a cache and without one)
        "packed": lambda: model(ids, position_ids=zigzag_shard(two_docs, rank, world,
                                                               dim=1).to(device)),
        "packed-nocache": lambda: model(ids, use_cache=False, position_ids=zigzag_shard(
            two_docs, rank, world, dim=1).to(device)),
        # each shard's own positions, not the whole sequence's
        "unsharded": lambda: model(ids, position_ids=torch.arange(SEQ // world).expand(
            BATCH, -1).to(device)),
        # a padding mask on one rank: the other, with nothing wrong, refuses too
        "one-rank-padding": lambda: model(ids, position_ids=positions,
                                          attention_mask=padding),
    }
    lines = []
    with sequence_parallel():
        for label, call in calls.items():
            lines.append(refusal(label, call))
    # packed documents declared, but the positions are one sequence's zigzag shard
    with sequence_parallel(cu_seqlens=DOCS):
        lines.append(refusal("packed-mismatch", lambda: model(ids[:1],
                                                              position_ids=positions[:1])))
    return lines


def test_every_rank_refuses_what_one_rank_cannot_run_under_sequence_parallel(tmp_path):
    # packed documents, positions not sharded like the tokens, a mask on one rank: a
    # ProblemError on every rank (none left waiting in the ring), never a wrong number
    need_gpus(2)
    ranks = spawn(_refusals, 2, tmp_path)
    for rank, lines in enumerate(ranks):
        got = dict(line.split(" ", 1) for line in lines)
        assert set(got) == {"packed", "packed-nocache", "unsharded", "one-rank-padding",
                            "packed-mismatch"}
        for label, outcome in got.items():
            assert outcome.startswith("refused"), (rank, label, outcome)
        assert "position_ids" in got["packed"]  # (each rank's shard restarts)
    # rank 1's own positions 0..7 are its zigzag positions 4..11 less a constant (allowed:
    # an offset), rank 0's are not: rank 0 says why, rank 1 that another rank refused;
    # so for the padding on rank 1 alone
    unsharded = [dict(line.split(" ", 1) for line in lines)["unsharded"] for lines in ranks]
    assert "position_ids" in unsharded[0] and "another rank" in unsharded[1]
    assert "attention_mask" in dict(line.split(" ", 1) for line in ranks[1])["one-rank-padding"]
    assert "another rank" in dict(line.split(" ", 1) for line in ranks[0])["one-rank-padding"]
