"""Class patching: fuselm's forwards as class attributes of a family's classes (every model of the family,
built before or after, runs them), the classes FSDP2 made from them, and HF's own forward of a class while
it is patched. Unpatching restores the very same objects (or their absence)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ._common import (
    MISSING,
    ORIGINAL_FORWARDS,
    is_peft_wrapper,
    modeling_module,
    original_forward,
    sharded_classes,
)
from .installs import add_user, has_rope, remove_user
from .plan import PatchPlan, forward_for
from .registry import FamilySpec, family, family_of_module, generic_spec, supported_model_types


@dataclass
class _ClassPatch:
    plan: PatchPlan
    saved: list[tuple[type, str, object]]  # (class, attribute, previous value or MISSING)


_class_patches: dict[FamilySpec, _ClassPatch] = {}


def is_class_patched(spec: FamilySpec | None) -> bool:
    return spec in _class_patches


def family_of_target(target: str | type) -> FamilySpec:
    """The family a model_type string or a model class names (a ``*ForCausalLM`` class of a family without a
    spec: its generic spec, the loss only); ValueError otherwise."""
    if isinstance(target, str):
        return family(target)
    spec = family_of_module(getattr(target, "__module__", ""))
    if spec is not None:
        return spec
    if is_peft_wrapper(target):
        raise ValueError(
            f"PEFT's {target.__name__} is a wrapper: patch the wrapped model (the PEFT model itself, an "
            "instance, is looked through) or its family's model_type"
        )
    if target.__name__.endswith("ForCausalLM"):
        return generic_spec(target)
    raise ValueError(
        f"{getattr(target, '__name__', target)} is not a class of a family fuselm.hf knows nor a "
        f"*ForCausalLM (supported model types: {', '.join(supported_model_types())})"
    )


def unpatch_family(spec: FamilySpec) -> None:
    patch = _class_patches.pop(spec, None)
    if patch is None:
        return
    for owner, name, previous in reversed(patch.saved):
        current = vars(owner).get(name)
        if previous is MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
        ORIGINAL_FORWARDS.pop(owner, None)
        for sub in sharded_classes(owner):  # made by FSDP2 while patched: wrapping fuselm's forward
            if getattr(vars(sub)["forward"], "__wrapped__", None) is current is not None:
                sub.forward = getattr(owner, name)  # as if made from the restored class
    remove_user(spec, None)


def patch_family(spec: FamilySpec, plan: PatchPlan) -> None:
    current = _class_patches.get(spec)
    if current is not None and current.plan == plan:
        return
    unpatch_family(spec)  # other options: they replace the previous class patch
    module = modeling_module(spec)
    names = [spec.components()[c] for c in plan.blocks if c in spec.components() and c != "rope"]
    names += list(spec.causal_lms) if plan.loss is not None else []
    saved, missing = [], []
    for name in names:
        cls = getattr(module, name, None)
        if cls is None:
            missing.append(name)
            continue
        new = forward_for(spec, cls, original_forward(cls), plan)
        saved.append((cls, "forward", cls.__dict__.get("forward", MISSING)))
        ORIGINAL_FORWARDS[cls] = cls.forward
        cls.forward = new
        for sub in sharded_classes(cls):  # FSDP2's class of it, made before: holds the old forward
            saved.append((sub, "forward", sub.__dict__.get("forward", MISSING)))
            sub.forward = new
    rope = "rope" in plan.blocks and spec.rope is not None
    if rope and not has_rope(spec):
        missing.append(spec.rope)
        rope = False
    if not saved and not rope:
        raise ValueError(
            f"nothing to patch in the {spec.model_type!r} family with these flags "
            f"(it swaps: {', '.join(spec.components()) or 'only the loss'})"
        )
    _class_patches[spec] = _ClassPatch(plan, saved)
    add_user(spec, None, rope=rope)
    if missing:
        warnings.warn(
            f"fuselm.hf: {spec.module} has no {', '.join(missing)} in this transformers version; "
            "they stay Hugging Face's",
            stacklevel=3,
        )
