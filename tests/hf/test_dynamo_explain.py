"""torch._dynamo.explain of a patched model exits cleanly (no "Exception ignored in ExactWeakKeyDictionary"
tracebacks at interpreter exit, which the CPU path once printed). The tracebacks come
at exit, so the run is a fresh Python process whose stderr is checked as a whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

TESTS = Path(__file__).resolve().parents[1]  # the kit's root (a fresh process has no pytest pythonpath)

# eval without labels (logits), and training with labels (the fused loss), as a user would explain them
SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from kit import hf_models
import fuselm.hf

model = hf_models.build("llama")
fuselm.hf.patch(model{patch})
ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(0))
model.{mode}()
kwargs = dict(input_ids=ids{labels})
explained = torch._dynamo.explain(model)(**kwargs)
print("graphs", explained.graph_count)
out = model(**kwargs)
if out.loss is not None:
    out.loss.backward()
"""


@pytest.mark.parametrize("mode", ["eval", "train", "train_offload"])
def test_explain_of_a_patched_model_exits_cleanly(mode):
    """train_offload: with checkpointing="offload" the offloaded checkpoint runs eagerly under dynamo (it
    used to be traced into weakref.finalize and fail a guard on its own frame)."""
    patch = ', checkpointing="offload"' if mode.endswith("offload") else ""
    mode, labels = mode.split("_")[0], ", labels=ids" if mode.startswith("train") else ""
    code = SCRIPT.format(tests=str(TESTS), mode=mode, labels=labels, patch=patch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU path of the report
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    graphs = [line for line in proc.stdout.splitlines() if line.startswith("graphs ")]
    assert graphs and int(graphs[0].split()[1]) >= 1, proc.stdout  # explain did trace the model
    assert "Exception ignored" not in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
