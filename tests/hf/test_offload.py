"""Activation offloading in Hugging Face models (fuselm.hf.offload): enable / disable on tiny Llama and Qwen3
models against HF's own gradient checkpointing and no checkpointing (numerics rule, float64 reference),
PEFT LoRA with dropout, Trainer's gradient checkpointing flag, the enable / disable state; on a GPU, that
the layer inputs leave the device for pinned host memory between forward and backward. offloaded_checkpoint
itself is tested in tests/test_offloaded_checkpoint.py."""

from __future__ import annotations

import copy
import doctest
import functools
import gc
import inspect
import pickle
import weakref

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from kit.hf_models import build, clone

import fuselm.offload as offloading
from fuselm.hf import offload
from fuselm.offload import host_memory_stats, offloaded_checkpoint
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh():
    yield
    gc.collect()  # graphs of a failed test: their host buffers back to the pool


def _in_use() -> int:
    return host_memory_stats()["in_use_bytes"]


# ---- transformers models ----

B, T = 2, 12


def _batch(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 5, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _hf_checkpointing(model, **kwargs):
    """HF's gradient checkpointing on, under the name this transformers version has."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def _hf_checkpointing_off(model):
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()


def _step(model, ids, labels, seed=7):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _decoder_layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _offloaded(layer) -> bool:
    f = layer._gradient_checkpointing_func
    return isinstance(f, functools.partial) and f.func is offloaded_checkpoint


def _compare(losses, grads, dtype):
    """(reference, eager..., ours): ours against each eager under the rule."""
    ref, *eagers, ours = range(len(losses))
    for e in eagers:
        assert_numerics("loss", losses[ours], losses[e], losses[ref], dtype)
        assert grads[ours].keys() == grads[e].keys() and grads[e]
        for name in grads[e]:
            assert_numerics(f"grad {name}", grads[ours][name], grads[e][name], grads[ref][name], dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_matches_hf_checkpointing_and_none(model_type, dtype):
    """Loss and every gradient of offloaded checkpointing against HF's checkpointing and no checkpointing
    (float64 no-checkpointing reference); between forward and backward the host holds exactly the
    layers' inputs, layers x B x T x H elements."""
    base = build(model_type, layers=3)
    ref, none, hf, ours = (
        clone(base, torch.float64),
        clone(base, dtype),
        clone(base, dtype),
        clone(base, dtype),
    )
    _hf_checkpointing(hf, use_reentrant=False)
    assert offload.enable(ours) is ours
    assert offload.is_enabled(ours) and not offload.is_enabled(hf)
    assert all(_offloaded(layer) and layer.gradient_checkpointing for layer in _decoder_layers(ours))
    ids, labels = _batch(base.config.vocab_size)
    losses = [_step(m, ids, labels) for m in (ref, none, hf)]

    ours.train()
    ours.zero_grad(set_to_none=True)
    before = host_memory_stats()
    torch.manual_seed(7)
    loss = ours(input_ids=ids, labels=labels).loss
    hidden = base.config.hidden_size
    assert _in_use() - before["in_use_bytes"] == 3 * B * T * hidden * dtype.itemsize
    loss.backward()
    after = host_memory_stats()
    assert after["in_use_bytes"] == before["in_use_bytes"]
    assert (after["offloads"] - before["offloads"], after["prefetched"] - before["prefetched"]) == (3, 2)
    losses.append(loss.detach())
    _compare(losses, [_grads(m) for m in (ref, none, hf, ours)], dtype)


def _peft(model, dropout):
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets)
    wrapped = peft.get_peft_model(model, config)
    for name, p in wrapped.named_parameters():  # LoRA B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return wrapped


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_peft_lora_with_dropout(model_type):
    """PEFT LoRA (frozen base, lora_dropout 0.1) on all seven projections: loss and every LoRA gradient
    as without checkpointing and as HF's checkpointing under the same seed (the same dropout masks in the
    recompute). HF's input-grad hook is off under offloading, so the first layer's input does not require
    grad: the LoRA weights of that layer still get their gradients."""
    wrapped = _peft(build(model_type, layers=2), dropout=0.1)
    ref = copy.deepcopy(wrapped).double()
    hf = copy.deepcopy(wrapped)
    _hf_checkpointing(hf.base_model.model, use_reentrant=False)
    ours = offload.enable(copy.deepcopy(wrapped))
    assert offload.is_enabled(ours)
    inner = ours.base_model.model
    assert all(_offloaded(layer) for layer in _decoder_layers(inner))
    seen = []
    first = _decoder_layers(inner)[0]
    first.register_forward_pre_hook(lambda m, args: seen.append(args[0].requires_grad))
    ids, labels = _batch(300)
    models = (ref, wrapped, hf, ours)
    losses = [_step(m, ids, labels) for m in models]
    assert seen and not any(seen)  # the embeddings (5.17 runs the pre-hook again in the recompute)
    grads = [_grads(m) for m in models]
    assert all("lora_" in n for n in grads[3]) and len(grads[3]) == 2 * 7 * 2
    _compare(losses, grads, torch.float32)


