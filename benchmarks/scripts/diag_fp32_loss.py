"""Diagnosis: per-step training losses of HF fp64 / fp32 eager / fp32 fuselm-patched on the GPU, and the
loss of one batch with and without grad mode. Run: PYTHONPATH=src python benchmarks/scripts/diag_fp32_loss.py"""

import sys

import torch

sys.path[:0] = ["tests", "tests/hf"]
from kit.hf_models import build, clone  # noqa: E402
from test_convergence import _batches  # noqa: E402

import fuselm.hf  # noqa: E402

model_type = sys.argv[1] if len(sys.argv) > 1 else "llama"
eager = build(model_type, torch.float32, "cuda", hidden=1024, layers=4, vocab=32000, heads=8)
ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager))
batches = _batches(32000, 4, 256, 6, "cuda")
ids, labels = batches[0]
for grad in (False, True):
    with torch.set_grad_enabled(grad):
        print("grad", grad, [m(input_ids=ids, labels=labels).loss.item() for m in (ref, eager, ours)])
opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (ref, eager, ours)]
for step, (ids, labels) in enumerate(batches[:-1]):
    row = []
    for m, opt in zip((ref, eager, ours), opts):
        out = m(input_ids=ids, labels=labels)
        before = out.loss.item()
        out.loss.backward()
        after = out.loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        row.append((before, after, out.loss.item()))
    print(step, row)
