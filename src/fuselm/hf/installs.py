"""What fuselm.hf installs outside the modules it patches, while a patch of a family needs it.

- The family's rotary function. The attention calls ``apply_rotary_pos_emb`` by name, so it is module-level:
  up to transformers 5.24 a plain function, replaced in the modeling module by fuselm's; from
  5.25 a ``kernels`` function-module (an ``nn.Module`` the attention calls, which ``kernelize`` may route to
  a hub kernel), which keeps its identity (pickles of models name it) and gets fuselm's function as its
  instance forward. It stays until no class patch and no live instance-patched model of the family (a
  weak set: a garbage-collected model drops out by itself) asks for it, and is taken out at the next
  explicit call; meanwhile every model of the family runs it (the same math as HF's). Never switched
  inside a step: a model collected between a checkpointed layer's forward and its recompute must not
  change what the recompute runs (the saved tensors would differ).
- A guard on each class of the family that ``kernels`` can kernelize (transformers >= 5.25 tags them with
  ``kernel_layer_name``): its ``kernel_condition`` makes ``kernelize`` skip the modules that run fuselm's
  forward (:func:`fuselm.hf.hub_kernels.guarded_condition`), so a ``train()`` / ``eval()`` switch of a
  kernelized model never takes fuselm's forwards out.

Modules and classes are only ever changed by explicit calls (``patch``, ``unpatch``, loading a pickled
patched model), never from a finalizer (a module global changed mid ``torch.compile`` can crash dynamo):
:func:`sweep` undoes an install once no user is left.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ._common import MISSING, is_fuselm_forward, modeling_module
from .blocks import rope_function
from .hub_kernels import guarded_condition
from .registry import FamilySpec


@dataclass
class _Install:
    """One install for a family (its rotary function, or its kernelize guards) and who needs it."""

    undo: Callable[[], None] = lambda: None
    class_user: bool = False
    instances: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def in_use(self) -> bool:
        return self.class_user or len(self.instances) > 0


_installs: dict[tuple[FamilySpec, str], _Install] = {}


def has_rope(spec: FamilySpec) -> bool:
    """Does the family swap a rotary function, and does this transformers' modeling module have it?"""
    return spec.rope is not None and hasattr(modeling_module(spec), spec.rope)


def rope_in_module(spec: FamilySpec) -> Callable:
    """What the attention of the family calls as its rotary function now: the module-level function, or
    the forward of the module-level function-module (transformers >= 5.25)."""
    current = getattr(modeling_module(spec), spec.rope)
    return vars(current).get("forward", current) if isinstance(current, nn.Module) else current


def rope_runs_fuselm(spec: FamilySpec) -> bool:
    """Does the family's attention run fuselm's RoPE now (installed by a patch)?"""
    return (spec, "rope") in _installs and is_fuselm_forward(rope_in_module(spec))


def _install_rope(spec: FamilySpec) -> Callable[[], None]:
    module = modeling_module(spec)
    current = getattr(module, spec.rope)
    if isinstance(current, nn.Module):  # kernels' function-module: its own forward dispatches to hub kernels
        original = types.MethodType(type(current).forward, current)
        installed = rope_function(spec, original)
        vars(current)["forward"] = installed

        def undo() -> None:
            if vars(current).get("forward") is installed:
                del vars(current)["forward"]

        return undo
    installed = rope_function(spec, current)
    setattr(module, spec.rope, installed)

    def undo() -> None:
        if getattr(module, spec.rope, None) is installed:
            setattr(module, spec.rope, current)

    return undo


def _kernelizable_classes(spec: FamilySpec) -> list[type]:
    module = modeling_module(spec)
    names = (spec.rms_norm, spec.mlp, *spec.causal_lms)
    classes = [getattr(module, n, None) for n in dict.fromkeys(n for n in names if n is not None)]
    return [c for c in classes if c is not None and hasattr(c, "kernel_layer_name")]


def _install_guards(spec: FamilySpec) -> Callable[[], None]:
    saved = []
    for cls in _kernelizable_classes(spec):
        saved.append((cls, vars(cls).get("kernel_condition", MISSING)))
        cls.kernel_condition = staticmethod(guarded_condition(getattr(cls, "kernel_condition", None)))

    def undo() -> None:
        for cls, previous in saved:
            if previous is MISSING:
                delattr(cls, "kernel_condition")
            else:
                cls.kernel_condition = previous

    return undo


_INSTALLERS = {"rope": _install_rope, "guards": _install_guards}


def add_user(spec: FamilySpec, user: nn.Module | None, *, rope: bool) -> None:
    """Register ``user`` (the root module of an instance-patched model, or None for the class patch) as a
    user of the family's kernelize guards and, with ``rope``, of fuselm's RoPE; installs what is not there."""
    for what in ("guards", "rope") if rope else ("guards",):
        record = _installs.get((spec, what))
        if record is None:
            record = _installs[(spec, what)] = _Install()
            record.undo = _INSTALLERS[what](spec)
        if user is None:
            record.class_user = True
        else:
            record.instances.add(user)


def remove_user(spec: FamilySpec, user: nn.Module | None) -> None:
    """``user`` (or the class patch, None) needs nothing of the family any more (:func:`sweep` undoes)."""
    for (s, _), record in _installs.items():
        if s != spec:
            continue
        if user is None:
            record.class_user = False
        else:
            record.instances.discard(user)


def sweep() -> None:
    """Undo every install no patch needs any more (models that were garbage-collected unpatched have left
    the weak sets by themselves)."""
    for key, record in list(_installs.items()):
        if not record.in_use():
            record.undo()
            del _installs[key]
