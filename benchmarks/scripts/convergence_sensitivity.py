"""How far patched and unpatched training drift from a float64 run, per family, mode and seed.

Prints err(patched) and err(unpatched) (relative norm vs float64) of the per-step losses, the worst
parameter and the top-5 log-probs after 20 AdamW steps, for pure bf16 weights, fp32 weights under bf16
autocast, and fp32. Used to choose the GPU convergence test's setup (tests/hf/test_convergence.py).
Run on a GPU from the repo root: PYTHONPATH=src:tests:tests/hf python benchmarks/scripts/convergence_sensitivity.py
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import torch
from kit.hf_models import MODEL_TYPES, build, clone
from test_convergence import _batches

import fuselm.hf
from fuselm.ops._common.testing import rel_err


def train(model, batches, autocast):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids, labels in batches[:-1]:
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext():
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().double().cpu())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext():
        lp = model(input_ids=batches[-1][0]).logits.double().log_softmax(-1).cpu()
    return torch.stack(losses), lp, dict(model.named_parameters())


LR = float(os.environ.get("LR", "1e-3"))
modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["bf16", "autocast", "fp32"]
families = sys.argv[2].split(",") if len(sys.argv) > 2 else list(MODEL_TYPES)
seeds = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0]
for mode in modes:
    for mt in families:
        for seed in seeds:
            dtype = torch.bfloat16 if mode == "bf16" else torch.float32
            eager = build(mt, dtype, "cuda", seed=seed, hidden=1024, layers=4, vocab=32000, heads=8)
            ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager))
            batches = _batches(32000, 4, 256, 20, "cuda", seed=7 + seed)
            r, e, o = (train(m, batches, mode == "autocast" and m is not ref) for m in (ref, eager, ours))
            top = r[1].topk(5, dim=-1).indices
            lp = [x[1].gather(-1, top) for x in (r, e, o)]
            worst = max(r[2], key=lambda n: rel_err(o[2][n], r[2][n]) / (rel_err(e[2][n], r[2][n]) + 1e-12))
            print(
                f"{mode:8s} {mt:8s} seed {seed}: loss {rel_err(o[0], r[0]):.2e}/{rel_err(e[0], r[0]):.2e}  "
                f"top5 {rel_err(lp[2], lp[0]):.2e}/{rel_err(lp[1], lp[0]):.2e}  worst param {worst} "
                f"{rel_err(o[2][worst], r[2][worst]):.2e}/{rel_err(e[2][worst], r[2][worst]):.2e}",
                flush=True,
            )
            fuselm.hf.unpatch(ours)
