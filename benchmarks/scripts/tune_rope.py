"""Sweep the RoPE launch constants, fwd+bwd, Llama-3-8B shapes, against torch.compile (GPU).

    PYTHONPATH=src python benchmarks/scripts/tune_rope.py
"""

import itertools

import torch
import triton

import fuselm
from fuselm.ops.rope import op as rope_op

B, T, HQ, HK, D = 4, 4096, 32, 8, 128
dev = torch.device("cuda")
q = torch.randn(B, HQ, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, HK, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
ang = torch.randn(1, T, D, device=dev)
cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
gq, gk = torch.randn_like(q), torch.randn_like(k)
nbytes = 4 * (q.numel() + k.numel()) * 2  # fwd reads q, k and writes both; bwd the same
src = torch.empty(2**29, device=dev, dtype=torch.bfloat16)
dst = torch.empty_like(src)
copy_tbs = 2 * src.numel() * 2 / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e9


def step():
    qe, ke = fuselm.apply_rotary(q, k, cos, sin)
    torch.autograd.grad((qe, ke), (q, k), (gq, gk))


def run(label):
    step()
    ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
    ratio = nbytes / ms / 1e9 / copy_tbs
    print(f"{label}: {ms * 1000:.1f} us, {ratio:.3f}x copy ({copy_tbs:.2f} TB/s)", flush=True)


compiled = torch.compile(lambda q, k: rope_op.apply_rotary_reference(q, k, cos, sin))
ms = triton.testing.do_bench(
    lambda: torch.autograd.grad(compiled(q, k), (q, k), (gq, gk)), warmup=50, rep=300, return_mode="median"
)
print(f"torch.compile of the reference: {ms * 1000:.1f} us")
for tile, warps, big in itertools.product((2048, 4096, 8192), (2, 4, 8), (2048, 4096)):
    rope_op.MAX_TILE, rope_op.NUM_WARPS, rope_op.BIG_TILE = tile, warps, big
    rope_op._launch_config.cache_clear()
    run(f"MAX_TILE={tile} NUM_WARPS={warps} BIG_TILE={big}")
