"""Sweep launch configs of the cross-entropy kernels on a GPU; print time and ratio to copy bandwidth.

Run on the GPU machine from the repo root: PYTHONPATH=src:peer-site python benchmarks/scripts/tune_cross_entropy.py
"""

import itertools
import sys

import torch
import triton

import fuselm
from fuselm.ops._common.loss import rows as ce_op  # the row kernels' launchers


def ceilings():
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    bw = 2 * src.numel() * 2 / ms / 1e6  # GB/s
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return bw, 2 * 8192**3 / ms / 1e9


def bench_full(fn, x, t):
    def run():
        loss = fn(x, t)
        torch.autograd.grad(loss, x)

    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


def graph_ms(x, t):
    """fwd+bwd captured in a CUDA graph: the GPU time without Python launch overhead."""
    for name, fn in [
        ("fwd no grad", lambda: fuselm.cross_entropy(x.detach(), t)),
        ("fwd with grad", lambda: fuselm.cross_entropy(x, t, inplace_backward=True)),
        ("fwd+backward()", lambda: fuselm.cross_entropy(x * 1, t).backward()),
    ]:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            print("   graph capture ok:", name)
        except Exception as e:  # noqa: BLE001
            print("   graph capture FAILED:", name, str(e)[:100])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.autograd.grad(fuselm.cross_entropy(x, t, inplace_backward=True), x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.autograd.grad(fuselm.cross_entropy(x, t, inplace_backward=True), x)
    return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")


def overhead_us():
    """Host time of one fwd+bwd on a tiny input (the GPU work is negligible)."""
    import time

    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1024, (16,), device="cuda")
    for fn_name, fn in [
        ("fuselm inplace", lambda: torch.autograd.grad(fuselm.cross_entropy(x, t, inplace_backward=True), x)),
        ("fuselm", lambda: torch.autograd.grad(fuselm.cross_entropy(x, t), x)),
        ("torch eager", lambda: torch.autograd.grad(torch.nn.functional.cross_entropy(x.float(), t), x)),
    ]:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        print(f"  host overhead {fn_name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us per fwd+bwd", flush=True)


def main():
    bw, tflops = ceilings()
    print(f"{torch.cuda.get_device_name()} copy {bw:.0f} GB/s  gemm {tflops:.0f} TFLOP/s", flush=True)
    overhead_us()
    shapes = [(8192, 128256), (16384, 32000), (16384, 8192)]
    if len(sys.argv) > 1:
        shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
    orig = ce_op._fwd_config
    for n, v in shapes:
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).mul_(2).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda")
        gb = n * v * 4 / 1e9

        def report(name, ms):
            print(f"  {n}x{v} {name:40s} {ms:7.3f} ms  {gb / ms:6.2f} TB/s  {gb / ms * 1000 / bw:5.2f}x copy", flush=True)

        # correctness spot check against torch fp32
        ref = torch.nn.functional.cross_entropy(x.float(), t)
        ours = fuselm.cross_entropy(x, t)
        print(f"  {n}x{v} loss ours {ours.item():.6f} torch {ref.item():.6f}", flush=True)
        configs = []
        pow2 = triton.next_power_of_2(v)
        for block, warps, per_sm in itertools.product([2048, 4096, 8192, 16384], [4, 8, 16], [2, 4, 8]):
            if block > pow2 or block < warps * 32 * 8 or (block < v and block > 16384):
                continue
            configs.append((block >= v, block, warps, per_sm))
        for cfg in configs:
            ce_op._fwd_config = lambda n_cols, cfg=cfg: cfg
            try:
                ms = bench_full(lambda a, b: fuselm.cross_entropy(a, b, inplace_backward=True), x, t)
                report(f"inplace single={cfg[0]} block={cfg[1]} warps={cfg[2]} per_sm={cfg[3]}", ms)
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
        ce_op._fwd_config = orig
        report("fuselm default inplace", bench_full(lambda a, b: fuselm.cross_entropy(a, b, inplace_backward=True), x, t))
        report("fuselm default", bench_full(lambda a, b: fuselm.cross_entropy(a, b), x, t))
        x.grad = None
        report("fuselm fwd only (no grad)", triton.testing.do_bench(
            lambda: fuselm.cross_entropy(x.detach(), t), warmup=25, rep=100, return_mode="median") * 2)
        report("fuselm reduction=none bwd-recompute", bench_full(
            lambda a, b: fuselm.cross_entropy(a, b, reduction="none").sum(), x, t))
        compiled = torch.compile(lambda a, b: torch.nn.functional.cross_entropy(a.float(), b))
        report("torch.compile", bench_full(compiled, x, t))
        try:
            from liger_kernel.transformers.functional import liger_cross_entropy

            report("liger", bench_full(lambda a, b: liger_cross_entropy(a, b), x, t))
        except Exception as e:  # noqa: BLE001
            print("  liger unavailable:", type(e).__name__, str(e)[:200])
        del x, t
        torch.cuda.empty_cache()
    x = torch.randn(8192, 128256, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, 128256, (8192,), device="cuda")
    ms = graph_ms(x, t)
    print(f"  8192x128256 fwd+bwd inplace in a CUDA graph: {ms:.3f} ms, {8192 * 128256 * 4 / 1e9 / ms:.2f} TB/s")


if __name__ == "__main__":
    main()
