"""Tiny Hugging Face models of every model type fuselm.hf knows, built from code (no downloads).

Keys are the ``model_type`` of the built model's config (``gemma3_text`` is ``Gemma3ForCausalLM``,
``gemma3`` the multimodal ``Gemma3ForConditionalGeneration``). Each family's own quirks are switched on
so the patched paths see them (attention biases, q/k norms, partial rotary, packed ``gate_up_proj``,
logit softcaps and scales, MoE router auxiliary losses, shared experts, dense layers before MoE ones).
"""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")

_HF_5_23 = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 23)
GEMMA2 = {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 16}
# Gemma 4 (E2B-like and 26B-A4B-like at once): sliding and full layers (the full ones with a wider head
# and proportional partial RoPE), the last two layers reusing earlier k/v with a double-wide MLP, k = v on
# full layers, per-layer inputs, a MoE block beside the MLP, the final logit softcap.
GEMMA4 = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=8,
    global_head_dim=32,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    attention_k_eq_v=True,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=300,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=48,
    final_logit_softcapping=30.0,
)
# MoE: 4 experts, 2 per token, the router's auxiliary loss in the outputs and the loss.
MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.01}

# model_type -> (config class, model class, extra config arguments).
DENSE = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 8}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3),
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {"sliding_window": 8}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"partial_rotary_factor": 0.5}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5, "use_qk_norm": True}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"logit_scale": 0.5, "sliding_window": 8}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": None}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 8}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            lm_head_multiplier=0.5,
            mlp_multipliers=[0.7, 1.3],  # gate, down: not powers of two, so dropping one changes the bits
            mlp_bias=True,  # the down multiplier scales the bias too
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_chunk_size=8,
        ),
    ),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4),
}
MIXTURE = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 48, "mlp_only_layers": [0]},  # a dense layer, a MoE one
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "sliding_window": None}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4}),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        # transformers 5.17's GraniteMoe crashes on its own router loss (an int .to()): off there
        {
            "num_local_experts": 4,
            "logits_scaling": 4.0,
            **({} if _HF_5_23 else {"output_router_logits": False}),
        },
    ),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "sliding_window": 8}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 48,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 32,
            "head_dim": 8,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "rope_interleave": False,  # HF's rotate_half RoPE (fuselm's); True runs HF's interleaved one
        },
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96, interleave_moe_layer_step=2
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "num_experts": 4,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 64,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
}
MULTIMODAL = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}
# Multimodal wrappers: (model class, text model_type inside, how its config is built below).
FAMILY_CLASSES = {**DENSE, **{k: (c, m, {**MOE, **x}) for k, (c, m, x) in MIXTURE.items()}}
ALL_TYPES = (*FAMILY_CLASSES, *MULTIMODAL)
# The families of the first registry (before the MoE and multimodal ones): what tests beyond tests/hf
# (FSDP) run on.
MODEL_TYPES = CLASSIC_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
MOE_TYPES = tuple(MIXTURE)
MULTIMODAL_TYPES = tuple(MULTIMODAL)


def _text_kwargs(hidden: int, layers: int, vocab: int, heads: int) -> dict:
    return dict(
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
        pad_token_id=0,
        tie_word_embeddings=False,
        num_experts_per_tok=2,
    )


def _vision(model_type: str) -> dict:
    """A 1-layer vision tower of 28 x 28 images in 14 x 14 patches (4 patches)."""
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        model_type=model_type,
    )


def tiny_config(model_type: str, *, hidden: int = 64, layers: int = 2, vocab: int = 300, heads: int = 4):
    """A small config: GQA (heads / 2 kv heads), head_dim hidden / heads, eager attention. Multimodal
    wrappers get a 1-layer vision tower; their image token is ``vocab - 1`` (:data:`IMAGE_TOKEN`)."""
    text = _text_kwargs(hidden, layers, vocab, heads)
    if model_type == "gemma3":
        text_config = transformers.Gemma3TextConfig(**text, **DENSE["gemma3_text"][2])
        config = transformers.Gemma3Config(
            text_config=text_config.to_dict(),
            vision_config=_vision("siglip_vision_model"),
            mm_tokens_per_image=4,
            image_token_index=vocab - 1,
            boi_token_index=vocab - 2,
            eoi_token_index=vocab - 3,
        )
    elif model_type == "gemma4":
        vision = _vision("gemma4_vision")
        del vision["image_size"]  # variable resolution: patches with 2-D positions
        config = transformers.Gemma4Config(
            text_config=transformers.Gemma4TextConfig(**{**text, **GEMMA4}).to_dict(),
            # 4 x 4 patches of 4 x 4 pixels pooled 2 x 2: 4 soft tokens an image
            vision_config={
                **vision,
                "head_dim": 16,
                "num_key_value_heads": 2,
                "patch_size": 4,
                "pooling_kernel_size": 2,
            },
            image_token_id=vocab - 1,
            video_token_id=vocab - 2,
            audio_token_id=vocab - 3,
            boi_token_id=vocab - 4,
            eoi_token_id=vocab - 5,
        )
    elif model_type == "llava":
        config = transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(**text).to_dict(),
            vision_config=_vision("clip_vision_model"),
            image_token_index=vocab - 1,
            vision_feature_layer=-1,
        )
    elif model_type == "qwen2_vl":
        # multimodal RoPE: mrope_section (temporal, height, width) sums to head_dim / 2, as Qwen2-VL's
        half = hidden // heads // 2
        sections = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
        config = transformers.Qwen2VLConfig(
            text_config={**text, "rope_parameters": rope},
            vision_config=dict(depth=1, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2),
            image_token_id=vocab - 1,
            video_token_id=vocab - 2,
            vision_start_token_id=vocab - 3,
            vision_end_token_id=vocab - 4,
        )
    else:
        config_cls, _, extra = FAMILY_CLASSES[model_type]
        if model_type == "deepseek_v3":
            text["num_key_value_heads"] = heads  # multi-head latent attention: one k/v per head
        config = getattr(transformers, config_cls)(**{**text, **extra})
    _no_dropout(config)  # e.g. Seed-OSS defaults to 0.1: runs would differ by their masks, not numerics
    config._attn_implementation = "eager"  # set on the sub-configs too
    config._experts_implementation = "eager"  # a loop over experts: float64 runs it (the reference)
    return config


def _no_dropout(config) -> None:
    for name, value in list(vars(config).items()):
        if "dropout" in name and isinstance(value, float) and value:
            setattr(config, name, 0.0)
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            _no_dropout(getattr(config, sub))


def model_class(model_type: str) -> type:
    """The class :func:`build` makes for ``model_type``."""
    name = MULTIMODAL.get(model_type) or FAMILY_CLASSES[model_type][1]
    return getattr(transformers, name)


def build(model_type: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, **sizes):
    """The model of ``model_type`` from :func:`tiny_config`, initialized from ``seed``, in ``dtype``."""
    torch.manual_seed(seed)
    model = model_class(model_type)(tiny_config(model_type, **sizes))
    return model.to(device=device, dtype=dtype)


def clone(model, dtype: torch.dtype | None = None, device: str | None = None):
    """A new model of the same class and config with the same weights (optionally another dtype)."""
    twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict())
    return twin.to(
        device=device or next(model.parameters()).device, dtype=dtype or next(model.parameters()).dtype
    )


def nf4_config(compute_dtype: torch.dtype = torch.float32):
    """bitsandbytes' QLoRA quantization (NF4, double quantization) computing in ``compute_dtype``."""
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
