"""Instance patching: fuselm's forwards put on the submodules of a built model as instance attributes, and
taken off again (:func:`patch_instance`, :func:`unpatch_instance`), for :mod:`fuselm.hf.patching`.

Patch state lives on the patched modules themselves, so it follows them wherever they go: each instance
forward is an :class:`InstanceForward`, and the outermost module of each family in the model (its root)
holds an :class:`_InstancePatch` (the options, and the family's use of fuselm's RoPE). So a model holding
patched modules (the model ``merge_and_unload`` returns from a patched PEFT model, a submodule) says so and
can be unpatched, and a copy (``copy.deepcopy``, pickle, ``torch.save`` / ``torch.load``) is patched for
real, with the same options.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable

from torch import nn

from ._common import (
    INSTANCE_MARK,
    INSTANCE_PATCHED,
    hf_class,
    is_peft_wrapper,
    module_name,
    original_forward,
    record_fallback,
    register_module_names,
)
from .attention import restore as restore_attention
from .blocks import unreadable
from .hub_kernels import give_back, kernelized, take_over
from .installs import add_user, has_rope, remove_user
from .lora import group_qkv, lora_linear_forward, ungroup_qkv
from .peft_operands import is_lora_linear, keep_quant_states
from .plan import PatchPlan, forward_for
from .registry import FamilySpec, family_of_module, generic_spec, is_lm_class_name, supported_model_types

# ---- instance patching ----


class InstanceForward(functools.partial):
    """``module.forward`` as instance patching sets it: ``forward``, one of fuselm's forwards, bound to
    ``module``, and standing for the bound method it is (``__func__``, ``__self__``, ``__qualname__``).
    ``forward`` is ``make(*how)``: how it was made, so that a copy of the module gets its own."""

    def __new__(cls, module: nn.Module, forward: Callable, make: Callable, how: tuple):
        self = super().__new__(cls, forward, module)
        self.make, self.how = make, how
        self.__name__, self.__qualname__ = self.func.__name__, self.func.__qualname__
        return self

    @property
    def __func__(self) -> Callable:
        return self.func

    @property
    def __self__(self) -> nn.Module:
        return self.args[0]

    def __repr__(self) -> str:
        return f"<fuselm forward {self.__qualname__} of {type(self.args[0]).__name__}>"

    def __reduce__(self):
        """Copied (``copy.deepcopy``) or pickled with its module: the copy's forward is made again and bound
        to the copy of the module."""
        return (_rebuilt_forward, (self.args[0], self.make, self.how))


def _rebuilt_forward(module: nn.Module, make: Callable, how: tuple) -> InstanceForward:
    """The forward of a copied or unpickled module (its state may not be restored yet: only its class is
    read). In a process whose transformers gives no fuselm forward for it, the copy runs HF's forward,
    through an InstanceForward that ``unpatch`` takes out."""
    forward = make(*how)
    if forward is None:
        forward = original_forward(hf_class(module))
    INSTANCE_PATCHED.add(module)
    return InstanceForward(module, forward, make, how)


class _InstancePatch:
    """Held by the outermost module of a family in an instance-patched model (the family's root, attribute
    :data:`INSTANCE_MARK`): the family, and the options its modules were patched with. The root is the
    user of the family's RoPE (:func:`fuselm.hf.installs.add_user`) while it holds this, and so is the root
    of a copy (``copy.deepcopy``, pickle): see :meth:`__reduce__`."""

    __slots__ = ("spec", "plan", "_root", "_peft_stamp")

    def __init__(self, root: nn.Module, spec: FamilySpec, plan: PatchPlan):
        self.spec, self.plan, self._root = spec, plan, weakref.ref(root)
        self._peft_stamp = _peft_stamp(root)

    def sync(self) -> None:
        """Give fuselm's forward to the LoRA layers PEFT added to the root since it was patched
        (``get_peft_model`` or ``add_adapter`` after ``fuselm.hf.patch``), on the root's next forward.
        PEFT records its adapters in the root's ``peft_config`` dict: a changed dict (or size) is the cue,
        so a forward with nothing new costs one dictionary lookup."""
        root = self.root
        stamp = _peft_stamp(root) if root is not None else None
        if stamp == self._peft_stamp:
            return
        self._peft_stamp = stamp
        if "lora" in self.plan.blocks:
            register_module_names(root)
            keep_quant_states(root)
            for sub in root.modules():
                if "forward" not in vars(sub) and is_lora_linear(sub):
                    _give_forward(sub, _lora_instance_forward(sub))
            group_qkv(root)

    @property
    def root(self) -> nn.Module | None:
        return self._root()

    def uses_rope(self) -> bool:
        return "rope" in self.plan.blocks and has_rope(self.spec)

    def __reduce__(self):
        return (_restored_patch, (self.root, self.spec, self.plan))


def _restored_patch(root: nn.Module, spec: FamilySpec, plan: PatchPlan) -> _InstancePatch:
    """The record of a copied or unpickled root: the copy uses the family's RoPE too (fuselm's is
    installed again when the process has none: loading a patched model is an explicit call)."""
    patch = _InstancePatch(root, spec, plan)
    add_user(spec, root, rope=patch.uses_rope())
    return patch


def _peft_stamp(root: nn.Module) -> tuple[int, int] | None:
    config = vars(root).get("peft_config")  # set by PEFT on the model it injects adapters into
    return None if config is None else (id(config), len(config))


def _lora_forward() -> Callable:
    return lora_linear_forward


def _lora_instance_forward(module: nn.Module) -> InstanceForward:
    return InstanceForward(module, lora_linear_forward, _lora_forward, ())


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


def _family_spec(module: nn.Module, plan: PatchPlan) -> FamilySpec | None:
    """The family of a module's class (a spec of the registry; the generic spec of a ``*ForCausalLM``
    without one, when ``plan`` has a loss), or None."""
    cls = hf_class(module)
    spec = family_of_module(cls.__module__)
    if spec is None and plan.loss is not None and _generic_lm(module, cls):
        spec = generic_spec(cls)
    return spec


def _family_forward(spec: FamilySpec, cls: type, plan: PatchPlan) -> Callable | None:
    return forward_for(spec, cls, original_forward(cls), plan)


def _instance_forward(module: nn.Module, plan: PatchPlan) -> InstanceForward | None:
    """The forward instance patching gives ``module`` under ``plan``, or None (it keeps its own): the one
    place that decides which submodules of a model get an instance forward, and which one. Here: fuselm's
    forward for the module's class when it is a class its family swaps (:func:`fuselm.hf.plan.forward_for`),
    or the fused loss of a ``*ForCausalLM`` without a spec, or :func:`fuselm.hf.lora.lora_linear_forward` for
    PEFT's LoRA Linear layers (``lora=True``)."""
    if "lora" in plan.blocks and is_lora_linear(module):
        return _lora_instance_forward(module)
    spec = _family_spec(module, plan)
    if spec is None:
        return None
    how = (spec, hf_class(module), plan)
    forward = _family_forward(*how)
    return None if forward is None else InstanceForward(module, forward, _family_forward, how)


