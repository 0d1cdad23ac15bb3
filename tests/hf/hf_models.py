"""Tiny Hugging Face configs for every family fuselm.hf knows, built from code (no downloads)."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")

# (config class, model class, extra config arguments): each family's own quirks switched on, so the
# patched paths see them (Qwen 2 attention bias, Qwen 3 / Gemma 3 q/k norms, Phi-3 partial rotary and
# packed gate_up, Gemma 2 / 3 final logit softcap).
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 16},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    ),
}
MODEL_TYPES = tuple(FAMILY_CLASSES)


def tiny_config(model_type: str, *, hidden: int = 64, layers: int = 2, vocab: int = 300, heads: int = 4):
    """A small config of the family: GQA (heads / 2 kv heads), head_dim hidden / heads, eager attention."""
    config_cls, _, extra = FAMILY_CLASSES[model_type]
    kw = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden + hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kw.update(extra)
    config = getattr(transformers, config_cls)(**kw)
    config._attn_implementation = "eager"
    return config


def build(model_type: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, **sizes):
    """The family's CausalLM from :func:`tiny_config`, initialized from ``seed``, in ``dtype``."""
    _, model_cls, _ = FAMILY_CLASSES[model_type]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(tiny_config(model_type, **sizes))
    return model.to(device=device, dtype=dtype)


def clone(model, dtype: torch.dtype | None = None, device: str | None = None):
    """A new model of the same class and config with the same weights (optionally another dtype)."""
    twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict())
    return twin.to(
        device=device or next(model.parameters()).device, dtype=dtype or next(model.parameters()).dtype
    )
