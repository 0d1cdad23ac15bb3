"""``patch`` / ``unpatch``: put fuselm's forwards into Hugging Face models, and take them out again.

Three targets:
- a model_type string (``"llama"``) or a model class: class patching. The family's RMSNorm, MLP and
  CausalLM (and multimodal ConditionalGeneration) classes (with ``fused_residual=True`` also the decoder
  layer of Llama's layout: the residual add fused into the post-attention RMSNorm) get fuselm's
  ``forward`` as a class attribute and the modeling module's rotary function is replaced: every model of
  the family, built before or after, uses them.
- a built model (any ``nn.Module``: a PEFT wrapper, a bare decoder, a CausalLM, a multimodal wrapper):
  instance patching. Every submodule of a known family class gets fuselm's forward as an instance
  attribute; other models of the same class are untouched.

Patch state is per target: :func:`is_patched` of a model says whether *it* was patched (or its classes
are), and patching a target again with other options replaces its patch (as ``unpatch`` then ``patch``).

The rotary function is module-level in HF (the attention calls it by name), so ``rope=True`` installs
a dispatcher in the family's modeling module: it runs fuselm's RoPE while a class patch or a live
instance-patched model of that family needs it (a weak set: a garbage-collected model drops out by
itself) and HF's otherwise. Modules are only ever changed by explicit ``patch`` / ``unpatch`` calls,
never from a finalizer (a module global changed mid ``torch.compile`` can crash dynamo); the original
function is put back by the first ``patch`` / ``unpatch`` call that finds no user left.

``unpatch`` restores exactly what was there: the original class attributes (or their absence), the
original module function, no instance attributes left behind.
"""

from __future__ import annotations

import importlib
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ._common import hf_class, is_peft_wrapper, sharded_classes
from .blocks import mlp_forward, rms_norm_forward, rope_function
from .causal_lm import causal_lm_forward
from .decoder_layer import decoder_layer_forward
from .loss import LossOptions
from .registry import (
    FamilySpec,
    family,
    family_of_module,
    generic_spec,
    is_lm_class_name,
    supported_model_types,
)

# the block components; the loss is the last one. residual_norm: the decoder layer's add after the
# attention runs inside the post-attention RMSNorm (opt-in: fused_residual=True, with rms_norm)
BLOCKS = ("rms_norm", "residual_norm", "rope", "swiglu")
MISSING = object()  # a class attribute that was not in the class's own __dict__
# Marker attribute on an instance-patched model: its _InstancePatch.
INSTANCE_MARK = "_fuselm_patch"


@dataclass(frozen=True)
class _Plan:
    """What one ``patch`` call asks for: block components, and the loss options (None: no loss)."""

    blocks: tuple[str, ...]
    loss: LossOptions | None


@dataclass
class _ClassPatch:
    plan: _Plan
    saved: list[tuple[type, str, object]]  # (class, attribute, previous value or MISSING)


@dataclass
class _InstancePatch:
    plan: _Plan
    modules: list[nn.Module] = field(default_factory=list)  # submodules given an instance forward
    rope_families: list[FamilySpec] = field(default_factory=list)


@dataclass
class _RopeState:
    """A family's rotary function while fuselm's dispatcher is installed in its modeling module."""

    original: Callable
    installed: Callable | None = None
    class_user: bool = False
    instances: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def in_use(self) -> bool:
        return self.class_user or len(self.instances) > 0


_class_patches: dict[FamilySpec, _ClassPatch] = {}
_ropes: dict[FamilySpec, _RopeState] = {}


def _modeling(spec: FamilySpec) -> types.ModuleType:
    try:
        return importlib.import_module(spec.module)
    except ImportError as e:
        raise ImportError(
            f"fuselm.hf needs transformers with the {spec.model_type!r} family ({spec.module}); "
            f'pip install "fuselm[hf]" (or a newer transformers)'
        ) from e


def _own(cls: type, name: str):
    """The attribute as the class itself defines it (MISSING if only inherited)."""
    return cls.__dict__.get(name, MISSING)


def _plan(
    rms_norm,
    fused_residual,
    rope,
    swiglu,
    linear_cross_entropy,
    cross_entropy,
    label_smoothing,
    memory,
    accum_dtype,
) -> _Plan:
    if cross_entropy and linear_cross_entropy:
        raise ValueError(
            "cross_entropy and linear_cross_entropy: two ways to compute the loss, pick one "
            "(linear_cross_entropy=False for the loss on materialized logits)"
        )
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1), got {label_smoothing!r}")
    if fused_residual and not rms_norm:
        raise ValueError(
            "fused_residual=True fuses the residual add into fuselm's RMSNorm: it needs rms_norm=True"
        )
    flags = (rms_norm, fused_residual, rope, swiglu)
    blocks = tuple(c for c, on in zip(BLOCKS, flags, strict=True) if on)
    loss = None
    if linear_cross_entropy or cross_entropy:
        loss = LossOptions(bool(cross_entropy), float(label_smoothing), memory, accum_dtype)
    if not blocks and loss is None:
        raise ValueError("nothing to patch: every component flag is False")
    return _Plan(blocks, loss)