def _family_roots(model: nn.Module, plan: PatchPlan) -> dict[nn.Module, FamilySpec]:
    """The outermost module of each family in ``model`` (one per model of the family in it: a Llava's Llama
    text model is the root of the llama family, the Llava wrapper of the llava family)."""
    roots: dict[nn.Module, FamilySpec] = {}

    def visit(module: nn.Module, above: frozenset) -> None:
        spec = _family_spec(module, plan)
        if spec is not None and spec not in above:
            roots.setdefault(module, spec)
            above = above | {spec}
        for child in module.children():
            visit(child, above)

    visit(model, frozenset())
    return roots


def _instance_patches(model: nn.Module) -> list[_InstancePatch]:
    return [vars(m)[INSTANCE_MARK] for m in model.modules() if INSTANCE_MARK in vars(m)]


def instance_plan(model: nn.Module) -> PatchPlan | None:
    """The plan ``model`` was instance-patched with (None: it was not)."""
    current = _instance_patches(model)
    return current[0].plan if current else None


def patch_instance(model: nn.Module, plan: PatchPlan) -> None:
    current = _instance_patches(model)
    if current and all(p.plan == plan for p in current):
        return
    unpatch_instance(model)  # other options: they replace the previous patch of this model
    register_module_names(model)  # warnings and the report name modules ("model.layers.0.mlp")
    forwards, kept = [], {}
    for sub in model.modules():
        if "forward" in vars(sub) and not kernelized(sub):  # someone else's instance forward: left to it
            continue
        forward = _instance_forward(sub, plan)
        if forward is None:
            continue
        reason = unreadable(forward.how[0], sub) if forward.how else None  # family forwards: their reads
        if reason is None:
            forwards.append((sub, forward))
        else:  # an attribute its forward reads is missing here: HF's forward, said below
            record_fallback(sub, reason, "Hugging Face's forward")
            kept.setdefault(reason, []).append(module_name(sub))
    patches = [_InstancePatch(root, spec, plan) for root, spec in _family_roots(model, plan).items()]
    if not forwards and not any(p.uses_rope() for p in patches):
        raise ValueError(
            f"{type(model).__name__}: nothing fuselm.hf can patch with these flags: no module of a family "
            f"it knows (supported model types: {', '.join(supported_model_types())}) and no decoder "
            "*ForCausalLM / *ForConditionalGeneration with an lm_head"
        )
    for sub, forward in forwards:
        _give_forward(sub, forward)
    if "lora" in plan.blocks:
        keep_quant_states(model)  # found there once fully_shard has replaced the 4-bit weights
        group_qkv(model)
    for patch in patches:
        vars(patch.root)[INSTANCE_MARK] = patch
        add_user(patch.spec, patch.root, rope=patch.uses_rope())
    _warn_generic(patches, {sub for sub, _ in forwards})
    for reason, names in kept.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        warnings.warn(f"fuselm.hf: {names[0]}{more} run Hugging Face's forward: {reason}", stacklevel=3)


