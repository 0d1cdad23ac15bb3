"""fuselm.hf.lora on PEFT models of tiny Llama / Qwen3 / Mistral / Gemma-3 text models (and 4-bit / 8-bit
bitsandbytes bases): every LoRA layer through lora_linear_forward and every MLP through
lora_gated_mlp_forward against PEFT's own forwards under the same seed (outputs and every gradient, the
numerics rule against float64 copies), a whole model with both installed, and the fallbacks (one
warning naming the module and the reason, then PEFT's result).
"""

from __future__ import annotations

import contextlib
import copy
import types
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import kernel_device
from kit.hf_models import build, nf4_config

import fuselm.hf.lora as hf_lora
import fuselm.hf.peft_operands as peft_operands
import fuselm.lora as L
from fuselm.hf import _common as hf_common
from fuselm.hf._common import register_module_names
from fuselm.ops._common.testing import assert_numerics

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
FAMILIES = ("llama", "qwen3", "mistral", "gemma3_text")
DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}
ACT = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
TARGETS = {"all": "all-linear", "qv": ["q_proj", "v_proj"]}
SEED = 4321
LEAD = (2, 7)


def randn(gen, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def lora_layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m) in peft_operands.peft_lora_kinds()}


def randomize_adapters(model, gen):
    """PEFT starts B at zero: random A and B, the update about as large as the base output."""
    for layer in lora_layers(model).values():
        for name in layer.lora_A:
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            s = layer.scaling[name]
            with torch.no_grad():
                a.copy_(randn(gen, a.shape, a.dtype, a.shape[1] ** -0.5))
                b.copy_(randn(gen, b.shape, b.dtype, b.shape[1] ** -0.5 / s))


def peft_model(model_type, gen, dtype=torch.float32, r=8, targets="all", p=0.0, model=None, **cfg):
    model = model if model is not None else build(model_type, dtype=dtype, device=DEVICE)
    config = LoraConfig(r=r, lora_alpha=2 * r + 4, target_modules=TARGETS[targets], lora_dropout=p, **cfg)
    pm = get_peft_model(model, config)
    randomize_adapters(pm, gen)
    register_module_names(pm)
    return pm.train()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused functions hf.lora calls."""
    calls = {"lora_linear": 0, "lora_gated_mlp": 0}
    for name in calls:
        real = getattr(hf_lora, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(hf_lora, name, spy)
    return calls


def no_fuselm_warnings(record):
    msgs = [
        str(w.message)
        for w in record
        if str(w.message).startswith("fuselm.hf: ") and " run" in str(w.message)
    ]
    assert not msgs, msgs


def leaf64(t):
    return t.detach().to(torch.float64).requires_grad_()


def adapter64(adapter):
    if adapter is None:
        return None, []
    A64, B64 = leaf64(adapter.A), leaf64(adapter.B)
    return L.LoraAdapter(A64, B64, adapter.scaling, adapter.dropout), [A64, B64]


def dense64(base):
    return (base if isinstance(base, torch.Tensor) else L.dense(base, torch.float32)).detach().double()


# ---- every LoRA layer ----


def peft_p(layer) -> float:
    """The dropout probability PEFT's layer applies (read from PEFT, not from fuselm's operands)."""
    drop = layer.lora_dropout["default"] if hasattr(layer, "lora_dropout") else None
    return drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0


@contextlib.contextmanager
def peft_masks(layers):
    """Keep-masks PEFT's dropout modules apply: (out != 0, in == 0) per call, in call order."""
    got = []
    hooks = [
        layer.lora_dropout["default"].register_forward_hook(
            lambda m, i, o: got.append((o.detach() != 0, i[0].detach() == 0))
        )
        for layer in layers
        if hasattr(layer, "lora_dropout") and isinstance(layer.lora_dropout["default"], nn.Dropout)
    ]
    try:
        yield got
    finally:
        for hk in hooks:
            hk.remove()


def assert_masks(got, masks):
    masks = [m for m in masks if m is not None]
    assert len(got) == len(masks)
    for (kept, zero), mask in zip(got, masks, strict=True):
        assert zero.float().mean() < 0.05
        assert torch.equal(kept | zero, mask | zero), "PEFT drew other dropout masks under the same seed"


