"""What one eager fwd+bwd call of fuselm's small ops launches and where its host time goes, on the GPU
machine: for each call of host_overhead.py, the CUDA kernels launched (name, count) and the top host-side
operators of a torch.profiler trace (self CPU time), then a cProfile of the Python side.

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/host_launches.py [call names]
"""

import cProfile
import io
import pstats
import sys

import torch
from host_overhead import CALLS, host_us
from torch.profiler import ProfilerActivity, profile


def launches(fn, steps=20):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0) + 1
    print(f"  kernels per call: {sum(kernels.values()) / steps:.1f}")
    for name, count in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"    {count / steps:4.1f} x {name[:110]}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
    print("\n".join("    " + line for line in table.splitlines()))


def python_profile(fn, calls=200):
    host_us(fn, 20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print("\n".join("    " + line for line in out.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    names = sys.argv[1:] or list(CALLS)
    for name in names:
        fn = CALLS[name]()
        print(f"## {name}: {host_us(fn):.0f} us per call")
        launches(fn)
        python_profile(fn)
