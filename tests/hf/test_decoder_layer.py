"""The decoder layer's add after the attention fused into the post-attention RMSNorm (``residual_norm``,
opt-in: ``fuselm.hf.patch(..., fused_residual=True)``): which families get it, that a patched tiny model
computes HF's loss, logits and every gradient under the numerics rule (fp32 and bf16, float64 reference),
that the call reaches HF's attention exactly as HF's forward makes it, gradient checkpointing, PEFT, the
fallbacks, that unpatching and the flag leave HF's layer, and that the default patch reads no source;
then the two-node layer (opt-in: ``fused_layer=True``).

The models are patched with only the norms and the fused residual (``rope=False, swiglu=False``, HF's
loss on its logits), so that what is compared is the layer itself; test_families.py runs every family
with everything on."""

from __future__ import annotations

import ast
import copy
import dataclasses
import gc
import importlib
import inspect
import warnings

import pytest
import torch
from conftest import triton_path
from kit.hf_models import ALL_TYPES, build, clone

import fuselm.hf
from fuselm.hf import _common, attention, decoder_layer, layer_layout
from fuselm.hf.registry import FAMILIES, LAYER_NOT_FUSED, family
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")
GCL = transformers.modeling_layers.GradientCheckpointingLayer

# Triton kernels on the CPU (TRITON_INTERPRET=1), whose fp32 -> bf16 conversions truncate
INTERPRETER = triton_path() and not torch.cuda.is_available()
FUSED_TYPES = tuple(t for t in ALL_TYPES if family(t).decoder_layer is not None)
# only the norms and the fused residual: the layer is what differs from HF
LAYER_ONLY = dict(fused_residual=True, rope=False, swiglu=False, linear_cross_entropy=False)


def _unpatch_all():
    gc.collect()
    for model_type in FAMILIES:
        fuselm.hf.unpatch(model_type)


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    _unpatch_all()
    yield
    _unpatch_all()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of decoder_layer.residual_rms_norm (one per decoder layer that took the fused path)."""
    calls = []
    fn = decoder_layer.residual_rms_norm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return fn(*args, **kwargs)

    monkeypatch.setattr(decoder_layer, "residual_rms_norm", spy)
    return calls


def _batch(vocab: int, b=2, t=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 5, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _step(model, ids, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(outs, models, dtype):
    """Loss, logits and every parameter gradient of (float64 reference, HF, patched) under the rule."""
    ref, eager, ours = outs
    assert_numerics("loss", ours.loss, eager.loss, ref.loss, dtype)
    assert_numerics("logits", ours.logits, eager.logits, ref.logits, dtype)
    grads = [_grads(m) for m in models]
    assert grads[2].keys() == grads[1].keys() and grads[1]
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], dtype)


def _checkpointing(model, **kwargs):
    """Gradient (activation) checkpointing on, under the name this transformers version has."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _decoder_layers(model, spec):
    return [m for m in model.modules() if _common.hf_class(m).__name__ == spec.decoder_layer]


# ---- which families ----


def test_every_family_with_a_swapped_rms_norm_says_whether_its_layer_is_fused():
    """A family whose RMSNorm fuselm swaps either names its decoder layer (Llama's layout) or says in
    LAYER_NOT_FUSED why not; no family is in both."""
    for key, spec in FAMILIES.items():
        if spec.rms_norm is None:
            assert spec.decoder_layer is None and key not in LAYER_NOT_FUSED, key
        else:
            assert (spec.decoder_layer is None) == (key in LAYER_NOT_FUSED), key


