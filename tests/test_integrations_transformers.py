"""`attn_implementation="fusedattn"` in Hugging Face transformers: a small randomly
initialised Llama-style model (GQA, nothing downloaded) against the same model under "sdpa",
both judged against a float64 run of it (the low-precision bound: <= 2x sdpa's error + a
floor; fp32 in emulation, bf16 on the GPU)."""

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the [hf] extra is not installed: pip install -e '.[hf]'")

import fusedattn.integrations.transformers  # noqa: E402,F401  (registers "fusedattn")
from fusedattn.mode import DEVICE, EMULATION  # noqa: E402
from fusedattn_lab.verify import check  # noqa: E402
from inputs import gpt_oss, spread_sinks  # noqa: E402

# emulation: tiny (the interpreter runs every program); GPU: a model with real tiles
SIZES = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, seq=16, batch=2)
         if EMULATION else
         dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
              num_attention_heads=8, num_key_value_heads=2, seq=300, batch=3))
DTYPE = torch.float32 if EMULATION else torch.bfloat16


WINDOW = 6 if EMULATION else 100  # shorter than the sequence: the band matters


def _config(kind: str = "llama"):
    """(config, `from_config` keywords)."""
    sizes = {k: v for k, v in SIZES.items() if k not in ("seq", "batch")}
    if kind == "gpt_oss":  # attention sinks (s_aux), trained through
        return gpt_oss(transformers, sizes, WINDOW, vocab_size=128,
                       max_position_embeddings=1024)
    common = dict(vocab_size=128, max_position_embeddings=1024, **sizes)
    if kind == "mistral":  # a sliding window on every layer
        return transformers.MistralConfig(sliding_window=WINDOW, **common), {}
    if kind == "gemma2":  # sliding and full layers in turn, logit softcap 5 (50 in Gemma 2)
        return transformers.Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=None,
                                         head_dim=sizes["hidden_size"]
                                         // sizes["num_attention_heads"], **common), {}
    return transformers.LlamaConfig(**common), {}


def _model(attn: str, state=None, dtype=DTYPE, kind: str = "llama"):
    torch.manual_seed(0)
    # a config per model: from_config records the implementation on the config it is given
    config, extra = _config(kind)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation=attn, **extra)
    if state is not None:
        model.load_state_dict(state)
    else:
        spread_sinks(model)
    return model.to(DEVICE, dtype)


def _step(model, ids):
    """Logits and the gradient of every parameter after one training step's backward."""
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return out.logits.detach(), grads


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_logits_and_training_gradients_match_sdpa(kind):
    # mistral: sliding windows; gemma2: sliding and full layers, softcap (window and softcap
    # reach the kernels as `window=` and `softcap=`); gpt_oss: attention sinks, whose
    # gradients are among the parameters
    ours = _model("fusedattn", kind=kind)
    assert ours.config._attn_implementation == "fusedattn"
    state = ours.state_dict()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (SIZES["batch"], SIZES["seq"]), generator=gen).to(DEVICE)
    # the float64 reference: the same weights, eager attention, on the CPU
    ref_logits, ref_grads = _step(_model("eager", state, torch.float64, kind).cpu(),
                                  ids.cpu())
    # the peer: "sdpa" in the same dtype (Gemma 2 and gpt-oss have no SDPA path: softcap,
    # sinks; eager there)
    peer = "eager" if kind in ("gemma2", "gpt_oss") else "sdpa"
    peer_logits, peer_grads = _step(_model(peer, state, kind=kind), ids)
    got_logits, got_grads = _step(ours, ids)
    for name, got, peer, ref in (("logits", got_logits, peer_logits, ref_logits),
                                 ("grads", got_grads, peer_grads, ref_grads)):
        peer_err = float((peer.double().cpu() - ref).abs().max())
        result = check(got, ref, peer_error=peer_err)
        assert result.ok, (name, result.reasons, peer_err)


def test_generate_with_a_cache_matches_sdpa():
    # prefill (Sq == Sk, causal) then decode steps (Sq == 1: every cached key, no mask)
    ours = _model("fusedattn", dtype=torch.float32)
    peer = _model("sdpa", ours.state_dict(), torch.float32)
    ids = torch.arange(1, 8, device=DEVICE)[None]  # no pad token (0): no padding mask
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), peer.generate(ids, **kwargs))


def test_a_layers_output_is_the_kernels_o_not_a_copy(monkeypatch):
    """A layer's q, k and v come as `[B, S, H, D]` projections seen as `[B, H, S, D]`;
    `attention` writes O in that memory (`api.new_out`), so the integration's
    `out.transpose(1, 2).contiguous()` hands back the kernel's O itself, as SDPA's flash
    and cuDNN backends let transformers' SDPA path do, with no copy kernel a layer."""
    hf = fusedattn.integrations.transformers
    written = []
    monkeypatch.setattr(hf, "attention", lambda *a, **kw: written.append(
        fusedattn.attention(*a, **kw)) or written[-1])
    b, s, heads, heads_kv, d = SIZES["batch"], SIZES["seq"], 4, 2, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(DEVICE, DTYPE).transpose(1, 2)
               for n in (heads, heads_kv, heads_kv))
    layer = type("Layer", (), {"training": False, "is_causal": True})()
    out, _ = hf.fusedattn_attention_forward(layer, q, k, v, None)
    (o,) = written
    assert out.shape == (b, s, heads, d) and out.is_contiguous()
    assert out.data_ptr() == o.data_ptr()  # the kernel's O itself
    plain = [t.contiguous() for t in (q, k, v)]  # the same call on contiguous inputs
    want = fusedattn.attention(*plain, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.equal(out, want)
