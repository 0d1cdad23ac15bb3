"""Every model type of the registry, patched vs unpatched on a tiny model (CPU fp32, float64 reference):
the training loss, every parameter gradient and the eval logits follow the numerics rule, and the
fused path was taken (no logits in training, every component the spec names called into fuselm)."""

from __future__ import annotations

import gc
import importlib
import types
from pathlib import Path

import pytest
import torch
from kit.hf_models import ALL_TYPES, MULTIMODAL_TYPES, build, clone, tiny_config

import fuselm.hf
from fuselm.hf import blocks, loss
from fuselm.hf.installs import rope_in_module
from fuselm.hf.registry import ALIASES, FAMILIES, family
from fuselm.nn.mlp import gated_mlp
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")

# The modules of fuselm.hf and the names in them through which each swapped component reaches a fuselm op.
OPS = {
    "rms_norm": (blocks, ("rms_norm",)),
    "rope": (blocks, ("apply_rotary",)),
    "swiglu": (blocks, ("gated_mlp", "gated_packed")),
    "loss": (loss, ("linear_cross_entropy",)),
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
    """Counts calls into the fuselm ops that fuselm.hf's forwards use."""

    def __init__(self, monkeypatch):
        self.n = {}
        for component, (module, names) in OPS.items():
            for name in names:
                where = f"{module.__name__}.{name}"
                assert hasattr(module, name), f"{where} is gone: update OPS"
                monkeypatch.setattr(module, name, self._spy(component, getattr(module, name)))

    def _spy(self, component, fn):
        def spy(*args, **kwargs):
            self.n[component] = self.n.get(component, 0) + 1
            return fn(*args, **kwargs)

        return spy


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_step(model, ids, labels, **inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **inputs)
    out.loss.backward()
    return out


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_family_patched_matches_hf(model_type, monkeypatch):
    """HF's model and its float64 twin run (training step, then eval) before fuselm patches a third copy:
    the RoPE is module-level in HF, and while a patched model of the family lives every model of it runs
    fuselm's, so the baselines must run first to be HF's own. The decoder layers and the attention stay
    HF's."""
    eager = build(model_type)
    ref = clone(eager, torch.float64)
    mine = clone(eager)
    spec = family(model_type)
    vocab = eager.config.get_text_config().vocab_size
    ids, labels = _batch(vocab)

    base = [_train_step(m, ids, labels) for m in (ref, eager)]
    again = eager(input_ids=ids, labels=labels).loss  # no dropout or other randomness: the runs compare
    assert torch.equal(again, base[1].loss), "the tiny model is not deterministic in training"
    base_grads = [_grads(m) for m in (ref, eager)]
    for m in (ref, eager):
        m.eval()
    with torch.no_grad():
        base_evals = [m(input_ids=ids, labels=labels) for m in (ref, eager)]

    ours = fuselm.hf.patch(mine)
    swapped = {type(m).__name__ for m in ours.modules() if "forward" in vars(m)}
    named = {spec.rms_norm, spec.mlp} - {None}
    assert named <= swapped, f"classes named by the spec but absent from the model: {named - swapped}"
    assert type(ours).__name__ in swapped
    assert not any(n.endswith(("DecoderLayer", "Attention")) for n in swapped), swapped

    calls = _Calls(monkeypatch)
    out = _train_step(ours, ids, labels)
    assert out.logits is None, "the training forward with labels made logits"
    if model_type == "llava":  # its text model is a Llama: instance patching finds that family's blocks
        assert {"LlamaRMSNorm", "LlamaMLP"} <= swapped
    for component in ["loss", *spec.components()]:
        assert calls.n.get(component, 0) > 0, f"{component}: no call into fuselm"
    assert_numerics("loss", out.loss, base[1].loss, base[0].loss, torch.float32)
    grads = _grads(ours)
    assert grads.keys() == base_grads[1].keys()
    for name in base_grads[1]:
        assert_numerics(f"grad {name}", grads[name], base_grads[1][name], base_grads[0][name], torch.float32)

    ours.eval()
    with torch.no_grad():
        evaluated = ours(input_ids=ids, labels=labels)
    assert evaluated.logits is not None, "eval with labels must return logits"
    logits = [e.logits for e in base_evals]
    assert_numerics("eval logits", evaluated.logits, logits[1], logits[0], torch.float32)
    assert_numerics("eval loss", evaluated.loss, base_evals[1].loss, base_evals[0].loss, torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma3", "llava"])
def test_class_patch_round_trip(model_type):
    """Class patching swaps every class the spec names (the multimodal wrapper's loss too) and unpatching
    restores the very same objects."""
    spec = family(model_type)
    module = importlib.import_module(spec.module)
    names = [*spec.causal_lms, *(n for c, n in spec.components().items() if c != "rope")]
    before = {n: vars(getattr(module, n)).get("forward") for n in names}
    rope_before = rope_in_module(spec) if spec.rope else None
    fuselm.hf.patch(model_type)
    assert fuselm.hf.is_patched(model_type)
    for n in names:
        assert getattr(module, n).forward is not before[n], n
    fuselm.hf.unpatch(model_type)
    assert not fuselm.hf.is_patched(model_type)
    for n in names:
        assert vars(getattr(module, n)).get("forward") is before[n], n
    if spec.rope:
        assert rope_in_module(spec) is rope_before


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


def test_readme_table_is_the_registry():
    readme = "src/fuselm/hf/README.md"
    text = (Path(__file__).resolve().parents[2] / readme).read_text()
    begin, end = "<!-- fuselm.hf.markdown_table() -->\n", "<!-- end of table -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == fuselm.hf.markdown_table(), f"regenerate {readme}'s table: fuselm.hf.markdown_table()"


# ---- Falcon-H1: the MLP's gate and down multipliers ----


def _falcon_h1_mlp_runs(x: torch.Tensor):
    """(float64 reference, eager HF, patched) first-layer MLPs of one tiny Falcon-H1 model, and x for each
    (leaves: x.grad is the input gradient)."""
    eager = build("falcon_h1")
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager)))
    mlps = [m.model.layers[0].feed_forward for m in models]
    xs = [x.to(dtype).detach().requires_grad_() for dtype in (torch.float64, torch.float32, torch.float32)]
    return mlps, xs