def check_layer(name, layer, gen, dtype):
    """lora_linear_forward vs PEFT's forward on one layer: output, dx, dA, dB (numerics rule)."""
    ops = peft_operands.lora_operands(layer)
    assert not isinstance(ops, str), f"{name}: {ops}"
    base, adapter, bias = ops
    p = peft_p(layer)
    assert adapter.dropout == p
    x = randn(gen, (*LEAD, layer.in_features), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, layer.out_features), dtype)
    wrt = (x, adapter.A, adapter.B)
    torch.manual_seed(SEED)
    mask = L.dropout_mask(x, p, adapter.A.dtype)
    torch.manual_seed(SEED)
    y = hf_lora.lora_linear_forward(layer, x)
    g = torch.autograd.grad(y, wrt, dy)
    torch.manual_seed(SEED)
    with peft_masks([layer]) as got:
        y_e = layer(x)  # PEFT's forward (no instance forward installed)
    assert_masks(got, [mask])
    g_e = torch.autograd.grad(y_e, wrt, dy)
    x64 = leaf64(x)
    ad64, (A64, B64) = adapter64(adapter)
    b64 = bias.double() if bias is not None else None
    y_r = L.lora_linear_reference(x64, dense64(base), ad64, b64, mask)
    g_r = torch.autograd.grad(y_r, (x64, A64, B64), dy.double())
    assert y.dtype == y_e.dtype and y.shape == y_e.shape, name
    assert_numerics(f"{name} y", y, y_e, y_r, dtype)
    for what, t, e, ref in zip(("dx", "dA", "dB"), g, g_e, g_r, strict=True):
        assert t.dtype == e.dtype, f"{name} {what}"
        assert_numerics(f"{name} {what}", t, e, ref, dtype)


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("r", [8, 16], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_lora_layer_matches_peft(model_type, dtype, r, targets, p, gen, fused_calls):
    pm = peft_model(model_type, gen, dtype, r, targets, p)
    layers = lora_layers(pm)
    assert layers and len(layers) == (14 if targets == "all" else 4)  # 2 layers x (7 | q, v)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for name, layer in layers.items():
            check_layer(name, layer, gen, dtype)
    no_fuselm_warnings(record)
    assert fused_calls["lora_linear"] == len(layers)


# ---- every MLP ----


def mlp_masks(x, projs, inter):
    """gate's, up's, down's masks in PEFT's order, p and dtype read from PEFT's layers."""
    h_like = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out = []
    for layer, inp in zip(projs, (x, x, h_like), strict=True):
        p = peft_p(layer)
        out.append(L.dropout_mask(inp, p, layer.lora_A["default"].weight.dtype) if p else None)
    return tuple(out)


def check_mlp(name, mlp, act, gen, dtype):
    ops = peft_operands.gated_mlp_operands(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    assert not isinstance(ops, str), f"{name}: {ops}"
    hidden, inter = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    x = randn(gen, (*LEAD, hidden), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, hidden), dtype)
    params = [t for _, ad, _ in ops if ad is not None for t in (ad.A, ad.B)]
    wrt = (x, *params)
    projs = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    for layer, (_, adapter, _) in zip(projs, ops, strict=True):
        assert (adapter.dropout if adapter is not None else 0.0) == peft_p(layer)
    torch.manual_seed(SEED)
    masks = mlp_masks(x, projs, inter)
    torch.manual_seed(SEED)
    y = hf_lora.lora_gated_mlp_forward(mlp, x, act)
    assert y is not None, name
    g = torch.autograd.grad(y, wrt, dy)
    torch.manual_seed(SEED)
    with peft_masks(projs) as got:
        y_e = mlp(x)  # HF's MLP forward over PEFT's layers
    assert_masks(got, masks)
    g_e = torch.autograd.grad(y_e, wrt, dy)
    x64 = leaf64(x)
    ops64, leaves = [], []
    for base, adapter, bias in ops:
        ad64, ls = adapter64(adapter)
        leaves += ls
        ops64.append((dense64(base), ad64, bias.double() if bias is not None else None))
    y_r = L.lora_gated_mlp_reference(x64, *ops64, act, masks=masks)
    g_r = torch.autograd.grad(y_r, (x64, *leaves), dy.double())
    assert y.dtype == y_e.dtype and y.shape == y_e.shape
    assert_numerics(f"{name} y", y, y_e, y_r, dtype)
    for i, (t, e, ref) in enumerate(zip(g, g_e, g_r, strict=True)):
        assert t.dtype == e.dtype
        assert_numerics(f"{name} grad {i}", t, e, ref, dtype)


def mlps(pm):
    return {n: m for n, m in pm.named_modules() if n.endswith(".mlp")}


def activation_of(pm):
    cfg = pm.base_model.model.config
    return ACT[getattr(cfg, "hidden_activation", None) or cfg.hidden_act]


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("r", [8, 16], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_mlp_matches_hf_with_peft(model_type, dtype, r, targets, p, gen, fused_calls):
    pm = peft_model(model_type, gen, dtype, r, targets, p)
    act = activation_of(pm)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for name, mlp in mlps(pm).items():
            check_mlp(name, mlp, act, gen, dtype)
    no_fuselm_warnings(record)
    assert fused_calls["lora_gated_mlp"] == 2


# ---- a whole model ----


def install(pm):
    """lora_linear_forward on every LoRA layer, the fused MLP (else HF's) on every MLP: per instance."""
    act = activation_of(pm)
    for layer in lora_layers(pm).values():
        layer.forward = types.MethodType(hf_lora.lora_linear_forward, layer)
    for mlp in mlps(pm).values():
        hf_forward = mlp.forward

        def forward(x, _mlp=mlp, _hf=hf_forward):
            y = hf_lora.lora_gated_mlp_forward(_mlp, x, act)
            return y if y is not None else _hf(x)

        mlp.forward = forward
    return pm


def train_step(pm, ids):
    torch.manual_seed(SEED)
    loss = pm(input_ids=ids, labels=ids).loss
    params = {n: t for n, t in pm.named_parameters() if t.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss, dict(zip(params, grads, strict=True))


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_whole_model_loss_and_lora_gradients(model_type, p, gen, fused_calls):
    """Patched (every layer and MLP fused) vs PEFT vs PEFT in float64, same seed: loss and the gradient
    of every adapter; dropout 0.1 draws the same masks across the whole model."""
    eager = peft_model(model_type, gen, torch.float32, 8, "all", p)
    ref = copy.deepcopy(eager).double()
    ours = install(copy.deepcopy(eager))
    ids = torch.randint(3, 290, (2, 9), generator=gen).to(DEVICE)
    (l_e, g_e), (l_r, g_r) = train_step(eager, ids), train_step(ref, ids)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        l_o, g_o = train_step(ours, ids)
    no_fuselm_warnings(record)
    assert fused_calls["lora_gated_mlp"] == 2 and fused_calls["lora_linear"] == 2 * 4  # q, k, v, o
    assert_numerics("loss", l_o, l_e, l_r, torch.float32)
    assert len(g_o) == 2 * 7 * 2
    for name in g_o:
        assert_numerics(name, g_o[name], g_e[name], g_r[name], torch.float32)


# ---- bitsandbytes bases (QLoRA) ----


def quantized_model(model_type, bits, gen, tmp_path):
    """A tiny model saved and loaded back through transformers' BitsAndBytesConfig (CPU or CUDA)."""
    pytest.importorskip("bitsandbytes")
    import transformers

    build(model_type, dtype=torch.float32).save_pretrained(tmp_path)
    if bits == 4:
        q = nf4_config(torch.float32)
    else:
        q = transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=q, device_map=DEVICE, dtype=torch.float32
    )


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_layers_and_mlps_match_peft(bits, p, gen, tmp_path, fused_calls):
    """QLoRA: PEFT's bitsandbytes LoRA layers and HF's MLP over them (fp32 activations; on CUDA the 8-bit
    matmul also quantizes activations, hence CPU only for 8-bit)."""
    if bits == 8 and ON_GPU:
        pytest.skip("bitsandbytes' CUDA int8 matmul quantizes activations: tests/lora compares 8-bit there")
    model = quantized_model("llama", bits, gen, tmp_path)
    pm = peft_model("llama", gen, targets="all", p=p, model=model)
    kinds = {peft_operands.peft_lora_kinds()[type(m)] for m in lora_layers(pm).values()}
    assert kinds == {f"{bits}bit"}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for name, layer in lora_layers(pm).items():
            check_layer(name, layer, gen, torch.float32)
        for name, mlp in mlps(pm).items():
            check_mlp(name, mlp, "silu", gen, torch.float32)
    no_fuselm_warnings(record)
    assert fused_calls["lora_linear"] == 14 and fused_calls["lora_gated_mlp"] == 2


def test_a_4bit_layer_that_lost_its_weights_state_keeps_it_on_the_layer(gen, tmp_path):
    """What FSDP2's fully_shard does to a 4-bit base (its Params4bit replaced by a tensor of the packed
    bytes, no quantization state): after keep_quant_states (fuselm.hf.patch calls it) the layer still gives
    bitsandbytes' dequantized weight; without it the refusal says to patch before sharding."""
    bnb = pytest.importorskip("bitsandbytes")

    model = quantized_model("llama", 4, gen, tmp_path)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    want = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    layer.quant_state = None  # as a layer whose Params4bit was made without it
    peft_operands.keep_quant_states(model)
    assert layer.quant_state is layer.weight.quant_state
    packed = layer.weight.data
    kept = layer.quant_state
    layer.quant_state = None
    layer.weight = nn.Parameter(packed.clone(), requires_grad=False)  # the state is gone with the Params4bit
    assert "sharded by fully_shard before fuselm.hf.patch" in peft_operands.lora_operands(layer)
    layer.quant_state = kept
    base, adapter, bias = peft_operands.lora_operands(layer)
    assert adapter is None and bias is None
    assert torch.equal(base.dense(), want)


# ---- states that run fused: merged, disabled, eval, rsLoRA, no adapter ----


def q_proj(pm):
    return pm.base_model.model.model.layers[0].self_attn.q_proj


def test_merged_and_disabled_adapters_run_the_base_layer_fused(gen, fused_calls):
    pm = peft_model("llama", gen, torch.float64, 8, "qv", 0.1)
    layer = q_proj(pm)
    x = randn(gen, (*LEAD, layer.in_features), torch.float64)
    base = layer.base_layer
    with pm.disable_adapter():
        ops = peft_operands.lora_operands(layer)
        assert ops[0] is base.weight and ops[1] is None
        assert torch.allclose(hf_lora.lora_linear_forward(layer, x), base(x), rtol=0, atol=1e-12)
    pm.merge_adapter()
    assert peft_operands.lora_operands(layer)[1] is None
    assert torch.allclose(hf_lora.lora_linear_forward(layer, x), layer(x), rtol=0, atol=1e-12)
    assert fused_calls["lora_linear"] == 2


def test_disabled_while_merged_falls_back_and_unmerges(gen):
    pm = peft_model("llama", gen, torch.float64, 8, "qv", 0.0)
    layer = q_proj(pm)
    pm.merge_adapter()
    x = randn(gen, (*LEAD, layer.in_features), torch.float64)
    with pm.disable_adapter(), pytest.warns(UserWarning, match="disabled while merged"):
        y = hf_lora.lora_linear_forward(layer, x)
    assert not layer.merged  # PEFT's forward unmerged
    assert torch.allclose(y, layer.base_layer(x), rtol=0, atol=1e-12)


def test_eval_mode_has_no_dropout_and_rslora_scaling(gen, fused_calls):
    pm = peft_model("qwen3", gen, torch.float64, 16, "qv", 0.1, use_rslora=True).eval()
    layer = q_proj(pm)
    _, adapter, _ = peft_operands.lora_operands(layer)
    assert adapter.dropout == 0.0 and adapter.scaling == pytest.approx((2 * 16 + 4) / 16**0.5)
    x = randn(gen, (*LEAD, layer.in_features), torch.float64)
    assert torch.allclose(hf_lora.lora_linear_forward(layer, x), layer(x), rtol=1e-12, atol=1e-12)
    assert fused_calls["lora_linear"] == 1


def test_plain_layers_are_operands_without_adapter():
    lin = nn.Linear(8, 4).requires_grad_(False)
    assert peft_operands.lora_operands(lin) == (lin.weight, None, lin.bias)
    assert "requires grad" in peft_operands.lora_operands(nn.Linear(8, 4))
    assert "not nn.Linear" in peft_operands.lora_operands(nn.Conv1d(2, 2, 1))


# ---- fallbacks: PEFT's forward, one warning per module and reason ----


def fallback(pm, gen, expect):
    register_module_names(pm)
    name, layer = next(iter(lora_layers(pm).items()))
    x = randn(gen, (*LEAD, layer.in_features), torch.float32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.manual_seed(SEED)
        y = hf_lora.lora_linear_forward(layer, x)
        hf_lora.lora_linear_forward(layer, x)  # the second call does not warn again
    msgs = [
        str(w.message)
        for w in record
        if str(w.message).startswith("fuselm.hf: ") and " run" in str(w.message)
    ]
    assert msgs == [f"fuselm.hf: {name} runs PEFT's forward: {expect}"]
    torch.manual_seed(SEED)
    assert torch.equal(y, layer(x)), "the fallback is PEFT's forward itself"
    return layer


def test_dora_falls_back(gen, fused_calls):
    pm = peft_model("llama", gen, torch.float32, 8, "qv", 0.0, use_dora=True)
    fallback(pm, gen, "DoRA (DoraLinearVariant)")
    assert fused_calls["lora_linear"] == 0


def test_lora_bias_falls_back(gen):
    pm = peft_model("mistral", gen, torch.float32, 8, "qv", 0.0, lora_bias=True)
    fallback(pm, gen, "LoRA bias (lora_bias=True)")


def test_two_active_adapters_fall_back(gen):
    pm = peft_model("llama", gen, torch.float32, 8, "qv", 0.0)
    pm.add_adapter("second", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    pm.base_model.set_adapter(["default", "second"])
    fallback(pm, gen, "2 active adapters (default, second)")


def test_mixed_adapter_batch_falls_back(gen):
    pm = peft_model("llama", gen, torch.float32, 8, "qv", 0.0).eval()
    layer = q_proj(pm)
    x = randn(gen, (2, 3, layer.in_features), torch.float32)
    with pytest.warns(
        UserWarning, match=r"q_proj runs PEFT's forward: adapter_names= \(a mixed-adapter batch\)"
    ):
        y = hf_lora.lora_linear_forward(layer, x, adapter_names=["default", "__base__"])
    assert torch.equal(y, layer(x, adapter_names=["default", "__base__"]))


def test_mlp_falls_back_naming_the_projection(gen, fused_calls):
    pm = peft_model("llama", gen, torch.float32, 8, "all", 0.0, use_dora=True)
    name, mlp = next(iter(mlps(pm).items()))
    x = randn(gen, (*LEAD, mlp.gate_proj.in_features), torch.float32)
    with pytest.warns(
        UserWarning, match=rf"{name} runs HF's MLP forward: gate_proj: DoRA \(DoraLinearVariant\)"
    ):
        assert hf_lora.lora_gated_mlp_forward(mlp, x, "silu") is None
    assert fused_calls["lora_gated_mlp"] == 0


@pytest.mark.parametrize("module", [hf_common, peft_operands], ids=lambda m: m.__name__)
def test_doctests_run(module):
    import doctest

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---- GPU: bf16 models against float64 ----


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_bf16_layers_and_mlps_on_cuda(model_type, p, gen):
    """bf16 model, fp32 adapters (get_peft_model's default upcast), against float64 and PEFT."""
    pm = peft_model(model_type, gen, torch.bfloat16, 16, "all", p)
    assert q_proj(pm).lora_A["default"].weight.dtype == torch.float32
    act = activation_of(pm)
    for name, layer in lora_layers(pm).items():
        check_layer(name, layer, gen, torch.bfloat16)
    for name, mlp in mlps(pm).items():
        check_mlp(name, mlp, act, gen, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_qlora_bf16_on_cuda(p, gen, tmp_path):
    """4-bit NF4 base (double quantization), bf16 activations: layers and MLPs against float64 and PEFT."""
    pytest.importorskip("bitsandbytes")
    import transformers

    build("llama", dtype=torch.bfloat16).save_pretrained(tmp_path)
    q = nf4_config(torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=q, device_map="cuda", dtype=torch.bfloat16
    )
    pm = peft_model("llama", gen, targets="all", p=p, model=model)
    for name, layer in lora_layers(pm).items():
        check_layer(name, layer, gen, torch.bfloat16)
    for name, mlp in mlps(pm).items():
        check_mlp(name, mlp, "silu", gen, torch.bfloat16)
