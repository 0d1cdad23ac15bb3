"""Host cost of the pieces of an eager fwd+bwd call on the GPU machine, to put host_overhead.py's numbers
next to their floors: an empty Triton kernel launched through `kernel[grid](...)` (Triton's binding,
cache lookup and launch) and through the compiled kernel's own launcher (what a cached launch binding
would call), an autograd.Function whose forward and backward do nothing, and the same with one empty
launch each.

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/launch_cost.py
"""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def empty_kernel(x_ptr, y_ptr, n, a, b, c, d, e, f, g, h, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    if FLAG:
        tl.store(y_ptr + pid, tl.load(x_ptr + pid))


def per_call_us(fn, n=2000, rounds=5):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    x = torch.zeros(16, device="cuda")
    y = torch.zeros(16, device="cuda")
    kw = dict(x_ptr=x, y_ptr=y, n=16, a=3, b=5, c=7, d=9, e=11, f=13, g=15, h=17, BLOCK=16, FLAG=False)

    def by_kwargs():
        empty_kernel[(1,)](**kw)

    compiled = empty_kernel.warmup(grid=(1,), **kw)
    compiled._init_handles()
    args = list(kw.values())
    stream = torch.cuda.current_stream().cuda_stream
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata

    def direct():
        run(1, 1, 1, stream, fn, meta, None, None, None, *args)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.new_empty(())

        @staticmethod
        def backward(ctx, grad):
            return torch.empty_like(x)

    class OneLaunch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            empty_kernel[(1,)](**kw)
            return a.new_empty(())

        @staticmethod
        def backward(ctx, grad):
            empty_kernel[(1,)](**kw)
            return torch.empty_like(x)

    leaf = torch.zeros(16, device="cuda", requires_grad=True)
    rows = [
        ("empty Triton kernel, kernel[grid](**kwargs) (12 arguments)", by_kwargs),
        ("the same through the compiled kernel's launcher", direct),
        ("autograd.Function, empty forward and backward, .backward()", lambda: Empty.apply(leaf).backward()),
        ("autograd.Function, one empty launch each way", lambda: OneLaunch.apply(leaf).backward()),
        ("torch: (x * 2).sum().backward()", lambda: (leaf * 2).sum().backward()),
        (
            "torch: F.cross_entropy fwd+bwd (64 x 8192 bf16, clone first)",
            _torch_ce(),
        ),
    ]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print("| host path | us per call (best of 5 x 2000) |\n|---|---|")
    for name, call in rows:
        print(f"| {name} | {per_call_us(call):.1f} |", flush=True)


def _torch_ce():
    z = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 8192, (64,), device="cuda")

    def call():
        logits = z.clone().requires_grad_()
        torch.nn.functional.cross_entropy(logits, t).backward()

    return call


if __name__ == "__main__":
    main()
