"""Where the fwd+bwd time of RMSNorm (16384 x 4096) and RoPE (Llama-3-8B shapes) goes, on the GPU host.

1. Host time per call: tiny shapes (GPU work ~ nothing), 300 calls back to back without a sync, wall
   time / call; a cProfile of the same calls (top entries by own time).
2. Kernel durations (torch.profiler) at the bench shapes, and eager do_bench vs a CUDA-graph replay.
3. RMSNorm backward sweep at 16384 x 4096: programs per SM cap, elements per warp, partial-reduce tiles
   (CUDA-graph replay of fwd+bwd, so the host is out of the figure; then eager do_bench of the best).
Usage (GPU): PYTHONPATH=src:benchmarks python benchmarks/scripts/probe_host_and_rms_bwd.py
"""

import cProfile
import io
import itertools
import pstats
import statistics

import torch
import triton
from host_overhead import host_us  # benchmarks/scripts (the script's own folder)

import fuselm
from fuselm_bench.harness import capture_graph
from fuselm.ops._common import launch, partial_sums
from fuselm.ops.rms_norm import op as rms_op

DEV = "cuda"


def rope_inputs(b, t, hq, hk, d):
    q = torch.randn(b, hq, t, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hk, t, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    ang = torch.randn(b, t, d // 2, device=DEV)
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def full():
        oq, ok = fuselm.apply_rotary(q, k, cos, sin)
        return torch.autograd.grad((oq, ok), (q, k), (gq, gk))

    def fwd():
        with torch.no_grad():
            return fuselm.apply_rotary(q, k, cos, sin)

    return full, fwd


def rms_inputs(n, h):
    x = torch.randn(n, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)

    def full():
        y = fuselm.rms_norm(x, w, 1e-6)
        return torch.autograd.grad(y, (x, w), gy)

    def fwd():
        with torch.no_grad():
            return fuselm.rms_norm(x, w, 1e-6)

    return full, fwd


def profile_host(name, fn, n=300):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"--- cProfile {name} ({n} calls) ---")
    print("\n".join(s.getvalue().splitlines()[:45]))


def med_ms(fn, reps=5, rep_ms=100):
    return statistics.median(triton.testing.do_bench(fn, warmup=25, rep=rep_ms) for _ in range(reps))


def kernel_table(fn, n=10):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)

    print("=== 1. host time per call (tiny shapes) ===")
    cases = {
        "rope": rope_inputs(1, 16, 4, 2, 128),
        "rms_norm": rms_inputs(16, 256),
    }
    x = torch.randn(16, 256, device=DEV, requires_grad=True)
    gx = torch.randn_like(x)
    print(f"baseline torch (x * 2) fwd+grad: {host_us(lambda: torch.autograd.grad(x * 2, x, gx)):.1f} us")
    for name, (full, fwd) in cases.items():
        print(f"{name}: full {host_us(full):.1f} us, fwd (no grad) {host_us(fwd):.1f} us")
    for name, (full, _) in cases.items():
        profile_host(name + " full", full)

    print("=== 2. kernels at the bench shapes; eager vs CUDA graph ===")
    big = {
        "rope 4x4096x32x8x128": rope_inputs(4, 4096, 32, 8, 128),
        "rms_norm 16384x4096": rms_inputs(16384, 4096),
    }
    for name, (full, _) in big.items():
        g = capture_graph(full, torch.device(DEV))
        print(f"{name}: eager {med_ms(full):.4f} ms, graph {med_ms(g.replay):.4f} ms")
        kernel_table(full)

    print("=== 3. RMSNorm backward sweep, 16384 x 4096 (graph replay of fwd+bwd) ===")
    full, _ = rms_inputs(16384, 4096)
    saved = {
        k: getattr(rms_op, k)
        for k in (
            "BWD_MAX_PROGRAMS_PER_SM",
            "BWD_ELEMS_PER_WARP",
            "REDUCE_BLOCK_P",
            "REDUCE_BLOCK_C",
            "REDUCE_WARPS",
        )
    }
    results = []
    for cap, epw, (bp, bc, rw) in itertools.product(
        (1, 2, 3, 4, 8), (512, 1024), ((128, 32, 4), (32, 128, 4), (64, 64, 4), (16, 256, 4))
    ):
        rms_op.BWD_MAX_PROGRAMS_PER_SM, rms_op.BWD_ELEMS_PER_WARP = cap, epw
        partial_sums.REDUCE_BLOCK_P, partial_sums.REDUCE_BLOCK_C, partial_sums.REDUCE_WARPS = bp, bc, rw
        launch._OCCUPANCY.clear()
        g = capture_graph(full, torch.device(DEV))
        ms = med_ms(g.replay, reps=3, rep_ms=50)
        results.append((ms, cap, epw, bp, bc, rw))
        print(f"cap {cap} epw {epw} reduce P{bp} C{bc} w{rw}: {ms:.4f} ms")
        del g
    results.sort()
    print("best 5:", results[:5])
    for k, v in saved.items():
        setattr(rms_op, k, v)
    launch._OCCUPANCY.clear()
    print(f"default eager {med_ms(full):.4f} ms")
    _, cap, epw, bp, bc, rw = results[0]
    rms_op.BWD_MAX_PROGRAMS_PER_SM, rms_op.BWD_ELEMS_PER_WARP = cap, epw
    partial_sums.REDUCE_BLOCK_P, partial_sums.REDUCE_BLOCK_C, partial_sums.REDUCE_WARPS = bp, bc, rw
    launch._OCCUPANCY.clear()
    print(f"best-config eager {med_ms(full):.4f} ms")
    kernel_table(full)


if __name__ == "__main__":
    main()
