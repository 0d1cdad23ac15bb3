"""fuselm.hf.attention: the training forward's attention. A causal call without a mask runs SDPA's kernel
through KeptAttention (HF's SDPA function for anything else); an offloaded layer keeps the attention's
output and statistics for its recompute, which then runs no attention forward. Inside a CUDA graph capture
a call with token ids and labels only runs without a mask in a model whose layers are all plainly causal
(the capture is simulated on CPU: attention.capturing patched)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from kit.hf_models import FAMILY_CLASSES, build, tiny_config

import fuselm.hf
from fuselm import offload
from fuselm.hf import _common, attention
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")

# the text families whose attention HF runs with SDPA (soft-capped attention logits need eager)
TEXT_TYPES = tuple(t for t in FAMILY_CLASSES if not getattr(tiny_config(t), "attn_logit_softcapping", None))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _seen(model, monkeypatch):
    """(implementation, path) of each attention call the model makes: path "kept" (KeptAttention) or
    "sdpa" (HF's SDPA function)."""
    seen = []
    sdpa = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
    apply = attention.KeptAttention.apply

    def spy_sdpa(*args, **kwargs):
        seen.append((model.config._attn_implementation, "sdpa"))
        return sdpa(*args, **kwargs)

    def spy_kept(*args):
        seen.append((model.config._attn_implementation, "kept"))
        return apply(*args)

    monkeypatch.setitem(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy_sdpa)
    monkeypatch.setattr(attention.KeptAttention, "apply", spy_kept)
    return seen


@pytest.mark.parametrize("model_type", TEXT_TYPES)
def test_training_attention_runs_kept_attention_and_captures_causal(model_type, monkeypatch):
    """Every family: the patched training step runs under KEEPING_SDPA (HF + PEFT's loss and gradients
    through it: tests/hf/test_patch.py and the others); a simulated capture gives the eager step's loss
    and gradients bit for bit, under CAUSAL_SDPA (attention through KeptAttention) exactly when the call
    is plainly causal."""
    model = build(model_type)
    model.config._attn_implementation = "sdpa"
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size - 5, (2, 16), generator=gen)
    fuselm.hf.patch(model)
    try:
        seen = _seen(model, monkeypatch)
        eager_loss, eager_grads = _loss_and_grads(model, ids)
        assert seen and {name for name, _ in seen} == {attention.KEEPING_SDPA}
        plain = attention.plainly_causal(model.config, {"input_ids": ids, "labels": ids})
        monkeypatch.setattr(attention, "capturing", lambda device=None: True)
        seen.clear()
        loss, grads = _loss_and_grads(model, ids)
        assert model.config._attn_implementation == attention.KEEPING_SDPA  # after the call: for recomputes
        assert torch.equal(loss, eager_loss)
        assert grads.keys() == eager_grads.keys()
        assert all(torch.equal(grads[n], eager_grads[n]) for n in grads)
        assert {name for name, _ in seen} == {attention.CAUSAL_SDPA if plain else attention.KEEPING_SDPA}
        if plain:
            assert {path for _, path in seen} == {"kept"}
    finally:
        fuselm.hf.unpatch(model)
    assert model.config._attn_implementation == "sdpa"  # unpatch gives SDPA back