def _original_forward(cls: type) -> Callable:
    """HF's own forward of a class, also while the class is class-patched."""
    for patch in _class_patches.values():
        for owner, name, previous in patch.saved:
            if owner is cls and name == "forward":
                return previous if previous is not MISSING else cls.__mro__[1].forward
    return cls.forward


def _forward_for(spec: FamilySpec, cls: type, plan: _Plan) -> Callable | None:
    """fuselm's forward for a class of ``spec``'s module under ``plan``, or None (not swapped)."""
    name = cls.__name__
    if name == spec.rms_norm and "rms_norm" in plan.blocks:
        return rms_norm_forward(spec)
    if name == spec.decoder_layer and "residual_norm" in plan.blocks:
        return decoder_layer_forward(spec, _original_forward(cls))
    if name == spec.mlp and "swiglu" in plan.blocks:
        return mlp_forward(spec, _original_forward(cls))
    if name in spec.causal_lms and plan.loss is not None:
        return causal_lm_forward(spec, _original_forward(cls), plan.loss)
    return None


# ---- the rotary function: a dispatcher that stays until an explicit call finds no user left ----


def _dispatcher(state: _RopeState, fused: Callable, original: Callable) -> Callable:
    def apply_rotary_pos_emb(*args, **kwargs):
        if state.class_user or state.instances:
            return fused(*args, **kwargs)
        return original(*args, **kwargs)

    apply_rotary_pos_emb.__module__ = fused.__module__
    apply_rotary_pos_emb.__qualname__ = fused.__qualname__
    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _rope_add(spec: FamilySpec, module: types.ModuleType, user) -> None:
    """Register ``user`` (a model, or None for the class patch) as needing fuselm's RoPE in the family."""
    state = _ropes.get(spec)
    if state is None:
        original = getattr(module, spec.rope)
        state = _RopeState(original)
        state.installed = _dispatcher(state, rope_function(spec, original), original)
        _ropes[spec] = state
        setattr(module, spec.rope, state.installed)
    if user is None:
        state.class_user = True
    else:
        state.instances.add(user)


def _sweep() -> None:
    """Put back the original rotary function of every family no patch needs any more (models that were
    garbage-collected unpatched have left the weak sets by themselves)."""
    for spec, state in list(_ropes.items()):
        if state.in_use():
            continue
        module = importlib.import_module(spec.module)
        if getattr(module, spec.rope, None) is state.installed:
            setattr(module, spec.rope, state.original)
        del _ropes[spec]


# ---- class patching ----


def _unpatch_family(spec: FamilySpec) -> None:
    patch = _class_patches.pop(spec, None)
    if patch is None:
        return
    for owner, name, previous in reversed(patch.saved):
        current = vars(owner).get(name)
        if previous is MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
        for sub in sharded_classes(owner):  # made by FSDP2 while patched: wrapping fuselm's forward
            if getattr(vars(sub)["forward"], "__wrapped__", None) is current is not None:
                sub.forward = getattr(owner, name)  # as if made from the restored class
    if spec in _ropes:
        _ropes[spec].class_user = False


def _patch_family(spec: FamilySpec, plan: _Plan) -> None:
    current = _class_patches.get(spec)
    if current is not None and current.plan == plan:
        return
    _unpatch_family(spec)  # other options: they replace the previous class patch
    module = _modeling(spec)
    names = [spec.components()[c] for c in plan.blocks if c in spec.components() and c != "rope"]
    names += list(spec.causal_lms) if plan.loss is not None else []
    saved, missing = [], []
    for name in names:
        cls = getattr(module, name, None)
        if cls is None:
            missing.append(name)
            continue
        new = _forward_for(spec, cls, plan)
        if new is None:  # a decoder layer that is not Llama's layout here (warned): it stays HF's
            continue
        saved.append((cls, "forward", _own(cls, "forward")))
        cls.forward = new
        for sub in sharded_classes(cls):  # FSDP2's class of it, made before: holds the old forward
            saved.append((sub, "forward", _own(sub, "forward")))
            sub.forward = new
    rope = "rope" in plan.blocks and spec.rope is not None
    if rope and not hasattr(module, spec.rope):
        missing.append(spec.rope)
        rope = False
    if not saved and not rope:
        raise ValueError(
            f"nothing to patch in the {spec.model_type!r} family with these flags "
            f"(it swaps: {', '.join(spec.components()) or 'only the loss'})"
        )
    _class_patches[spec] = _ClassPatch(plan, saved)
    if rope:
        _rope_add(spec, module, None)
    if missing:
        warnings.warn(
            f"fuselm.hf: {spec.module} has no {', '.join(missing)} in this transformers version; "
            "they stay Hugging Face's",
            stacklevel=3,
        )


