"""fuselm.hf.patch / unpatch: what is swapped, what is restored, and that the patched models compute
HF's outputs (loss, logits, gradients) under the numerics rule (CPU fp32; float64 reference)."""

from __future__ import annotations

import ast
import copy
import doctest
import gc
import importlib
import inspect
import pickle
import types
import warnings

import pytest
import torch
from kit.hf_models import CLASSIC_TYPES, build, clone, tiny_config

import fuselm.hf
from fuselm.hf import _common, blocks, plan
from fuselm.hf.installs import rope_in_module
from fuselm.hf.loss import LossOptions
from fuselm.hf.registry import FAMILIES, family
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")


def _modeling(model_type):
    return importlib.import_module(family(model_type).module)


def _snapshot(model_type):
    """Everything patching may touch: the classes' own attribute dicts and the module's globals."""
    spec, module = family(model_type), _modeling(model_type)
    names = (spec.rms_norm, spec.mlp, *spec.causal_lms)
    classes = {name: dict(vars(getattr(module, name))) for name in names if name is not None}
    return classes, dict(vars(module))


def _same(a, b):
    (ca, ma), (cb, mb) = a, b
    assert ca.keys() == cb.keys() and ma.keys() == mb.keys()
    for name in ca:
        assert ca[name].keys() == cb[name].keys(), name
        for attr in ca[name]:
            assert ca[name][attr] is cb[name][attr], f"{name}.{attr} changed"
    for attr in ma:
        assert ma[attr] is mb[attr], f"module global {attr} changed"


def _batch(vocab=300, b=2, t=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    return ids, labels


def _unpatch_all():
    """Unpatch every family: also puts back the rotary function of families whose instance-patched
    models were garbage-collected (modules change only in explicit calls, never at collection)."""
    gc.collect()
    for model_type in FAMILIES:
        fuselm.hf.unpatch(model_type)


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    _unpatch_all()  # patched models other test modules dropped
    yield
    _unpatch_all()
    assert not any(fuselm.hf.is_patched(model_type) for model_type in FAMILIES)


@pytest.mark.parametrize("model_type", CLASSIC_TYPES)
@pytest.mark.parametrize("by", ["model_type", "class"])
def test_class_patch_round_trip(model_type, by):
    spec, module = family(model_type), _modeling(model_type)
    target = model_type if by == "model_type" else getattr(module, spec.causal_lms[0])
    before = _snapshot(model_type)
    fuselm.hf.patch(target)
    assert fuselm.hf.is_patched(target)
    for name in before[0]:
        assert getattr(module, name).forward is not before[0][name]["forward"]
    assert rope_in_module(spec) is not before[1][spec.rope]
    fuselm.hf.patch(target)  # idempotent
    fuselm.hf.unpatch(target)
    _same(before, _snapshot(model_type))
    assert not fuselm.hf.is_patched(target)


def test_class_patch_reaches_models_built_before_and_after():
    early = build("llama")
    fuselm.hf.patch("llama")
    late = build("llama")
    for model in (early, late):
        assert model.model.norm.forward.__func__.__qualname__ == "fuselm_LlamaRMSNorm.forward"
        assert model.forward.__func__.__qualname__ == "fuselm_LlamaForCausalLM.forward"


@pytest.mark.parametrize("model_type", CLASSIC_TYPES)
def test_instance_patch_touches_only_that_model(model_type):
    spec = family(model_type)
    model, other = build(model_type), build(model_type)
    before = _snapshot(model_type)  # after building: HF caches a few values on its classes then
    assert fuselm.hf.patch(model) is model
    assert fuselm.hf.is_patched(model)
    patched = [m for m in model.modules() if "forward" in vars(m)]
    kinds = {type(m).__name__ for m in patched}
    assert kinds == {spec.rms_norm, spec.mlp, type(model).__name__}
    assert not any("forward" in vars(m) for m in other.modules())
    assert rope_in_module(spec).__qualname__.startswith("fuselm_")  # rope is module-level in HF
    fuselm.hf.unpatch(model)
    assert not any("forward" in vars(m) for m in model.modules())
    assert not fuselm.hf.is_patched(model)
    _same(before, _snapshot(model_type))


def _rope_calls(monkeypatch) -> list:
    """Records every call into fuselm's RoPE made through fuselm.hf (its rotary function)."""
    calls = []
    apply_rotary = blocks.apply_rotary

    def spy(*args, **kwargs):
        calls.append(1)
        return apply_rotary(*args, **kwargs)

    monkeypatch.setattr(blocks, "apply_rotary", spy)
    return calls


def test_garbage_collection_changes_no_module(monkeypatch):
    """A patched model dropped unpatched: collecting it changes no module (a module global changed
    mid torch.compile can crash dynamo) and nothing that runs (a checkpointed layer's recompute must run
    what its forward ran): fuselm's RoPE stays until the next explicit unpatch restores the original."""
    original = rope_in_module(family("llama"))
    model = fuselm.hf.patch(build("llama"))
    other = build("llama")
    assert not fuselm.hf.is_patched(other)  # per instance, though it shares the module-level RoPE
    ids, _ = _batch()
    calls = _rope_calls(monkeypatch)
    other(input_ids=ids)
    assert calls  # module-level in HF: every llama runs fuselm's RoPE
    before = _snapshot("llama")
    del model
    gc.collect()
    _same(before, _snapshot("llama"))  # nothing changed by the collection
    calls.clear()
    other(input_ids=ids)
    assert calls  # still fuselm's: no switch outside an explicit call
    fuselm.hf.unpatch("llama")  # finds no patch of llama left: HF's function back
    assert rope_in_module(family("llama")) is original
    calls.clear()
    other(input_ids=ids)
    assert not calls


def test_a_model_collected_mid_step_does_not_change_the_recompute():
    """HF's gradient checkpointing on an unpatched llama while a patched llama is collected between the
    forward and the backward: the recompute runs the RoPE the forward ran (torch's checkpoint raises when
    the tensors saved differ), and the gradients are those of a step without the collection."""
    torch.manual_seed(0)
    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, labels = _batch()
    want = _run(clone(model), ids, labels)
    patched = fuselm.hf.patch(build("llama"))
    out = model(input_ids=ids, labels=labels)
    del patched
    gc.collect()
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)


