"""Does the fused residual add of fuselm's patched decoder layers run? A tiny Llama from tests/hf/hf_models.py,
patched: calls of fuselm.hf.decoder_layer.residual_rms_norm in one eager step and one torch.compile
(fullgraph) forward (CUDA and CPU), and on CUDA the rms_norm ops of the compiled graph that take a residual
(2 expected: one per layer). Usage (GPU): PYTHONPATH=src python benchmarks/scripts/diag_fused_residual.py
"""

import sys

import torch

sys.path[:0] = ["tests", "tests/hf"]
from hf_models import build

import fuselm.hf
from fuselm.hf import decoder_layer as layers

calls = []
fn = layers.residual_rms_norm


def spy(*a, **k):
    calls.append(1)
    return fn(*a, **k)


layers.residual_rms_norm = spy
import torch.nn.modules.module as mm

print("global hooks", [len(getattr(mm, n)) for n in layers._GLOBAL_HOOKS])
for dev, dt in [
    d
    for d in (("cuda", torch.bfloat16), ("cpu", torch.float32))
    if d[0] == "cpu" or torch.cuda.is_available()
]:
    m = build("llama", dt, dev)
    fuselm.hf.patch(m, fused_residual=True)
    ids = torch.randint(3, 100, (2, 12), device=dev)
    calls.clear()
    m(input_ids=ids, labels=ids).loss.backward()
    print(dev, "eager", len(calls))
    torch._dynamo.reset()
    c = torch.compile(m.model, backend="eager", fullgraph=True)
    calls.clear()
    with torch.no_grad():
        c(input_ids=ids)
    print(dev, "compile", len(calls))
if torch.cuda.is_available():  # which rms_norm ops the compiled graph holds (with a residual: fused)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = build("llama", torch.bfloat16, "cuda")
    fuselm.hf.patch(m, fused_residual=True)
    torch._dynamo.reset()
    c = torch.compile(m.model, backend=backend, fullgraph=True)
    with torch.no_grad():
        c(input_ids=torch.randint(3, 100, (2, 12), device="cuda"))
    nodes = [n for g in graphs for n in g.graph.nodes if "rms_norm" in str(n.target)]
    print("graph rms_norm nodes", len(nodes), "with a residual", sum(n.args[1] is not None for n in nodes))
    print("graph", [str(n.target) for n in nodes][:3])