def _family_of_target(target) -> FamilySpec:
    if isinstance(target, str):
        return family(target)
    spec = family_of_module(getattr(target, "__module__", ""))
    if spec is not None:
        return spec
    if isinstance(target, type) and is_peft_wrapper(target):
        raise ValueError(
            f"PEFT's {target.__name__} is a wrapper: patch the wrapped model (the PEFT model itself, an "
            "instance, is looked through) or its family's model_type"
        )
    if isinstance(target, type) and target.__name__.endswith("ForCausalLM"):
        return generic_spec(target)
    raise ValueError(
        f"{getattr(target, '__name__', target)} is not a class of a family fuselm.hf knows nor a "
        f"*ForCausalLM (supported model types: {', '.join(supported_model_types())})"
    )


# ---- instance patching ----


def _generic_lm(module: nn.Module, cls: type) -> bool:
    """A decoder-only language model with a head of a family without a spec (encoder-decoder models
    compute another loss: never touched; PEFT's wrappers are looked through: the model inside is patched)."""
    config = getattr(module, "config", None)
    return (
        is_lm_class_name(cls.__name__)
        and not is_peft_wrapper(module)
        and isinstance(getattr(module, "lm_head", None), nn.Module)
        and config is not None
        and not getattr(config, "is_encoder_decoder", False)
    )


def _patch_instance(model: nn.Module, plan: _Plan) -> None:
    current = getattr(model, INSTANCE_MARK, None)
    if current is not None and current.plan == plan:
        return
    _unpatch_instance(model)  # other options: they replace the previous patch of this model
    patch = _InstancePatch(plan)
    known: dict[FamilySpec, None] = {}  # families with a spec, in order of appearance
    generic: list[str] = []
    for sub in model.modules():
        cls = hf_class(sub)
        spec = family_of_module(cls.__module__)
        if spec is not None:
            known[spec] = None
        elif plan.loss is not None and _generic_lm(sub, cls):
            spec = generic_spec(cls)
            generic.append(f"{cls.__name__} ({spec.model_type})")
        else:
            continue
        new = _forward_for(spec, cls, plan)
        if new is None or "forward" in vars(sub):  # not swapped, or someone else's instance forward
            continue
        sub.forward = types.MethodType(new, sub)
        patch.modules.append(sub)
    if "rope" in plan.blocks:
        patch.rope_families = [s for s in known if s.rope is not None and hasattr(_modeling(s), s.rope)]
    if not patch.modules and not patch.rope_families:
        raise ValueError(
            f"{type(model).__name__}: nothing fuselm.hf can patch with these flags: no module of a family "
            f"it knows (supported model types: {', '.join(supported_model_types())}) and no decoder "
            "*ForCausalLM / *ForConditionalGeneration with an lm_head"
        )
    for spec in patch.rope_families:
        _rope_add(spec, _modeling(spec), model)
    object.__setattr__(model, INSTANCE_MARK, patch)
    if generic:
        inside = [s.model_type for s in known if s.components()]
        blocks = (
            f"the {', '.join(inside)} blocks inside run fuselm's" if inside else "nothing else is swapped"
        )
        warnings.warn(
            f"fuselm.hf: no spec for {', '.join(generic)}: its loss is fused; its norms, RoPE and MLP "
            f"stay Hugging Face's ({blocks})",
            stacklevel=3,
        )


def _unpatch_instance(model: nn.Module) -> None:
    patch = getattr(model, INSTANCE_MARK, None)
    if patch is None:
        return
    for sub in patch.modules:
        if "forward" in vars(sub):
            del sub.forward
    for spec in patch.rope_families:
        if spec in _ropes:
            _ropes[spec].instances.discard(model)
    object.__delattr__(model, INSTANCE_MARK)


def _bad_target(target) -> TypeError:
    got = type(target).__name__
    return TypeError(f"target must be a model, a model class or a model_type string, got {got}")


