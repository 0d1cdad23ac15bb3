"""How much of RoPE's fwd+bwd time at Llama-3-8B shapes is the host path? Eager fwd+bwd vs the same
captured in a CUDA graph (no Python, no launch overhead), and torch.compile of the reference; then the
device time of every kernel of fuselm and of torch.compile (profiler tables).
Usage (GPU): PYTHONPATH=src:benchmarks python benchmarks/scripts/rope_host_share.py"""

import torch
import triton

import fuselm
from fuselm_bench.harness import capture_graph
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

    def full(fn):
        oq, ok = fn(q, k, cos, sin)
        return torch.autograd.grad((oq, ok), (q, k), (gq, gk))

    eager = lambda: full(fuselm.apply_rotary)  # noqa: E731
    compiled_fn = torch.compile(apply_rotary_reference)
    compiled = lambda: full(compiled_fn)  # noqa: E731
    for _ in range(3):
        eager()
        compiled()
    g = capture_graph(eager, torch.device(dev))
    for name, fn in (("fuselm eager", eager), ("fuselm cuda graph", g.replay), ("torch.compile", compiled)):
        ms = sorted(triton.testing.do_bench(fn, warmup=25, rep=200) for _ in range(5))
        print(f"{name:20s} median of 5: {ms[2]:.4f} ms  (min {ms[0]:.4f}, max {ms[-1]:.4f})")
    for name, fn in (("fuselm", eager), ("torch.compile", compiled)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(f"=== {name}: kernels of 20 fwd+bwd calls ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
