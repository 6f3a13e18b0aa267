"""`fusedattn bench --suite hf-generate|hf-train|tiny-hf`: Hugging Face models end to end,
"fusedattn" against "sdpa" in one process on the same random weights (nothing downloaded).

- `hf-generate`: a left-padded batch (prompt lengths drawn from 100..2000), greedy
  `generate` of 128 new tokens with a dynamic cache: tokens per second, and the time per
  decode step, (T(128 new) - T(1 new)) / 127, the prefill's share taken out. Also the same
  with a static cache, whose decode step transformers compiles itself (its CompileConfig:
  `torch.compile(mode="reduce-overhead")`, CUDA graphs); a failure there is a row with its
  error, not a crash. The two implementations'
  tokens are compared (greedy bf16 runs may part where two logits tie within rounding).
- `hf-train`: one training step (forward and backward) on documents of random lengths:
  fusedattn packed (`DataCollatorWithFlattening`: no padding) against sdpa on the same
  documents right-padded to the longest; tokens per second count real tokens only.

The model is Llama-shaped, 852.6M parameters (hidden 2048, 16 layers, 32 heads, 8 K/V
heads, MLP 5632), bf16; `tiny-hf` is a toy one for emulation, logic only.
"""

from __future__ import annotations

import copy
import time

import torch

from fusedattn.mode import DEVICE, EMULATION

SUITES = ("hf-generate", "hf-train", "tiny-hf")
BIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=96)


def _model(attn: str, sizes: dict, dtype):
    import transformers

    import fusedattn.integrations.transformers  # noqa: F401  (registers "fusedattn")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(max_position_embeddings=4096, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation=attn)
    return model.to(DEVICE, dtype)


def _sync():
    if not EMULATION:
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _prompts(batch: int, low: int, high: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (batch,), generator=g)
    longest = int(lengths.max())
    ids = torch.randint(1, vocab, (batch, longest), generator=g)
    mask = (torch.arange(longest)[None] >= longest - lengths[:, None]).long()  # left pads
    return (ids * mask).to(DEVICE), mask.to(DEVICE), lengths.tolist()


def generate_rows(tiny: bool) -> list[dict]:
    sizes, dtype = (TINY, torch.float32) if tiny else (BIG, torch.bfloat16)
    batch, new = (2, 2) if tiny else (32, 128)
    ids, mask, lengths = _prompts(batch, 4 if tiny else 100, 10 if tiny else 2000,
                                  sizes["vocab_size"])
    rows, tokens = [], {}
    for attn in ("fusedattn", "sdpa"):
        model = _model(attn, sizes, dtype).eval()
        args = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
        for cache in ("dynamic", "static-compiled") if not tiny else ("dynamic",):
            # static-compiled: transformers compiles a static cache's decode step itself
            # (its CompileConfig, reduce-overhead: CUDA graphs), and marks each step
            row = {"suite": "hf-generate", "attn": attn, "cache": cache, "batch": batch,
                   "prompt_tokens": sum(lengths), "new_tokens": new}
            try:
                run = model
                extra = {}
                if cache == "static-compiled":
                    import transformers

                    extra = {"cache_implementation": "static",
                             "compile_config": transformers.CompileConfig()}
                with torch.no_grad():
                    run.generate(ids, max_new_tokens=2, **args, **extra)  # warm: compiles
                    _, t1 = _timed(lambda r=run, a=args, e=extra: r.generate(
                        ids, max_new_tokens=1, **a, **e))
                    out, tn = _timed(lambda r=run, a=args, e=extra: r.generate(
                        ids, max_new_tokens=new, **a, **e))
                tokens[(attn, cache)] = out[:, ids.shape[1]:]
                row.update(status="ok", total_s=tn, prefill_s=t1,
                           decode_step_ms=(tn - t1) / max(new - 1, 1) * 1e3,
                           tokens_per_s=batch * new / tn)
            except Exception as err:  # noqa: BLE001  (a row that failed says why)
                row.update(status=f"failed: {type(err).__name__}: {str(err)[:200]}")
            rows.append(row)
        del model
    for row in rows:
        ours, theirs = tokens.get(("fusedattn", row["cache"])), tokens.get(("sdpa",
                                                                             row["cache"]))
        if ours is not None and theirs is not None:
            # greedy runs part for good at the first step where two logits tie within
            # rounding: the first token says more than the rest
            row["first_token_equal_to_sdpa"] = float((ours[:, 0] == theirs[:, 0]).float().mean())
            row["tokens_equal_to_sdpa"] = float((ours == theirs).float().mean())
    return rows


