"""What accum_dtype=torch.float32 costs fuselm.linear_cross_entropy (time and extra memory, fwd+bwd), against
the default accumulation, at the benchmark's shapes, both plans, in one process; and how far each dW is
from a float64 dW at a smaller shape with many chunks.

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/lce_accum_cost.py
"""

import torch
import triton

import fuselm

SHAPES = ((8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 128256))


def case(n, h, v, memory, accum_dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    x.grad = torch.zeros_like(x)
    w.grad = torch.zeros_like(w)

    def step():
        fuselm.linear_cross_entropy(x, w, t, memory=memory, accum_dtype=accum_dtype).backward()

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    return ms, extra


def dw_error(memory, accum_dtype, n=4096, h=1024, v=32000):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    wr = w.clone().requires_grad_()
    fuselm.linear_cross_entropy(x, wr, t, memory=memory, accum_dtype=accum_dtype).backward()
    w64 = w.double().requires_grad_()
    torch.nn.functional.cross_entropy(x.double() @ w64.T, t).backward()
    return ((wr.grad.double() - w64.grad).norm() / w64.grad.norm()).item()


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| N, H, V | memory | default ms | fp32 ms | fp32 / default | default extra MiB | fp32 extra MiB |")
    print("|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        for memory in ("auto", "min"):
            d = case(*shape, memory, None)
            f = case(*shape, memory, torch.float32)
            cells = [
                shape,
                memory,
                f"{d[0]:.2f}",
                f"{f[0]:.2f}",
                f"{f[0] / d[0]:.3f}",
                f"{d[1]:.0f}",
                f"{f[1]:.0f}",
            ]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    print("\n| dW rel. error vs float64 (4096 x 1024 x 32000, bf16) | default | fp32 |\n|---|---|---|")
    for memory in (8 * 2**20, "auto", "min"):
        print(f"| memory={memory!r} | {dw_error(memory, None):.2e} | {dw_error(memory, torch.float32):.2e} |")
