"""What one ``fuselm.hf.patch`` call asks for (:class:`PatchPlan`, checked when patching), and which of
fuselm's forwards a class of a family gets under it (:func:`forward_for`): what class and instance
patching share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops.swiglu import check_chunk_rows
from .activation_plan import check_budget
from .attention import attention_forward, has_attention_core
from .blocks import mlp_forward, rms_norm_forward
from .causal_lm import causal_lm_forward
from .decoder_layer import decoder_layer_forward
from .loss import LossOptions
from .registry import FamilySpec

# the block components; the loss is the last one. residual_norm: the decoder layer's add after the
# attention runs inside the post-attention RMSNorm (opt-in: fused_residual=True, with rms_norm). layer: the
# decoder layer as two autograd nodes around the attention and the attention's q, k, v + RoPE as one node,
# made from the installed transformers' source (opt-in: fused_layer=True, with rms_norm, rope and swiglu and
# no mlp_chunk_tokens). lora: PEFT's LoRA Linear layers run fuselm.lora (instance patching; the gated MLP's
# LoRA path comes with swiglu)
BLOCKS = ("rms_norm", "residual_norm", "layer", "rope", "swiglu", "lora")


# None: HF's gradient checkpointing as the model has it; "offload": every layer's input on the host;
# "auto": per layer, keep / recompute / offload under a memory budget (fuselm.hf.activation_plan)
CHECKPOINTING = (None, "offload", "auto")


@dataclass(frozen=True)
class PatchPlan:
    """Every option of one ``patch`` call: block components (of :data:`BLOCKS`), the loss options (None:
    the loss stays HF's), the MLP's chunk size and the checkpointing mode (of :data:`CHECKPOINTING`).
    Patching a target again with another plan replaces its patch, options and checkpointing alike."""

    blocks: tuple[str, ...]
    loss: LossOptions | None
    mlp_chunk: int | None = None  # the gated MLP over chunks of this many tokens (long sequences)
    checkpointing: str | None = None
    memory_budget: float | None = None  # GiB, with checkpointing="auto" (None: the default budget)


def make_plan(
    *,
    rms_norm: bool,
    fused_residual: bool,
    rope: bool,
    swiglu: bool,
    lora: bool,
    linear_cross_entropy: bool,
    cross_entropy: bool,
    label_smoothing: float,
    memory: str | int,
    accum_dtype: torch.dtype | None,
    mlp_chunk_tokens: int | None = None,
    fused_layer: bool = False,
    checkpointing: str | None = None,
    memory_budget: float | None = None,
) -> PatchPlan:
    """The :class:`PatchPlan` of ``fuselm.hf.patch``'s keyword arguments; ValueError naming a bad one (the
    loss options are checked by :class:`~fuselm.hf.loss.LossOptions`, also when no loss flag is on)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    if memory_budget is not None:
        memory_budget = check_budget(memory_budget)
        if checkpointing != "auto":
            raise ValueError("memory_budget is the budget of checkpointing='auto': pass both")
    if cross_entropy and linear_cross_entropy:
        raise ValueError(
            "cross_entropy and linear_cross_entropy: two ways to compute the loss, pick one "
            "(linear_cross_entropy=False for the loss on materialized logits)"
        )
    check_chunk_rows("mlp_chunk_tokens", mlp_chunk_tokens)
    if mlp_chunk_tokens is not None and not swiglu:
        raise ValueError("mlp_chunk_tokens chunks fuselm's gated MLP: it needs swiglu=True")
    if fused_residual and not rms_norm:
        raise ValueError(
            "fused_residual=True fuses the residual add into fuselm's RMSNorm: it needs rms_norm=True"
        )
    if fused_layer:
        parts = {"rms_norm": rms_norm, "rope": rope, "swiglu": swiglu}
        missing = [name for name, on in parts.items() if not on]
        if missing:
            raise ValueError(
                f"fused_layer=True fuses fuselm's RMSNorm, RoPE and gated MLP into two nodes per layer: it "
                f"needs {' and '.join(f'{name}=True' for name in missing)}"
            )
        if mlp_chunk_tokens is not None:
            raise ValueError(
                "fused_layer=True runs each layer's MLP whole, in one node: it cannot take mlp_chunk_tokens "
                "(pick one)"
            )
    loss = LossOptions(bool(cross_entropy), label_smoothing, memory, accum_dtype)  # checked, also if unused
    if not (linear_cross_entropy or cross_entropy):
        loss = None
    flags = (rms_norm, fused_residual, fused_layer, rope, swiglu, lora)
    blocks = tuple(c for c, on in zip(BLOCKS, flags, strict=True) if on)
    if not blocks and loss is None:
        raise ValueError("nothing to patch: every component flag is False")
    return PatchPlan(blocks, loss, mlp_chunk_tokens, checkpointing, memory_budget)


def forward_for(spec: FamilySpec, cls: type, original: Callable, plan: PatchPlan) -> Callable | None:
    """fuselm's forward for ``cls``, a class of ``spec``'s modeling module whose own (HF's) forward is
    ``original``, under ``plan``; None: the class keeps HF's (not a class the family swaps, not asked for,
    or a decoder layer that is not Llama's layout in this transformers, warned once)."""
    name = cls.__name__
    if name == spec.rms_norm and "rms_norm" in plan.blocks:
        return rms_norm_forward(spec)
    if name == spec.decoder_layer:
        two_nodes = "layer" in plan.blocks and "layer" in spec.components() and has_attention_core(spec)
        if two_nodes or "residual_norm" in plan.blocks:
            return decoder_layer_forward(spec, original, two_nodes, "residual_norm" in plan.blocks)
        return None
    if name == spec.attention and "layer" in plan.blocks:
        return attention_forward(spec, original)
    if name == spec.mlp and "swiglu" in plan.blocks:
        return mlp_forward(spec, original, plan.mlp_chunk)
    if name in spec.causal_lms and plan.loss is not None:
        return causal_lm_forward(spec, original, plan.loss)
    return None
