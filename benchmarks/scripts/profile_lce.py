"""Kernel-time breakdown of fuselm.linear_cross_entropy fwd+bwd (torch profiler, GPU).

    PYTHONPATH=src:benchmarks python benchmarks/scripts/profile_lce.py N H V inputs k [memory]

memory: "auto" (default), "min" or a byte count. Prints the CUDA kernels by total time over 3 steps.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fuselm
from fuselm_bench import linear_cross_entropy as suite

shape = tuple(int(a) for a in sys.argv[1:6])
memory = sys.argv[6] if len(sys.argv) > 6 else "auto"
memory = int(memory) if memory.isdigit() else memory
data = suite.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
x, w, t = data["input"], data["linear_weight"], data["target"]


def step():
    torch.autograd.grad(fuselm.linear_cross_entropy(x, w, t, memory=memory), (x, w))


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
print(f"## {suite.describe(shape)}, memory={memory}: CUDA kernels over 3 fwd+bwd steps")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
