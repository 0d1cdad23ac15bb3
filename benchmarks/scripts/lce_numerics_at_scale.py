"""Numerics of fused linear cross-entropy at real shapes, against a float64 reference (GPU).

    PYTHONPATH=src:benchmarks python benchmarks/scripts/lce_numerics_at_scale.py [N H V inputs k ...]

For each shape (default: Llama-3-8B's head, random and peaked inputs, 1/7 ignored) prints the relative
norm error (docs/design.md s. 5) of the loss, dX and dW of every provider against fuselm's float64 chunked
reference, and the numerics-rule bound 2 * err(eager bf16) + atol. Providers: eager bf16 (the rule's
baseline), eager with fp32 upcast, fuselm at several byte budgets (auto = 256 MiB, ..., min = 8 MiB:
the number of dW roundings is the number of chunks), Liger and Cut Cross-Entropy when importable.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import fuselm
from fuselm_bench import linear_cross_entropy as suite
from fuselm_bench.harness import SkipProvider
from fuselm.ops._common.testing import ATOL
from fuselm.ops.linear_cross_entropy import linear_cross_entropy_reference
from fuselm.ops.linear_cross_entropy.chunked import chunk_rows_for

DEVICE = torch.device(os.environ.get("DEVICE", "cuda"))  # DEVICE=cpu for a smoke run at tiny shapes


def rel(a: torch.Tensor, r: torch.Tensor) -> float:
    """||a - r|| / ||r|| in float64 on the device (testing.rel_err without the host copy)."""
    return float((a.double() - r).norm() / r.norm())


def providers(h: int, v: int):
    out = {
        "eager_bf16": lambda x, w, t: F.cross_entropy(x @ w.T, t, ignore_index=-100),
        "eager_fp32_upcast": lambda x, w, t: F.cross_entropy((x @ w.T).float(), t, ignore_index=-100),
    }
    for mib in (256, 64, 32, 8):
        chunks = chunk_rows_for(mib * 2**20, v, h, 2)
        out[f"fuselm_{mib}MiB(C={chunks})"] = lambda x, w, t, m=mib: fuselm.linear_cross_entropy(
            x, w, t, memory=m * 2**20
        )
    out["fuselm_min"] = lambda x, w, t: fuselm.linear_cross_entropy(x, w, t, memory="min")
    for name, setup in (("liger", suite.setup_liger), ("cce", suite.setup_cce)):
        try:
            run = setup(DEVICE)
        except SkipProvider as e:
            print(f"# {name} skipped: {e}")
            continue
        out[name] = lambda x, w, t, run=run: run({"input": x, "linear_weight": w, "target": t})
    return out


def grads(fn, x, w, t):
    xs = x.detach().clone().requires_grad_()
    ws = w.detach().clone().requires_grad_()
    loss = fn(xs, ws, t)
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    return loss.detach(), dx, dw


def main(shapes):
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}")
    for shape in shapes:
        n, h, v, inputs, k = suite.split_shape(shape)
        data = suite.make_inputs(shape, torch.bfloat16, DEVICE)
        x, w, t = data["input"].detach(), data["linear_weight"].detach(), data["target"]
        ref = grads(
            lambda a, b, c: linear_cross_entropy_reference(a, b, c, chunk_rows=256), x.double(), w.double(), t
        )
        print(f"\n## {suite.describe(shape)}  (mean target prob {suite.mean_target_prob(x, w, t):.3f})")
        print("| provider | loss err | dX err | dW err | pass |")
        print("|---|---|---|---|---|")
        bound = None
        for name, fn in providers(h, v).items():
            errs = [rel(a, r) for a, r in zip(grads(fn, x, w, t), ref, strict=True)]
            if name == "eager_bf16":
                bound = [2 * e + ATOL[torch.bfloat16] for e in errs]
                print(f"| rule bound | {bound[0]:.2e} | {bound[1]:.2e} | {bound[2]:.2e} | |")
            ok = all(e <= b for e, b in zip(errs, bound, strict=True))
            print(f"| {name} | {errs[0]:.2e} | {errs[1]:.2e} | {errs[2]:.2e} | {'yes' if ok else 'NO'} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    if args:
        main([tuple(args[i : i + 5]) for i in range(0, len(args), 5)])
    else:
        main([(8192, 4096, 128256, 1, 7), (8192, 4096, 128256, 2, 7), (8192, 2304, 256000, 1, 7)])