def _embedding_output_after_forward(model, ids, labels):
    """Run a training forward; return (the loss, the input embeddings' output if still alive then)."""
    seen = []
    embeddings = model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    handle.remove()
    gc.collect()
    return loss, seen[0]()


def test_input_embedding_hooks_are_off_while_offloading():
    """HF's checkpointing makes the input embeddings' output require grad (a hook, for reentrant
    checkpointing), which keeps it alive until the backward ends; under offloading the hook is removed and
    later requests for it (HF's own enable calls, PEFT's) are noted, not done: the embedding output is
    freed right after the forward. disable() puts the hook back."""
    model = build("llama", layers=2)
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen, as under PEFT
    _hf_checkpointing(model, use_reentrant=False)
    ids, labels = _batch(300)
    loss, embedded = _embedding_output_after_forward(model, ids, labels)
    assert embedded is not None and embedded.requires_grad  # HF's hook: kept for the backward
    del embedded
    loss.backward()
    model.enable_input_require_grads()  # asked again (PEFT does): HF keeps only this call's hook handles
    offload.enable(model)
    _hf_checkpointing(model, use_reentrant=True)  # what Trainer does at train(): hooks asked for again
    model.enable_input_require_grads()  # what PEFT's prepare_model_for_kbit_training does
    loss, embedded = _embedding_output_after_forward(model, ids, labels)
    assert embedded is None  # freed before the backward
    loss.backward()
    offload.disable(model)
    loss, embedded = _embedding_output_after_forward(model, ids, labels)
    assert embedded is not None and embedded.requires_grad  # the hook is back
    del embedded
    loss.backward()


@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_keeps_offloading(tmp_path, flag):
    """Trainer(gradient_checkpointing=True, use_reentrant=True) after enable(): Trainer's own enable call
    re-installs offloading over the function it sets (with its use_reentrant), every layer of every
    step offloads, and the logged losses and trained weights are those of HF's checkpointing run."""
    pytest.importorskip("accelerate")
    fields = transformers.TrainingArguments.__dataclass_fields__
    if flag not in fields:
        pytest.skip(f"no TrainingArguments.{flag} in transformers {transformers.__version__}")
    kwargs_name = flag + "_kwargs"
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(4):
        ids = torch.randint(3, 300, (T,), generator=g)
        labels = ids.clone()
        labels[: 1 + i] = -100
        rows.append({"input_ids": ids, "labels": labels})

    def train(model, checkpointing):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(id(model))),
            per_device_train_batch_size=2,
            max_steps=2,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            data_seed=0,
            **({flag: True, kwargs_name: {"use_reentrant": True}} if checkpointing else {}),
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])

    base = build("llama", layers=2)
    ref, hf, ours = clone(base, torch.float64), clone(base), offload.enable(clone(base))
    before = host_memory_stats()["offloads"]
    losses = [train(ref, False), train(hf, True), train(ours, True)]
    assert host_memory_stats()["offloads"] - before == 2 * 2  # 2 steps x 2 layers
    assert offload.is_enabled(ours)
    for layer in _decoder_layers(ours):
        assert _offloaded(layer) and layer._gradient_checkpointing_func.keywords == {"use_reentrant": True}
    assert_numerics("logged losses", losses[2], losses[1], losses[0], torch.float32)
    params = [dict(m.named_parameters()) for m in (ref, hf, ours)]
    for name in params[1]:
        assert_numerics(f"trained {name}", params[2][name], params[1][name], params[0][name], torch.float32)


