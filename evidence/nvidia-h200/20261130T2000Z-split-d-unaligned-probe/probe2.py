"""Overlapping head-dim piece on the H200: one case per process.
args: dim causal extra_cols stages(0 = rule) [one_loop: '', 0, 1]"""
import os, sys
import torch, triton
from fusedattn.configs import forward_config
from fusedattn.tiles.flash import flash_forward

d, causal, extra, stages = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
dt = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
b, h, s = 1, 2, 2600
q, k, v = (torch.randn(b, h, s, d + extra, device="cuda", generator=g).to(dt)[..., :d]
           for _ in range(3))
cfg = None
bm, bn, w, st = forward_config(dim=d, seq_q=s, programs_per_tile_row=b * h, causal=causal,
                               precision=None)
if stages:
    st = stages
cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
out = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=dt)
_, kern = flash_forward(q, k, v, out=out, lse=None, is_causal=causal, scale=d ** -0.5,
                        precision="ieee", config=cfg)
torch.cuda.synchronize()
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                       is_causal=causal)
err = (out.float() - ref).abs()
cols = err.amax(dim=(0, 1, 2))
bad = (cols > 0.02).nonzero().flatten().tolist()
print(f"{dt} d={d} causal={causal} stride={q.stride(2)} cfg={bm}x{bn} w{w} s{st} "
      f"split={os.environ.get('FUSEDATTN_SPLIT_D', '1')} one_loop={os.environ.get('FUSEDATTN_ONE_LOOP', '')} "
      f"maxerr={err.max().item():.3g} bad_cols={bad[:4]}..{bad[-2:] if bad else ''} n_bad={len(bad)}")
if kern is not None and os.environ.get("DUMP"):
    open(os.path.join(os.environ["OUT"], f"d{d}-e{extra}-s{st}.ttgir"), "w").write(kern.asm["ttgir"])
    open(os.path.join(os.environ["OUT"], f"d{d}-e{extra}-s{st}.ptx"), "w").write(kern.asm["ptx"])
