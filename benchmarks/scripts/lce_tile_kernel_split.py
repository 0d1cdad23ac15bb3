"""The fused tile plan's gradient kernel (lce_tile_grad_kernel) alone, by what it computes: the logits
recompute and G only (db, no GEMM after), plus dX (G W, atomics into dX), plus dW (G^T X, atomics into dW),
or both; for a few launch configs (fused.GPU_CONFIG replaced). Llama-3-8B's head, bf16, all rows.

Usage (GPU): PYTHONPATH=src python benchmarks/scripts/lce_tile_kernel_split.py [--default-only]
"""

import sys

import torch
import triton

from fuselm.ops._common.loss.options import LossOptions
from fuselm.ops.linear_cross_entropy import fused

N, H, V = 8192, 4096, 128256


def main():
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16).div_(H**0.5)
    t = torch.randint(0, V, (N,), device="cuda")
    coef = torch.stack(
        [
            torch.full((N,), 12.0, device="cuda"),
            torch.full((N,), 1.0 / N, device="cuda"),
            torch.full((N,), 1.0 / N, device="cuda"),
            torch.zeros(N, device="cuda"),
        ]
    ).contiguous()
    opts = LossOptions()
    unit = 2 * N * H * V / 1e9  # MFLOP... per ms -> TFLOP/s
    base = dict(fused.GPU_CONFIG)
    configs = [
        {},
        {"BLOCK_HG": 128},
        {"num_stages": 4},
        {"BLOCK_HG": 128, "num_stages": 4},
        {"BLOCK_V": 128},
        {"BLOCK_V": 128, "BLOCK_HG": 128},
    ]
    if "--default-only" in sys.argv:
        configs = configs[:1]
    print(f"{torch.cuda.get_device_name()}; default config {base}")
    for change in configs:
        fused.GPU_CONFIG.clear()
        fused.GPU_CONFIG.update(base, **change)
        for gather in (False, True):
            rows = torch.arange(N, device="cuda") if gather else None
            for name, needs in (
                ("logits + G (db only)", (False, False, True)),
                ("+ dX", (True, False, False)),
                ("+ dW", (False, True, False)),
                ("+ dX + dW", (True, True, False)),
            ):
                try:
                    ms = triton.testing.do_bench(
                        lambda needs=needs, rows=rows: fused.fused_tile_grads(
                            x, w, None, t, rows, coef, opts, needs
                        ),
                        warmup=10,
                        rep=60,
                        return_mode="median",
                    )
                    gemms = 1 + needs[0] + needs[1]
                    print(
                        f"{str(change):36s} {name:22s} {ms:7.2f} ms  {gemms * unit / ms:5.0f} TFLOP/s "
                        f"({gemms} N H V GEMMs)",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001
                    print(f"{change} {name}: {type(e).__name__} {str(e)[:150]}", flush=True)
    fused.GPU_CONFIG.clear()
    fused.GPU_CONFIG.update(base)


if __name__ == "__main__":
    main()
