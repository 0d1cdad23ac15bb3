"""A patched model under torch.compile (README: "Making a patched step cheaper on the host"): the
compiled forward and backward of a tiny Llama patched by fuselm.hf.patch give HF's loss and gradients
(the numerics rule against a float64 reference). On the GPU (and under TRITON_INTERPRET=1) fuselm's ops
run inside the graph as their torch.library custom ops; on the CPU reference path the graph traces the
PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from kit.hf_models import build, clone

import fuselm
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


def _sdpa(model):
    """The model on SDPA attention, as from_pretrained gives it: a CUDA graph can capture its causal mask
    (None without padding), not the eager attention's, which copies a host scalar to the GPU."""
    model.config._attn_implementation = "sdpa"
    return model


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


@pytest.mark.gpu
def test_reduce_overhead_compile_of_a_patched_model():
    """torch.compile(mode="reduce-overhead") (CUDA graphs by the compiler) of a patched model: HF's loss
    and gradients, over three steps of new data (the graphs are recorded, then replayed)."""
    torch._dynamo.reset()
    hf = _sdpa(build("llama", device=DEVICE))
    ref = clone(hf, torch.float64)
    compiled = torch.compile(fuselm.hf.patch(clone(hf)), mode="reduce-overhead")
    for seed in (1, 2, 3):
        ids, labels = _batch(hf.config.vocab_size, seed=seed)
        loss, grads = _loss_and_grads(compiled, ids, labels)
        loss, grads = loss.clone(), [g.clone() for g in grads]  # the graph's outputs are reused
        loss_hf, grads_hf = _loss_and_grads(hf, ids, labels)
        loss_ref, grads_ref = _loss_and_grads(ref, ids, labels)
        assert_numerics("loss", loss, loss_hf, loss_ref, torch.float32)
        for g, g_hf, g_ref in zip(grads, grads_hf, grads_ref, strict=True):
            assert_numerics("grad", g, g_hf, g_ref, torch.float32)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_patched_step():
    """The README's recipe: a patched model's forward and backward captured in a CUDA graph by
    fuselm.CapturedStep and replayed on new batches: HF's loss and gradients."""
    hf = _sdpa(build("llama", device=DEVICE))  # eager attention builds its mask from a host scalar
    ref = clone(hf, torch.float64)
    model = fuselm.hf.patch(clone(hf))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    step = fuselm.CapturedStep(
        lambda ids, labels: model(input_ids=ids, labels=labels).loss,
        params,
        list(_batch(hf.config.vocab_size, seed=1)),
    )
    for seed in (2, 3):
        ids, labels = _batch(hf.config.vocab_size, seed=seed)
        model.zero_grad(set_to_none=True)  # the step adds into .grad, as backward() does
        loss = step(ids, labels)
        loss_hf, grads_hf = _loss_and_grads(hf, ids, labels)
        loss_ref, grads_ref = _loss_and_grads(ref, ids, labels)
        assert_numerics("loss", loss, loss_hf, loss_ref, torch.float32)
        for p, g_hf, g_ref in zip(params, grads_hf, grads_ref, strict=True):
            assert_numerics("grad", p.grad, g_hf, g_ref, torch.float32)
