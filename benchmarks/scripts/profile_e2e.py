"""Where a training step of the e2e benchmark spends GPU time, per provider: top kernels by total CUDA
time over profiled steps (torch.profiler), grouped by name.

Run on the GPU from the repo root (Liger needs peer-site on PYTHONPATH):
    PYTHONPATH=src:benchmarks:peer-site python benchmarks/scripts/profile_e2e.py fuselm 4 [top]
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fuselm_bench.e2e import GPU_PRESET, build_model

provider, batch = sys.argv[1], int(sys.argv[2])
top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
device = torch.device("cuda")
model = build_model(GPU_PRESET, provider, torch.bfloat16, device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
ids = torch.randint(0, model.config.vocab_size, (batch, 4096), device=device)


def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(3):
    step()
torch.cuda.synchronize()
steps = 2
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
totals = defaultdict(lambda: [0.0, 0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        totals[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        totals[e.name][1] += 1
all_us = sum(t for t, _ in totals.values())
print(f"{provider} batch {batch}: GPU kernel time per step {all_us / steps / 1e3:.1f} ms")
for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"{us / steps / 1e3:8.2f} ms/step {n // steps:5d}x  {name[:110]}")
