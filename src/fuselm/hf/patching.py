"""``patch`` / ``unpatch``: put fuselm's forwards into Hugging Face models, and take them out again.

Three targets:
- a model_type string (``"llama"``) or a model class: class patching. The family's RMSNorm, MLP and
  CausalLM classes get fuselm's ``forward`` as a class attribute and the modeling module's rotary
  function is replaced: every model of the family, built before or after, uses them.
- a built model (any ``nn.Module``: a PEFT wrapper, a bare decoder, a CausalLM): instance patching.
  Every submodule of a known family class gets fuselm's forward as an instance attribute; other models
  of the same class are untouched. The rotary function is module-level in HF (the attention calls it by
  name), so ``rope=True`` replaces it in the family's module until the last patched model is
  unpatched.

``unpatch`` restores exactly what was there: the original class attributes (or their absence), the
original module function, no instance attributes left behind.
"""

from __future__ import annotations

import importlib
import types
import weakref
from collections.abc import Callable

from torch import nn

from . import layers
from .registry import FamilySpec, family, family_of_module, supported_model_types

COMPONENTS = ("rms_norm", "rope", "swiglu", "linear_cross_entropy", "cross_entropy")
LOSSES = ("linear_cross_entropy", "cross_entropy")  # two ways to swap the CausalLM forward: one at a time
MISSING = object()  # a class attribute that was not in the class's own __dict__

# Class patches in force: (family, component) -> [(owner, name, previous value or MISSING)].
_class_patches: dict[tuple[str, str], list[tuple[object, str, object]]] = {}
# Who needs a family's rotary function replaced: "class" and/or one token per instance-patched model
# (released by unpatch, or by a finalizer when the model is garbage-collected unpatched).
_rope_users: dict[str, set] = {}
_rope_original: dict[str, Callable] = {}
# Marker attribute on an instance-patched model: the components and families patched there.
INSTANCE_MARK = "_fuselm_patch"


def _modeling(spec: FamilySpec) -> types.ModuleType:
    try:
        return importlib.import_module(spec.module)
    except ImportError as e:
        raise ImportError(
            f"fuselm.hf needs transformers with the {spec.model_type!r} family ({spec.module}): "
            'pip install "fuselm[hf]"'
        ) from e


def _own(cls: type, name: str):
    """The attribute as the class itself defines it (MISSING if only inherited)."""
    return cls.__dict__.get(name, MISSING)


def _components(rms_norm: bool, rope: bool, swiglu: bool, linear_cross_entropy: bool, cross_entropy: bool):
    if cross_entropy and linear_cross_entropy:
        raise ValueError(
            "cross_entropy and linear_cross_entropy: two ways to compute the loss, pick one "
            "(linear_cross_entropy=False for the loss on materialized logits)"
        )
    flags = (rms_norm, rope, swiglu, linear_cross_entropy, cross_entropy)
    return [c for c, on in zip(COMPONENTS, flags, strict=True) if on]


def _replacement(spec: FamilySpec, component: str, module: types.ModuleType) -> tuple[type, str, Callable]:
    """(class, attribute name, new forward) of a class-level component (all but rope)."""
    if component == "rms_norm":
        cls = getattr(module, spec.rms_norm)
        return cls, "forward", layers.rms_norm_forward(spec)
    if component == "swiglu":
        cls = getattr(module, spec.mlp)
        return cls, "forward", layers.mlp_forward(spec, cls.forward)
    cls = getattr(module, spec.causal_lm)
    options = layers.LossOptions(from_logits=component == "cross_entropy")
    return cls, "forward", layers.causal_lm_forward(spec, cls.forward, options)


def _rope_acquire(spec: FamilySpec, module: types.ModuleType, user) -> None:
    users = _rope_users.setdefault(spec.model_type, set())
    if not users:
        original = getattr(module, spec.rope)
        _rope_original[spec.model_type] = original
        setattr(module, spec.rope, layers.rope_function(spec, original))
    users.add(user)


