"""A Hugging Face model's training step under context parallelism: 2 gloo processes (NCCL
on a machine with 2 GPUs), each with a zigzag shard of the sequence, through
`sequence_parallel` and the "fusedattn" attention implementation, against one process on
the whole sequence with the same weights."""

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip(
    "transformers", reason="the [hf] extra is not installed: pip install -e '.[hf]'")

import fusedattn  # noqa: E402,F401  (fix the mode before the workers are spawned)
from fusedattn.mode import EMULATION  # noqa: E402

SEQ, BATCH, VOCAB = 16, 2, 64


def _model(device):
    import fusedattn.integrations.transformers  # noqa: F401  (registers "fusedattn")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
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


def _worker(rank: int, world: int, init: str, results: str) -> None:
    import torch.distributed as dist

    from fusedattn.distributed import zigzag_shard
    from fusedattn.integrations.transformers import sequence_parallel
    from fusedattn.mode import DEVICE

    lines = []
    try:
        device = DEVICE if EMULATION else torch.device("cuda", rank)
        if not EMULATION:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if EMULATION else "nccl", init_method=init, rank=rank,
                                world_size=world)
        model = _model(device)
        shards = [zigzag_shard(t, rank, world, dim=1).contiguous().to(device)
                  for t in _data()]
        with sequence_parallel():
            loss = _loss_sum(model, *shards)
        loss.backward()
        dist.all_reduce(loss.detach())
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(grads)
        torch.save({"loss": loss.detach().cpu(), "grads": grads.cpu()}, f"{results}.{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        lines.append("ERROR " + traceback.format_exc().replace("\n", " | "))
    with open(f"{results}.{rank}", "w") as f:
        f.write("\n".join(lines) + "\n")
    os._exit(0)  # as in test_distributed: gloo's teardown, not the results, is flaky


def test_a_training_step_over_sequence_shards_matches_one_process(tmp_path):
    if not EMULATION and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs 2 GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path / "r")),
             nprocs=2, join=True)
    for rank in range(2):
        errors = (tmp_path / f"r.{rank}").read_text().strip()
        assert not errors, errors
    got = torch.load(tmp_path / "r.0.pt")
    from fusedattn.mode import DEVICE
    device = DEVICE if EMULATION else torch.device("cuda", 0)
    model = _model(device)
    ids, labels, positions = (t.to(device) for t in _data())
    loss = _loss_sum(model, ids, labels, positions)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
    # fp32 on both sides; the ring merges partial softmaxes in another order
    assert torch.allclose(got["loss"], loss.detach().cpu(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(got["grads"], grads, rtol=1e-4, atol=1e-5), \
        float((got["grads"] - grads).abs().max())