def _layer_classes(spec):
    module = importlib.import_module(spec.module)
    return [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, GCL) and c.__module__ == spec.module
        if c.__name__.endswith("DecoderLayer")
    ]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_layout_check_agrees_with_the_registry(model_type):
    """The syntax-tree check finds Llama's layout in the layer each spec names, and in no decoder layer of
    the families LAYER_NOT_FUSED lists (a transformers version that made one Llama-like shows here)."""
    spec = FAMILIES[model_type]
    if spec.decoder_layer is not None:
        cls = getattr(importlib.import_module(spec.module), spec.decoder_layer)
        raw, _, _ = layer_layout.split_checkpointing(cls.forward)
        layout = layer_layout.llama_layer_layout(raw)
        assert isinstance(layout, layer_layout.LayerLayout), layout
        assert layout.params[0] == "hidden_states" and layout.attn_var_kw
    elif model_type in LAYER_NOT_FUSED:
        classes = _layer_classes(spec)
        assert classes
        for cls in classes:
            split = layer_layout.split_checkpointing(cls.forward)
            assert isinstance(split, str) or isinstance(layer_layout.llama_layer_layout(split[0]), str), cls


def test_a_layer_that_is_not_llamas_layout_stays_hf(monkeypatch):
    """A spec naming a layer of another layout (Phi-3's: dropout before the adds) gets no patched layer:
    one warning, the class keeps HF's forward, the rest of the family is patched."""
    monkeypatch.setattr(_common, "_warned", set())
    spec = dataclasses.replace(family("phi3"), decoder_layer="Phi3DecoderLayer")
    cls = importlib.import_module(spec.module).Phi3DecoderLayer
    before = vars(cls)["forward"]
    with pytest.warns(UserWarning, match="Phi3DecoderLayer .*not Llama's pre-norm layout"):
        assert decoder_layer.decoder_layer_forward(spec, cls.forward, False, True) is None
    monkeypatch.setitem(FAMILIES, "phi3", spec)
    try:
        fuselm.hf.patch("phi3", fused_residual=True)
        assert vars(cls)["forward"] is before
        norm = getattr(importlib.import_module(spec.module), spec.rms_norm)
        assert norm.forward.__qualname__ == "fuselm_Phi3RMSNorm.forward"
    finally:
        fuselm.hf.unpatch("phi3")


