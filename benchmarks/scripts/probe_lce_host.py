"""Where does fused linear cross-entropy (memory="auto") lose time outside its kernels? (GPU)

    PYTHONPATH=src:benchmarks python benchmarks/scripts/probe_lce_host.py N H V inputs k

Times fwd+bwd (triton do_bench median, as the benchmark) with the defaults, with ignored-row compaction
off (no host sync), with an int budget (no free-memory query), and 10 steps back to back (CUDA events).
"""

import sys

import torch
import triton

import fuselm
from fuselm_bench import linear_cross_entropy as suite
from fuselm.ops.linear_cross_entropy import op as lce_op

shape = tuple(int(a) for a in sys.argv[1:6])
data = suite.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
x, w, t = data["input"], data["linear_weight"], data["target"]


def step(memory="auto"):
    torch.autograd.grad(fuselm.linear_cross_entropy(x, w, t, memory=memory), (x, w))


def bench(label, fn):
    fn()
    ms = triton.testing.do_bench(fn, warmup=50, rep=500, return_mode="median")
    print(f"{label}: {ms:.2f} ms", flush=True)


print(f"## {suite.describe(shape)}")
bench("auto (default)", step)
bench("int budget 256 MiB", lambda: step(256 * 2**20))
allowed = lce_op.compaction_allowed
lce_op.compaction_allowed = lambda device: False
bench("compaction off (every row computed, no sync)", step)
lce_op.compaction_allowed = allowed
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
step()
torch.cuda.synchronize()
start.record()
for _ in range(10):
    step()
end.record()
torch.cuda.synchronize()
print(f"10 steps back to back: {start.elapsed_time(end) / 10:.2f} ms per step")
