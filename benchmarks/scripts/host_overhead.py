"""Host time per eager fwd+bwd call of fuselm's ops, on the GPU machine: tiny shapes (the GPU work is next
to nothing), 300 calls back to back without a sync, wall time / call (best of 3), and with --profile the
top entries of a cProfile of cross_entropy's calls.

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/host_overhead.py [--profile]
(PYTHONPATH=<another tree's src> measures that tree: compare two trees in one session.)
"""

import cProfile
import io
import pstats
import sys
import time

import torch

import fuselm

DEV = "cuda"
BF16 = dict(device=DEV, dtype=torch.bfloat16)


def cross_entropy_call(inplace: bool):
    x = torch.randn(64, 8192, **BF16)
    t = torch.randint(0, 8192, (64,), device=DEV)

    def call():
        logits = x.clone().requires_grad_()
        fuselm.cross_entropy(logits, t, inplace_backward=inplace).backward()

    return call


def linear_cross_entropy_call():
    x = torch.randn(64, 256, **BF16, requires_grad=True)
    w = torch.randn(1024, 256, **BF16, requires_grad=True)
    t = torch.randint(0, 1024, (64,), device=DEV)
    return lambda: fuselm.linear_cross_entropy(x, w, t).backward()


def rms_norm_call():
    x = torch.randn(64, 512, **BF16, requires_grad=True)
    w = torch.randn(512, **BF16, requires_grad=True)
    return lambda: fuselm.rms_norm(x, w, 1e-6).sum().backward()


def apply_rotary_call():
    q = torch.randn(1, 8, 16, 64, **BF16, requires_grad=True)
    k = torch.randn(1, 2, 16, 64, **BF16, requires_grad=True)
    ang = torch.randn(1, 16, 32, device=DEV)
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()

    def call():
        oq, ok = fuselm.apply_rotary(q, k, cos, sin)
        (oq.sum() + ok.sum()).backward()

    return call


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(best)


CALLS = {
    "cross_entropy": lambda: cross_entropy_call(False),
    "cross_entropy(inplace_backward)": lambda: cross_entropy_call(True),
    "linear_cross_entropy": linear_cross_entropy_call,
    "rms_norm": rms_norm_call,
    "apply_rotary": apply_rotary_call,
}

if __name__ == "__main__":
    print(f"fuselm from {fuselm.__file__}")
    print("| op (fwd+bwd, eager) | host us per call |\n|---|---|")
    for name, make in CALLS.items():
        print(f"| {name} | {host_us(make()):.0f} |", flush=True)
    if "--profile" in sys.argv:
        fn = cross_entropy_call(False)
        host_us(fn, 50)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