# ---- numerics ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", FUSED_TYPES)
def test_fused_residual_matches_hf(model_type, dtype, fused_calls):
    """Training loss, logits and every parameter gradient of the patched model follow the numerics rule
    against HF's (float64 reference); every decoder layer took the fused path."""
    if dtype == torch.bfloat16 and INTERPRETER:
        pytest.skip(
            "the Triton interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest even, "
            "as PyTorch): bf16 is checked without TRITON_INTERPRET (the PyTorch reference path), the "
            "kernel by tests/ops/test_rms_norm.py on the GPU"
        )
    eager = build(model_type, dtype=dtype)
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY))
    spec = family(model_type)
    n_layers = len(_decoder_layers(models[2], spec))
    assert n_layers == 2
    ids, labels = _batch(eager.config.get_text_config().vocab_size)
    outs = [_step(m, ids, labels) for m in models[:2]]
    assert not fused_calls
    outs.append(_step(models[2], ids, labels))
    assert len(fused_calls) == n_layers
    _compare(outs, models, dtype)


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_self_attn_gets_what_hf_passes(model_type):
    """The patched layer calls self_attn with the keyword arguments HF's forward passes (Mixtral's forward
    has another signature and passes no use_cache), extra keyword arguments included, whether the
    layer's arguments come by name or by position; the output is HF's tensor."""
    eager = build(model_type)
    ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager), **LAYER_ONLY)
    seen = {}

    def record(name):
        def hook(module, args, kwargs):
            seen[name] = (args, dict(kwargs))

        return hook

    for name, model in (("hf", eager), ("ours", ours)):
        model.model.layers[0].self_attn.register_forward_pre_hook(record(name), with_kwargs=True)
    h = torch.randn(2, 8, eager.config.hidden_size, generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(8)[None].expand(2, 8)
    cos_sin = eager.model.rotary_emb(h, position_ids)
    layer_hf, layer_ours = eager.model.layers[0], ours.model.layers[0]
    assert "forward" in vars(layer_ours) and "forward" not in vars(layer_hf)
    calls = [
        dict(position_embeddings=cos_sin, position_ids=position_ids, extra_kwarg="x"),
        dict(position_embeddings=cos_sin, attention_mask=None),
    ]
    for kwargs in calls:
        y_hf, y_ours = layer_hf(h, **kwargs), layer_ours(h, **kwargs)
        assert type(y_hf) is type(y_ours) is torch.Tensor
        kwargs64 = {**kwargs, "position_embeddings": tuple(t.double() for t in cos_sin)}
        y64 = ref.model.layers[0](h.double(), **kwargs64)
        assert_numerics("layer output", y_ours, y_hf, y64, torch.float32)
        (args_hf, kw_hf), (args_ours, kw_ours) = seen["hf"], seen["ours"]
        assert args_hf == args_ours == ()
        assert kw_hf.keys() == kw_ours.keys()
        for key in kw_hf:
            if key != "hidden_states":
                assert kw_ours[key] is kw_hf[key], key
    # by position, as far as the signature goes: the same binding as HF's
    names = layer_layout.llama_layer_layout(
        layer_layout.split_checkpointing(type(layer_hf).forward)[0]
    ).params
    positional = {"position_embeddings": cos_sin, "attention_mask": None, "position_ids": position_ids}
    args = [positional.get(n) for n in names[1:]]
    args = [False if n == "use_cache" else a for n, a in zip(names[1:], args, strict=True)]
    torch.testing.assert_close(layer_ours(h, *args), layer_hf(h, *args))
    assert seen["ours"][1].keys() == seen["hf"][1].keys()
    for layer in (layer_hf, layer_ours):  # the same errors as HF's
        with pytest.raises(TypeError, match="multiple values"):
            layer(h, args[0], **{names[1]: args[0]})
        with pytest.raises(TypeError):
            layer(h, *args, None)


def test_generation_with_a_cache(fused_calls):
    """Eval with a KV cache (prefill, then one token): the layer passes past_key_values and use_cache on,
    the cache fills as HF's, the logits follow the rule."""
    eager = build("qwen3")
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY))
    ids, _ = _batch(eager.config.vocab_size, t=9)
    logits, lengths = [], []
    for m in models:
        m.eval()
        cache = transformers.DynamicCache(config=m.config)
        with torch.no_grad():
            m(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
            out = m(input_ids=ids[:, 8:], past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        lengths.append(cache.get_seq_length())
    assert lengths == [9, 9, 9]
    assert len(fused_calls) == 4  # 2 layers x 2 calls
    assert_numerics("decode logits", logits[2], logits[1], logits[0], torch.float32)


# ---- gradient checkpointing, PEFT ----


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("by", ["instance", "class"])
def test_gradient_checkpointing(by, reentrant, fused_calls):
    """With gradient checkpointing on, the patched layer is checkpointed (the backward recomputes it: the
    fused norm runs twice per layer) and loss and gradients follow the rule."""
    eager = build("llama")
    models = [clone(eager, torch.float64), eager, clone(eager)]
    for m in models:
        _checkpointing(m, use_reentrant=reentrant)
    if by == "instance":
        fuselm.hf.patch(models[2], **LAYER_ONLY)
    ids, labels = _batch(eager.config.vocab_size)
    outs = [_step(m, ids, labels) for m in models[:2]]
    if by == "class":
        fuselm.hf.patch("llama", **LAYER_ONLY)
        assert type(models[2].model.layers[0]).forward.__qualname__ == "fuselm_LlamaDecoderLayer.forward"
    outs.append(_step(models[2], ids, labels))
    assert len(fused_calls) == 2 * 2  # forward, then the recompute in backward
    _compare(outs, models, torch.float32)


def test_checkpointing_every_other_layer(fused_calls):
    """transformers 5.23's every_n_layers=2: the first layer is checkpointed, the second not (the patched
    forward reads the flag HF sets per layer)."""
    model = fuselm.hf.patch(build("llama"), **LAYER_ONLY)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip("no every_n_layers in this transformers version")
    enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    _step(model, *_batch(300))
    assert len(fused_calls) == 3  # 2 in forward, the first layer again in backward


def test_gradient_checkpointing_turns_the_cache_off_as_hf(fused_calls):
    """Training under gradient checkpointing with use_cache=True: the layer gets use_cache=False and no
    cache, as HF's GradientCheckpointingLayer sets them (the cache argument under the name the installed
    transformers uses: past_key_values, or cache from 5.24 on)."""
    eager = build("llama")
    raw, _, _ = layer_layout.split_checkpointing(type(eager.model.layers[0]).forward)
    cache_name = "cache" if "cache" in inspect.signature(raw).parameters else "past_key_values"
    h = torch.randn(1, 4, eager.config.hidden_size, requires_grad=True)
    cos_sin = eager.model.rotary_emb(h, torch.arange(4)[None])
    seen = {}
    for name, model in (("hf", eager), ("ours", fuselm.hf.patch(clone(eager), **LAYER_ONLY))):
        _checkpointing(model, use_reentrant=False)
        model.train()
        layer = model.model.layers[0]
        seen[name] = []
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, _s=seen[name]: _s.append((kw.get("use_cache"), kw.get(cache_name))),
            with_kwargs=True,
        )
        cache = transformers.DynamicCache(config=model.config)
        layer(h, position_embeddings=cos_sin, use_cache=True, **{cache_name: cache}).sum().backward()
        assert cache.get_seq_length() == 0
    assert seen["ours"] == seen["hf"] == [(False, None)] * 2  # forward, recompute
    assert len(fused_calls) == 2


def test_deprecated_cache_argument_is_renamed_as_hf(fused_calls):
    """transformers 5.24 renamed the layers' past_key_values argument cache (with a deprecate_kwarg
    wrapper): the patched layer keeps that wrapper, so the old name still reaches the attention as cache,
    with the same outputs as HF's layer."""
    eager = build("llama")
    raw, _, _ = layer_layout.split_checkpointing(type(eager.model.layers[0]).forward)
    if "cache" not in inspect.signature(raw).parameters:
        pytest.skip("this transformers version names the layer's cache argument past_key_values")
    h = torch.randn(1, 4, eager.config.hidden_size)
    cos_sin = eager.model.rotary_emb(h, torch.arange(4)[None])
    seen = {}
    for name, model in (("hf", eager), ("ours", fuselm.hf.patch(clone(eager), **LAYER_ONLY))):
        layer = model.model.layers[0]
        seen[name] = []
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, _s=seen[name]: _s.append(type(kw.get("cache")).__name__), with_kwargs=True
        )
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            layer(h, position_embeddings=cos_sin, use_cache=True, past_key_values=cache)
        assert cache.get_seq_length() == 4
    assert seen["ours"] == seen["hf"] == ["DynamicCache"]
    assert len(fused_calls) == 1


