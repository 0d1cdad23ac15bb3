"""Which fuselm.hf component breaks gradients of a compiled patched model on the GPU (diagnostic).

Prints, per torch.compile backend and per set of patch flags, the parameters whose gradient differs
from HF eager's by more than 1e-3 (relative), with the ratio of the gradients' norms."""

import sys

import torch
from kit.hf_models import build, clone

import fuselm.hf
from fuselm.ops._common.testing import rel_err

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
hf = build("llama", device=device)
print("tied:", hf.lm_head.weight is hf.model.embed_tokens.weight, flush=True)
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, hf.config.vocab_size - 5, (2, 12), generator=g).to(device)


def grads(m):
    m.train()
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in m.named_parameters()}


want_loss, want = grads(hf)
LOSS_ONLY = {"rope": False, "swiglu": False, "rms_norm": False}
FLAG_SETS = ({}, {"rope": False}, {"swiglu": False}, {"rms_norm": False}, {"linear_cross_entropy": False}, LOSS_ONLY)
for backend in ("eager", "aot_eager"):
    for flags in FLAG_SETS:
        torch._dynamo.reset()
        model = torch.compile(fuselm.hf.patch(clone(hf), **flags), backend=backend)
        loss, got = grads(model)
        bad = []
        for n in want:
            if got[n] is None:
                bad.append((n, "None"))
            elif rel_err(got[n], want[n]) > 1e-3:
                bad.append((n, f"err {rel_err(got[n], want[n]):.3g} norm ratio {got[n].norm() / want[n].norm():.3g}"))
        print(f"{backend} {flags}: loss err {rel_err(loss, want_loss):.2g}; {len(bad)}/{len(want)} bad", flush=True)
        for n, what in bad[:8]:
            print("   ", n, what, flush=True)
        fuselm.hf.unpatch("llama")