def test_drop_a_compiled_patched_model_then_compile_another():
    """Drop a compiled patched model, collect, compile another model in the same
    process: no crash, and unpatch still restores the original objects."""
    ids, labels = _batch(t=8)
    before = _snapshot("llama")
    model = fuselm.hf.patch(build("llama", layers=1, hidden=32))
    compiled = torch.compile(model, backend="eager")
    compiled(input_ids=ids, labels=labels).loss.backward()
    del model, compiled
    gc.collect()
    other = build("llama", layers=1, hidden=32, seed=1)
    compiled = torch.compile(other, backend="eager")
    compiled(input_ids=ids, labels=labels).loss.backward()
    fuselm.hf.unpatch("llama")
    _same(before, _snapshot("llama"))


def test_is_patched_is_per_instance():
    a, b = build("llama"), build("llama")
    fuselm.hf.patch(a)
    assert fuselm.hf.is_patched(a) and not fuselm.hf.is_patched(b)
    assert not fuselm.hf.is_patched("llama")  # no class patch
    fuselm.hf.patch("llama")
    assert fuselm.hf.is_patched(b)  # its class runs fuselm's forwards now
    fuselm.hf.unpatch("llama")
    fuselm.hf.unpatch(a)
    assert not fuselm.hf.is_patched(a) and not fuselm.hf.is_patched(b)