def test_peft_lora_on_attention_and_mlp(fused_calls):
    """LoRA on q_proj, v_proj and up_proj: the patched layer calls the PEFT-wrapped attention and MLP as
    modules; loss, logits and the LoRA gradients follow the rule."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    eager = peft.get_peft_model(build("mistral"), lora)
    for name, p in eager.named_parameters():  # LoRA B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    models = (copy.deepcopy(eager).double(), eager, fuselm.hf.patch(copy.deepcopy(eager), **LAYER_ONLY))
    ids, labels = _batch(300)
    outs = [_step(m, ids, labels) for m in models]
    assert len(fused_calls) == 2
    assert any("lora_B" in n for n in _grads(models[2]))
    _compare(outs, models, torch.float32)


# ---- fallbacks ----


def test_a_hooked_norm_runs_hfs_forward(fused_calls):
    """A forward hook on a layer's post-attention norm: that layer runs HF's forward (the hook fires), the
    other one the fused path; the results follow the rule."""
    eager = build("llama")
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY))
    fired = []
    for m in models:
        m.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *a: fired.append(1))
    ids, labels = _batch(300)
    outs = [_step(m, ids, labels) for m in models]
    assert len(fired) == 3 and len(fused_calls) == 1
    _compare(outs, models, torch.float32)


def test_a_norm_of_another_class_runs_hfs_forward(fused_calls):
    """A post-attention norm that is not the family's RMSNorm (a subclass of it here, which could compute
    anything) or not on fuselm's forward (an instance forward of someone else's): HF's forward runs."""

    module = importlib.import_module(family("llama").module)

    class ScaledNorm(module.LlamaRMSNorm):
        def forward(self, hidden_states):
            return 2.0 * super().forward(hidden_states)

    eager = build("llama")
    models = [clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY)]
    for m in models:
        norm = ScaledNorm(m.config.hidden_size, eps=m.config.rms_norm_eps).to(m.dtype)
        m.model.layers[0].post_attention_layernorm = norm
        other = m.model.layers[1].post_attention_layernorm  # an instance forward of someone else's
        other.forward = lambda x, _f=other.forward: _f(x) * 0.5  # over fuselm's (HF's in the others)
    ids, labels = _batch(300)
    outs = [_step(m, ids, labels) for m in models]
    assert not fused_calls
    _compare(outs, models, torch.float32)