def _mlp_step(mlp, x, dy):
    mlp.zero_grad(set_to_none=True)
    y = mlp(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def test_falcon_h1_patched_mlp_carries_the_multipliers():
    """FalconH1MLP runs fuselm's gated MLP with HF's ``up * act(gate * g)`` and ``down(...) * d``: output,
    input gradient and every parameter gradient (biases included) follow the numerics rule, with
    multipliers that are read at each call (as HF's forward reads them)."""
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    mlps, xs = _falcon_h1_mlp_runs(x)
    assert (mlps[1].gate_multiplier, mlps[1].down_multiplier) == (0.7, 1.3)
    assert mlps[2].forward.__qualname__ == "fuselm_FalconH1MLP.forward"
    assert "forward" not in vars(mlps[1]) and mlps[1].down_proj.bias is not None
    for gate, down in ((0.7, 1.3), (2.5, 0.25)):  # the config's, then changed on the modules
        for mlp in mlps:
            mlp.gate_multiplier, mlp.down_multiplier = gate, down
        for x_ in xs:
            x_.grad = None
        runs = [_mlp_step(mlp, x_, dy) for mlp, x_ in zip(mlps, xs, strict=True)]
        (y64, dx64, dp64), (y, dx, dp), (y_ours, dx_ours, dp_ours) = runs
        assert_numerics("mlp output", y_ours, y, y64, torch.float32)
        assert_numerics("mlp dx", dx_ours, dx, dx64, torch.float32)
        for name in dp:
            assert_numerics(f"mlp grad {name}", dp_ours[name], dp[name], dp64[name], torch.float32)


@pytest.mark.parametrize("dropped", ["gate", "down", "both"])
def test_falcon_h1_mlp_without_a_multiplier_fails_the_numerics_rule(dropped):
    """The comparisons above would catch a fused MLP that dropped a multiplier: fuselm's gated MLP
    without it is outside the numerics rule against HF's FalconH1MLP."""
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    mlps, xs = _falcon_h1_mlp_runs(x)
    with torch.no_grad():
        y64, y = mlps[0](xs[0]), mlps[1](xs[1])
        mlp = mlps[2]
        kept = {
            "gate_multiplier": 1.0 if dropped in ("gate", "both") else mlp.gate_multiplier,
            "down_multiplier": 1.0 if dropped in ("down", "both") else mlp.down_multiplier,
        }
        wrong = gated_mlp(xs[2], mlp.gate_proj, mlp.up_proj, mlp.down_proj, "silu", **kept)
    with pytest.raises(AssertionError, match="mlp output"):
        assert_numerics("mlp output", wrong, y, y64, torch.float32)


def test_falcon_h1_model_with_dropped_multipliers_fails_the_family_check(monkeypatch):
    """At the model level too: the patched Falcon-H1 with its MLP multipliers set to 1 gives a training
    loss outside the numerics rule against HF's (multipliers 0.7 and 1.3), so
    test_family_patched_matches_hf[falcon_h1] checks that the multipliers are applied."""
    eager = build("falcon_h1")
    ref, ours = clone(eager, torch.float64), fuselm.hf.patch(clone(eager))
    for layer in ours.model.layers:
        layer.feed_forward.gate_multiplier = layer.feed_forward.down_multiplier = 1.0
    ids, labels = _batch(eager.config.vocab_size)
    losses = [_train_step(m, ids, labels).loss for m in (ref, eager, ours)]
    with pytest.raises(AssertionError, match="loss"):
        assert_numerics("loss", losses[2], losses[1], losses[0], torch.float32)


def test_falcon_h1_spec_patches_the_attention_blocks_and_leaves_the_mamba_mixer():
    """FalconH1RMSNorm is Llama's (fp32 statistics, cast, then weight *), the attention calls the standard
    ``apply_rotary_pos_emb(q, k, cos, sin)``, and the Mamba mixer's gated RMSNorm stays HF's."""
    spec = family("falcon_h1")
    assert (spec.rms_norm, spec.norm_style, spec.mlp, spec.rope) == (
        "FalconH1RMSNorm",
        "llama",
        "FalconH1MLP",
        "apply_rotary_pos_emb",
    )
    assert spec.mlp_multipliers == ("gate_multiplier", "down_multiplier") and not spec.rope_one_tensor
    config = tiny_config("falcon_h1")
    config.mamba_rms_norm = True  # the mixer's FalconH1RMSNormGated
    model = fuselm.hf.patch(transformers.FalconH1ForCausalLM(config))
    gated = [m for m in model.modules() if type(m).__name__ == "FalconH1RMSNormGated"]
    assert gated and all("forward" not in vars(m) for m in gated)
    assert rope_in_module(spec).__qualname__ == "fuselm_falcon_h1_apply_rotary_pos_emb"


# ---- Gemma 4: weight-only norms (some without weight), one-tensor RoPE, the vision tower ----


def _trained_like(model, seed=5):
    """Gemma4RMSNorm weights away from their initial ones (a wrong offset or rounding would show), and a
    random vision position table in place of HF's all-ones init, under which every patch gets the same
    position embedding: the vision q/k norm weight gradients are then sums that nearly cancel (HF's own
    fp32 error 2e-5 against float64), so they compare rounding orders more than the math."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Gemma4RMSNorm" and m.with_scale:
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
        table = model.model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(torch.randn(table.shape, generator=g))


@pytest.mark.parametrize("with_scale", [True, False])
def test_gemma4_rms_norm_is_weight_times_norm(with_scale):
    """Gemma4RMSNorm: fp32 statistics, times the weight itself (no ``1 + weight`` as Gemma 1-3) in fp32, cast
    at the end; ``with_scale=False`` (v_norm, the router's norm) has no weight. fuselm's patched forward
    follows the numerics rule in fp32 and bf16; Gemma 3's ``1 + weight`` would not."""
    module = importlib.import_module(family("gemma4").module)
    norms = [module.Gemma4RMSNorm(64, eps=1e-6, with_scale=with_scale) for _ in range(3)]
    if with_scale:
        w = 0.5 + torch.rand(64, generator=torch.Generator().manual_seed(2))
        for n in norms:
            n.weight.data.copy_(w)
    norms[0].double()
    fuselm.hf.patch("gemma4")
    assert all(n.forward.__qualname__ == "fuselm_Gemma4RMSNorm.forward" for n in norms)
    fuselm.hf.unpatch("gemma4")
    patched = types.MethodType(blocks.rms_norm_forward(family("gemma4")), norms[2])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        ref, eager, ours = norms[0](x.double()), norms[1](x), patched(x)
        assert ours.dtype == eager.dtype == dtype
        assert_numerics(f"norm {dtype}", ours, eager, ref, dtype)
        if with_scale:
            gemma3_style = blocks.rms_norm(x, norms[2].weight, 1e-6, offset=1.0, casting="gemma")
            with pytest.raises(AssertionError):
                assert_numerics(f"norm {dtype}", gemma3_style, eager, ref, dtype)


def _gemma4_image_batch(config, seed=1):
    """Two texts with one 4 x 4-patch image each (pooled 2 x 2: 4 soft tokens), image tokens unlabelled."""
    vocab = config.text_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 5, (2, 16), generator=g)
    ids[:, 3:7] = config.image_token_id
    labels = torch.where(ids == config.image_token_id, -100, ids)
    patch = config.vision_config.patch_size
    pixels = torch.rand(2, 16, 3 * patch * patch, generator=g)
    grid = torch.arange(4)
    positions = (
        torch.stack(torch.meshgrid(grid, grid, indexing="xy"), dim=-1).reshape(1, 16, 2).expand(2, 16, 2)
    )
    return ids, labels, dict(pixel_values=pixels, image_position_ids=positions)


def test_gemma4_with_an_image_matches_hf(monkeypatch):
    """Gemma4ForConditionalGeneration on text with images and trained-like weights: loss and every gradient
    (vision tower included) follow the numerics rule; the text attention's RoPE (q and k in separate
    calls, head dims 16 and 32) and the vision tower's 2-D RoPE (two 8-wide parts of
    apply_multidimensional_rope) both ran fuselm's kernel; the weightless norms ran fuselm's forward."""
    eager = build("gemma4")
    _trained_like(eager)
    models = (clone(eager, torch.float64), eager, fuselm.hf.patch(clone(eager)))
    ours = models[2]
    weightless = [
        n for n, m in ours.named_modules() if type(m).__name__ == "Gemma4RMSNorm" and not m.with_scale
    ]
    assert any("v_norm" in n for n in weightless) and any("router.norm" in n for n in weightless)
    assert all(
        ours.get_submodule(n).forward.__qualname__ == "fuselm_Gemma4RMSNorm.forward" for n in weightless
    )
    assert "forward" not in vars(ours.model.vision_tower.encoder.layers[0].mlp)  # clippable linears: HF's

    widths = []
    rope = blocks.apply_rotary
    monkeypatch.setattr(
        blocks, "apply_rotary", lambda q, k, *a, **kw: widths.append(q.shape[-1]) or rope(q, k, *a, **kw)
    )
    ids, labels, images = _gemma4_image_batch(eager.config)
    outs = [
        _train_step(m, ids, labels, **images) for m in models[1:]
    ]  # HF's, then fuselm's: widths are fuselm's only
    assert outs[1].logits is None and outs[1].image_hidden_states is not None
    assert sorted(set(widths)) == [8, 16, 32], widths  # vision parts, sliding heads, full (global) heads
    ref = _train_step(models[0], ids, labels, **images)
    assert_numerics("loss", outs[1].loss, outs[0].loss, ref.loss, torch.float32)
    grads = [_grads(m) for m in models]
    assert grads[2].keys() == grads[1].keys() and any("vision_tower" in n for n in grads[2])
    for name in grads[1]:
        assert_numerics(f"grad {name}", grads[2][name], grads[1][name], grads[0][name], torch.float32)
