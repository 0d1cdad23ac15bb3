"""Time the fused tile plan (memory="min") fwd+bwd under several tile configs (GPU).

    PYTHONPATH=src:benchmarks python benchmarks/scripts/tune_lce_fused.py N H V inputs k
"""

import itertools
import sys

import torch
import triton

import fuselm
from fuselm_bench import linear_cross_entropy as suite
from fuselm.ops.linear_cross_entropy import fused

shape = tuple(int(a) for a in sys.argv[1:6])
data = suite.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
x, w, t = data["input"], data["linear_weight"], data["target"]
base = dict(fused.GPU_CONFIG)
space = {
    "BLOCK_M": (128,),
    "BLOCK_V": (128, 256),
    "BLOCK_HG": (64, 128),
    "num_warps": (8,),
    "num_stages": (3, 4),
}
print(f"## {suite.describe(shape)}")
for values in itertools.product(*space.values()):
    fused.GPU_CONFIG = dict(base, **dict(zip(space, values, strict=True)))
    try:
        ms = triton.testing.do_bench(
            lambda: torch.autograd.grad(fuselm.linear_cross_entropy(x, w, t, memory="min"), (x, w)),
            warmup=50,
            rep=300,
            return_mode="median",
        )
        print(f"{fused.GPU_CONFIG}: {ms:.2f} ms", flush=True)
    except Exception as e:  # noqa: BLE001 - out of resources etc.: report and go on
        print(f"{fused.GPU_CONFIG}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