# ---- enable / disable state ----


def test_disable_after_enable_turned_checkpointing_on():
    """enable() on a model without checkpointing switches it on; disable() switches it off again and
    leaves exactly what HF's own enable + disable leave (no wrapper, no fuselm attribute)."""
    model, twin = build("llama"), build("llama")
    _hf_checkpointing(twin)
    _hf_checkpointing_off(twin)
    offload.disable(offload.enable(model))
    assert not offload.is_enabled(model)
    assert "_set_gradient_checkpointing" not in vars(model)
    for layer, other in zip(_decoder_layers(model), _decoder_layers(twin), strict=True):
        assert not layer.gradient_checkpointing
        assert layer._gradient_checkpointing_func is other._gradient_checkpointing_func
        assert not [k for k in vars(layer) if "fuselm" in k]


def test_disable_restores_hfs_function_as_it_was():
    """Checkpointing already on (reentrant): enable keeps its options, disable puts back HF's very
    function objects and leaves checkpointing on."""
    model = build("llama")
    _hf_checkpointing(model, use_reentrant=True)
    before = [layer._gradient_checkpointing_func for layer in _decoder_layers(model)]
    offload.enable(model)
    assert [layer._gradient_checkpointing_func.keywords for layer in _decoder_layers(model)] == [
        {"use_reentrant": True}
    ] * 2
    offload.disable(model)
    assert [layer._gradient_checkpointing_func for layer in _decoder_layers(model)] == before
    assert all(layer.gradient_checkpointing for layer in _decoder_layers(model))


def test_later_hf_calls_keep_offloading_and_own_the_state():
    """After enable(): HF's enable with new kwargs keeps offloading (with those kwargs); HF's disable
    stops it (is_enabled False), HF's enable brings it back; disable() then restores HF's latest function
    and leaves checkpointing on (the user switched it on last)."""
    model = offload.enable(build("llama"))
    _hf_checkpointing(model, use_reentrant=True, preserve_rng_state=False)
    assert offload.is_enabled(model)
    assert model.model.layers[0]._gradient_checkpointing_func.keywords == {
        "use_reentrant": True,
        "preserve_rng_state": False,
    }
    _hf_checkpointing_off(model)
    assert not offload.is_enabled(model)
    _hf_checkpointing(model, use_reentrant=False)
    assert offload.is_enabled(model)
    offload.disable(model)
    func = model.model.layers[0]._gradient_checkpointing_func
    assert func.func is torch_checkpoint.checkpoint and func.keywords == {"use_reentrant": False}
    assert model.model.layers[0].gradient_checkpointing


def test_every_n_layers_is_kept():
    model = build("llama", layers=3)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    if "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip("no every_n_layers in this transformers version")
    enable(every_n_layers=2)
    offload.enable(model)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True]
    before = host_memory_stats()["offloads"]
    _step(model, *_batch(300))
    assert host_memory_stats()["offloads"] - before == 2