def _rope_release(spec: FamilySpec, user) -> None:
    users = _rope_users.get(spec.model_type, set())
    users.discard(user)
    if not users and spec.model_type in _rope_original:
        setattr(_modeling(spec), spec.rope, _rope_original.pop(spec.model_type))


def _patch_family(spec: FamilySpec, components: list[str]) -> None:
    module = _modeling(spec)
    for component in components:
        key = (spec.model_type, component)
        if key in _class_patches:
            continue
        if component in LOSSES and any((spec.model_type, other) in _class_patches for other in LOSSES):
            raise ValueError(f"{spec.model_type}: the other loss is patched in; unpatch first to switch")
        if component == "rope":
            _rope_acquire(spec, module, "class")
            _class_patches[key] = []
            continue
        owner, name, new = _replacement(spec, component, module)
        _class_patches[key] = [(owner, name, _own(owner, name))]
        setattr(owner, name, new)


def _unpatch_family(spec: FamilySpec) -> None:
    for component in COMPONENTS:
        saved = _class_patches.pop((spec.model_type, component), None)
        if saved is None:
            continue
        if component == "rope":
            _rope_release(spec, "class")
        for owner, name, previous in saved:
            if previous is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def _same_slot(component: str) -> tuple[str, ...]:
    """The components that replace the same forward as ``component`` (the two losses share one)."""
    return LOSSES if component in LOSSES else (component,)