def train_rows(tiny: bool) -> list[dict]:
    from transformers import DataCollatorWithFlattening

    sizes, dtype = (TINY, torch.float32) if tiny else (BIG, torch.bfloat16)
    n_docs = 3 if tiny else 16
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4 if tiny else 100, (10 if tiny else 2000) + 1, (n_docs,),
                            generator=g).tolist()
    docs = [torch.randint(1, sizes["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    packed = {k: v.to(DEVICE) for k, v in DataCollatorWithFlattening()(
        [{"input_ids": d} for d in docs]).items()
        if k in ("input_ids", "labels", "position_ids")}
    longest = max(lengths)
    ids = torch.zeros(n_docs, longest, dtype=torch.long)
    mask = torch.zeros(n_docs, longest, dtype=torch.long)
    for i, d in enumerate(docs):  # right-padded to the longest
        ids[i, :len(d)], mask[i, :len(d)] = torch.tensor(d), 1
    padded = {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE),
              "labels": ids.masked_fill(mask == 0, -100).to(DEVICE)}
    rows = []
    for attn, batch, layout in (("fusedattn", packed, "packed"), ("sdpa", padded, "padded"),
                                ("fusedattn", padded, "padded")):
        model = _model(attn, sizes, dtype).train()
        row = {"suite": "hf-train", "attn": attn, "layout": layout, "documents": n_docs,
               "real_tokens": sum(lengths),
               "computed_tokens": int(batch["input_ids"].numel())}

        def step(model=model, batch=batch):
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        try:
            step()  # warm: compiles
            times = []
            for _ in range(1 if tiny else 5):
                loss, t = _timed(step)
                times.append(t)
            t = sorted(times)[len(times) // 2]
            row.update(status="ok", step_s=t, loss=float(loss),
                       tokens_per_s=sum(lengths) / t, spread_s=max(times) - min(times))
        except Exception as err:  # noqa: BLE001  (a row that failed says why)
            row.update(status=f"failed: {type(err).__name__}: {str(err)[:200]}")
        rows.append(row)
        del model
    return rows


def run_hf_suite(args, console) -> int:
    """The suite's rows into OUT/<gpu>/<stamp>-bench-SUITE/hf.csv, with the environment."""
    from fusedattn.problem import ProblemError
    from fusedattn_lab.cli.shared import (
        render_table,
        stamp_dir,
        write_environment,
        write_rows_csv,
    )
    from fusedattn_lab.evidence import environment

    if EMULATION != (args.suite == "tiny-hf"):
        raise ProblemError("suite", args.suite, "tiny-hf in emulation, hf-generate and "
                           "hf-train on a GPU")
    env = environment()
    out_dir = stamp_dir(args, f"-bench-{args.suite}", env)
    tiny = args.suite == "tiny-hf"
    rows = []
    if args.suite in ("hf-generate", "tiny-hf"):
        rows += generate_rows(tiny)
    if args.suite in ("hf-train", "tiny-hf"):
        rows += train_rows(tiny)
    if EMULATION:  # emulation proves logic, never speed: no times kept
        times = ("total_s", "prefill_s", "decode_step_ms", "tokens_per_s", "step_s", "spread_s")
        rows = [{k: v for k, v in r.items() if k not in times} for r in rows]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    write_rows_csv(out_dir / "hf.csv", [{k: r.get(k, "") for k in keys} for r in rows])
    write_environment(out_dir, env)
    render_table(console, f"bench {args.suite}", rows, [
        ("suite", lambda r: r["suite"]), ("attn", lambda r: r["attn"]),
        ("case", lambda r: r.get("cache") or r.get("layout")),
        ("status", lambda r: r["status"][:60]),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "—"),
        ("decode step ms", lambda r: f"{r['decode_step_ms']:.2f}" if "decode_step_ms" in r
         else "—")])
    console.print(f"written: {out_dir}")
    return 0 if all(r["status"] == "ok" for r in rows if r["attn"] == "fusedattn") else 1