def test_autocast_adds_in_the_residual_dtype(fused_calls):
    """Under CPU autocast (bf16 matmuls, fp32 weights) the attention output is bf16 and the residual stream
    fp32: HF's add promotes to fp32, and so does the fused path (the attention output is upcast first)."""
    eager = build("llama")
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY))
    ids, labels = _batch(300)
    outs = [_step(models[0], ids, labels)]
    for m in models[1:]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(_step(m, ids, labels))
    assert len(fused_calls) == 2
    _compare(outs, models, torch.bfloat16)


def test_tensors_that_are_not_plain_run_hfs_add_and_norm(monkeypatch, fused_calls):
    """When the attention output or the residual is not a plain tensor (a DTensor), the layer runs HF's
    add and calls the norm module, after the attention it has already run."""
    only_weights = lambda t: type(t) is torch.nn.Parameter  # noqa: E731 - the weights stay plain
    monkeypatch.setattr(decoder_layer, "is_plain_tensor", only_weights)
    eager = build("llama")
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY))
    ids, labels = _batch(300)
    outs = [_step(m, ids, labels) for m in models]
    assert not fused_calls
    _compare(outs, models, torch.float32)


# ---- flags, unpatching ----


@pytest.mark.parametrize("by", ["instance", "class"])
def test_unpatch_restores_hfs_layer(by):
    spec = family("llama")
    module = importlib.import_module(spec.module)
    cls = getattr(module, spec.decoder_layer)
    before = vars(cls)["forward"]
    model = build("llama")
    fuselm.hf.patch(model if by == "instance" else "llama", fused_residual=True)
    layer = model.model.layers[0]
    assert layer.forward.__func__.__qualname__ == "fuselm_LlamaDecoderLayer.forward"
    assert (by == "instance") == ("forward" in vars(layer))
    fuselm.hf.unpatch(model if by == "instance" else "llama")
    assert vars(cls)["forward"] is before
    assert not any("forward" in vars(m) for m in model.modules())
    assert layer.forward.__func__ is before


@pytest.mark.parametrize("by", ["instance", "class"])
def test_the_fused_residual_is_opt_in(by, fused_calls):
    """Without the two-node layer (fused_layer=False) the patch leaves the decoder layers HF's (their norms
    and MLP run fuselm's); re-patching with fused_residual=True puts the fused residual in; without
    rms_norm it is refused."""
    module = importlib.import_module(family("llama").module)
    model = build("llama")
    target = model if by == "instance" else "llama"
    fuselm.hf.patch(target, fused_layer=False)
    layer = model.model.layers[0]
    assert layer.forward.__func__ is vars(module.LlamaDecoderLayer)["forward"]  # HF's own
    assert layer.mlp.forward.__func__.__qualname__ == "fuselm_LlamaMLP.forward"
    _step(model, *_batch(300))
    assert not fused_calls
    fuselm.hf.patch(target, fused_residual=True, fused_layer=False)
    assert layer.forward.__func__.__qualname__ == "fuselm_LlamaDecoderLayer.forward"
    _step(model, *_batch(300))
    assert len(fused_calls) == 2
    with pytest.raises(ValueError, match="fused_residual=True .* needs rms_norm=True"):
        fuselm.hf.patch(target, fused_residual=True, rms_norm=False)