def _give_forward(module: nn.Module, forward: InstanceForward) -> None:
    """``module`` runs ``forward`` from now on (a hub kernel's forward kernelize put there is kept aside)."""
    take_over(module)
    vars(module)["forward"] = forward
    INSTANCE_PATCHED.add(module)


def _warn_generic(patches: list[_InstancePatch], patched: set[nn.Module]) -> None:
    """One warning naming the ``*ForCausalLM`` models without a spec that got the fused loss."""
    roots = {p.root: p.spec for p in patches}
    generic = [(m, s) for m, s in roots.items() if family_of_module(s.module) is None and m in patched]
    if not generic:
        return
    inside = [s.model_type for s in dict.fromkeys(roots.values()) if s.components()]
    blocks = f"the {', '.join(inside)} blocks inside run fuselm's" if inside else "nothing else is swapped"
    names = ", ".join(f"{hf_class(m).__name__} ({s.model_type})" for m, s in generic)
    warnings.warn(
        f"fuselm.hf: no spec for {names}: its loss is fused; its norms, RoPE and MLP stay Hugging Face's "
        f"({blocks})",
        stacklevel=4,
    )


def unpatch_instance(model: nn.Module) -> None:
    """Take out every instance forward and patch record fuselm put in ``model`` or its submodules."""
    ungroup_qkv(model)
    for sub in model.modules():
        if isinstance(vars(sub).get("forward"), InstanceForward):
            del vars(sub)["forward"]
            INSTANCE_PATCHED.discard(sub)
            give_back(sub)
        patch = vars(sub).pop(INSTANCE_MARK, None)
        if patch is not None:
            remove_user(patch.spec, sub)
        restore_attention(getattr(sub, "config", None))  # (a config the training attention switched)


def class_spec(cls: type) -> FamilySpec | None:
    spec = family_of_module(cls.__module__)
    if spec is None and cls.__name__.endswith("ForCausalLM"):
        return generic_spec(cls)
    return spec
