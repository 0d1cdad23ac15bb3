"""fuselm.hf.attention: the attention forward made from Hugging Face's own source with the q, k, v
projections and the RoPE call as one node (fuselm.ops.rope.qkv_rotary), opt-in (fused_layer=True); when
it runs, when it falls back to HF's statements, and what happens when the installed source differs.

Granite's attention is Llama's but its decoder layer is not (residual multipliers): its layers run their
modules, so its attention's own forward runs under fused_layer=True (Llama's layers run as two nodes)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from kit.hf_models import build, clone

import fuselm.hf
from fuselm.hf import attention
from fuselm.hf.registry import FAMILIES
from fuselm.ops._common.testing import assert_numerics

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    fuselm.hf.unpatch("llama")
    fuselm.hf.unpatch("granite")


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return qkv_rotary(*args, **kwargs)

    qkv_rotary = attention.qkv_rotary
    monkeypatch.setattr(attention, "qkv_rotary", spy)
    return calls


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(ours, eager, ids):
    ref = clone(eager, torch.float64)
    outs = [_loss_and_grads(m, ids) for m in (ref, eager, ours)]
    assert_numerics("loss", outs[2][0], outs[1][0], outs[0][0], torch.float32)
    for name in outs[1][1]:
        assert_numerics(name, outs[2][1][name], outs[1][1][name], outs[0][1][name], torch.float32)


def test_patched_attention_runs_one_fused_node_per_layer(fused_calls):
    eager = build("granite")
    ours = fuselm.hf.patch(clone(eager), fused_layer=True)
    ids = torch.randint(0, eager.config.vocab_size, (2, 12))
    _compare(ours, eager, ids)
    assert len(fused_calls) == eager.config.num_hidden_layers
    attn = ours.model.layers[0].self_attn
    fused = attn.forward.func if hasattr(attn.forward, "func") else attn.forward.__func__
    original = type(attn).forward
    assert fused is not original
    # the made forward keeps HF's signature (the keyword names HF's decoder layer passes)
    assert inspect.signature(fused).parameters.keys() == inspect.signature(original).parameters.keys()


def test_hooked_projection_falls_back_to_hf_statements(fused_calls):
    """A forward hook on q_proj (or a PEFT / bitsandbytes layer): HF's statements run, with the hook."""
    eager = build("granite")
    ours = fuselm.hf.patch(clone(eager), fused_layer=True)
    seen = []
    for model in (eager, ours):
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ids = torch.randint(0, eager.config.vocab_size, (2, 12))
    _compare(ours, eager, ids)
    assert len(fused_calls) == eager.config.num_hidden_layers - 1  # the hooked layer ran HF's statements
    assert len(seen) == 2  # the hook ran in HF's model and in fuselm's (the float64 twin has none)


def test_only_fused_layer_swaps_the_attention_forward_and_unpatch_restores_it(fused_calls):
    """The default patch leaves the attention's forward HF's (its RoPE call runs fuselm's kernel);
    fused_layer=True gives it fuselm's; unpatching takes it out."""
    model = fuselm.hf.patch(build("granite"))
    attn = model.model.layers[0].self_attn
    assert "forward" not in vars(attn)
    model(input_ids=torch.randint(0, model.config.vocab_size, (2, 12)))
    assert not fused_calls
    fuselm.hf.patch(model, fused_layer=True)
    assert vars(attn)["forward"].func.__qualname__ == "fuselm_GraniteAttention.forward"
    fuselm.hf.unpatch(model)
    assert "forward" not in vars(attn)


def test_source_that_differs_keeps_hf_forward_with_one_warning():
    """An attention whose forward does not start with Llama's statements: None (HF's forward stays) and
    one warning naming the class and the reason."""

    class OtherAttention(torch.nn.Module):
        def forward(self, hidden_states, position_embeddings=None, **kwargs):
            query_states = self.q_proj(hidden_states)
            return query_states, None

    spec = dataclasses.replace(FAMILIES["llama"], attention="OtherAttention", model_type="llama_test")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attention.attention_forward(spec, OtherAttention.forward) is None
        assert attention.attention_forward(spec, OtherAttention.forward) is None  # cached: no 2nd warning
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "OtherAttention keeps Hugging Face's attention forward" in messages[0]
    assert "does not project hidden_states with q_proj, k_proj and v_proj" in messages[0]


@pytest.mark.parametrize("rope", [{"rope": None}, {"rope_one_tensor": True}], ids=["no_rope", "one_tensor"])
def test_an_attention_spec_needs_the_two_tensor_rope(rope):
    with pytest.raises(ValueError, match="fused attention input replaces the two-tensor"):
        dataclasses.replace(FAMILIES["llama"], **rope)


def test_made_source_replaces_exactly_the_five_statements():
    """The made forward is HF's with the five input statements replaced by one call: every other
    statement is HF's own (compared on the syntax tree)."""
    import ast

    from transformers.models.llama.modeling_llama import LlamaAttention

    from fuselm.hf.layer_layout import split_checkpointing

    forward = split_checkpointing(LlamaAttention.forward)[0]
    tree, how = attention.fused_attention_source(forward)
    assert how == "qkv_rotary"
    made = tree.body[0].body[0]  # _fuselm_make_forward -> forward
    original = ast.parse(inspect.cleandoc("\n" + inspect.getsource(forward))).body[0]
    made_body = [ast.dump(s) for s in made.body]
    hf_body = [ast.dump(s) for s in original.body]
    assert len(hf_body) - len(made_body) == 3  # five statements became two (cos, sin and the call)
    removed = [s for s in hf_body if s not in made_body]
    assert len(removed) == 4  # q, k, v and the RoPE call; "cos, sin = position_embeddings" stays
    assert sum("_fuselm_attention_input" in s for s in made_body) == 1


def test_patched_model_under_autocast(fused_calls):
    """An fp32 model under bf16 autocast (Trainer(bf16=True) on fp32 weights): the fused attention input
    runs (its operands cast as nn.Linear's are), and the loss and every gradient (fp32) follow HF's under
    the same autocast, against the float64 model (numerics rule at bf16)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    eager = build("granite", device=device_type)
    ours = fuselm.hf.patch(clone(eager), fused_layer=True)
    ref = clone(eager, torch.float64)
    ids = torch.randint(0, eager.config.vocab_size, (2, 12)).to(device_type)
    results = []
    for model in (ref, eager, ours):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=model is not ref):
            results.append(_loss_and_grads(model, ids))
    assert fused_calls, "the fused attention input did not run under autocast"
    (l_ref, g_ref), (l_e, g_e), (l_o, g_o) = results
    assert_numerics("loss", l_o, l_e, l_ref, torch.bfloat16)
    for name in g_e:
        assert g_o[name].dtype == torch.float32
        assert_numerics(name, g_o[name], g_e[name], g_ref[name], torch.bfloat16)


def test_qk_norm_attention_fuses_its_projections_only():
    """Qwen 3's attention normalizes q and k between the projections and the RoPE: its three projection
    calls become one linear_projections node, the norms and the RoPE call stay HF's statements."""
    import ast

    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from fuselm.hf.layer_layout import split_checkpointing

    forward = split_checkpointing(Qwen3Attention.forward)[0]
    tree, how = attention.fused_attention_source(forward)
    assert how == "projections"
    made = ast.unparse(tree.body[0].body[0])
    assert made.count("_fuselm_projections(self, hidden_states)") == 1
    assert "self.q_proj(hidden_states)" not in made and "self.q_norm(" in made
    assert "apply_rotary_pos_emb(" in made