def _refuse_source_reading(guard):
    """Make ast.parse, inspect.getsource and inspect.findsource raise AssertionError (under ``guard``, a
    monkeypatch context)."""

    def refuse(name):
        def refused(*args, **kwargs):
            raise AssertionError(f"{name} called on the patch path")

        return refused

    guard.setattr(ast, "parse", refuse("ast.parse"))
    guard.setattr(inspect, "getsource", refuse("inspect.getsource"))
    guard.setattr(inspect, "findsource", refuse("inspect.findsource"))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma", "granite"])
def test_the_default_patch_reads_no_source(model_type, monkeypatch):
    """The default patch, of an instance or of the family's classes, never reads transformers' source (no
    ast.parse, no inspect.getsource / findsource), also with nothing built and cached before, and the
    patched model trains through fuselm's forwards."""
    attention.attention_forward.cache_clear()
    decoder_layer.decoder_layer_forward.cache_clear()
    with monkeypatch.context() as guard:
        _refuse_source_reading(guard)
        model = fuselm.hf.patch(build(model_type))
        fuselm.hf.patch(model_type)
        out = _step(model, *_batch(model.config.vocab_size))
        fuselm.hf.unpatch(model_type)
    assert out.logits is None and torch.isfinite(out.loss)
    assert model.forward.__func__.__qualname__.startswith("fuselm_")


def test_fused_layer_reads_the_source_once_per_class(monkeypatch):
    """fused_layer=True (the two-node layer, the fused attention input) reads the installed source once per
    class, when its forward is first built: patching again parses nothing for an instance or a class patch,
    and the patched model trains; a forward not built yet does read the layer's source, which the same
    guards stop."""
    model = build("llama")
    fuselm.hf.patch(build("llama"), fused_layer=True)  # builds (and caches) the forwards
    with monkeypatch.context() as guard:
        _refuse_source_reading(guard)
        fuselm.hf.patch(model, fused_layer=True)
        fuselm.hf.patch("llama", fused_layer=True)
        decoder_layer.decoder_layer_forward.cache_clear()  # not cached: built from the source again
        with pytest.raises(AssertionError, match="called on the patch path"):
            fuselm.hf.patch(build("llama"), fused_residual=True)
    out = _step(model, *_batch(300))
    assert out.logits is None and torch.isfinite(out.loss)
    assert model.model.layers[0].forward.__func__.__qualname__ == "fuselm_LlamaDecoderLayer.forward"


def test_class_patch_reaches_fsdp2_classes_made_before_and_during_it(fused_calls):
    """FSDP2 makes one subclass (FSDPModule, cls) per class and caches it, and transformers 5.23 wraps a
    subclass's forward when the subclass is made: a class patch also patches such a class made before it,
    one made during it wraps the patched forward, and unpatching leaves both on HF's forward. Layers of
    both classes are checkpointed once (the fused norm runs twice per layer, not more)."""
    cls = importlib.import_module(family("llama").module).LlamaDecoderLayer

    class FSDPModule:  # the name FSDP2's base class has (fuselm.hf looks through its subclasses)
        pass

    def make():
        return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})

    if "forward" not in vars(make()):
        pytest.skip("this transformers version checkpoints in __call__: subclasses inherit forward")
    hf = vars(cls)["forward"]
    before = make()
    fuselm.hf.patch("llama", fused_residual=True, fused_layer=False)
    ours = vars(cls)["forward"]
    during = make()
    assert vars(before)["forward"] is ours and vars(during)["forward"].__wrapped__ is ours
    config = build("llama").config
    h = torch.randn(1, 4, config.hidden_size, requires_grad=True)
    for sub in (before, during):
        layer = sub(config, 0).train()
        layer.gradient_checkpointing = True
        checkpoints = []

        def checkpoint(fn, *args, _seen=checkpoints):
            _seen.append(1)
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

        layer._gradient_checkpointing_func = checkpoint
        cos_sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)(
            h, torch.arange(4)[None]
        )
        fused_calls.clear()
        layer(h, position_embeddings=cos_sin).sum().backward()
        assert len(fused_calls) == 2 and len(checkpoints) == 1, sub
    fuselm.hf.unpatch("llama")
    assert vars(cls)["forward"] is hf and vars(during)["forward"] is hf
    assert vars(before)["forward"].__wrapped__ is hf  # its own wrapper, as FSDP2 made it
    del before, during, layer
    gc.collect()  # the test's classes leave cls.__subclasses__()


