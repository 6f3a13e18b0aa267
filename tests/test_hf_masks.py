"""Masks beyond causal in the Hugging Face integration (issue 32): the mask plan
(`integrations.masks`) on its own, then tiny randomly initialised Llama, Mistral (window),
Qwen2 and Gemma 2 (softcap, sliding and full layers), nothing downloaded, against "sdpa"
(Gemma 2: "eager") on padded generate, a static cache, chunked prefill, right-padded and
packed training steps, and the refusals."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the [hf] extra is not installed: pip install -e '.[hf]'")

import fusedattn.integrations.transformers as hf  # noqa: E402  (registers "fusedattn")
from fusedattn.integrations.masks import plan_from_mask  # noqa: E402
from fusedattn.mode import DEVICE, EMULATION  # noqa: E402
from fusedattn.problem import ProblemError  # noqa: E402
from fusedattn.reference import attention_ref  # noqa: E402
from fusedattn_lab.verify import check  # noqa: E402
from inputs import gpt_oss, spread_sinks  # noqa: E402

SIZES = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
         if EMULATION else
         dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2))
DTYPE = torch.float32 if EMULATION else torch.bfloat16
SEQ = 12 if EMULATION else 200
WINDOW = 5 if EMULATION else 64


def _causal(sq, sk, window=None):
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None]
    seen = j <= i
    return seen & (j > i - window) if window else seen


# --- the plan on its own ---------------------------------------------------------------

def _padded(valid, sq, window=None):
    """transformers' causal mask over keys `valid [B, Sk]`, the last `sq` of them queries."""
    sk = valid.shape[1]
    mask = _causal(sq, sk, window)[None] & valid[:, None, :]
    return mask & valid[:, sk - sq:, None]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("sq", [9, 4, 1])  # prefill (Sq == Sk), chunked prefill, decode
def test_a_padded_mask_plans_as_sequences_and_attends_right(window, sq):
    valid = torch.ones(3, 9, dtype=torch.bool)
    valid[0, :4] = False  # left padding
    valid[2, 7:] = False if sq == 9 else True  # right padding (training only)
    mask = _padded(valid, sq, window)
    plan = plan_from_mask(mask[:, None])
    # (a decode step's window drops the keys it cuts: no window is left to apply)
    assert plan is not None and plan.left == (None if window is None or sq == 1
                                              else window - 1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, sq, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(3, 2, 9, 16, generator=g).to(DEVICE) for _ in range(2))
    plan = plan_from_mask(mask[:, None].to(DEVICE))
    out = plan.attend(q, k, v)  # [B, Sq, H, D]
    for b in range(3):
        rows, keys = valid[b, 9 - sq:], valid[b]
        ref = attention_ref(q[b][:, rows], k[b][:, keys], v[b][:, keys], causal=True,
                            align="bottom-right",
                            window=None if window is None else (window - 1, None))
        result = check(out[b][rows].transpose(0, 1), ref)
        assert result.ok, result.reasons
        assert torch.all(out[b][~rows] == 0)  # padded query rows: zeros


def test_packed_documents_and_a_static_tail_plan_too():
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2])
    packed = (_causal(9, 9) & (docs[:, None] == docs[None]))[None]
    plan = plan_from_mask(packed)
    assert plan.cu_q.tolist() == [0, 3, 8, 9]
    # queries and keys the same tokens: one offsets tensor and one index (keyed and read
    # once a layer's call)
    assert plan.cu_k is plan.cu_q and plan.k_index is plan.q_index
    tail = torch.zeros(1, 2, 12, dtype=torch.bool)  # a static cache of 12, 8 rows written
    tail[0, 0, :7], tail[0, 1, :8] = True, True    # a chunk of 2 queries at rows 6 and 7
    plan = plan_from_mask(tail)
    assert plan.cu_q.tolist() == [0, 2] and plan.cu_k.tolist() == [0, 8]
    assert plan.k_index.tolist() == list(range(8)) and plan.q_index.tolist() == [0, 1]


def test_masks_of_another_kind_have_no_plan():
    g = torch.Generator().manual_seed(0)
    noise = (torch.rand(2, 6, 6, generator=g) > 0.5) | torch.eye(6, dtype=torch.bool)
    assert plan_from_mask(noise) is None
    assert plan_from_mask(torch.ones(1, 4, 4, dtype=torch.bool)) is None  # bidirectional
    assert plan_from_mask(_causal(4, 4).float()[None]) is None  # not a boolean mask
    assert plan_from_mask(torch.zeros(2, 3, 3, dtype=torch.bool)) is None  # sees nothing
    holes = _causal(6, 6, 3)[None].clone()
    holes[0, 5, 4] = False  # a window with a hole in it
    assert plan_from_mask(holes) is None