def test_repatching_an_instance_applies_the_new_options():
    """patch() on a patched model with other options replaces its patch (as unpatch, then patch)."""
    ids, labels = _batch()
    model = fuselm.hf.patch(build("llama"))
    assert model(input_ids=ids, labels=labels).logits is None
    fuselm.hf.patch(model, linear_cross_entropy=False, cross_entropy=True)  # the README's keep-logits recipe
    assert model.forward.__func__.__qualname__.endswith("forward[logits]")
    assert model(input_ids=ids, labels=labels).logits is not None
    fuselm.hf.patch(model, rms_norm=False)
    kinds = {type(m).__name__ for m in model.modules() if "forward" in vars(m)}
    assert kinds == {"LlamaMLP", "LlamaForCausalLM"}
    fuselm.hf.patch(model, rms_norm=False)  # the same options: nothing changes
    assert {type(m).__name__ for m in model.modules() if "forward" in vars(m)} == kinds
    fuselm.hf.unpatch(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_repatching_a_class_applies_the_new_options():
    module = _modeling("llama")
    fuselm.hf.patch("llama", linear_cross_entropy=False, cross_entropy=True)
    assert module.LlamaForCausalLM.forward.__qualname__.endswith("forward[logits]")
    fuselm.hf.patch("llama")
    assert not module.LlamaForCausalLM.forward.__qualname__.endswith("forward[logits]")
    fuselm.hf.patch("llama", rms_norm=False)
    assert module.LlamaRMSNorm.forward.__qualname__ == "LlamaRMSNorm.forward"


def test_an_instance_patch_overrides_the_class_patch():
    ids, labels = _batch()
    fuselm.hf.patch("llama")
    model = fuselm.hf.patch(build("llama"), linear_cross_entropy=False, cross_entropy=True)
    assert model(input_ids=ids, labels=labels).logits is not None
    fuselm.hf.unpatch(model)
    assert model(input_ids=ids, labels=labels).logits is None  # the class patch again


@pytest.mark.parametrize("by", ["instance", "class"])
def test_loss_options_reach_the_loss_forward(by, monkeypatch):
    seen = []
    factory = plan.causal_lm_forward

    def spy(spec, original, options):
        seen.append(options)
        return factory(spec, original, options)

    monkeypatch.setattr(plan, "causal_lm_forward", spy)
    fuselm.hf.patch(build("llama") if by == "instance" else "llama", label_smoothing=0.1, memory="min")
    want = LossOptions(from_logits=False, label_smoothing=0.1, memory="min")
    assert seen == [want]


def test_rope_stays_patched_while_any_patched_model_needs_it():
    original = rope_in_module(family("llama"))
    a, b = build("llama"), build("llama")
    fuselm.hf.patch(a)
    fuselm.hf.patch(b)
    fuselm.hf.unpatch(a)
    assert rope_in_module(family("llama")) is not original
    fuselm.hf.patch("llama")
    fuselm.hf.unpatch(b)
    assert rope_in_module(family("llama")) is not original  # the class patch still needs it
    fuselm.hf.unpatch("llama")
    assert rope_in_module(family("llama")) is original


def test_component_flags():
    model = build("llama")
    fuselm.hf.patch(model, rms_norm=False, rope=False, swiglu=True, linear_cross_entropy=False)
    kinds = {type(m).__name__ for m in model.modules() if "forward" in vars(m)}
    assert kinds == {"LlamaMLP"}
    assert not _common.is_fuselm_forward(rope_in_module(family("llama")))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma", "granite"])
def test_patching_reads_no_source(model_type, monkeypatch):
    """Patching an instance or a family's classes never reads transformers' source (no ast.parse, no
    inspect.getsource / findsource), and the patched model trains through fuselm's forwards (a first
    patched step outside the guard: torch reads the source of custom ops it registers lazily)."""
    first = fuselm.hf.patch(build(model_type))
    ids, labels = _batch(first.config.vocab_size)
    _run(first, ids, labels)
    fuselm.hf.unpatch(first)

    def refuse(name):
        def refused(*args, **kwargs):
            raise AssertionError(f"{name} called on the patch path")

        return refused

    with monkeypatch.context() as guard:
        guard.setattr(ast, "parse", refuse("ast.parse"))
        guard.setattr(inspect, "getsource", refuse("inspect.getsource"))
        guard.setattr(inspect, "findsource", refuse("inspect.findsource"))
        model = fuselm.hf.patch(build(model_type))
        fuselm.hf.patch(model_type)
        out = _run(model, ids, labels)
        fuselm.hf.unpatch(model_type)
    assert out.logits is None and torch.isfinite(out.loss)
    assert model.forward.__func__.__qualname__.startswith("fuselm_")


@pytest.mark.parametrize("option", ["fused_layer", "fused_residual"])
def test_removed_options_say_what_replaces_them(option):
    """fused_layer and fused_residual were removed: True raises a ValueError naming the option and
    capture_training_steps (nothing patched), False is accepted; an unknown option is a TypeError."""
    model = build("llama")
    with pytest.raises(
        ValueError, match=rf"^{option}=True was removed from fuselm.hf.patch .*capture_training_steps"
    ):
        fuselm.hf.patch(model, **{option: True})
    assert not fuselm.hf.is_patched(model)
    with pytest.raises(ValueError, match=f"{option}=True was removed"):
        fuselm.hf.patch("llama", **{option: True})
    assert fuselm.hf.patch(model, **{option: False}) is model and fuselm.hf.is_patched(model)
    with pytest.raises(TypeError, match="patch\\(\\) got an unexpected keyword argument 'fused_layers'"):
        fuselm.hf.patch(model, fused_layers=True)


def test_bad_targets_and_flags():
    with pytest.raises(ValueError, match="no spec for model_type 'bert'"):
        fuselm.hf.patch("bert")
    with pytest.raises(ValueError, match="nothing fuselm.hf can patch"):
        fuselm.hf.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="nor a \\*ForCausalLM"):
        fuselm.hf.patch(transformers.BertModel)
    with pytest.raises(TypeError, match="target must be"):
        fuselm.hf.patch(3)
    with pytest.raises(ValueError, match="pick one"):
        fuselm.hf.patch("llama", cross_entropy=True)
    with pytest.raises(ValueError, match="every component flag is False"):
        fuselm.hf.patch(
            "llama", rms_norm=False, rope=False, swiglu=False, lora=False, linear_cross_entropy=False
        )
    with pytest.raises(ValueError, match="label_smoothing"):
        fuselm.hf.patch("llama", label_smoothing=1.5)
    with pytest.raises(ValueError, match="nothing to patch in the 'llava' family"):
        fuselm.hf.patch("llava", linear_cross_entropy=False)  # llava's own module has no blocks
    with pytest.raises(ValueError, match="nothing fuselm.hf can patch"):
        fuselm.hf.patch(build("llama").model, rms_norm=False, rope=False, swiglu=False)  # no head here
    assert "gemma3_text" in fuselm.hf.supported_model_types()