def test_enable_is_idempotent_and_survives_deepcopy_and_pickle():
    model = offload.enable(offload.enable(build("llama")))
    wrapper = vars(model)["_set_gradient_checkpointing"]
    assert wrapper.previous is offload._MISSING
    model.disable_input_require_grads()  # HF's hook is a local function: no pickling with it
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert offload.is_enabled(twin)
        assert vars(twin)["_set_gradient_checkpointing"].model is twin
        _hf_checkpointing(twin, use_reentrant=True)  # reinstalls on the copy's layers, not the original's
        assert twin.model.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": True}
        assert model.model.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
        offload.disable(twin)  # HF's enable came last: checkpointing stays, HF's function back
        assert not offload.is_enabled(twin) and twin.model.layers[0].gradient_checkpointing
        assert twin.model.layers[0]._gradient_checkpointing_func.func is torch_checkpoint.checkpoint
    assert offload.is_enabled(model)


def test_enable_rejects_what_it_cannot_switch():
    with pytest.raises(TypeError, match="model: Linear holds no transformers PreTrainedModel"):
        offload.enable(torch.nn.Linear(2, 2))
    model = build("llama")
    _hf_checkpointing(model, use_reentrant=False, context_fn=torch_checkpoint.noop_context_fn)
    offload.enable(model)  # the default context_fn is fine
    with pytest.raises(ValueError, match="context_fn"):
        _hf_checkpointing(model, use_reentrant=False, context_fn=lambda: (None, None))
    assert not offload.is_enabled(torch.nn.Linear(2, 2)) and not offload.is_enabled(build("llama"))


def test_docstring_examples_run():
    result = doctest.testmod(offload, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 10 and result.failed == 0


# ---- GPU ----


@pytest.mark.gpu
def test_gpu_layer_inputs_live_in_pinned_host_memory():
    """Llama, bf16, 4 layers, B2 x 1024 x 1024: after the forward, the CUDA memory the step holds is lower
    than under HF's checkpointing by exactly 3 of the 4 layer inputs (3 x B x T x H x 2 bytes, less than one
    more input of slack: the last layer's stays on the device too, for its backward, which comes first),
    host_memory_stats holds all 4 (pinned), the backward prefetches 3 of them (the last layer's needs no
    copy back), and loss and gradients follow the rule against a float64 reference without checkpointing."""
    layers, b, t, h = 4, 2, 1024, 1024
    base = build("llama", dtype=torch.bfloat16, device="cuda", hidden=h, layers=layers, vocab=512, heads=8)
    ref, hf, ours = clone(base, torch.float64), clone(base), clone(base)
    _hf_checkpointing(hf, use_reentrant=False)
    offload.enable(ours)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (b, t), generator=g).cuda()
    for m in (hf, ours):  # warm-up: cuBLAS workspaces, pinned buffers
        _step(m, ids, ids)
    held, losses = {}, {}
    for name, m in (("hf", hf), ("ours", ours)):
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start, host = torch.cuda.memory_allocated(), host_memory_stats()
        torch.manual_seed(7)
        loss = m(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - start
        if name == "ours":  # the last layer's stash: its input alone (no output kept by a plain layer)
            assert [x.shape for x, _ in offloading._Stash._last().on_device] == [(b, t, h)]
        if name == "ours":
            stats = host_memory_stats()
            assert stats["in_use_bytes"] - host["in_use_bytes"] == layers * b * t * h * 2
            assert stats["pinned_bytes"] >= stats["in_use_bytes"]
            assert stats["pageable_bytes"] == host["pageable_bytes"]  # nothing of this step pageable
        loss.backward()
        losses[name] = loss.detach()
        if name == "ours":
            stats = host_memory_stats()
            assert stats["in_use_bytes"] == host["in_use_bytes"]
            assert stats["prefetched"] - host["prefetched"] == layers - 1
    saved, one = held["hf"] - held["ours"], b * t * h * 2
    assert (layers - 1) * one <= saved < layers * one, (held, layers * one)
    losses["ref"] = _step(ref, ids, ids)
    grads = {name: _grads(m) for name, m in (("ref", ref), ("hf", hf), ("ours", ours))}
    _compare(
        [losses["ref"], losses["hf"], losses["ours"]],
        [grads["ref"], grads["hf"], grads["ours"]],
        torch.bfloat16,
    )
