"""Diagnosis: is the fp32 per-row loss of the cross-entropy kernel stable when it writes the gradient
(in place over the logits, or into a separate buffer)? Run: PYTHONPATH=src python this_file.py"""

import torch

from fuselm.ops._common.loss.options import LossOptions, LossScales
from fuselm.ops._common.loss.rows import rows_fwd_into

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for v in (4000, 32000, 128256):
        n = 1024
        logits0 = (torch.randn(n, v, device="cuda") * 2).to(dtype)
        t = torch.randint(0, v, (n,), device="cuda")
        ref = torch.nn.functional.cross_entropy(logits0.double(), t, reduction="none")
        gs = torch.tensor([1.0 / n], device="cuda")
        res = {}
        for mode in ("nograd", "separate", "inplace", "inplace2"):
            logits = logits0.clone()
            grad = None if mode == "nograd" else (torch.empty_like(logits) if mode == "separate" else logits)
            loss, lse = rows_fwd_into(logits, t, LossOptions(), LossScales(None, gs), grad)
            res[mode] = ((loss.double() - ref).abs().max().item(), (loss.double() - ref).norm().item() / ref.norm().item())
        print(dtype, v, {k: f"max {a:.2e} rel {b:.2e}" for k, (a, b) in res.items()}, flush=True)

# the same question one level up: fuselm.linear_cross_entropy (chunked plan), fp32, with/without grad
from fuselm.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402

for dtype in (torch.float32, torch.bfloat16):
    n, h, v = 1024, 1024, 32000
    x0 = torch.randn(n, h, device="cuda").to(dtype)
    w0 = (torch.randn(v, h, device="cuda") * 0.05).to(dtype)
    for ignore in (False, True):
        t = torch.randint(0, v, (n,), device="cuda")
        if ignore:
            t[: n // 3] = -100
        ref = torch.nn.functional.cross_entropy(x0.double() @ w0.double().T, t).item()
        out = []
        for grad in (False, True, True, False):
            x, w = x0.clone().requires_grad_(grad), w0.clone().requires_grad_(grad)
            out.append(f"{(linear_cross_entropy(x, w, t, loss_dtype=torch.float32).item() - ref) / ref:+.2e}")
        print("lce", dtype, "ignore" if ignore else "all rows", "rel err nograd/grad/grad/nograd:", out, flush=True)