BAD_LOSS_OPTIONS = [
    (dict(memory="low"), "memory must be 'auto', 'min' or a positive int"),
    (dict(memory=0), "memory must be 'auto', 'min' or a positive int"),
    (dict(memory=True), "memory must be 'auto', 'min' or a positive int"),
    (dict(memory=1.5e9), "memory must be 'auto', 'min' or a positive int"),
    (dict(accum_dtype=torch.int64), "accum_dtype must be one of"),
    (dict(accum_dtype="float32"), "accum_dtype must be one of"),
    (dict(label_smoothing=1.5), "label_smoothing must be in \\[0, 1\\]"),
    (dict(label_smoothing="0.1"), "label_smoothing must be a number"),
    (dict(memory="low", linear_cross_entropy=False, cross_entropy=True), "memory must be"),
    (dict(memory="low", linear_cross_entropy=False), "memory must be"),  # no loss: still checked
]


@pytest.mark.parametrize("by", ["instance", "class"])
@pytest.mark.parametrize(("options", "message"), BAD_LOSS_OPTIONS, ids=lambda x: str(x))
def test_bad_loss_options_raise_at_patch_time(options, message, by):
    """Every loss option is checked by patch() (memory="low" once was accepted and the first
    training step raised): ValueError naming the argument and what it may be; nothing is patched."""
    model = build("llama")
    with pytest.raises(ValueError, match=message):
        fuselm.hf.patch(model if by == "instance" else "llama", **options)
    assert not fuselm.hf.is_patched(model) and not fuselm.hf.is_patched("llama")


