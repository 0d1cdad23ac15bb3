"""Per-family specs: which classes and functions of a Hugging Face modeling module fuselm replaces.

One small :class:`FamilySpec` per modeling module; a family that reuses Llama's structure is one entry.
Names are looked up in ``transformers.models.<family>.modeling_<family>`` when patching. A component a
family does not have, or whose math differs from fuselm's kernels (an interleaved or complex RoPE, a
non-gated MLP, experts stored as fused 3-D parameters, a centered LayerNorm), is None: it stays Hugging
Face's, and :attr:`FamilySpec.keeps` says why. Everything a spec names computes exactly HF's math
(``tests/hf/test_families.py`` checks loss, every gradient and the logits of each family).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The names an RMSNorm's epsilon goes by (transformers renames them between versions: Llama 4's and Gemma
# 4's `eps` became `variance_epsilon` in 5.25); the first one a module has is read (blocks.norm_operands).
EPS_NAMES = ("variance_epsilon", "eps")

# How a family's RMSNorm computes, as arguments of fuselm.rms_norm.
NORM_STYLES = {
    # LlamaRMSNorm: normalize in fp32, cast to the input dtype, multiply by weight.
    "llama": {"offset": 0.0, "casting": "llama"},
    # GemmaRMSNorm: everything in fp32 with (1 + weight), cast at the end.
    "gemma": {"offset": 1.0, "casting": "gemma"},
    # Olmo2RMSNorm (OLMo 3, gpt-oss): everything in fp32 with the weight, cast at the end.
    "olmo2": {"offset": 0.0, "casting": "gemma"},
    # Gemma4RMSNorm: everything in fp32 with the weight itself (no 1 + weight, unlike Gemma 1-3), cast at
    # the end; ``with_scale=False`` instances (Gemma 4's v_norm, router norm) have no weight at all.
    "gemma4": {"offset": 0.0, "casting": "gemma", "scale_flag": "with_scale"},
}


@dataclass(frozen=True)
class FamilySpec:
    """What to swap in one Hugging Face modeling module.

    Attributes:
        model_type: the config's ``model_type`` (also the key of :data:`FAMILIES`).
        module: the modeling module's import path.
        causal_lms: the classes whose ``forward`` gets the fused loss: the ``*ForCausalLM`` and, for a
            multimodal family, its ``*ForConditionalGeneration``.
        rms_norm: the RMSNorm class, or None (stays HF's).
        norm_style: a key of :data:`NORM_STYLES`.
        mlp: the gated MLP class (``gate_proj``/``up_proj``/``down_proj``, or ``gate_up_proj``), or None.
        packed_mlp: the MLP has one ``gate_up_proj`` (gate first) instead of ``gate_proj`` and ``up_proj``.
        act_attr: the config attribute naming the MLP activation (``hidden_act`` or Gemma 2/3's
            ``hidden_activation``).
        mlp_multipliers: the MLP's attributes holding (gate multiplier, down multiplier) when its forward
            is ``down_proj(act(gate_proj(x) * g) * up_proj(x)) * d`` (Falcon-H1's ``mlp_multipliers``), or
            None (no multipliers). Split projections only.
        rope: the module-level rotary function the attention calls (HF's ``rotate_half`` RoPE), or None.
        rope_one_tensor: that function rotates one tensor, ``apply_rotary_pos_emb(x, cos, sin,
            unsqueeze_dim=1)`` (Gemma 4: called once for q, once for k), instead of
            ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.
        keeps: what stays Hugging Face's and why (shown in the supported-models table).
    """

    model_type: str
    module: str
    causal_lms: tuple[str, ...]
    rms_norm: str | None
    mlp: str | None
    norm_style: str = "llama"
    packed_mlp: bool = False
    act_attr: str = "hidden_act"
    mlp_multipliers: tuple[str, str] | None = None
    rope: str | None = "apply_rotary_pos_emb"
    rope_one_tensor: bool = False
    keeps: str = field(default="", compare=False)

    def __post_init__(self):
        if self.mlp_multipliers is not None and self.packed_mlp:
            raise ValueError(f"{self.model_type}: MLP multipliers need split gate_proj / up_proj projections")

    def components(self) -> dict[str, str]:
        """The block components the family swaps -> the class or function name each replaces."""
        names = {"rms_norm": self.rms_norm, "rope": self.rope, "swiglu": self.mlp}
        return {c: n for c, n in names.items() if n is not None}


def _spec(model_type: str, prefix: str, *, module: str | None = None, **kw) -> FamilySpec:
    """A spec with the usual names: ``<prefix>RMSNorm``, ``<prefix>MLP``, ``<prefix>ForCausalLM`` in
    ``transformers.models.<module or model_type>.modeling_<...>``; keyword arguments override."""
    name = module or model_type
    kw = {
        "causal_lms": (f"{prefix}ForCausalLM",),
        "rms_norm": f"{prefix}RMSNorm",
        "mlp": f"{prefix}MLP",
        **kw,
    }
    return FamilySpec(model_type=model_type, module=f"transformers.models.{name}.modeling_{name}", **kw)


# Reasons a component stays HF's (the table's "stays HF's" column).
INTERLEAVED = "RoPE (interleaved pairs)"
EXPERTS = "experts (fused 3-D parameters)"
# Gemma 2 and 3: Gemma's norm, the activation under another config name.
GEMMA2_LIKE = dict(norm_style="gemma", act_attr="hidden_activation")
FAMILIES: dict[str, FamilySpec] = {
    s.model_type: s
    for s in (
        # dense
        _spec("llama", "Llama"),
        _spec("mistral", "Mistral"),
        _spec("ministral", "Ministral"),
        _spec("qwen2", "Qwen2"),
        _spec("qwen3", "Qwen3"),
        _spec("phi3", "Phi3", packed_mlp=True),
        _spec("gemma", "Gemma", norm_style="gemma"),
        _spec("gemma2", "Gemma2", **GEMMA2_LIKE),
        _spec(
            "gemma3",
            "Gemma3",
            **GEMMA2_LIKE,
            causal_lms=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        ),
        # Gemma 4: the norm has no 1 + weight (and may have no weight), RoPE rotates q and k in separate
        # calls; the MLP of the text layers is Gemma's GeGLU (the vision tower's has clipped linears)
        _spec(
            "gemma4",
            "Gemma4",
            norm_style="gemma4",
            act_attr="hidden_activation",
            mlp="Gemma4TextMLP",
            rope_one_tensor=True,
            causal_lms=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
            keeps=f"{EXPERTS}, per-layer-input gate, vision MLP (clippable linears), audio feed-forward",
        ),
        _spec("olmo2", "Olmo2", norm_style="olmo2"),
        _spec("olmo3", "Olmo3", norm_style="olmo2"),
        _spec("granite", "Granite"),
        _spec("smollm3", "SmolLM3"),
        _spec("glm4", "Glm4", packed_mlp=True, rope=None, keeps=INTERLEAVED),
        _spec("cohere", "Cohere", rms_norm=None, rope=None, keeps=f"LayerNorm (centered), {INTERLEAVED}"),
        _spec("cohere2", "Cohere2", rms_norm=None, rope=None, keeps=f"LayerNorm (centered), {INTERLEAVED}"),
        _spec(
            "starcoder2",
            "Starcoder2",
            rms_norm=None,
            mlp=None,
            keeps="nn.LayerNorm, MLP (not gated)",
        ),
        _spec("exaone4", "Exaone4"),
        _spec(
            "seed_oss",
            "SeedOss",
            mlp=None,
            keeps="MLP (a residual dropout after it)",
        ),
        _spec("ernie4_5", "Ernie4_5", rope=None, keeps=INTERLEAVED),
        _spec("apertus", "Apertus", mlp=None, keeps="MLP (not gated, xIELU)"),
        _spec(
            "arcee",
            "Arcee",
            mlp=None,
            keeps="MLP (not gated, ReLU^2)",
        ),
        _spec("hunyuan_v1_dense", "HunYuanDenseV1"),
        # hybrid: attention and a Mamba-2 mixer side by side in every layer; the MLP scales its gate
        # projection and its output (config.mlp_multipliers), which the patched forward does too
        _spec(
            "falcon_h1",
            "FalconH1",
            mlp_multipliers=("gate_multiplier", "down_multiplier"),
            keeps="Mamba mixer (and its gated RMSNorm)",
        ),
        # mixture of experts: the dense MLPs (shared experts, dense layers) are swapped, the experts not
        _spec("qwen3_moe", "Qwen3Moe", keeps=EXPERTS),
        _spec("qwen2_moe", "Qwen2Moe", keeps=EXPERTS),
        _spec("qwen3_next", "Qwen3Next", norm_style="gemma", keeps=f"{EXPERTS}, gated DeltaNet"),
        _spec("mixtral", "Mixtral", mlp=None, keeps=EXPERTS),
        _spec("olmoe", "Olmoe", mlp=None, keeps=EXPERTS),
        _spec("granitemoe", "GraniteMoe", mlp=None, keeps=EXPERTS),
        _spec(
            "gpt_oss",
            "GptOss",
            norm_style="olmo2",
            mlp=None,
            rope=None,
            keeps=f"{EXPERTS}, RoPE (half-width cos/sin layout)",
        ),
        _spec("deepseek_v3", "DeepseekV3", keeps=f"{EXPERTS}, RoPE with rope_interleave=True"),
        _spec(
            "llama4_text",
            "Llama4Text",
            module="llama4",
            causal_lms=("Llama4ForCausalLM",),
            rope=None,
            keeps=f"{EXPERTS}, RoPE (complex), L2 q/k norm",
        ),
        # multimodal: the text model's blocks; the vision tower stays HF's
        _spec(
            "qwen2_vl",
            "Qwen2VL",
            causal_lms=("Qwen2VLForConditionalGeneration",),
            mlp="Qwen2MLP",
            keeps="vision tower",
        ),
        _spec(
            "llava",
            "Llava",
            causal_lms=("LlavaForConditionalGeneration",),
            rms_norm=None,
            mlp=None,
            rope=None,
            keeps="vision tower; the text model's blocks are its own family's",
        ),
    )
}
# model_type values of configs that map to a family above (Gemma 3's and Gemma 4's text-only configs).
ALIASES = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}


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


def generic_spec(cls: type) -> FamilySpec:
    """A spec for a ``*ForCausalLM`` / ``*ForConditionalGeneration`` class of a family without one: its
    loss is fused, nothing else is swapped."""
    model_type = getattr(getattr(cls, "config_class", None), "model_type", "") or cls.__name__
    return FamilySpec(
        model_type=model_type,
        module=cls.__module__,
        causal_lms=(cls.__name__,),
        rms_norm=None,
        mlp=None,
        rope=None,
        keeps="norms, RoPE, MLP (no fuselm spec for this family)",
    )


def is_lm_class_name(name: str) -> bool:
    """A class name Hugging Face gives a language model with a head: ``*ForCausalLM`` or
    ``*ForConditionalGeneration``."""
    return name.endswith(("ForCausalLM", "ForConditionalGeneration"))


def supported_model_types() -> list[str]:
    """Every ``model_type`` fuselm.hf has a spec for, aliases included.

    Example:
        >>> import fuselm.hf
        >>> "qwen3_moe" in fuselm.hf.supported_model_types()
        True
    """
    return sorted([*FAMILIES, *ALIASES])


_COMPONENT_TITLES = {"rms_norm": "RMSNorm", "rope": "RoPE", "swiglu": "gated MLP"}


def markdown_table() -> str:
    """The supported model types as a Markdown table: model type, loss classes, what fuselm swaps (``RMSNorm
    (<style>)``, ``gated MLP (packed)``, ...), what stays Hugging Face's. ``src/fuselm/hf/README.md`` holds
    this table (tests keep it equal).

    Example:
        >>> import fuselm.hf
        >>> print(fuselm.hf.markdown_table().splitlines()[0])
        | model_type | fused loss on | fuselm kernels | stays HF's |
    """
    rows = [
        "| model_type | fused loss on | fuselm kernels | stays HF's |",
        "|---|---|---|---|",
    ]
    aliases = {v: k for k, v in ALIASES.items()}
    for key in sorted(FAMILIES):
        spec = FAMILIES[key]
        name = f"`{key}`" + (f" (`{aliases[key]}`)" if key in aliases else "")
        lms = ", ".join(f"`{c}`" for c in spec.causal_lms)
        kernels = []
        for component, title in _COMPONENT_TITLES.items():
            if component in spec.components():
                detail = ""
                if component == "rms_norm":
                    detail = f" ({spec.norm_style})"
                elif component == "swiglu" and spec.packed_mlp:
                    detail = " (packed)"
                elif component == "swiglu" and spec.mlp_multipliers:
                    detail = " (multipliers)"
                kernels.append(title + detail)
        rows.append(f"| {name} | {lms} | {', '.join(kernels) or '-'} | {spec.keeps or '-'} |")
    return "\n".join(rows) + "\n"
