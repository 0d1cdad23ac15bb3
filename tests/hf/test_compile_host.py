"""A patched model under torch.compile (README: "Making a patched step cheaper on the host"): the
compiled forward and backward of a tiny Llama patched by fuselm.hf.patch give HF's loss and gradients
(the numerics rule against a float64 reference). On the GPU (and under TRITON_INTERPRET=1) fuselm's ops
run inside the graph as their torch.library custom ops; on the CPU reference path the graph traces the
PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from hf_models import build, clone

import fuselm.hf
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(vocab: int, b=2, t=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 5, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def _loss_and_grads(model, ids, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_compiled_patched_model_gives_hfs_loss_and_gradients(backend):
    """torch.compile(patched model): forward + backward twice (the second call reuses the graph on new
    data), loss and every parameter's gradient within the numerics rule of HF eager."""
    torch._dynamo.reset()
    hf = build("llama", device=DEVICE)
    ref = clone(hf, torch.float64)
    patched = fuselm.hf.patch(clone(hf))
    compiled = torch.compile(patched, backend=backend)
    for seed in (1, 2):
        ids, labels = _batch(hf.config.vocab_size, seed=seed)
        loss, grads = _loss_and_grads(compiled, ids, labels)
        loss_hf, grads_hf = _loss_and_grads(hf, ids, labels)
        loss_ref, grads_ref = _loss_and_grads(ref, ids, labels)
        assert_numerics("loss", loss, loss_hf, loss_ref, torch.float32)
        names = [n for n, _ in patched.named_parameters()]
        for name, g, g_hf, g_ref in zip(names, grads, grads_hf, grads_ref, strict=True):
            assert_numerics(f"grad {name}", g, g_hf, g_ref, torch.float32)
    torch._dynamo.reset()
