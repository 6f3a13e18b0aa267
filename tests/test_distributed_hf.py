"""A Hugging Face model's training step under context parallelism: 2 gloo processes (NCCL
on a machine with 2 GPUs), each with a shard of the sequence, through `sequence_parallel`
and the "fusedattn" attention implementation, against one process on the whole sequence
with the same weights: Llama over the ring (zigzag shards), Mistral's sliding window over
Ulysses (contiguous shards)."""

import pytest
import torch
import torch.distributed

from ranks import need_gpus, spawn

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
    config = (transformers.MistralConfig(sliding_window=6, **sizes) if kind == "ulysses"
              else transformers.LlamaConfig(**sizes))
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="fusedattn").to(device)


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)  # shifted once
    return ids, labels, torch.arange(SEQ).expand(BATCH, SEQ)


def _loss_sum(model, ids, labels, positions):
    logits = model(ids, position_ids=positions).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                             ignore_index=-100, reduction="sum")


def _step(rank: int, world: int, device, results: str, kind: str) -> list[str]:
    """One rank: a training step on its shard; loss and gradients summed over ranks."""
    import torch.distributed as dist

    from fusedattn.distributed import contiguous_shard, zigzag_shard
    from fusedattn.integrations.transformers import sequence_parallel

    model = _model(device, kind)
    shard = zigzag_shard if kind == "ring" else contiguous_shard
    shards = [shard(t, rank, world, dim=1).contiguous().to(device) for t in _data()]
    with sequence_parallel(kind=kind):
        loss = _loss_sum(model, *shards)
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


@pytest.mark.parametrize("kind, body", [("ring", _ring_step), ("ulysses", _ulysses_step)])
def test_a_training_step_over_sequence_shards_matches_one_process(tmp_path, kind, body):
    need_gpus(2)
    for lines in spawn(body, 2, tmp_path):
        assert not "".join(lines).strip(), lines
    got = torch.load(tmp_path / "r.0.pt")
    from fusedattn.mode import DEVICE
    device = DEVICE if EMULATION else torch.device("cuda", 0)
    model = _model(device, kind)
    ids, labels, positions = (t.to(device) for t in _data())
    loss = _loss_sum(model, ids, labels, positions)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
    # fp32 on both sides; the ring merges partial softmaxes in another order (Ulysses runs
    # the same kernels on the whole sequence)
    assert torch.allclose(got["loss"], loss.detach().cpu(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(got["grads"], grads, rtol=1e-4, atol=1e-5), \
        float((got["grads"] - grads).abs().max())


def test_sequence_parallel_takes_known_kinds_only():
    from fusedattn.integrations.transformers import sequence_parallel
    from fusedattn.problem import ProblemError

    with pytest.raises(ProblemError, match="kind"):
        with sequence_parallel(kind="tree"):
            pass
    with pytest.raises(ProblemError, match="mesh"):
        with sequence_parallel(object(), mesh=object()):
            pass
