"""RoPE at Llama-3-8B shapes: device time per kernel, fuselm vs torch.compile of the reference (fwd+bwd).
Usage (GPU): PYTHONPATH=src python benchmarks/scripts/rope_vs_compile_kernels.py"""

import torch

import fuselm
from fuselm.ops.rope.reference import apply_rotary_reference

B, T, HQ, HK, D = 4, 4096, 32, 8, 128


def main():
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, HQ, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, HK, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ang = torch.randn(B, T, D // 2, device=dev)
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    compiled = torch.compile(apply_rotary_reference)
    for name, fn in (("fuselm", fuselm.apply_rotary), ("torch.compile", compiled)):

        def full(fn=fn):
            oq, ok = fn(q, k, cos, sin)
            return torch.autograd.grad((oq, ok), (q, k), (gq, gk))

        for _ in range(3):
            full()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                full()
            torch.cuda.synchronize()
        print(f"=== {name}: kernels of 20 fwd+bwd calls ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