def test_loss_options_the_ops_accept_are_accepted():
    """label_smoothing=1.0 and accum_dtype=<the model's dtype> are what fuselm.linear_cross_entropy takes:
    patch takes them too, and the loss is PyTorch's cross-entropy with that smoothing (numerics rule)."""
    eager = build("llama")
    ids, labels = _batch()

    def reference(model):
        logits = model(input_ids=ids).logits[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), label_smoothing=1.0)

    want64, want = reference(clone(eager, torch.float64)), reference(eager)
    model = fuselm.hf.patch(clone(eager), label_smoothing=1.0, accum_dtype=torch.float32)
    assert_numerics("loss", _run(model, ids, labels).loss, want, want64, torch.float32)


def test_a_model_of_a_family_without_a_spec_gets_the_fused_loss():
    """A decoder-only *ForCausalLM fuselm has no spec for: the loss is fused, one warning says what
    stays HF's; an encoder-decoder model is never touched."""
    config = transformers.PhiConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=300
    )
    torch.manual_seed(0)
    eager = transformers.PhiForCausalLM(config)
    ref, ours = clone(eager, torch.float64), clone(eager)
    with pytest.warns(UserWarning, match="no spec for PhiForCausalLM") as record:
        fuselm.hf.patch(ours)
    assert len(record) == 1 and "norms, RoPE and MLP stay Hugging Face's" in str(record[0].message)
    ids, labels = _batch()
    outs = [_run(m, ids, labels) for m in (ref, eager, ours)]
    assert outs[2].logits is None
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss, torch.float32)
    grads = [_grads(m) for m in (ref, eager, ours)]
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)
    original = vars(transformers.PhiForCausalLM)["forward"]
    with pytest.warns(UserWarning, match="no spec for PhiForCausalLM"):
        fuselm.hf.patch(transformers.PhiForCausalLM)
    assert fuselm.hf.is_patched(transformers.PhiForCausalLM) and fuselm.hf.is_patched(eager)
    fuselm.hf.unpatch(transformers.PhiForCausalLM)
    assert vars(transformers.PhiForCausalLM)["forward"] is original and not fuselm.hf.is_patched(eager)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=50)
    )
    with pytest.raises(ValueError, match="nothing fuselm.hf can patch"):
        fuselm.hf.patch(t5)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, ids, labels=None, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    if labels is not None:
        out.loss.backward()
    return out


@pytest.mark.parametrize("model_type", CLASSIC_TYPES)
def test_patched_loss_and_gradients_follow_the_numerics_rule(model_type):
    ids, labels = _batch()
    eager = build(model_type)
    ref = clone(eager, torch.float64)
    ours = fuselm.hf.patch(clone(eager))
    out_ref, out_eager, out_ours = (_run(m, ids, labels) for m in (ref, eager, ours))
    assert out_ours.logits is None and out_eager.logits is not None
    assert out_ours.loss.dtype == torch.float32
    assert_numerics("loss", out_ours.loss, out_eager.loss, out_ref.loss, torch.float32)
    g_ref, g_eager, g_ours = _grads(ref), _grads(eager), _grads(ours)
    assert g_ours.keys() == g_eager.keys()
    for name in g_eager:
        assert_numerics(f"grad {name}", g_ours[name], g_eager[name], g_ref[name], torch.float32)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma2"])
def test_without_labels_logits_are_returned(model_type):
    ids, _ = _batch()
    eager = build(model_type)
    ref = clone(eager, torch.float64)
    ours = fuselm.hf.patch(clone(eager))
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (ref, eager, ours)]
        last = ours(input_ids=ids, logits_to_keep=1).logits
    assert_numerics("logits", logits[2], logits[1], logits[0], torch.float32)
    assert last.shape == (ids.shape[0], 1, ours.config.vocab_size)


