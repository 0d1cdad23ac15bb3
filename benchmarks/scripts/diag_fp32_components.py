import sys, torch
sys.path[:0] = ["tests", "tests/hf"]
from kit.hf_models import build, clone
from test_convergence import _batches
import fuselm.hf
from fuselm.ops.linear_cross_entropy import linear_cross_entropy
eager = build("llama", torch.float32, "cuda", hidden=1024, layers=4, vocab=32000, heads=8)
ids, labels = _batches(32000, 4, 256, 1, "cuda")[0]
print("eager", eager(input_ids=ids, labels=labels).loss.item())
for c in ["rms_norm", "rope", "swiglu", "linear_cross_entropy"]:
    flags = {k: k == c for k in ["rms_norm", "rope", "swiglu", "linear_cross_entropy"]}
    m = fuselm.hf.patch(clone(eager), **flags)
    print(c, [m(input_ids=ids, labels=labels).loss.item() for _ in range(2)])
    fuselm.hf.unpatch(m)
h = eager.model(input_ids=ids).last_hidden_state.detach()
t = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
w = eager.lm_head.weight
for req in [(False, False), (True, False), (False, True), (True, True)]:
    hh = h.reshape(-1, 1024).clone().requires_grad_(req[0]); ww = w.detach().clone().requires_grad_(req[1])
    for mem in ("auto", "min"):
        print(req, mem, linear_cross_entropy(hh, ww, t, memory=mem).item(), linear_cross_entropy(hh, ww, t, memory=mem, loss_dtype=torch.float32).item())
print("no-ignore", linear_cross_entropy(h.reshape(-1,1024), w, t.clamp(min=0)).item(), torch.nn.functional.cross_entropy(eager.lm_head(h).reshape(-1,32000), t.clamp(min=0)).item())
