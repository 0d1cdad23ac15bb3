"""Is a LoRA projection cheaper as ONE GEMM over a K widened by the rank (lab script, not the library)?

    y = x W^T + s (x A^T) B^T = [x | x A^T] [W | s B]^T

The fused path today writes y = s low B^T (a rank-r GEMM, y written) and lets the base GEMM add itself
(``y.addmm_``: y read in its epilogue). The wide form writes y once from one GEMM over K + r, for the
copies that put x and W beside the rank-r operands (none for W where a 4-bit weight is dequantized
straight into the wide buffer). Gate and up of a gated MLP share x: one [N, K + rg + ru] operand.

    PYTHONPATH=src python benchmarks/scripts/lora_wide_k_probe.py --json /tmp/wide.json
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"llama3.2-1b": (8192, 2048, 8192), "llama3-8b": (8192, 4096, 14336)}  # tokens, H, I


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def probe(n: int, k: int, i: int, r: int = 16, s: float = 2.0) -> dict:
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(n, k, device=dev, dtype=dt)
    w = [torch.randn(i, k, device=dev, dtype=dt) / k**0.5 for _ in range(2)]
    a = [torch.randn(r, k, device=dev, dtype=dt) / k**0.5 for _ in range(2)]
    b = [torch.randn(i, r, device=dev, dtype=dt) for _ in range(2)]
    a_cat = torch.cat(a)
    zero = torch.zeros((), device=dev, dtype=dt)

    def current():
        low = x @ a_cat.t()
        out = []
        for j in range(2):
            y = torch.addmm(zero, low[:, j * r : (j + 1) * r], b[j].t(), beta=0, alpha=s)
            out.append(y.addmm_(x, w[j].t()))
        return out

    wide_w = []
    for j in range(2):
        ww = torch.zeros(i, k + 2 * r, device=dev, dtype=dt)
        ww[:, :k] = w[j]
        wide_w.append(ww)

    def wide(copy_w: bool):
        xw = torch.empty(n, k + 2 * r, device=dev, dtype=dt)
        xw[:, :k].copy_(x)
        xw[:, k:].copy_(x @ a_cat.t())
        out = []
        for j in range(2):
            ww = wide_w[j]
            if copy_w:
                ww[:, :k].copy_(w[j])
            ww[:, k + j * r : k + (j + 1) * r].copy_(b[j]).mul_(s)
            out.append(xw @ ww.t())
        return out

    stacked_w = torch.cat(wide_w)  # [2I, K + 2r]: gate's rows, then up's

    def wide_stacked(copy_w: bool):
        xw = torch.empty(n, k + 2 * r, device=dev, dtype=dt)
        xw[:, :k].copy_(x)
        xw[:, k:].copy_(x @ a_cat.t())
        for j in range(2):
            rows = stacked_w[j * i : (j + 1) * i]
            if copy_w:
                rows[:, :k].copy_(w[j])
            rows[:, k + j * r : k + (j + 1) * r].copy_(b[j]).mul_(s)
        gu = xw @ stacked_w.t()
        return [gu[:, :i], gu[:, i:]]

    def plain():
        return [x @ w[j].t() for j in range(2)]

    ref = current()
    err = max(
        float((g.float() - e.float()).abs().max() / e.float().abs().max())
        for got in (wide(True), wide_stacked(True))
        for g, e in zip(got, ref, strict=True)
    )
    return {
        "shape": [n, k, i, r],
        "current_ms": timed(current),
        "wide_copy_w_ms": timed(lambda: wide(True)),
        "wide_no_w_copy_ms": timed(lambda: wide(False)),
        "stacked_copy_w_ms": timed(lambda: wide_stacked(True)),
        "stacked_no_w_copy_ms": timed(lambda: wide_stacked(False)),
        "plain_ms": timed(plain),
        "rel_err": err,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    rows = [dict(model=m, **probe(*shape)) for m, shape in SHAPES.items()]
    for row in rows:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
