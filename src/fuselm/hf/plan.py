"""What one ``fuselm.hf.patch`` call asks for (:class:`PatchPlan`, checked when patching), and which of
fuselm's forwards a class of a family gets under it (:func:`forward_for`): what class and instance
patching share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops.swiglu import check_chunk_rows
from .activation_plan import check_budget
from .blocks import mlp_forward, rms_norm_forward
from .causal_lm import causal_lm_forward
from .loss import LossOptions
from .registry import FamilySpec

# the block components; the loss is the last one. lora: PEFT's LoRA Linear layers run fuselm.lora (instance
# patching; the gated MLP's LoRA path comes with swiglu)
BLOCKS = ("rms_norm", "rope", "swiglu", "lora")

# options patch() no longer has -> what replaces them (True raises ValueError saying so; False does nothing)
REMOVED = {
    "fused_layer": (
        "the decoder layer as two nodes made from transformers' source; for the host time of small-batch "
        "steps capture them in CUDA graphs instead: fuselm.integrations.trainer.capture_training_steps("
        "trainer) (Hugging Face's Trainer, TRL's trainers) or fuselm.CapturedStep"
    ),
    "fused_residual": (
        "the residual add inside the post-attention RMSNorm (0.27% of a step); small-batch steps: "
        "fuselm.integrations.trainer.capture_training_steps(trainer)"
    ),
}


# None: HF's gradient checkpointing as the model has it; "recompute": fuselm's checkpointing, every layer's
# input on the device (a CUDA graph captures it); "offload": every layer's input on the host; "auto": per
# layer, keep / recompute / offload under a memory budget (fuselm.hf.activation_plan)
CHECKPOINTING = (None, "recompute", "offload", "auto")


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
    rope: bool,
    swiglu: bool,
    lora: bool,
    linear_cross_entropy: bool,
    cross_entropy: bool,
    label_smoothing: float,
    memory: str | int,
    accum_dtype: torch.dtype | None,
    mlp_chunk_tokens: int | None = None,
    checkpointing: str | None = None,
    memory_budget: float | None = None,
    removed: dict | None = None,
) -> PatchPlan:
    """The :class:`PatchPlan` of ``fuselm.hf.patch``'s keyword arguments; ValueError naming a bad one (the
    loss options are checked by :class:`~fuselm.hf.loss.LossOptions`, also when no loss flag is on).
    ``removed``: the other keyword arguments patch() got: an option of :data:`REMOVED` set (True) raises
    ValueError saying what replaces it, False is accepted; any other name raises TypeError."""
    for name, value in (removed or {}).items():
        if name not in REMOVED:
            raise TypeError(f"patch() got an unexpected keyword argument {name!r}")
        if value:
            raise ValueError(f"{name}=True was removed from fuselm.hf.patch ({REMOVED[name]})")
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
    loss = LossOptions(bool(cross_entropy), label_smoothing, memory, accum_dtype)  # checked, also if unused
    if not (linear_cross_entropy or cross_entropy):
        loss = None
    flags = (rms_norm, rope, swiglu, lora)
    blocks = tuple(c for c, on in zip(BLOCKS, flags, strict=True) if on)
    if not blocks and loss is None:
        raise ValueError("nothing to patch: every component flag is False")
    return PatchPlan(blocks, loss, mlp_chunk_tokens, checkpointing, memory_budget)


def forward_for(spec: FamilySpec, cls: type, original: Callable, plan: PatchPlan) -> Callable | None:
    """fuselm's forward for ``cls``, a class of ``spec``'s modeling module whose own (HF's) forward is
    ``original``, under ``plan``; None: the class keeps HF's (not a class the family swaps, not asked for)."""
    name = cls.__name__
    if name == spec.rms_norm and "rms_norm" in plan.blocks:
        return rms_norm_forward(spec)
    if name == spec.mlp and "swiglu" in plan.blocks:
        return mlp_forward(spec, original, plan.mlp_chunk)
    if name in spec.causal_lms and plan.loss is not None:
        return causal_lm_forward(spec, original, plan.loss)
    return None
