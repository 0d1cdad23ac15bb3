"""Every model type of the registry, patched vs unpatched on a tiny model (CPU fp32, float64 reference):
the training loss, every parameter gradient and the eval logits follow the numerics rule, and the
fused path was taken (no logits in training, every component the spec names called into fuselm)."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path

import pytest
import torch
from hf_models import ALL_TYPES, MULTIMODAL_TYPES, build, clone, tiny_config

import fuselm.hf
from fuselm.hf import layers
from fuselm.hf.registry import ALIASES, FAMILIES, family
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")

# The names in fuselm.hf.layers through which each swapped component reaches a fuselm op.
OPS = {
    "rms_norm": ("rms_norm",),
    "rope": ("apply_rotary",),
    "swiglu": ("gated_mlp", "gated_packed"),
    "loss": ("linear_cross_entropy",),
}


def _unpatch_all():
    gc.collect()  # dropped instance-patched models leave the rotary dispatchers' weak sets
    for model_type in FAMILIES:
        fuselm.hf.unpatch(model_type)  # also restores rotary functions no live patch needs


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    _unpatch_all()
    yield
    _unpatch_all()


def test_every_registered_model_type_has_a_tiny_model():
    assert set(fuselm.hf.supported_model_types()) <= set(ALL_TYPES)
    assert len(FAMILIES) >= 30


def _batch(vocab: int, b=2, t=16, seed=1):
    """Token ids clear of the special ids (image tokens sit at the top of the tiny vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 5, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


class _Calls:
    """Counts calls into the fuselm ops that fuselm.hf.layers uses."""

    def __init__(self, monkeypatch):
        self.n = {}
        for component, names in OPS.items():
            for name in names:
                assert hasattr(layers, name), f"fuselm.hf.layers has no {name} any more: update OPS"
                monkeypatch.setattr(layers, name, self._spy(component, getattr(layers, name)))

    def _spy(self, component, fn):
        def spy(*args, **kwargs):
            self.n[component] = self.n.get(component, 0) + 1
            return fn(*args, **kwargs)

        return spy


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_step(model, ids, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_family_patched_matches_hf(model_type, monkeypatch):
    eager = build(model_type)
    ref = clone(eager, torch.float64)
    ours = fuselm.hf.patch(clone(eager))
    spec = family(model_type)
    vocab = eager.config.get_text_config().vocab_size
    ids, labels = _batch(vocab)

    swapped = {type(m).__name__ for m in ours.modules() if "forward" in vars(m)}
    named = {spec.rms_norm, spec.mlp} - {None}
    assert named <= swapped, f"classes named by the spec but absent from the model: {named - swapped}"
    assert type(ours).__name__ in swapped

    calls = _Calls(monkeypatch)
    outs = [_train_step(m, ids, labels) for m in (ref, eager, ours)]
    again = eager(input_ids=ids, labels=labels).loss  # no dropout or other randomness: the runs compare
    assert torch.equal(again, outs[1].loss), "the tiny model is not deterministic in training"
    assert outs[2].logits is None, "the training forward with labels made logits"
    if model_type == "llava":  # its text model is a Llama: instance patching finds that family's blocks
        assert {"LlamaRMSNorm", "LlamaMLP"} <= swapped
    for component in ["loss", *spec.components()]:
        assert calls.n.get(component, 0) > 0, f"{component}: no call into fuselm"
    assert_numerics("loss", outs[2].loss, outs[1].loss, outs[0].loss, torch.float32)
    grads = [_grads(m) for m in (ref, eager, ours)]
    assert grads[2].keys() == grads[1].keys()
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)

    for m in (ref, eager, ours):
        m.eval()
    with torch.no_grad():
        evals = [m(input_ids=ids, labels=labels) for m in (ref, eager, ours)]
    assert evals[2].logits is not None, "eval with labels must return logits"
    assert_numerics("eval logits", evals[2].logits, evals[1].logits, evals[0].logits, torch.float32)
    assert_numerics("eval loss", evals[2].loss, evals[1].loss, evals[0].loss, torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma3", "llava"])
def test_class_patch_round_trip(model_type):
    """Class patching swaps every class the spec names (the multimodal wrapper's loss too) and
    unpatching restores the very same objects."""
    spec = family(model_type)
    module = importlib.import_module(spec.module)
    names = [*spec.causal_lms, *(n for c, n in spec.components().items() if c != "rope")]
    before = {n: vars(getattr(module, n)).get("forward") for n in names}
    rope_before = getattr(module, spec.rope) if spec.rope else None
    fuselm.hf.patch(model_type)
    assert fuselm.hf.is_patched(model_type)
    for n in names:
        assert getattr(module, n).forward is not before[n], n
    fuselm.hf.unpatch(model_type)
    assert not fuselm.hf.is_patched(model_type)
    for n in names:
        assert vars(getattr(module, n)).get("forward") is before[n], n
    if spec.rope:
        assert getattr(module, spec.rope) is rope_before


def test_aliases_point_at_registered_families():
    for alias, key in ALIASES.items():
        assert family(alias) is FAMILIES[key]


@pytest.mark.parametrize("model_type", MULTIMODAL_TYPES)
def test_multimodal_wrapper_from_auto_class_gets_the_fused_loss(model_type):
    """AutoModelForCausalLM on a Gemma 3 (>= 4B) config gives Gemma3ForConditionalGeneration, as
    AutoModelForImageTextToText does on Llava and Qwen2-VL configs: patch() fuses the wrapper's loss (no
    logits in training)."""
    auto = (
        transformers.AutoModelForCausalLM
        if model_type == "gemma3"
        else transformers.AutoModelForImageTextToText
    )
    model = auto.from_config(tiny_config(model_type))
    assert type(model).__name__ in family(model_type).causal_lms
    fuselm.hf.patch(model)
    ids, labels = _batch(model.config.get_text_config().vocab_size)
    assert model(input_ids=ids, labels=labels).logits is None


@pytest.mark.parametrize("readme", ["src/fuselm/hf/README.md", "README.md"])
def test_readme_table_is_the_registry(readme):
    text = (Path(__file__).resolve().parents[2] / readme).read_text()
    begin, end = "<!-- fuselm.hf.markdown_table() -->\n", "<!-- end of table -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == fuselm.hf.markdown_table(), f"regenerate {readme}'s table: fuselm.hf.markdown_table()"