def patch(
    target,
    *,
    rms_norm: bool = True,
    fused_residual: bool = False,
    rope: bool = True,
    swiglu: bool = True,
    linear_cross_entropy: bool = True,
    cross_entropy: bool = False,
    label_smoothing: float = 0.0,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
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
        fused_residual: opt-in, with ``rms_norm``: in the families whose decoder layer is Llama's pre-norm
            layout (``FamilySpec.decoder_layer``), the layer's add after the attention runs inside the
            post-attention RMSNorm: ``hidden, residual = fuselm.rms_norm(attn_out, w, eps,
            residual=residual)``, one kernel instead of an add and a norm (and one in backward instead of
            the norm's backward and a gradient add). The sum is rounded to the activations' dtype as HF's
            add rounds it. Off by default: the layer forward it installs is built from the installed
            transformers' source (its syntax tree is checked against Llama's, its keyword-renaming
            wrappers are rebuilt around fuselm's code), which a transformers release can break, for
            -0.27% of a training step on an H100 (``benchmarks/results/h100/tuning/``
            ``e2e_fused_residual_ab.md``). With the default no source is read and the decoder layers
            stay HF's (their norms, attention and MLP inside run fuselm's forwards).
        rope: the attention's ``apply_rotary_pos_emb`` runs :func:`fuselm.apply_rotary` (GQA, partial
            rotary). Module-level in HF: while a class patch or a live instance-patched model of the
            family needs it, every model of that family runs it (the same math as HF's).
        swiglu: the gated MLP (also shared experts and dense layers of MoE models) runs the fused
            activation; with separate ``gate_proj``/``up_proj`` the down projection's input is recomputed
            in backward instead of saved. Activations without a fuselm kernel run HF's MLP.
        linear_cross_entropy: the ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward with
            ``labels`` in training computes HF's causal-LM loss from the hidden states with
            :func:`fuselm.linear_cross_entropy` and returns ``logits=None``: no ``[B, T, V]`` tensor.
        cross_entropy: with ``linear_cross_entropy=False``: the forward with labels returns HF's logits
            and computes the loss on them with :func:`fuselm.cross_entropy`. At most one loss flag.
        label_smoothing: PyTorch's label smoothing inside the fused loss (the route to use instead of
            the Trainer's ``label_smoothing_factor``).
        memory: the ``memory=`` plan of :func:`fuselm.linear_cross_entropy`.
        accum_dtype: :func:`fuselm.linear_cross_entropy`'s (``torch.float32``: the lm_head's gradient
            summed in fp32 across chunks).

    Patching a target that is already patched with other options replaces its patch (the same as
    :func:`unpatch` then :func:`patch`); with the same options it does nothing. An instance patch
    overrides a class patch of the same classes for that model.

    Returns:
        the target (so ``model = fuselm.hf.patch(model)`` reads naturally).

    Raises:
        ValueError: an unknown model type, a class of an unknown family that is no ``*ForCausalLM``, a
            model in which nothing can be patched with these flags (fuselm never patches silently
            nothing), both loss flags, a bad ``label_smoothing``, ``fused_residual`` without ``rms_norm``.
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
    plan = _plan(
        rms_norm,
        fused_residual,
        rope,
        swiglu,
        linear_cross_entropy,
        cross_entropy,
        label_smoothing,
        memory,
        accum_dtype,
    )
    if isinstance(target, nn.Module):
        _patch_instance(target, plan)
    elif isinstance(target, (str, type)):
        spec = _family_of_target(target)
        _patch_family(spec, plan)
        if spec.model_type not in supported_model_types() and family_of_module(spec.module) is None:
            warnings.warn(
                f"fuselm.hf: no spec for {spec.causal_lms[0]} ({spec.model_type}): its loss is fused; its "
                "norms, RoPE and MLP stay Hugging Face's",
                stacklevel=2,
            )
    else:
        raise _bad_target(target)
    _sweep()
    return target


def unpatch(target):
    """Undo :func:`patch` on the same target: a built model loses every forward fuselm gave it; a class
    or model_type string gets its family's original classes back. Rotary functions no patch needs any
    more are restored. A target that was not patched is left as it is. Returns the target."""
    if isinstance(target, nn.Module):
        _unpatch_instance(target)
    elif isinstance(target, (str, type)):
        _unpatch_family(_family_of_target(target))
    else:
        raise _bad_target(target)
    _sweep()
    return target


def is_patched(target) -> bool:
    """Whether a patch is in force on this target: for a built model, its own instance patch or a class
    patch of one of its classes' families (not another model's patch); for a model_type or class, a
    class patch of its family."""
    if isinstance(target, nn.Module):
        if getattr(target, INSTANCE_MARK, None) is not None:
            return True
        return any(_class_spec(hf_class(m)) in _class_patches for m in target.modules())
    if not isinstance(target, (str, type)):
        raise _bad_target(target)
    return _family_of_target(target) in _class_patches


def _class_spec(cls: type) -> FamilySpec | None:
    spec = family_of_module(cls.__module__)
    if spec is None and cls.__name__.endswith("ForCausalLM"):
        return generic_spec(cls)
    return spec