def _hf_class(module: nn.Module) -> type:
    """The module's Hugging Face class: FSDP2's fully_shard (and replicate) swap a module's class for a
    subclass (FSDPModule, cls) defined in torch; look through that one, not through user subclasses."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ in ("FSDPModule", "ReplicateModule"):
        return bases[1]
    return cls


def _patch_instance(model: nn.Module, components: list[str]) -> None:
    mark = getattr(model, INSTANCE_MARK, None) or {"families": {}, "modules": []}
    families: dict[str, FamilySpec] = {}
    for sub in model.modules():
        spec = family_of_module(_hf_class(sub).__module__)
        if spec is None:
            continue
        families[spec.model_type] = spec
        module = _modeling(spec)
        for component in components:
            in_class = any((spec.model_type, c) in _class_patches for c in _same_slot(component))
            if component == "rope" or in_class:
                continue  # rope: module-level, below; a patched class already runs fuselm's forward
            cls, _, new = _replacement(spec, component, module)
            if _hf_class(sub) is not cls or "forward" in vars(sub):
                continue
            sub.forward = types.MethodType(new, sub)
            mark["modules"].append(sub)
    if not families:
        raise ValueError(
            f"{type(model).__name__} contains no module of a family fuselm.hf knows "
            f"(supported model types: {', '.join(supported_model_types())})"
        )
    if "rope" in components:
        for spec in families.values():
            if spec.model_type not in mark["families"]:
                token = object()
                _rope_acquire(spec, _modeling(spec), token)
                mark["families"][spec.model_type] = weakref.finalize(model, _rope_release, spec, token)
    object.__setattr__(model, INSTANCE_MARK, mark)


def _unpatch_instance(model: nn.Module) -> None:
    mark = getattr(model, INSTANCE_MARK, None)
    if mark is None:
        return
    for sub in mark["modules"]:
        if "forward" in vars(sub):
            del sub.forward
    for release in mark["families"].values():
        release()  # a weakref.finalize: runs once, then never again at garbage collection
    object.__delattr__(model, INSTANCE_MARK)


def _family_of_target(target) -> FamilySpec:
    if isinstance(target, str):
        return family(target)
    spec = family_of_module(getattr(target, "__module__", ""))
    if spec is None:
        raise ValueError(
            f"{target.__name__} is not a class of a family fuselm.hf knows "
            f"(supported model types: {', '.join(supported_model_types())})"
        )
    return spec


def _bad_target(target) -> TypeError:
    got = type(target).__name__
    return TypeError(f"target must be a model, a model class or a model_type string, got {got}")


def patch(
    target,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    linear_cross_entropy: bool = True,
    cross_entropy: bool = False,
):
    """Run a Hugging Face model (or a whole model family) on fuselm's kernels.

    Args:
        target: a built model (``nn.Module``: a ``*ForCausalLM``, its base model, a PEFT wrapper of it;
            only this instance is patched), a model class (``LlamaForCausalLM``: its whole family is
            patched, models built before and after), or a ``model_type`` string (``"llama"``, the same
            as its class, usable before anything is imported). Families: llama, mistral, qwen2, qwen3,
            phi3, gemma, gemma2, gemma3 (``gemma3_text``).
        rms_norm: every RMSNorm (including Qwen 3 / Gemma 3 q/k norms) runs :func:`fuselm.rms_norm`
            with the family's casting (Llama's or Gemma's ``1 + weight``), bit for bit HF's formula in fp32.
        rope: the attention's ``apply_rotary_pos_emb`` runs :func:`fuselm.apply_rotary` (GQA, partial
            rotary). Module-level in HF, so it applies to the whole family while any patch needs it.
        swiglu: the gated MLP runs the fused activation; with separate ``gate_proj``/``up_proj`` the
            down projection's input is recomputed in backward instead of saved (less activation memory).
            Activations without a fuselm kernel run HF's MLP.
        linear_cross_entropy: ``*ForCausalLM.forward`` with ``labels`` computes HF's causal-LM loss
            (shifted labels, ``-100`` ignored, ``num_items_in_batch``, Gemma's final softcap) from the
            hidden states with :func:`fuselm.linear_cross_entropy` and returns ``logits=None``: no
            ``[B, T, V]`` tensor is created. Without labels it returns logits as before.
        cross_entropy: with ``linear_cross_entropy=False``: ``*ForCausalLM.forward`` with labels
            returns HF's logits and computes the loss on them with :func:`fuselm.cross_entropy` (one
            pass per row, no fp32 copy of the logits): for code that needs the logits in training.
            Works with an adapter on ``lm_head`` too. At most one of the two loss flags.

    Returns:
        the target (so ``model = fuselm.hf.patch(model)`` reads naturally).

    Raises:
        ValueError: unknown model type / class, a model with no known family inside, both loss flags,
            class-patching one loss while the other is patched in.
        ImportError: transformers is missing (``pip install "fuselm[hf]"``).

    Example:
        >>> import fuselm.hf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
        >>> model = fuselm.hf.patch(LlamaForCausalLM(config))
        >>> fuselm.hf.is_patched(model)
        True
        >>> import torch
        >>> ids = torch.randint(0, 300, (2, 16))
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.loss.shape, out.logits is None
        (torch.Size([]), True)
        >>> _ = fuselm.hf.unpatch(model)
    """
    components = _components(rms_norm, rope, swiglu, linear_cross_entropy, cross_entropy)
    if isinstance(target, nn.Module):
        _patch_instance(target, components)
    elif isinstance(target, (str, type)):
        _patch_family(_family_of_target(target), components)
    else:
        raise _bad_target(target)
    return target


def unpatch(target):
    """Undo :func:`patch` on the same target: a built model loses every forward fuselm gave it; a class
    or model_type string gets its family's original classes and rotary function back. A target that was
    not patched is left as it is. Returns the target."""
    if isinstance(target, nn.Module):
        _unpatch_instance(target)
    elif isinstance(target, (str, type)):
        _unpatch_family(_family_of_target(target))
    else:
        raise _bad_target(target)
    return target


def is_patched(target) -> bool:
    """Whether any fuselm forward is in force on a built model (its own patch, a class patch of its
    family, or its family's module-level rotary function swapped by another patch), or on a model_type /
    class's family."""
    if isinstance(target, nn.Module):
        if getattr(target, INSTANCE_MARK, None) is not None:
            return True
        specs = {s.model_type for m in target.modules() if (s := family_of_module(_hf_class(m).__module__))}
        return any(_family_patched(model_type) for model_type in specs)
    return _family_patched(_family_of_target(target).model_type)


def _family_patched(model_type: str) -> bool:
    return any(key[0] == model_type for key in _class_patches) or bool(_rope_users.get(model_type))
