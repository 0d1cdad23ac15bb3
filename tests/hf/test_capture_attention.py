"""Inside a CUDA graph capture, a training call with token ids and labels only runs SDPA without a mask
(is_causal, as the eager step) in a model whose layers are all plainly causal, and keeps transformers' own
masking otherwise. The capture is simulated (causal_lm.capturing patched): on CPU the swapped attention
must give the eager step's loss and gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
from kit.hf_models import FAMILY_CLASSES, build, tiny_config

import fuselm.hf
from fuselm.hf import causal_lm

transformers = pytest.importorskip("transformers")

# the text families whose attention HF runs with SDPA (soft-capped attention logits need eager)
TEXT_TYPES = tuple(t for t in FAMILY_CLASSES if not getattr(tiny_config(t), "attn_logit_softcapping", None))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _seen_implementations(model, monkeypatch):
    """The attention implementations the model's attention layers ran with, in call order."""
    seen = []
    sdpa = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(*args, **kwargs):
        seen.append(model.config._attn_implementation)
        return sdpa(*args, **kwargs)

    monkeypatch.setitem(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    return seen


@pytest.mark.parametrize("model_type", TEXT_TYPES)
def test_captured_call_attention_matches_eager(model_type, monkeypatch):
    model = build(model_type)
    model.config._attn_implementation = "sdpa"
    fuselm.hf.patch(model)
    try:
        model.train()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size - 5, (2, 16), generator=gen)
        eager_loss, eager_grads = _loss_and_grads(model, ids)
        plain = causal_lm.plainly_causal(model.config, {"input_ids": ids, "labels": ids})
        monkeypatch.setattr(causal_lm, "capturing", lambda: True)
        seen = _seen_implementations(model, monkeypatch)
        loss, grads = _loss_and_grads(model, ids)
        assert model.config._attn_implementation == "sdpa"  # restored after the call
        if plain:
            assert torch.equal(loss, eager_loss)
            assert grads.keys() == eager_grads.keys()
            assert all(torch.equal(grads[n], eager_grads[n]) for n in grads)
        # the implementation swapped exactly when the predicate said so (SDPA itself ran either way)
        swapped = {causal_lm.CAUSAL_SDPA} if plain else {"sdpa"}
        assert seen and set(seen) == swapped
    finally:
        fuselm.hf.unpatch(model)


def test_plainly_causal_needs_sdpa_full_layers_and_plain_arguments():
    config = transformers.LlamaConfig(num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert causal_lm.plainly_causal(config, {"input_ids": ids, "labels": ids, "attention_mask": None})
    assert causal_lm.plainly_causal(config, {"input_ids": ids, "kwargs": {"num_items_in_batch": 3}})
    assert not causal_lm.plainly_causal(config, {"input_ids": ids, "attention_mask": torch.ones(1, 4)})
    assert not causal_lm.plainly_causal(config, {"input_ids": ids, "position_ids": torch.arange(4)[None]})
    assert not causal_lm.plainly_causal(config, {"input_ids": ids, "kwargs": {"cu_seq_lens_q": ids}})
    config._attn_implementation = "eager"
    assert not causal_lm.plainly_causal(config, {"input_ids": ids})
    mistral = transformers.MistralConfig(num_hidden_layers=2, sliding_window=8)
    mistral._attn_implementation = "sdpa"
    assert not causal_lm.plainly_causal(mistral, {"input_ids": ids})


def test_not_capturing_changes_nothing():
    config = transformers.LlamaConfig(num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    with causal_lm.causal_attention_while_capturing(config, {"input_ids": torch.zeros(1, 4)}):
        assert config._attn_implementation == "sdpa"