def test_num_items_in_batch_and_shift_labels_as_hf():
    ids, labels = _batch()
    eager = build("llama")
    ref = clone(eager, torch.float64)
    ours = fuselm.hf.patch(clone(eager))
    n_items = torch.tensor(57)  # e.g. the count over all micro-batches of a gradient accumulation step
    loss = [m(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss for m in (ref, eager, ours)]
    assert_numerics("loss / num_items_in_batch", loss[2], loss[1], loss[0], torch.float32)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    by_shift = ours(input_ids=ids, shift_labels=shifted).loss
    by_labels = ours(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(by_shift, by_labels, rtol=0, atol=0)


def test_return_dict_false_gives_a_tuple():
    ids, labels = _batch()
    model = fuselm.hf.patch(build("llama"))
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0


def test_wrong_label_shape_is_named():
    ids, _ = _batch()
    model = fuselm.hf.patch(build("llama"))
    with pytest.raises(ValueError, match="one target per token"):
        model(input_ids=ids, shift_labels=torch.zeros(ids.shape[0], 3, dtype=torch.long))


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    ids, labels = _batch()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0
    )
    eager = peft.get_peft_model(build("llama"), lora)
    for name, p in eager.named_parameters():  # LoRA B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ref = copy.deepcopy(eager).double()
    ours = fuselm.hf.patch(copy.deepcopy(eager))
    outs = [_run(m, ids, labels) for m in (ref, eager, ours)]
    assert outs[2].logits is None
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss, torch.float32)
    grads = [_grads(m) for m in (ref, eager, ours)]
    assert grads[2].keys() == grads[1].keys() and any("lora_B" in n for n in grads[2])
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)


def _fuselm_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "fuselm" in str(w.message)]


def test_a_peft_wrapper_is_looked_through(monkeypatch):
    """patch(peft_model) after peft.get_peft_model (the README's order): PeftModelForCausalLM and its
    LoraModel are not taken for a CausalLM without a spec: no warning at patch time nor at the first
    training step, the wrapper keeps its forward, the base model's forward computes the fused loss."""
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(_common, "_warned", set())  # every one-time warning fresh
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(build("llama"), lora)
    assert type(model).__name__ == "PeftModelForCausalLM"
    ids, labels = _batch()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fuselm.hf.patch(model)
        out = _run(model, ids, labels)
    assert not _fuselm_warnings(record)
    assert out.logits is None and torch.isfinite(out.loss)
    assert not any("forward" in vars(m) for m in (model, model.base_model))
    assert model.get_base_model().forward.__func__.__qualname__ == "fuselm_LlamaForCausalLM.forward"
    with pytest.raises(ValueError, match="PEFT's PeftModelForCausalLM"):
        fuselm.hf.patch(type(model))


def _left_behind(model) -> list[str]:
    """Instance attributes fuselm.hf may set (forwards, patch records) found on the model's modules."""
    return [
        f"{type(m).__name__}.{a}"
        for m in model.modules()
        for a in ("forward", "_fuselm_patch")
        if a in vars(m)
    ]


def test_the_patch_state_follows_the_model_peft_merges_into(monkeypatch):
    """After patch(peft_model), merge_and_unload() returns the model inside with its patched modules: it is
    patched (is_patched, fuselm's loss and RoPE run, also once the PEFT wrapper is gone) and unpatch(merged)
    takes every forward and record out and gives the family's RoPE back."""
    peft = pytest.importorskip("peft")
    rope_before = rope_in_module(family("llama"))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = fuselm.hf.patch(peft.get_peft_model(build("llama"), lora))
    merged = model.merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert fuselm.hf.is_patched(merged) and fuselm.hf.is_patched(merged.model.layers[0])
    del model
    gc.collect()
    calls = _rope_calls(monkeypatch)
    out = _run(merged.requires_grad_(True), *_batch())  # PEFT froze the base weights
    assert out.logits is None and calls
    fuselm.hf.unpatch(merged)
    assert not fuselm.hf.is_patched(merged) and not _left_behind(merged)
    assert rope_in_module(family("llama")) is rope_before