@pytest.mark.parametrize("checkpointing", ["hf", "offload"])
def test_a_checkpointed_layers_recompute_runs_the_attention_its_forward_ran(checkpointing, monkeypatch):
    """The training attention stays the model's after the forward: the recompute of a layer (HF's
    checkpoint, which compares the tensors both save, or fuselm's offloading) in the backward runs it
    too. GQA Llama in fp32: loss and gradients against HF's checkpointed model (SDPA) under the numerics
    rule, float64 the reference. The backend's check runs inside the first checkpointed forward (it
    saves no tensor there)."""
    monkeypatch.setattr(attention, "_CHECKED", {})
    base = build("llama")
    base.config._attn_implementation = "sdpa"
    ids = torch.randint(3, base.config.vocab_size - 5, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for dtype, ours in ((torch.float64, False), (torch.float32, False), (torch.float32, True)):
        model = copy.deepcopy(base).to(dtype).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if ours:
            fuselm.hf.patch(model, checkpointing="offload" if checkpointing == "offload" else None)
        results.append(_loss_and_grads(model, ids))
    assert model.config._attn_implementation == attention.KEEPING_SDPA
    (ref, ref_grads), (hf, hf_grads), (got, grads) = results
    assert_numerics("loss", got, hf, ref, torch.float32)
    assert grads.keys() == hf_grads.keys()
    for name in grads:
        assert_numerics(name, grads[name], hf_grads[name], ref_grads[name], torch.float32)


def test_plainly_causal_needs_sdpa_full_layers_and_plain_arguments():
    config = transformers.LlamaConfig(num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert attention.plainly_causal(config, {"input_ids": ids, "labels": ids, "attention_mask": None})
    assert attention.plainly_causal(config, {"input_ids": ids, "kwargs": {"num_items_in_batch": 3}})
    assert not attention.plainly_causal(config, {"input_ids": ids, "attention_mask": torch.ones(1, 4)})
    assert not attention.plainly_causal(config, {"input_ids": ids, "position_ids": torch.arange(4)[None]})
    assert not attention.plainly_causal(config, {"input_ids": ids, "kwargs": {"cu_seq_lens_q": ids}})
    config._attn_implementation = "eager"
    assert not attention.plainly_causal(config, {"input_ids": ids})
    mistral = transformers.MistralConfig(num_hidden_layers=2, sliding_window=8)
    mistral._attn_implementation = "sdpa"
    assert not attention.plainly_causal(mistral, {"input_ids": ids})


def test_training_attention_switches_sdpa_models_only_until_restored():
    config = transformers.LlamaConfig(num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    with attention.training_attention(config, {"input_ids": torch.zeros(1, 4)}):
        assert config._attn_implementation == attention.KEEPING_SDPA
    assert config._attn_implementation == attention.KEEPING_SDPA
    attention.restore(config)
    assert config._attn_implementation == "sdpa"
    config._attn_implementation = "eager"
    with attention.training_attention(config, {"input_ids": torch.zeros(1, 4)}):
        assert config._attn_implementation == "eager"


def _qkv(gen, dtype, device, heads=4, kv_heads=2, t=129, d=64):
    q = torch.randn(2, heads, t, d, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    k = torch.randn(2, kv_heads, t, d, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    v = torch.randn(2, kv_heads, t, d, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    return q, k, v


def _sdpa(q, k, v, scale):
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_causal_attention_is_sdpas_under_the_numerics_rule(kv_heads, device):
    """Output and q / k / v gradients against SDPA in the same dtype and float64 (bf16 on a GPU: cuDNN's
    kernel; fp32 on the CPU: its flash kernel)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, dtype, device, kv_heads=kv_heads)
    module = torch.nn.Module()
    assert attention._backend(q, k, 0.25) == ("cudnn" if device == "cuda" else "cpu")
    out, none = attention.sdpa_attention(module, q, k, v, None, scaling=0.25)
    assert none is None and out.shape == (2, 129, 4, 64) and out.is_contiguous()
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device, dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    eager = _sdpa(q, k, v, 0.25)
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _sdpa(q64, k64, v64, 0.25)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert_numerics("out", out, eager, ref, dtype)
    for name, g, e, r in zip("qkv", grads, eager_grads, ref_grads, strict=True):
        assert_numerics(f"d{name}", g, e, r, dtype)


@pytest.mark.parametrize(
    "call",
    [
        {"attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)},
        {"dropout": 0.1},
        {"position_bias": torch.zeros(1, 4, 8, 8)},
        {"softcap": 30.0},
        {"output_attentions": True},
        {"is_causal": False},
        {"kv_length": 12},
        {"compiling": True},
    ],
    ids=lambda c: next(iter(c)),
)
def test_anything_beyond_causal_attention_goes_to_hfs_sdpa(call, monkeypatch):
    call = dict(call)
    kv = call.pop("kv_length", 8)
    if call.pop("compiling", False):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, kv, 16)
    calls = []
    monkeypatch.setitem(
        transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping,
        "sdpa",
        lambda *args, **kwargs: calls.append(kwargs) or ("hf", None),
    )
    mask = call.pop("attention_mask", None)
    assert attention.sdpa_attention(torch.nn.Module(), q, k, k, mask, **call) == ("hf", None)
    assert len(calls) == 1


def test_an_offloaded_recompute_takes_the_kept_output_instead_of_running_attention(monkeypatch, device):
    """In an offloaded call the attention keeps its output and statistics; the recompute runs no attention
    forward, and the gradients are those of the call whose recompute computed them again, under the
    numerics rule (float64 the reference); with nothing kept (kept_per_input=0) the recompute runs it.
    (GPU: bf16, cuDNN's kernels.)"""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    forwards = []
    real = attention._forward

    def counted(backend, q, *args, **kwargs):
        if q.shape[2] == 129:  # this test's calls (not the backend's one-time check of its ops)
            forwards.append(1)
        return real(backend, q, *args, **kwargs)

    monkeypatch.setattr(attention, "_forward", counted)
    module = torch.nn.Module()
    base = torch.nn.Linear(16, 256)
    x = torch.randn(2, 129, 16, generator=torch.Generator().manual_seed(1))

    def layer(proj, x):
        q = proj(x).view(2, 129, 4, 64).transpose(1, 2)
        out, _ = attention.sdpa_attention(module, q, q[:, :2], q[:, :2], None, scaling=0.5)
        return out.sum(-1).sum(-1)

    def grads(dtype, device, kept=None):
        proj = copy.deepcopy(base).to(device, dtype)
        xg = x.to(device, dtype).requires_grad_()
        y = (
            layer(proj, xg)
            if kept is None
            else offload.offloaded_checkpoint(layer, proj, xg, kept_per_input=kept)
        )
        y.backward(torch.ones_like(y))
        return xg.grad, proj.weight.grad

    offload.set_kept_output_room(None)
    ref = grads(torch.float64, "cpu")
    results = {}
    for kept in (0.0, 32.0):
        forwards.clear()
        results[kept] = (grads(dtype, device, kept), len(forwards))
    assert results[0.0][1] == 2 and results[32.0][1] == 1
    for name, got, eager, r in zip(("dx", "dW"), results[32.0][0], results[0.0][0], ref, strict=True):
        assert_numerics(name, got, eager, r, dtype)


def test_ops_that_fail_their_check_leave_the_attention_hfs_said_once(monkeypatch):
    """The backend's ops are checked against attention written out, once per device and dtype, eagerly:
    ops that raise, or give other values, make the attention HF's SDPA after one warning; working ops
    pass; no check runs while a CUDA graph is captured."""
    q = torch.randn(1, 4, 8, 16)
    backward = attention._backward

    def raising(*args):
        raise RuntimeError("no such kernel")

    def swapping(*args):
        dq, dk, dv = backward(*args)
        return dq, dv, dk

    for ops, why in ((backward, None), (raising, "no such kernel"), (swapping, "its dk, dv differ")):
        monkeypatch.setattr(attention, "_CHECKED", {})
        monkeypatch.setattr(_common, "_warned", set())
        monkeypatch.setattr(attention, "_backward", ops)
        if why is None:
            assert attention._backend(q, q[:, :2], 0.25) == "cpu"
            continue
        with pytest.warns(UserWarning, match=rf"cpu SDPA ops failed their check .*{why}.*runs HF's SDPA"):
            assert attention._backend(q, q[:, :2], 0.25) is None
        assert attention._backend(q, q[:, :2], 0.25) is None  # checked once (no second warning)
    monkeypatch.setattr(attention, "_CHECKED", {})
    monkeypatch.setattr(attention, "capturing", lambda device=None: True)
    assert attention._backend(q, q[:, :2], 0.25) is None
    assert not attention._CHECKED