# --- tiny models -------------------------------------------------------------------------

def _config(kind):
    """(config, `from_config` keywords)."""
    if kind == "gpt_oss":  # attention sinks through the mask plan's varlen calls
        return gpt_oss(transformers, SIZES, WINDOW, vocab_size=96, max_position_embeddings=512)
    common = dict(vocab_size=96, max_position_embeddings=512, **SIZES)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common), {}
    if kind == "qwen2":
        return transformers.Qwen2Config(**common), {}
    if kind == "gemma2":
        return transformers.Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=None, head_dim=16,
                                         **common), {}
    return transformers.LlamaConfig(**common), {}


def _models(kind, dtype=DTYPE, peer_only=False):
    """(ours, the peer) with the same random weights, in eval mode (the peer alone)."""
    out = []
    peer = "eager" if kind in ("gemma2", "gpt_oss") else "sdpa"
    config, extra = _config(kind)
    for attn in (peer,) if peer_only else ("fusedattn", peer):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                              attn_implementation=attn, **extra)
        spread_sinks(model)
        out.append(model.to(DEVICE, dtype).eval())
    return out


def _left_padded(batch=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[0, : SEQ // 2], mask[1, :1] = 0, 0
    return (ids * mask).to(DEVICE), mask.to(DEVICE)


KINDS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_generate_gives_the_peers_tokens_and_logits(kind):
    # logits in the models' dtype against a float64 run (the low-precision bound: 2x the
    # peer's error); greedy tokens in fp32, where no two logits tie within rounding
    ours, peer = _models(kind)
    ids, mask = _left_padded()
    keep = mask.bool()
    (ref,) = _models(kind, dtype=torch.float64, peer_only=True)  # the float64 reference
    with torch.no_grad():
        got, want, exact = (m(ids, attention_mask=mask).logits for m in (ours, peer, ref))
    peer_err = float((want.double() - exact)[keep].abs().max())
    result = check(got[keep], exact[keep], peer_error=peer_err)
    assert result.ok, (result.reasons, peer_err)
    if DTYPE != torch.float32:
        ours, peer = _models(kind, dtype=torch.float32)
    # (8 steps in emulation: past the window there too, SEQ + 8 > WINDOW; each step is
    # interpreted)
    args = dict(attention_mask=mask, max_new_tokens=8 if EMULATION else 16, do_sample=False,
                pad_token_id=0)
    assert torch.equal(ours.generate(ids, **args), peer.generate(ids, **args))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_static_cache_generate_gives_the_peers_tokens(kind):
    ours, peer = _models(kind, dtype=torch.float32)
    ids, mask = _left_padded()
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = peer.generate(ids, **args)
    assert torch.equal(ours.generate(ids, cache_implementation="static", **args), want)


@pytest.mark.gpu_only("transformers compiles a static cache's decoding on CUDA only (and "
                     "inductor on a CPU compiles C++ for minutes)")
def test_compiled_static_cache_generate_gives_the_peers_tokens():
    ours, peer = _models("llama", dtype=torch.float32)
    ids, mask = _left_padded()
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = peer.generate(ids, **args)
    compiled = transformers.CompileConfig(fullgraph=False)
    got = ours.generate(ids, cache_implementation="static", compile_config=compiled, **args)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_chunked_prefill_gives_one_prefills_logits(kind):
    ours, _ = _models(kind)
    ids, _ = _left_padded(batch=2)
    ids = ids.clamp(min=1)  # no padding here: two chunks of one prompt
    with torch.no_grad():
        whole = ours(ids).logits
        cache = transformers.DynamicCache()
        first = ours(ids[:, : SEQ // 2], past_key_values=cache, use_cache=True).logits
        second = ours(ids[:, SEQ // 2:], past_key_values=cache, use_cache=True).logits
    got = torch.cat([first, second], 1)
    assert float((got - whole).abs().max()) < (2e-4 if EMULATION else 0.1)


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_a_right_padded_training_step_matches_the_peer(kind):
    ours, peer = _models(kind, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 96, (3, SEQ), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 4:], mask[2, SEQ - 1:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in (ours, peer):
        model.train()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert float((losses[0] - losses[1]).abs()) < 1e-4
    assert float((_grads(ours) - _grads(peer)).abs().max()) < 1e-3


def test_a_packed_batch_trains_like_its_documents_one_by_one():
    from transformers import DataCollatorWithFlattening

    ours, _ = _models("llama", dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, SEQ, 7)]
    batch = DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    batch = {k: v.to(DEVICE) for k, v in batch.items() if k in ("input_ids", "labels",
                                                                 "position_ids")}
    ours.train()
    packed = ours(**batch)
    packed.loss.backward()
    g_packed = _grads(ours).clone()
    ours.zero_grad()
    total, count = 0.0, 0
    for d in docs:  # each document alone: the summed token losses over all label tokens
        ids = torch.tensor([d], device=DEVICE)
        logits = ours(ids).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:],
                                                          reduction="sum")
        count += len(d) - 1
    (total / count).backward()
    assert float((packed.loss.detach() - total.detach() / count).abs()) < 1e-4
    assert float((g_packed - _grads(ours)).abs().max()) < 1e-3


def test_refusals_name_what_is_supported():
    ours, peer = _models("llama")
    ids, _ = _left_padded()
    with pytest.raises(ProblemError, match="output_attentions"):
        ours(ids, output_attentions=True)
    noise = torch.rand(ids.shape[0], 1, SEQ, SEQ, generator=torch.Generator().manual_seed(4))
    custom = (noise > 0.5).to(DEVICE) | torch.eye(SEQ, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ProblemError, match="allow_mask_fallback"):
        ours(ids, attention_mask=custom)
    with pytest.raises(ProblemError, match="^allowed=.*True or False"):
        hf.allow_mask_fallback("no")  # (a truthy string allowed it before)
    with pytest.raises(ProblemError, match="allow_mask_fallback"):
        ours(ids, attention_mask=custom)  # still refused
    # the opt-in: the plain formula for that call, said once
    hf.allow_mask_fallback(True)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with torch.no_grad():
                got, want = ours(ids, attention_mask=custom).logits, \
                    peer(ids, attention_mask=custom).logits
        assert sum("falls back" in str(w.message) for w in said) == 1
        assert float((got - want).abs().max()) < (1e-4 if EMULATION else 0.1)
        # sinks (gpt-oss's s_aux) have no fallback: SDPA would drop them
        q = torch.zeros(1, 4, SEQ, 16, device=DEVICE)
        with pytest.raises(ProblemError, match="no fallback"):
            hf.fusedattn_attention_forward(ours.model.layers[0].self_attn, q, q, q,
                                           custom[:1], s_aux=torch.zeros(4, device=DEVICE))
    finally:
        hf.allow_mask_fallback(False)
    layer = type("Layer", (), {"training": True, "is_causal": True})()
    q = torch.zeros(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ProblemError, match="dropout"):
        hf.fusedattn_attention_forward(layer, q, q, q, None, dropout=0.1)


@pytest.mark.emulation_only("the GPU-sized Hugging Face suites run on the H200 as evidence")
def test_the_hf_bench_runs_every_row_in_emulation(tmp_path, capsys):
    from fusedattn_lab.cli import main

    assert main(["bench", "--suite", "tiny-hf", "--out", str(tmp_path)]) == 0
    (csv_path,) = tmp_path.glob("*/*/hf.csv")
    text = csv_path.read_text()
    assert text.count(",ok,") >= 5 and "tokens_per_s" not in text  # no times in emulation


def test_a_padded_forward_reads_its_offsets_once_not_per_layer(monkeypatch):
    """The layers of one padded forward share the mask plan's `cu_seqlens`, so their values
    are read (a device-to-host copy that waits for the GPU) by the first layer alone: once
    per forward, not once per layer (`varlen.check_cu_seqlens` keeps the verdict)."""
    from fusedattn import varlen

    reads = []
    monkeypatch.setattr(varlen, "read_offsets", lambda cu: reads.append(1) or cu.tolist())
    ours, _ = _models("llama")
    assert ours.config.num_hidden_layers >= 2
    ids, mask = _left_padded()
    with torch.no_grad():
        ours(ids, attention_mask=mask)
        assert len(reads) == 1  # q's and k's offsets: one tensor (the same tokens)
        ours(ids, attention_mask=mask)  # a new forward plans anew: new offsets, read again
    assert len(reads) == 2
