"""The library installed alone (`pip install .`, no extras) imports and runs: CI's first step.

    TRITON_INTERPRET=1 python scripts/library_alone.py      # CI: CPU tensors, interpreted
    python scripts/library_alone.py --installed-ok          # a GPU image that has the lab's
                                                            # packages (and numpy 2.5)

Checks that none of the lab's dependencies (numba, matplotlib, rich) is installed (or, with
`--installed-ok`, imported), then runs `attention` forward and backward, `attention_varlen`,
`attention_with_kvcache` and FP8's forward and backward (CPU tensors in Triton's
interpreter, else CUDA tensors), the first against a float64 formula of its own (the lab's
verification is not installed here), and, in emulation, a CPU tensor without
TRITON_INTERPRET in a child process: a ProblemError that says how to emulate. Triton's
interpreter itself needs numpy (any version: the `interpret` extra).
"""

import importlib.util
import os
import subprocess
import sys

LAB_ONLY = ("numba", "matplotlib", "rich")


def main() -> int:
    present = [m for m in LAB_ONLY if importlib.util.find_spec(m) is not None]
    if present and "--installed-ok" not in sys.argv:
        print(f"library_alone: {present} installed; run this in a venv with the library only")
        return 1
    import torch

    import fusedattn
    from fusedattn.distributed import ring_attention  # noqa: F401  (imports alone too)

    emulated = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if emulated else "cuda"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 21, 16, generator=g).to(dev).requires_grad_()
               for _ in range(3))
    out = fusedattn.attention(q, k, v, is_causal=True)
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0
    s = s.masked_fill(torch.ones(21, 21, dtype=torch.bool, device=dev).triu(1),
                      float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    assert (out.double() - ref).abs().max() < 2e-4
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    x = torch.randn(9, 2, 16, generator=g).to(dev)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=dev)
    fusedattn.attention_varlen(x, x, x, cu, cu, 5, 5, is_causal=True)
    cache = torch.zeros(2, 1, 8, 16, device=dev)
    fusedattn.attention_with_kvcache(torch.randn(2, 2, 1, 16, device=dev), cache, cache.clone(),
                                     cache_seqlens=torch.tensor([3, 5], dtype=torch.int32,
                                                                device=dev))
    # FP8 (e4m3) forward and its backward: O and the gradients finite, in bf16
    q8, k8, v8 = (torch.randn(1, 2, 16, 64, generator=g).to(dev).to(torch.float8_e4m3fn)
                  for _ in range(3))
    out8 = fusedattn.attention(q8, k8, v8, descale_v=torch.tensor(0.5, device=dev))
    grads = fusedattn.attention_fp8_backward(torch.ones_like(out8), q8, k8, v8,
                                             descale_v=torch.tensor(0.5, device=dev))
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t).all() for t in (out8, *grads))
    loaded = [m for m in LAB_ONLY if m in sys.modules]
    assert not loaded, loaded
    import numpy

    print(f"library_alone: numpy {numpy.__version__}, torch {torch.__version__}")
    if not emulated:
        print("library_alone: imports and runs on the GPU without the lab's packages")
        return 0
    # without emulation chosen, a CPU tensor gets the error that says how to choose it
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = ("import torch, fusedattn\n"
             "from fusedattn.problem import ProblemError\n"
             "try:\n    fusedattn.attention(*[torch.randn(1, 1, 4, 16)] * 3)\n"
             "except ProblemError as e:\n    print(e)\n")
    said = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True).stdout
    assert "TRITON_INTERPRET=1" in said, said
    print("library_alone: imports and runs with torch and triton only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