def test_torch_compile_fullgraph_takes_the_fused_path(fused_calls):
    """torch.compile(fullgraph=True) of the patched decoder traces the fused path (no graph break, the
    checks of the norm resolved at trace time) and computes HF's hidden states."""
    eager = build("llama")
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager), **LAYER_ONLY))
    ids, _ = _batch(300)
    torch._dynamo.reset()
    compiled = torch.compile(models[2].model, backend="eager", fullgraph=True)
    with torch.no_grad():
        ref, hf = (m.model(input_ids=ids).last_hidden_state for m in models[:2])
        ours = compiled(input_ids=ids).last_hidden_state
    assert len(fused_calls) == 2  # traced once per layer
    assert_numerics("hidden states", ours, hf, ref, torch.float32)
    torch._dynamo.reset()


# ---- the two-node layer (fused_layer=True, opt-in) ----

TWO_NODE_TYPES = ("llama", "mistral", "qwen2", "gemma")  # gemma: (1 + weight) norms, GeLU-tanh


@pytest.fixture
def two_node_calls(monkeypatch):
    """Counts calls of decoder_layer.norm_qkv_rotary (one per layer that took the two-node path)."""
    calls = []
    fn = decoder_layer.norm_qkv_rotary

    def spy(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(decoder_layer, "norm_qkv_rotary", spy)
    return calls


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", TWO_NODE_TYPES)
def test_two_node_layer_matches_hf(model_type, dtype, checkpointing, two_node_calls):
    """fused_layer=True runs every decoder layer as two nodes around HF's attention (Mistral's and Qwen 2's
    sliding-window arguments, Qwen 2's q, k, v biases, Gemma's norms and GeGLU reach it): loss, logits and
    every gradient follow the numerics rule against HF's (float64 reference), with and without gradient
    checkpointing."""
    if dtype == torch.bfloat16 and INTERPRETER:
        pytest.skip("the Triton interpreter truncates fp32 to bf16: bf16 is checked on the GPU")
    eager = build(model_type, dtype=dtype)
    models = [clone(eager, torch.float64), eager, clone(eager)]
    # HF's loss on the logits, to compare them too
    models[2] = fuselm.hf.patch(models[2], linear_cross_entropy=False, fused_layer=True)
    if checkpointing:
        for m in models:
            _checkpointing(m, use_reentrant=False)
    ids, labels = _batch(eager.config.get_text_config().vocab_size)
    outs = [_step(m, ids, labels) for m in models[:2]]
    assert not two_node_calls
    outs.append(_step(models[2], ids, labels))
    n_layers = len(_decoder_layers(models[2], family(model_type)))
    expected = n_layers * (2 if checkpointing else 1)  # checkpointing runs each forward again
    assert len(two_node_calls) == expected
    _compare(outs, models, dtype)


def test_two_node_layer_under_autocast_runs_the_modules_and_says_so(two_node_calls, monkeypatch):
    """An fp32 model under bf16 autocast: the layers run their modules (the nodes take one dtype), with one
    warning naming the reason."""
    monkeypatch.setattr(_common, "_warned", set())
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    model = fuselm.hf.patch(build("llama", device=device_type), fused_layer=True)
    ids, labels = _batch(300)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        why = "LlamaDecoderLayer runs its modules: autocast to torch.bfloat16 over torch.float32"
        with pytest.warns(UserWarning, match=why):
            out = _step(model, ids.to(device_type), labels.to(device_type))
    assert torch.isfinite(out.loss) and not two_node_calls


def test_two_node_layer_under_autocast_to_the_models_dtype(two_node_calls):
    """A bf16 model under bf16 autocast (Trainer's bf16=True): autocast casts nothing, the two nodes run,
    silently, and the loss and gradients are those of the same model without autocast, bit for bit."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    model = fuselm.hf.patch(build("llama", dtype=torch.bfloat16, device=device_type), fused_layer=True)
    ids, labels = (t.to(device_type) for t in _batch(300))
    runs = []
    for cast in (False, True):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cast), warnings.catch_warnings():
            warnings.simplefilter("error")  # no "runs its modules" warning
            runs.append((_step(model, ids, labels).loss.detach(), _grads(model)))
    assert len(two_node_calls) == 4  # two layers, two runs
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


def test_two_node_layer_not_where_hooks_or_adapters_are(two_node_calls):
    """A hook on the MLP, or PEFT LoRA layers on the projections: the layer runs its modules (hooks run,
    the adapters take fuselm.lora's path), silently (it is their designed path)."""
    model = fuselm.hf.patch(build("llama"), fused_layer=True)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda *a: seen.append(1))
    _step(model, *_batch(300))
    assert seen == [1] and len(two_node_calls) == 1  # the other layer took the two nodes
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    fuselm.hf.patch(lora, fused_layer=True)
    two_node_calls.clear()
    _step(lora, *_batch(300))
    assert not two_node_calls


def test_the_two_node_layer_is_opt_in():
    model = fuselm.hf.patch(build("llama"))
    module = importlib.import_module(family("llama").module)
    assert model.model.layers[0].forward.__func__ is vars(module.LlamaDecoderLayer)["forward"]
    fused = fuselm.hf.patch(build("llama"), fused_layer=True).model.layers[0]
    assert fused.forward.__func__.__qualname__ == "fuselm_LlamaDecoderLayer.forward"


@pytest.mark.parametrize(
    "flags, why",
    [
        (dict(rms_norm=False), "needs rms_norm=True"),
        (dict(rope=False, swiglu=False), "needs rope=True and swiglu=True"),
        (dict(mlp_chunk_tokens=64), "cannot take mlp_chunk_tokens"),
    ],
)
def test_fused_layer_without_its_parts_is_refused(flags, why):
    model = build("llama")
    with pytest.raises(ValueError, match=f"fused_layer=True .*{why}"):
        fuselm.hf.patch(model, fused_layer=True, **flags)
    assert not fuselm.hf.is_patched(model)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_two_node_layer_generates_as_hf(model_type, two_node_calls):
    """Greedy generation (a KV cache, a padded batch's mask) through the two-node layers gives HF's
    tokens: the cache update and the mask are HF's code between the nodes."""
    eager = build(model_type)
    ours = fuselm.hf.patch(clone(eager), fused_layer=True)
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in the first row
    for m in (eager, ours):
        m.eval()
    want = eager.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert not two_node_calls
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert two_node_calls  # the prefill and every decoding step
    assert torch.equal(got, want)


def test_output_attentions_and_hidden_states_as_hf(two_node_calls):
    """output_attentions / output_hidden_states (transformers records them with hooks on the modules): the
    patched model returns HF's attention weights and hidden states (eager attention, float32)."""
    eager = build("llama")
    eager.config._attn_implementation = "eager"
    ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager), fused_layer=True)
    ref.config._attn_implementation = "eager"
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    outs = [m(ids, output_attentions=True, output_hidden_states=True) for m in (ref, eager, ours)]
    assert len(outs[2].attentions) == len(outs[1].attentions) == 2
    for name in ("attentions", "hidden_states"):
        for i, (r, e, o) in enumerate(zip(*(getattr(out, name) for out in outs), strict=True)):
            assert_numerics(f"{name} {i}", o, e, r, torch.float32)
