"""Per-family specs: which classes and functions of a Hugging Face modeling module fuselm replaces.

One small :class:`FamilySpec` per model family; adding a family that reuses Llama's structure is one
entry. Names are looked up in ``transformers.models.<family>.modeling_<family>`` when patching.
"""

from __future__ import annotations

from dataclasses import dataclass

# How a family's RMSNorm computes, as arguments of fuselm.rms_norm, and where its epsilon lives.
NORM_STYLES = {
    # LlamaRMSNorm: normalize in fp32, cast to the input dtype, multiply by weight.
    "llama": {"eps_attr": "variance_epsilon", "offset": 0.0, "casting": "llama"},
    # GemmaRMSNorm: everything in fp32 with (1 + weight), cast at the end.
    "gemma": {"eps_attr": "eps", "offset": 1.0, "casting": "gemma"},
}


@dataclass(frozen=True)
class FamilySpec:
    """What to swap in one Hugging Face model family.

    Attributes:
        model_type: the config's ``model_type`` (also the key of :data:`FAMILIES`).
        module: the modeling module's import path.
        causal_lm: the ``*ForCausalLM`` class (its forward gets the fused loss).
        rms_norm: the RMSNorm class.
        norm_style: a key of :data:`NORM_STYLES`.
        mlp: the gated MLP class.
        packed_mlp: the MLP has one ``gate_up_proj`` (gate first, Phi-3) instead of ``gate_proj`` and
            ``up_proj``.
        act_attr: the config attribute naming the MLP activation (``hidden_act`` or Gemma 2/3's
            ``hidden_activation``).
        rope: the module-level rotary function the attention calls.
        softcap_attr: the config attribute of the final logit softcap (Gemma 2/3), or None.
    """

    model_type: str
    module: str
    causal_lm: str
    rms_norm: str
    mlp: str
    norm_style: str = "llama"
    packed_mlp: bool = False
    act_attr: str = "hidden_act"
    rope: str = "apply_rotary_pos_emb"
    softcap_attr: str | None = None


def _spec(model_type: str, prefix: str, **kw) -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        module=f"transformers.models.{model_type}.modeling_{model_type}",
        causal_lm=f"{prefix}ForCausalLM",
        rms_norm=f"{prefix}RMSNorm",
        mlp=f"{prefix}MLP",
        **kw,
    )


# Gemma 2 and 3: Gemma's norm, the activation under another config name, a final logit softcap.
GEMMA2_LIKE = dict(norm_style="gemma", act_attr="hidden_activation", softcap_attr="final_logit_softcapping")
FAMILIES: dict[str, FamilySpec] = {
    s.model_type: s
    for s in (
        _spec("llama", "Llama"),
        _spec("mistral", "Mistral"),
        _spec("qwen2", "Qwen2"),
        _spec("qwen3", "Qwen3"),
        _spec("phi3", "Phi3", packed_mlp=True),
        _spec("gemma", "Gemma", norm_style="gemma"),
        _spec("gemma2", "Gemma2", **GEMMA2_LIKE),
        _spec("gemma3", "Gemma3", **GEMMA2_LIKE),
    )
}
# model_type values of configs that map to a family above (Gemma 3's text-only config).
ALIASES = {"gemma3_text": "gemma3"}


def family(model_type: str) -> FamilySpec:
    """The spec of a ``model_type`` (or alias); ValueError naming the supported ones otherwise."""
    key = ALIASES.get(model_type, model_type)
    if key not in FAMILIES:
        known = ", ".join(supported_model_types())
        raise ValueError(f"fuselm.hf has no spec for model_type {model_type!r}; supported: {known}")
    return FAMILIES[key]


def family_of_module(module_name: str) -> FamilySpec | None:
    """The spec whose modeling module is ``module_name`` (a class's ``__module__``), or None."""
    for spec in FAMILIES.values():
        if spec.module == module_name:
            return spec
    return None


def supported_model_types() -> list[str]:
    """Every ``model_type`` fuselm.hf can patch, aliases included."""
    return sorted([*FAMILIES, *ALIASES])
