"""Small helpers the tests share: seeded inputs on the mode's device, int32 index
tensors, the scripts as modules, the one check against the float64 reference, the two
forward paths side by side, and tiny Hugging Face configs."""

import torch

from fusedattn.mode import DEVICE, EMULATION
from fusedattn_lab.verify import check

ON_HOPPER = (not EMULATION and torch.cuda.is_available()
             and torch.cuda.get_device_capability() == (9, 0))


def rand(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return t.requires_grad_() if grad else t


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def offsets(lengths):
    """The int32 offsets (cu_seqlens) of sequences of `lengths` on the tests' device."""
    from fusedattn.varlen import offsets_of

    return offsets_of(lengths, DEVICE)


def script(name: str):
    """`scripts/NAME.py` loaded as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paged(dense, page, spare, seed):
    """`dense [B, H_kv, S, D]` as pages `[num_blocks, H_kv, page, D]` in a shuffled order,
    with `spare` unused blocks, and its block table."""
    batch, heads, seq, dim = dense.shape
    per = -(-seq // page)
    order = torch.randperm(batch * per + spare, generator=torch.Generator().manual_seed(seed))
    table = order[: batch * per].reshape(batch, per).to(torch.int32)
    pages = torch.zeros(batch * per + spare, heads, page, dim, dtype=dense.dtype)
    padded = torch.nn.functional.pad(dense.cpu(), (0, 0, 0, per * page - seq))
    for b in range(batch):
        for j in range(per):
            pages[table[b, j]] = padded[b, :, j * page:(j + 1) * page]
    return pages.to(DEVICE), table.to(DEVICE)


# a ragged packed batch for the Hopper varlen tests: empty query and key sequences, one
# token, and sequences past a tile
RAGGED_Q, RAGGED_K = [5, 0, 1, 300, 1000, 64], [5, 3, 1, 500, 1000, 0]


# the same kinds of sequence, shorter, where the interpreter runs them (FP8's emulated
# kernel took 2 minutes on the long ones)
SHORT_Q, SHORT_K = [5, 0, 1, 70, 150, 64], [5, 3, 1, 90, 150, 0]


def ragged(dim: int, dim_v: int | None = None, heads=(4, 2), lengths=(RAGGED_Q, RAGGED_K)):
    """q, k, v of `lengths` (default `RAGGED_Q`/`RAGGED_K`; bf16, `heads` query and K/V
    heads, V's head dim `dim_v`, default `dim`), their offsets and longest lengths."""
    lengths_q, lengths_k = lengths
    cu_q, cu_k = (offsets(n) for n in lengths)
    q = rand(sum(lengths_q), heads[0], dim, dtype=torch.bfloat16)
    k = rand(sum(lengths_k), heads[1], dim, dtype=torch.bfloat16, seed=1)
    v = rand(sum(lengths_k), heads[1], dim_v or dim, dtype=torch.bfloat16, seed=2)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def forget_plans() -> None:
    """Every plan and call decision the library keeps forgotten: the next call takes the
    full path and launches through `launch` (what a spy on a launch builder sees), not a
    replay of a plan an earlier test recorded on the same shapes."""
    from fusedattn import api, dispatch, kvcache, varlen
    from fusedattn.tiles import flash_bwd

    for plans in (dispatch._PLANS, flash_bwd._PLANS, api._CALLS, varlen._DECIDED,
                  kvcache._DECIDED):
        plans.clear()


def passes(got, ref, name="", peer=None):
    """`got` within the dtype's bound of the float64 `ref` (low precision: twice `peer`'s
    error, the same formula by torch in the same dtype, plus a floor)."""
    peer_error = None if peer is None else float(
        (peer.detach().double().cpu() - ref.detach().double().cpu()).abs().max())
    result = check(got, ref, peer_error=peer_error)
    assert result.ok, (name, result.reasons, peer_error)


def both_paths(call) -> list:
    """The same call on the Hopper path, then on the portable one (`use_backend`)."""
    from fusedattn.dispatch import use_backend

    outs = []
    for backend in ("hopper", "portable"):
        with use_backend(backend):
            outs.append(call())
    return outs


def within_portable(out, out_portable, ref) -> None:
    """The Hopper path's error against the float64 `ref` at most twice the portable
    kernel's on the same inputs, plus a floor; and finite."""
    assert torch.isfinite(out).all()
    err, err_p = ((o.double() - ref).abs().max().item() for o in (out, out_portable))
    assert err <= 2 * err_p + 1e-3, (err, err_p)


def gpt_oss(transformers, sizes: dict, window: int, **common):
    """A tiny gpt-oss config (attention sinks, sliding and full layers, GQA, a small MoE
    run by its eager experts, which float64 takes) and the `from_config` keywords it needs."""
    heads = sizes["num_attention_heads"]
    config = transformers.GptOssConfig(
        sliding_window=window, head_dim=sizes["hidden_size"] // heads, num_local_experts=4,
        num_experts_per_tok=2, layer_types=[("sliding_attention", "full_attention")[i % 2]
                                            for i in range(sizes["num_hidden_layers"])],
        **sizes, **common)
    return config, {"experts_implementation": "eager"}


def spread_sinks(model) -> None:
    """Sinks of a few units (gpt-oss initialises them near 0, where they barely count)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=g) * 2)


def background_done() -> None:
    """No compile or build of an earlier test still running on a thread (the backward's
    precompiles, `launch.ahead`'s builds): for tests that patch what those would call
    (Triton's driver, its key, its module builder)."""
    import threading

    from fusedattn.tiles import flash_bwd

    flash_bwd._wait_for_precompiles()
    for t in threading.enumerate():
        if t.name == "fusedattn-ahead":
            t.join()