def _saved(model, how: str, tmp_path):
    """A way to copy a model, in two steps: what is kept of it (the copy itself for deepcopy, bytes or a
    file otherwise), then the copy from that (after the original is gone, as in a new process)."""
    if how == "deepcopy":
        kept = copy.deepcopy(model)
        return lambda: kept
    if how == "pickle":
        data = pickle.dumps(model)
        return lambda: pickle.loads(data)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return lambda: torch.load(path, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_patched_model_is_patched(how, tmp_path, monkeypatch):
    """A deep copy, a pickle round trip or torch.save / torch.load of a patched model is patched for real:
    its modules run fuselm's forwards (bound to the copy's modules, with the options of
    the original), its family's RoPE is fuselm's (the dispatcher put back when loading finds none), the
    loss and gradients are the original's bit for bit; is_patched, re-patching and unpatch act on the copy
    alone."""
    rope_before = rope_in_module(family("llama"))
    model = fuselm.hf.patch(build("llama"), label_smoothing=0.1)
    ids, labels = _batch()
    want = _run(model, ids, labels)
    want_grads = _grads(model)
    load = _saved(model, how, tmp_path)
    fuselm.hf.unpatch(model)  # and gone: nothing of the original's patch is left in the process
    del model
    gc.collect()
    assert (rope_in_module(family("llama")) is rope_before) == (how != "deepcopy")
    loaded = load()
    assert fuselm.hf.is_patched(loaded)
    patched = [m for m in loaded.modules() if "forward" in vars(m)]
    swapped = {"LlamaRMSNorm", "LlamaMLP", "LlamaForCausalLM"}
    assert {type(m).__name__ for m in patched} == swapped
    assert all(vars(m)["forward"].__self__ is m for m in patched)
    assert rope_in_module(family("llama")) is not rope_before
    calls = _rope_calls(monkeypatch)
    got = _run(loaded, ids, labels)
    assert calls and got.logits is None
    assert torch.equal(got.loss, want.loss)  # label_smoothing=0.1 too
    got_grads = _grads(loaded)
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)
    fuselm.hf.patch(loaded, linear_cross_entropy=False, cross_entropy=True)
    assert loaded.forward.__func__.__qualname__.endswith("forward[logits]")
    fuselm.hf.unpatch(loaded)
    assert not fuselm.hf.is_patched(loaded) and not _left_behind(loaded)
    assert rope_in_module(family("llama")) is rope_before


def _trainer_args(tmp_path, model) -> dict:
    """Two optimizer steps of two micro-batches of 2 on the CPU, a loss logged every step, nothing saved."""
    return dict(
        output_dir=str(tmp_path / str(id(model))),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        data_seed=0,
    )


def test_trainer_with_gradient_accumulation_matches_hf(tmp_path):
    pytest.importorskip("accelerate")
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):  # rows of different lengths of real targets: num_items_in_batch matters
        ids = torch.randint(3, 300, (20,), generator=g)
        labels = ids.clone()
        labels[: 2 + 2 * i] = -100
        rows.append({"input_ids": ids, "labels": labels})

    def train(model):
        args = transformers.TrainingArguments(**_trainer_args(tmp_path, model))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])

    eager = build("llama")
    ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager))
    losses = [train(m) for m in (ref, eager, ours)]
    assert losses[1].shape == (2,)
    assert_numerics("logged losses", losses[2], losses[1], losses[0], torch.float32)
    params = [dict(m.named_parameters()) for m in (ref, eager, ours)]
    for name in params[1]:
        assert_numerics(f"trained {name}", params[2][name], params[1][name], params[0][name], torch.float32)


@pytest.mark.parametrize(
    "module", [fuselm.hf.patching, fuselm.hf.registry, fuselm.hf.block_report], ids=lambda m: m.__name__
)
def test_docstring_examples_run(module):
    """The docstring examples of fuselm.hf (patch, the registry's functions) run as written."""
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module) if t.examples]
    assert tests
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_config_helper_is_what_it_says():
    config = tiny_config("phi3")
    assert config.partial_rotary_factor == 0.5
    assert isinstance(fuselm.hf.patch, types.FunctionType)


