"""Which fuselm.hf component breaks gradients under torch.compile(aot_eager) on the GPU (diagnostic)."""
import sys

import torch

sys.path[:0] = ["tests/hf", "tests"]
from hf_models import build, clone  # noqa: E402

import fuselm.hf  # noqa: E402
from fuselm.ops._common.testing import rel_err  # noqa: E402

hf = build("llama", device="cuda")
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, hf.config.vocab_size - 5, (2, 12), generator=g).cuda()


def grads(m):
    m.train()
    m.zero_grad(set_to_none=True)
    m(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in m.named_parameters()}


want = grads(hf)
for flags in ({}, {"rope": False}, {"swiglu": False}, {"rope": False, "swiglu": False}):
    torch._dynamo.reset()
    model = torch.compile(fuselm.hf.patch(clone(hf), **flags), backend="aot_eager")
    got = grads(model)
    bad = {n: round(rel_err(got[n], want[n]), 4) for n in want if rel_err(got[n], want[n]) > 1e-3}
    print(flags, "bad:", list(bad.items())[:6], flush=True)
    fuselm.hf.unpatch("llama")
