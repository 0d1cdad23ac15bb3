"""fuselm.hf.patch on PEFT LoRA / QLoRA models: the fused LoRA path against PEFT's own modules.

Patched vs unpatched PEFT models (Llama, Qwen3, Gemma-3 text, Mistral; r 8 and 16; dropout 0 and 0.1;
all-linear and q,v only), patched after or before ``get_peft_model``, in float64 and float32: the loss and
every LoRA gradient under the numerics rule against a float64 twin; bitsandbytes 4-bit and 8-bit bases
(its CPU backend); adapters trained on a patched model load in plain PEFT; merge_and_unload keeps the
patch truthful; checkpointing="offload".
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from kit.hf_models import build

from fuselm.ops._common.testing import assert_numerics

peft = pytest.importorskip("peft")
import fuselm.hf  # noqa: E402

FAMILIES = ["llama", "qwen3", "gemma3_text", "mistral"]
TARGETS = {"all": "all-linear", "qv": ["q_proj", "v_proj"]}
SEED = 3


def lora_model(model_type, dtype, r, dropout, targets, seed=0):
    torch.manual_seed(seed)
    base = build(model_type, dtype=dtype)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=TARGETS[targets], init_lora_weights=False
    )
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(base, cfg)


def step(model, ids):
    """loss and the gradients of the trainable parameters (names -> grad), same dropout draws."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def ref_step(model, ids):
    """The float64 reference: HF's forward in float64 and the causal-LM loss taken in float64 here (HF's own
    loss upcasts the logits to float32, which would make the reference float32)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def fused_ran(model) -> tuple[int, int]:
    """(PEFT LoRA layers whose forward is fuselm's, all PEFT LoRA layers)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    fused = [m for m in layers if "fuselm" in getattr(m.forward, "__qualname__", "") or _is_fuselm(m.forward)]
    return len(fused), len(layers)


def _is_fuselm(fn) -> bool:
    inner = getattr(fn, "func", getattr(fn, "__func__", None))
    return inner is not None and getattr(inner, "__module__", "").startswith("fuselm")


def compare(model_type, dtype, r, dropout, targets, *, patch_before=False, **patch_options):
    # HF's RMSNorm and causal-LM loss compute in float32 also in a float64 model (and fuselm's match them):
    # in float64 their rounding would swamp the LoRA path's, so float64 runs keep HF's norms and loss on both
    # sides (those against float64: tests/hf/test_loss_path.py, tests/ops/test_rms_norm.py)
    f64 = dtype == torch.float64
    options = {"linear_cross_entropy": not f64, "rms_norm": not f64, **patch_options}
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    ref_model = lora_model(model_type, torch.float64, r, dropout, targets)
    eager = lora_model(model_type, dtype, r, dropout, targets)
    if patch_before:
        torch.manual_seed(0)
        base = build(model_type, dtype=dtype)
        fuselm.hf.patch(base, **options)
        cfg = peft.LoraConfig(
            r=r,
            lora_alpha=2 * r,
            lora_dropout=dropout,
            target_modules=TARGETS[targets],
            init_lora_weights=False,
        )
        torch.manual_seed(1)
        ours = peft.get_peft_model(base, cfg)
    else:
        ours = copy.deepcopy(eager)
        fuselm.hf.patch(ours, **options)
    l_ref, g_ref = ref_step(ref_model, ids)
    l_e, g_e = step(eager, ids)
    l_o, g_o = step(ours, ids)
    assert_numerics("loss", l_o, l_e, l_ref, dtype)
    assert g_o.keys() == g_e.keys() and len(g_o) > 0
    for name in g_e:
        assert_numerics(name, g_o[name], g_e[name], g_ref[name], dtype)
    return ours


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["p0", "p0.1"])
def test_patched_lora_matches_peft(model_type, dtype, dropout):
    ours = compare(model_type, dtype, 8, dropout, "all")
    fused, total = fused_ran(ours)
    assert total > 0 and fused == total, f"{fused} of {total} LoRA layers run fuselm's forward"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_mlp_chunks_match_peft(dtype, monkeypatch):
    """patch(..., mlp_chunk_tokens=5) on a LoRA model (32 tokens a batch): the LoRA MLP runs over chunks
    (fuselm.lora.lora_gated_mlp with chunk_rows=5) and the loss and every LoRA gradient follow PEFT's."""
    seen = []
    fused_mlp = fuselm.hf.lora.lora_gated_mlp

    def spy(*args, chunk_rows=None, **kwargs):
        seen.append(chunk_rows)
        return fused_mlp(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(fuselm.hf.lora, "lora_gated_mlp", spy)
    compare("llama", dtype, 8, 0.0, "all", mlp_chunk_tokens=5)
    assert seen and set(seen) == {5}


def test_mlp_chunks_with_down_dropout_run_whole_and_say_so():
    """LoRA dropout on down_proj: its mask would be [tokens, I], so the MLP runs whole, with one warning
    per MLP naming why, and the results still follow PEFT's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compare("llama", torch.float32, 8, 0.1, "all", mlp_chunk_tokens=5)
    said = [
        str(w.message) for w in caught if "mlp_chunk_tokens with LoRA dropout on down_proj" in str(w.message)
    ]
    assert len(said) == 2, said  # the tiny Llama's two MLPs, once each


@pytest.mark.parametrize("r", [8, 16])
@pytest.mark.parametrize("targets", ["all", "qv"])
def test_rank_and_targets(r, targets):
    compare("llama", torch.float32, r, 0.1, targets)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_patch_before_get_peft_model(model_type):
    """The README's other order: patch the HF model, then wrap it; the LoRA layers PEFT adds later run
    fuselm's forward from the first training step on."""
    ours = compare(model_type, torch.float32, 8, 0.1, "all", patch_before=True)
    fused, total = fused_ran(ours)
    assert total > 0 and fused == total


def test_no_warning_on_a_covered_model():
    model = lora_model("llama", torch.float32, 8, 0.0, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuselm.hf.patch(model)
        step(model, torch.randint(0, 300, (1, 8)))


def test_dora_falls_back_with_one_warning():
    torch.manual_seed(0)
    base = build("llama", dtype=torch.float32)
    cfg = peft.LoraConfig(r=8, target_modules=["q_proj"], use_dora=True)
    model = peft.get_peft_model(base, cfg)
    fuselm.hf.patch(model)
    ids = torch.randint(0, 300, (1, 8))
    # the warning names the layer by its path in the model, then the reason
    with pytest.warns(
        UserWarning, match=r"layers\.0\.self_attn\.q_proj runs PEFT's forward: .*(DoRA|variant)"
    ) as record:
        step(model, ids)
    first = len(record)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        step(model, ids)
    assert first >= 1 and not [w for w in again if "q_proj" in str(w.message)]


def test_unpatch_restores_peft_forwards():
    model = lora_model("llama", torch.float32, 8, 0.0, "all")
    fuselm.hf.patch(model)
    assert fused_ran(model)[0] > 0
    fuselm.hf.unpatch(model)
    assert fused_ran(model)[0] == 0 and not fuselm.hf.is_patched(model)


def test_adapters_trained_patched_load_in_plain_peft(tmp_path):
    model = lora_model("llama", torch.float32, 8, 0.0, "all")
    fuselm.hf.patch(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 300, (2, 16))
    for _ in range(2):
        step(model, ids)
        opt.step()
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    fresh = build("llama", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    fuselm.hf.unpatch(model)  # plain PEFT on both sides: the same adapters give the same logits
    model.eval()
    loaded.eval()
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = loaded(input_ids=ids).logits
    assert torch.equal(a, b)


def test_merge_and_unload_after_patch():
    model = lora_model("llama", torch.float32, 8, 0.0, "all")
    fuselm.hf.patch(model)
    ids = torch.randint(0, 300, (1, 8))
    merged = model.merge_and_unload()  # plain (frozen) Linear layers again, the fused blocks still in
    assert fuselm.hf.is_patched(merged)
    mlp = merged.model.layers[0].mlp
    assert mlp.forward.__qualname__.startswith("fuselm")
    merged.train()
    assert merged(input_ids=ids, labels=ids).loss.isfinite()
    fuselm.hf.unpatch(merged)
    assert not fuselm.hf.is_patched(merged) and "forward" not in vars(mlp)


def _bnb_model(bits):
    bnb = pytest.importorskip("bitsandbytes")  # noqa: F841
    from kit.hf_models import model_class, nf4_config, tiny_config
    from transformers import BitsAndBytesConfig

    q = nf4_config(torch.float32) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)
    torch.manual_seed(0)
    src = model_class("llama")(tiny_config("llama"))
    return src, q


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_patched_matches_peft(bits, tmp_path):
    """A bitsandbytes-quantized base (CPU backend) with LoRA: patched vs PEFT under the numerics rule
    (reference: the dequantized weights in float64 through PEFT's modules)."""
    src, q = _bnb_model(bits)
    src.save_pretrained(tmp_path)
    cls = type(src)
    try:
        quant = cls.from_pretrained(tmp_path, quantization_config=q, dtype=torch.float32)
    except Exception as e:  # bitsandbytes without a CPU backend for this format
        pytest.skip(f"bitsandbytes {bits}-bit on CPU: {e}")
    cfg = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear", init_lora_weights=False
    )
    torch.manual_seed(1)
    eager = peft.get_peft_model(quant, cfg)
    ours = copy.deepcopy(eager)
    fuselm.hf.patch(ours)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    ids = ids.to(next(eager.parameters()).device)  # bitsandbytes loads onto CUDA where there is one
    l_e, g_e = step(eager, ids)
    l_o, g_o = step(ours, ids)
    fused, total = fused_ran(ours)
    assert total > 0 and fused == total
    # float64 reference: the same adapters over the dequantized base
    ref = _dequantized_twin(eager)
    l_r, g_r = ref_step(ref, ids)
    assert_numerics("loss", l_o, l_e, l_r, torch.float32)
    for name in g_e:
        assert_numerics(name, g_o[name], g_e[name], g_r[name], torch.float32)


def _dequantized_twin(model):
    """A float64 copy of a PEFT model over bitsandbytes layers with each base dequantized (plain Linear)."""
    import bitsandbytes as bnb
    from peft.utils.integrations import dequantize_bnb_weight

    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
                w = dequantize_bnb_weight(child.weight, state=getattr(child, "state", None))
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight = torch.nn.Parameter(w.detach().to(torch.float32), requires_grad=False)
                if child.bias is not None:
                    lin.bias = torch.nn.Parameter(child.bias.detach().float(), requires_grad=False)
                setattr(module, child_name, lin)
    return twin.to(torch.float64)


def test_checkpointing_offload_through_patch():
    """patch(model, checkpointing="offload"): gradient checkpointing with layer inputs on the host, the same
    loss and LoRA gradients as the patched model without it; unpatch turns it off again."""
    from fuselm.hf import offload

    eager = lora_model("llama", torch.float32, 8, 0.1, "all")
    ours = copy.deepcopy(eager)
    fuselm.hf.patch(eager)
    fuselm.hf.patch(ours, checkpointing="offload")
    assert offload.is_enabled(ours) and not offload.is_enabled(eager)
    ids = torch.randint(0, 300, (2, 16))
    l_e, g_e = step(eager, ids)
    l_o, g_o = step(ours, ids)
    assert torch.equal(l_o, l_e)
    for name in g_e:
        assert torch.equal(g_o[name], g_e[name]), name
    fuselm.hf.unpatch(ours)
    assert not offload.is_enabled(ours)


def test_repatching_replaces_the_checkpointing_too():
    """checkpointing is an option of the patch like the others: patching again without it turns the
    offloading that patch asked for off (and HF's checkpointing with it, which offloading switched on);
    with the same options nothing changes; unpatch turns it off."""
    from fuselm.hf import offload

    model = fuselm.hf.patch(build("llama"), checkpointing="offload")
    assert offload.is_enabled(model) and model.is_gradient_checkpointing
    fuselm.hf.patch(model, checkpointing="offload")
    assert offload.is_enabled(model)
    fuselm.hf.patch(model, label_smoothing=0.1)
    assert not offload.is_enabled(model) and not model.is_gradient_checkpointing
    fuselm.hf.patch(model, checkpointing="offload")
    fuselm.hf.unpatch(model)
    assert not offload.is_enabled(model)


def test_checkpointing_bad_value_names_the_argument():
    model = lora_model("llama", torch.float32, 8, 0.0, "qv")
    with pytest.raises(ValueError, match="checkpointing"):
        fuselm.hf.patch(model, checkpointing="cpu")
    with pytest.raises(ValueError, match="checkpointing"):
        fuselm.hf.patch("llama", checkpointing="offload")
    assert not fuselm.hf.is_patched(model)


def test_q_k_and_v_are_projected_in_one_node(monkeypatch):
    """A patched LoRA model's attention runs q_proj, k_proj and v_proj through one lora_projections call
    per layer; unpatching takes the grouping out."""
    from fuselm.hf import lora as hf_lora

    model = lora_model("llama", torch.float32, 4, 0.0, "all")
    fuselm.hf.patch(model)
    calls = []
    real = hf_lora.lora_projections
    monkeypatch.setattr(hf_lora, "lora_projections", lambda x, ops: calls.append(len(ops)) or real(x, ops))
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback said
        step(model, ids)
    assert calls == [3] * model.config.num_hidden_layers
    fuselm.hf.unpatch(model)
    assert not any(hf_lora._QKV in vars(m) or hf_lora._LEFT in vars(m) for m in model.modules())


def test_an_attention_that_projects_k_from_another_input_runs_them_one_by_one():
    """k_proj called on another tensor than q_proj's: said once, then q, k and v one by one; the outputs
    are PEFT's all along."""
    import types

    from fuselm.hf.lora import group_qkv, lora_linear_forward

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q_proj(x) + self.k_proj(2 * x) + self.v_proj(x)

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    eager = peft.get_peft_model(Attention(), cfg)
    ours = copy.deepcopy(eager)
    attention = ours.base_model.model
    for m in (attention.q_proj, attention.k_proj, attention.v_proj):
        m.forward = types.MethodType(lora_linear_forward, m)
    group_qkv(attention)
    x = torch.randn(3, 16)
    with pytest.warns(UserWarning, match="q_proj, k_proj and v_proj one by one"):
        first = ours(x)
    assert torch.allclose(first, eager(x), atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.allclose(ours(x), eager(x), atol=1e-5)
