"""Where the fused tile plan (memory="min") spends its time: fwd+bwd of fuselm.linear_cross_entropy with
gradients for (x, W), x only, W only, and the forward alone, at Llama-3-8B's and Gemma-2-2B's heads
(bf16, random, 1/7 ignored). The x-only and W-only runs do the same logits recompute and one of the two
gradient GEMMs, with only that GEMM's atomic adds (dX [BM, H] or dW [BV, H] per tile).

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/lce_min_split.py
"""

import torch
import triton

import fuselm
from fuselm.bench import linear_cross_entropy as suite


def main():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = 2 * 8192**3 / triton.testing.do_bench(lambda: a @ a, rep=100, return_mode="median") / 1e9
    del a
    print(f"{torch.cuda.get_device_name()} bf16 GEMM {gemm:.0f} TFLOP/s")
    for shape in ((8192, 4096, 128256, 1, 7), (8192, 2304, 256000, 1, 7)):
        data = suite.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
        x, w, t = data["input"], data["linear_weight"], data["target"]
        n, h, v = shape[:3]
        kept = int((t != -100).sum())
        unit = 2 * kept * h * v / gemm / 1e9  # ms of one N H V GEMM (kept rows) at the measured rate
        rows = []
        for name, wrt in (
            ("fwd only (stats)", ()),
            ("grad x", (x,)),
            ("grad W", (w,)),
            ("grad x, W", (x, w)),
        ):

            def call(wrt=wrt):
                loss = fuselm.linear_cross_entropy(x, w, t, memory="min")
                if wrt:
                    torch.autograd.grad(loss, wrt)

            if not wrt:
                with torch.no_grad():
                    ms = triton.testing.do_bench(call, rep=200, return_mode="median")
            else:
                ms = triton.testing.do_bench(call, rep=200, return_mode="median")
            rows.append((name, ms))
        for name, ms in rows:
            print(f"{n}x{h}x{v} {name:18s} {ms:7.2f} ms = {ms / unit:4.2f} x (2 N H V at the GEMM rate)")
        del x, w, t, data
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
