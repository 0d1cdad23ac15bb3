"""``patch`` / ``unpatch`` / ``is_patched``: put fuselm's forwards into Hugging Face models, take them out.

Three targets:
- a model_type string (``"llama"``) or a model class: class patching (:mod:`fuselm.hf.class_patch`). The
  family's RMSNorm, MLP and CausalLM (and multimodal ConditionalGeneration) classes get fuselm's ``forward``
  as a class attribute and the modeling module's rotary function is replaced: every model of the family,
  built before or after, uses them.
- a built model (any ``nn.Module``: a PEFT wrapper, a bare decoder, a CausalLM, a multimodal wrapper):
  instance patching (:mod:`fuselm.hf.instance_patch`). Every submodule of a known family class gets
  fuselm's forward as an instance attribute; other models of the same class are untouched. The patch
  state lives on the patched modules, so :func:`is_patched` and :func:`unpatch` tell the truth about any
  model holding patched modules, and copies are patched for real.

Patching a target again with other options replaces its patch (as ``unpatch`` then ``patch``).
``unpatch`` restores exactly what was there: the original class attributes (or their absence), the
original module function, no instance attributes left behind. The rotary function is module-level in HF
(:mod:`fuselm.hf.installs`): it runs fuselm's RoPE while a class patch or a live patched model needs it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import activation_plan, offload
from ._common import INSTANCE_MARK, hf_class
from .class_patch import family_of_target, is_class_patched, patch_family, unpatch_family
from .installs import sweep
from .instance_patch import InstanceForward, class_spec, instance_plan, patch_instance, unpatch_instance
from .plan import PatchPlan, make_plan
from .registry import family_of_module

# ---- the public functions ----


def _bad_target(target) -> TypeError:
    got = type(target).__name__
    return TypeError(f"target must be a model, a model class or a model_type string, got {got}")


def patch(
    target,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    lora: bool = True,
    linear_cross_entropy: bool = True,
    cross_entropy: bool = False,
    label_smoothing: float = 0.0,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
    checkpointing: str | None = None,
    memory_budget: float | None = None,
    mlp_chunk_tokens: int | None = None,
    **removed,
):
    """Run a Hugging Face model (or a whole model family) on fuselm's kernels.

    Args:
        target: a built model (``nn.Module``: a ``*ForCausalLM``, a multimodal
            ``*ForConditionalGeneration``, its base model, a PEFT wrapper of it; only this instance is
            patched), a model class (``LlamaForCausalLM``: its whole family is patched, models built
            before and after), or a ``model_type`` string (``"llama"``, the same as its class, usable
            before anything is imported). Supported model types: :func:`fuselm.hf.supported_model_types`
            (table in ``fuselm/hf/README.md``). A ``*ForCausalLM`` (model or class) of a family without a
            spec gets the fused loss only, with one warning naming what stays Hugging Face's.
        rms_norm: every RMSNorm of the family (including q/k norms) runs :func:`fuselm.rms_norm` with
            the family's casting (Llama's, Gemma's ``1 + weight``, OLMo 2's), HF's formula exactly.
        rope: the attention's ``apply_rotary_pos_emb`` runs :func:`fuselm.apply_rotary` (GQA, partial
            rotary). Module-level in HF: from the patch on, every model of that family runs it (the same
            math as HF's), until a later ``patch`` / ``unpatch`` call finds no patch of the family left.
        swiglu: the gated MLP (also shared experts and dense layers of MoE models) runs the fused
            activation; with separate ``gate_proj``/``up_proj`` the down projection's input is recomputed
            in backward instead of saved, and plain ``nn.Linear`` projections run as one autograd node
            (:func:`fuselm.ops.swiglu.swiglu_mlp`). Activations without a fuselm kernel run HF's MLP.
            Projections that are PEFT LoRA layers or bitsandbytes 4/8-bit layers run
            :func:`fuselm.lora.lora_gated_mlp` (one autograd node saving x, the gate and up
            pre-activations and the rank-r products).
        lora: PEFT's LoRA ``Linear`` layers (attention projections, and any other target) run
            :func:`fuselm.lora.lora_linear` (instance patching): the update added into the base GEMM's
            output, adapters cast to the compute dtype once per call, bitsandbytes 4-bit / 8-bit bases
            dequantized into one shared buffer, PEFT's dropout masks. Patched before ``get_peft_model``,
            the layers PEFT adds get it at the model's next forward. What it does not cover (DoRA, LoRA
            bias, several active adapters, ...) runs PEFT's forward after one warning naming the layer.
        linear_cross_entropy: the ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward with
            ``labels`` in training computes HF's causal-LM loss from the hidden states with
            :func:`fuselm.linear_cross_entropy` and returns ``logits=None``: no ``[B, T, V]`` tensor.
        cross_entropy: with ``linear_cross_entropy=False``: the forward with labels returns HF's logits
            and computes the loss on them with :func:`fuselm.cross_entropy`. At most one loss flag.
        label_smoothing: PyTorch's label smoothing inside the fused loss (the route to use instead of
            the Trainer's ``label_smoothing_factor``).
        memory: the ``memory=`` plan of :func:`fuselm.linear_cross_entropy`: ``"auto"``, ``"min"`` or a
            positive int (bytes).
        accum_dtype: :func:`fuselm.linear_cross_entropy`'s: None, or ``torch.float32`` (the lm_head's
            gradient summed in fp32 across chunks). The loss options are checked here, also when no
            loss flag is on.
        checkpointing: None (HF's gradient checkpointing as the model has it), ``"recompute"`` (built
            models only): every decoder layer checkpointed by :func:`fuselm.offload.recompute_checkpoint`,
            its input kept on the device (a step that a CUDA graph captures: :class:`fuselm.CapturedStep`,
            :func:`~fuselm.integrations.trainer.capture_training_steps`; turned on like ``"offload"``), or
            ``"offload"`` (built models only): gradient checkpointing with each decoder layer's input kept
            in pinned host
            memory between forward and backward (:func:`fuselm.hf.offload.enable`: turned on if it is off,
            kept through later ``gradient_checkpointing_enable()`` calls and Trainer's flag), or ``"auto"``
            (built models only): per decoder layer, keep its activations, recompute it, or offload its
            input, so that the step's peak stays under ``memory_budget``, recomputing as little as it
            allows (:mod:`fuselm.hf.activation_plan`: planned at the first training forward, again when a
            batch has more tokens; ``fuselm.hf.report(model).activations`` says what each layer does).
            Options of the patch like the others: patching the model again without them, or unpatching,
            turns them off.
        memory_budget: with ``checkpointing="auto"``: GiB for the training step's peak (weights,
            optimizer state and activations); None: 90% of the GPU's memory (on the CPU: no limit, every
            layer keeps its activations). A number > 0.
        mlp_chunk_tokens: None, or (with ``swiglu``) the gated MLP runs over chunks of this many tokens:
            no ``[tokens, intermediate]`` tensor is ever held, only x is saved, each chunk's gate and up
            projections are recomputed in backward (for the longest sequences, where those tensors
            decide what fits). Dense and LoRA / QLoRA MLPs; one with LoRA dropout on ``down_proj``,
            multipliers or hooked projections says so once and runs whole.
        removed: ``fused_layer`` and ``fused_residual`` were options (the decoder layer as two autograd
            nodes, the residual add inside the RMSNorm, made from transformers' source); ``True`` raises
            ValueError pointing to what replaces them for small-batch host time,
            :func:`fuselm.integrations.trainer.capture_training_steps`; ``False`` does nothing. Any other
            name raises TypeError.

    Patching a target that is already patched with other options replaces its patch (the same as
    :func:`unpatch` then :func:`patch`); with the same options it does nothing. An instance patch
    overrides a class patch of the same classes for that model. The patch lives on the patched modules:
    a model holding them is patched (``peft_model.merge_and_unload()``), and a copy of a patched model
    (``copy.deepcopy``, pickle, ``torch.save`` / ``torch.load``) is patched for real, with the same
    options (loading it installs the family's RoPE if the process has none).

    Returns:
        the target (so ``model = fuselm.hf.patch(model)`` reads naturally).

    Raises:
        ValueError: an unknown model type, a class of an unknown family that is no ``*ForCausalLM``, a
            model in which nothing can be patched with these flags (fuselm never patches silently
            nothing), both loss flags, a bad ``label_smoothing``, ``memory`` or ``accum_dtype`` (the
            message names the argument and its allowed values), ``fused_layer=True`` or
            ``fused_residual=True`` (removed options).
        ImportError: transformers is missing, or too old for the family's modeling module.

    Example:
        >>> import fuselm.hf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
        >>> model = fuselm.hf.patch(LlamaForCausalLM(config))
        >>> fuselm.hf.is_patched(model), fuselm.hf.is_patched(LlamaForCausalLM(config))
        (True, False)
        >>> model.model.layers[0].mlp.forward.__qualname__
        'fuselm_LlamaMLP.forward'
        >>> import torch
        >>> ids = torch.randint(0, 300, (2, 16))
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.loss.shape, out.logits is None
        (torch.Size([]), True)
        >>> _ = fuselm.hf.unpatch(model)
    """
    plan = make_plan(
        rms_norm=rms_norm,
        rope=rope,
        swiglu=swiglu,
        lora=lora,
        linear_cross_entropy=linear_cross_entropy,
        cross_entropy=cross_entropy,
        label_smoothing=label_smoothing,
        memory=memory,
        accum_dtype=accum_dtype,
        mlp_chunk_tokens=mlp_chunk_tokens,
        checkpointing=checkpointing,
        memory_budget=memory_budget,
        removed=removed,
    )
    if isinstance(target, nn.Module):
        before = instance_plan(target)
        patch_instance(target, plan)
        if before != plan:
            _set_checkpointing(target, before, plan)
    elif checkpointing is not None and isinstance(target, (str, type)):
        raise ValueError(
            f"checkpointing={checkpointing!r} takes a built model, not a model class or model_type"
        )
    elif isinstance(target, (str, type)):
        spec = family_of_target(target)
        patch_family(spec, plan)
        if family_of_module(spec.module) is None:
            warnings.warn(
                f"fuselm.hf: no spec for {spec.causal_lms[0]} ({spec.model_type}): its loss is fused; its "
                "norms, RoPE and MLP stay Hugging Face's",
                stacklevel=2,
            )
    else:
        raise _bad_target(target)
    sweep()
    return target


def _set_checkpointing(model: nn.Module, before: PatchPlan | None, plan: PatchPlan) -> None:
    """The checkpointing ``plan`` asks for on ``model``, the one ``before`` asked for taken out first."""
    if before is not None and before.checkpointing is not None:
        activation_plan.disable(model)
        if offload.is_enabled(model):
            offload.disable(model)
    if plan.checkpointing == "offload":
        offload.enable(model)
    elif plan.checkpointing == "auto":
        activation_plan.enable(model, plan.memory_budget)
    elif plan.checkpointing == "recompute":
        activation_plan.enable(model, every_layer="recompute")


def unpatch(target):
    """Undo :func:`patch` on the same target: a built model loses every forward fuselm gave it or its
    submodules (also a model holding modules of a patched one: ``merge_and_unload``'s result, a copy); a
    class or model_type string gets its family's original classes back. Rotary functions no patch needs
    any more are restored. A target that was not patched is left as it is. Returns the target."""
    if isinstance(target, nn.Module):
        unpatch_instance(target)
        activation_plan.disable(target)
        if offload.is_enabled(target):
            offload.disable(target)
    elif isinstance(target, (str, type)):
        unpatch_family(family_of_target(target))
    else:
        raise _bad_target(target)
    sweep()
    return target


def is_patched(target) -> bool:
    """Whether fuselm's code runs in this target: for a built model, an instance patch of it or of its
    submodules (wherever they are now: inside a PEFT model, the model ``merge_and_unload`` returned, a
    copy), or a class patch of one of its classes' families (not another model's patch); for a
    model_type or class, a class patch of its family."""
    if isinstance(target, nn.Module):
        for m in target.modules():
            if INSTANCE_MARK in vars(m) or isinstance(vars(m).get("forward"), InstanceForward):
                return True
        return any(is_class_patched(class_spec(hf_class(m))) for m in target.modules())
    if not isinstance(target, (str, type)):
        raise _bad_target(target)
    return is_class_patched(family_of_target(target))
