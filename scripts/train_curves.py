"""200 training steps of a small Llama-style model (GQA, random init, nothing downloaded) on
a synthetic copy task, once under attn_implementation="fusedattn" and once under "sdpa",
from the same initial weights and the same batches; the two loss curves overlaid.

The task: 128 random tokens, then the same 128 again; the loss counts the second half only,
which a model can only predict by attending back (an induction head), so attention carries
the learning. bf16 autocast (the attention runs in bf16), fp32 weights, AdamW.

    python3 scripts/train_curves.py OUT_DIR     # writes loss.csv, loss.png, environment.json
"""

import copy
import csv
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import fusedattn.integrations.transformers  # noqa: E402,F401  (registers "fusedattn")
from fusedattn_lab.evidence import environment, sha256_file, write_json  # noqa: E402

STEPS, BATCH, HALF, VOCAB = 200, 32, 128, 256
CONFIG = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)


def batches(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        first = torch.randint(1, VOCAB, (BATCH, HALF), generator=gen)
        ids = torch.cat([first, first], dim=1)
        labels = ids.clone()
        labels[:, :HALF] = -100  # only the copy is scored
        yield ids.cuda(), labels.cuda()


def train(attn: str, state: dict) -> list[float]:
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**CONFIG), attn_implementation=attn)
    model.load_state_dict(state)
    model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for ids, labels in batches():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    init = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    state = copy.deepcopy(init.state_dict())
    curves, seconds = {}, {}
    for attn in ("fusedattn", "sdpa"):
        t0 = time.perf_counter()
        curves[attn] = train(attn, state)
        seconds[attn] = time.perf_counter() - t0
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "fusedattn", "sdpa"])
        for i, (a, b) in enumerate(zip(curves["fusedattn"], curves["sdpa"], strict=True)):
            w.writerow([i, a, b])
    fig, ax = plt.subplots(figsize=(7, 4))
    for attn, style in (("sdpa", "-"), ("fusedattn", "--")):
        ax.plot(curves[attn], style, label=attn)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (copied half)")
    ax.set_yscale("log")
    ax.set_title("Llama-style, 4 layers, GQA 8/2, S=256, bf16 autocast")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    diff = max(abs(a - b) for a, b in zip(curves["fusedattn"], curves["sdpa"], strict=True))
    src = Path(__file__).resolve().parents[1] / "src" / "fusedattn"
    write_json(out / "environment.json", environment() | {
        "command": "python3 scripts/train_curves.py " + str(out), "config": CONFIG,
        "steps": STEPS, "batch": BATCH, "seq": 2 * HALF,
        "final_loss": {k: v[-1] for k, v in curves.items()},
        "max_abs_loss_difference": diff, "wall_seconds": seconds,
        "transformers": transformers.__version__,
        "source_sha256": {p.name: sha256_file(p) for p in
                          (src / "tiles" / "flash.py", src / "tiles" / "flash_bwd.py",
                           src / "integrations" / "transformers.py")}})
    print(f"final loss fusedattn {curves['fusedattn'][-1]:.4f} sdpa {curves['sdpa'][-1]:.4f}"
          f" max |diff| {diff:.4f}; wall s {seconds}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
