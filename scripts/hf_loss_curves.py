"""Issue 33's training check: a randomly initialised Hugging Face Mistral (GQA 8/2, a sliding
window of 256, head dim 64) trained 100 steps on one fixed synthetic token stream, three
times from the same weights: attn_implementation "fusedattn" (under use_backend("hopper"):
the Hopper forward and backward, their launches counted), "sdpa", and "eager" (the bf16
noise yardstick: the same maths as SDPA by other kernels). bf16 weights and activations
(not autocast: HF's rotary embedding hands attention fp32 q and k there, which fusedattn
now runs in autocast's dtype, as SDPA does; the run of record predates that), AdamW. The curves
match when |fusedattn - sdpa| stays within twice |eager - sdpa| (plus 0.01) at every
step.

    python3 scripts/hf_loss_curves.py --out DIR [--steps 100]

Writes loss_curves.json and loss_curves.png (matplotlib, the lab's) under --out."""

import argparse
import copy
import sys
import time

import torch
import transformers
from hopper_bwd_check import sources

import fusedattn.integrations.transformers  # noqa: F401  (registers "fusedattn")
from fusedattn.dispatch import use_backend
from fusedattn_lab.evidence import environment, write_json

SEQ, BATCH, VOCAB = 1024, 8, 512


def _stream(steps: int) -> torch.Tensor:
    """Tokens a model can learn: each sequence a random walk over the vocabulary with
    small steps (the next token predictable from the last few)."""
    g = torch.Generator().manual_seed(7)
    steps_ = torch.randint(-3, 4, (steps, BATCH, SEQ), generator=g)
    start = torch.randint(0, VOCAB, (steps, BATCH, 1), generator=g)
    return (start + steps_.cumsum(-1)) % VOCAB


def _train(model, tokens, impl: str) -> list[float]:
    model.config._attn_implementation = impl
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in tokens:
        batch = batch.cuda()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    from triton import knobs

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=256,
        max_position_embeddings=SEQ)
    base = transformers.AutoModelForCausalLM.from_config(config).cuda().bfloat16()
    tokens = _stream(args.steps)
    curves, seconds, launched = {}, {}, []

    def count(meta):
        launched.append(meta.get()["name"])

    for impl in ("fusedattn", "sdpa", "eager"):
        model = copy.deepcopy(base)
        t0 = time.time()
        if impl == "fusedattn":
            knobs.runtime.launch_enter_hook.add(count)
            with use_backend("hopper"):
                curves[impl] = _train(model, tokens, impl)
            knobs.runtime.launch_enter_hook.remove(count)
        else:
            curves[impl] = _train(model, tokens, impl)
        seconds[impl] = time.time() - t0
    gap = [abs(a - b) for a, b in zip(curves["fusedattn"], curves["sdpa"], strict=True)]
    noise = [abs(a - b) for a, b in zip(curves["eager"], curves["sdpa"], strict=True)]
    ok = all(g <= 2 * max(noise) + 0.01 for g in gap)
    kernels = {name: launched.count(name) for name in sorted(set(launched))}
    summary = dict(ok=ok, max_gap=max(gap), max_noise=max(noise), curves=curves,
                   seconds=seconds, kernels=kernels, config=config.to_dict(),
                   seq=SEQ, batch=BATCH, steps=args.steps, environment=environment(),
                   transformers=transformers.__version__, command=" ".join(sys.argv),
                   sources=sources())
    write_json(f"{args.out}/loss_curves.json", summary)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, losses in curves.items():
        ax.plot(losses, label=impl, lw=1)
    ax.set(xlabel="step", ylabel="loss", title=f"Mistral (GQA 8/2, window 256), B{BATCH} "
           f"S{SEQ}, bf16: max |fusedattn - sdpa| {max(gap):.4f}, "
           f"|eager - sdpa| {max(noise):.4f}")
    ax.title.set_fontsize(8)
    ax.legend()
    fig.savefig(f"{args.out}/loss_curves.png", dpi=120, bbox_inches="tight")
    print(f"ok={ok} max_gap={max(gap):.4f} max_noise={max(noise):.4f} "
          f"final={[round(c[-1], 4) for c in curves.values()]} kernels={kernels}")
    return 0 if ok and "_flash_bwd_sm90" in kernels else 1


if __name__ == "__main__":
    sys.exit(main())