def test_trl_sft_trainer_matches_hf(tmp_path):
    """TRL's SFTTrainer (1.x) computes the loss with its own chunked LM head (it wraps model.forward and
    calls the backbone): under it, fuselm's norms, RoPE and MLP run and the losses still match HF's."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = {"[PAD]": 0, **{f"w{i}": i for i in range(1, 300)}}  # one id per word: no ambiguous reverse map
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=words, unk_token="w1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="w2", unk_token="w1"
    )
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 20, (8,), generator=g)  # padded batches: num_items_in_batch matters
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(3, 300, (int(n),), generator=g)) for n in lengths]
    data = datasets.Dataset.from_dict({"text": texts})

    def train(model):
        config = trl.SFTConfig(**_trainer_args(tmp_path, model), max_length=32)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])

    eager = build("llama")
    ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager))
    losses = [train(m) for m in (ref, eager, ours)]
    assert losses[1].shape == (2,)
    assert_numerics("SFTTrainer logged losses", losses[2], losses[1], losses[0], torch.float32)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
@pytest.mark.parametrize("by", ["instance", "class"])
def test_loss_on_logits_with_cross_entropy_flag(model_type, by):
    """cross_entropy=True: HF's logits are returned and the loss on them is fuselm.cross_entropy's."""
    ids, labels = _batch()
    eager = build(model_type)
    ref = clone(eager, torch.float64)
    ours = clone(eager)
    fuselm.hf.patch(ours if by == "instance" else model_type, linear_cross_entropy=False, cross_entropy=True)
    assert ours.forward.__func__.__qualname__.endswith("forward[logits]")
    outs = [_run(m, ids, labels, num_items_in_batch=torch.tensor(31)) for m in (ref, eager, ours)]
    assert outs[2].loss.dtype == torch.float32
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss, torch.float32)
    assert_numerics("logits", outs[2].logits, outs[1].logits, outs[0].logits, torch.float32)
    grads = [_grads(m) for m in (ref, eager, ours)]
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)


def test_loss_on_logits_with_an_adapter_on_lm_head():
    peft = pytest.importorskip("peft")
    ids, labels = _batch()
    eager = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    ref = copy.deepcopy(eager).double()
    ours = fuselm.hf.patch(copy.deepcopy(eager), linear_cross_entropy=False, cross_entropy=True)
    outs = [_run(m, ids, labels) for m in (ref, eager, ours)]
    assert ours.get_base_model().forward.__func__.__qualname__.endswith("forward[logits]")
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss, torch.float32)


def test_mlp_chunk_tokens_runs_the_dense_mlp_over_chunks(monkeypatch):
    """patch(..., mlp_chunk_tokens=7) (48 tokens a batch): the one-node MLP runs over chunks of 7 rows and
    the loss and every gradient follow HF's (numerics rule, float64 reference)."""
    from fuselm.nn import mlp as nn_mlp

    seen = []
    swiglu_mlp = nn_mlp.swiglu_mlp

    def spy(*args, chunk_rows=None, **kwargs):
        seen.append(chunk_rows)
        return swiglu_mlp(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(nn_mlp, "swiglu_mlp", spy)
    hf = build("llama")
    ref = clone(hf, torch.float64)
    ours = fuselm.hf.patch(clone(hf), mlp_chunk_tokens=7)
    ids, labels = _batch()
    outs = [_run(m, ids, labels) for m in (ref, hf, ours)]
    assert seen and set(seen) == {7}
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss, torch.float32)
    grads = [_grads(m) for m in (ref, hf, ours)]
    for name in grads[1]:
        assert_numerics(name, grads[2][name], grads[1][name], grads[0][name], torch.float32)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_mlp_chunk_tokens_bad_value_names_it(bad):
    with pytest.raises(ValueError, match="^mlp_chunk_tokens must be"):
        fuselm.hf.patch(build("llama"), mlp_chunk_tokens=bad)


def test_mlp_chunk_tokens_needs_swiglu():
    with pytest.raises(ValueError, match="^mlp_chunk_tokens chunks fuselm's gated MLP"):
        fuselm.hf.patch(build("llama"), swiglu=False, mlp_chunk_tokens=8)
