"""The rotary function of a family while fuselm.hf needs it: module-level in Hugging Face (the attention
calls ``apply_rotary_pos_emb`` by name), so patching installs a dispatcher in the family's modeling module.

The dispatcher runs fuselm's RoPE while a class patch or a live instance-patched model of the family uses
it (a weak set: a garbage-collected model drops out by itself) and HF's function otherwise. Modules are
only ever changed by explicit calls (``patch``, ``unpatch``, loading a pickled patched model), never from
a finalizer (a module global changed mid ``torch.compile`` can crash dynamo): :func:`sweep` puts the
original function back once no user is left.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ._common import modeling_module
from .blocks import rope_function
from .registry import FamilySpec


@dataclass
class _RopeState:
    """A family's rotary function while fuselm's dispatcher is installed in its modeling module."""

    original: Callable
    installed: Callable | None = None
    class_user: bool = False
    instances: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def in_use(self) -> bool:
        return self.class_user or len(self.instances) > 0


_ropes: dict[FamilySpec, _RopeState] = {}


def has_rope(spec: FamilySpec) -> bool:
    """Does the family swap a rotary function, and does this transformers' modeling module have it?"""
    return spec.rope is not None and hasattr(modeling_module(spec), spec.rope)


def _dispatcher(state: _RopeState, fused: Callable, original: Callable) -> Callable:
    def apply_rotary_pos_emb(*args, **kwargs):
        if state.class_user or state.instances:
            return fused(*args, **kwargs)
        return original(*args, **kwargs)

    apply_rotary_pos_emb.__module__ = fused.__module__
    apply_rotary_pos_emb.__qualname__ = fused.__qualname__
    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def add_user(spec: FamilySpec, user: nn.Module | None) -> None:
    """Register ``user`` (a module of an instance-patched model, or None for the class patch) as needing
    fuselm's RoPE in the family; installs the dispatcher in the modeling module if it is not there."""
    state = _ropes.get(spec)
    if state is None:
        module = modeling_module(spec)
        original = getattr(module, spec.rope)
        state = _RopeState(original)
        state.installed = _dispatcher(state, rope_function(spec, original), original)
        _ropes[spec] = state
        setattr(module, spec.rope, state.installed)
    if user is None:
        state.class_user = True
    else:
        state.instances.add(user)


def remove_user(spec: FamilySpec, user: nn.Module | None) -> None:
    """``user`` (or the class patch, None) needs the family's RoPE no more (:func:`sweep` restores HF's)."""
    state = _ropes.get(spec)
    if state is None:
        return
    if user is None:
        state.class_user = False
    else:
        state.instances.discard(user)


def sweep() -> None:
    """Put back the original rotary function of every family no patch needs any more (models that were
    garbage-collected unpatched have left the weak sets by themselves)."""
    for spec, state in list(_ropes.items()):
        if state.in_use():
            continue
        module = importlib.import_module(spec.module)
        if getattr(module, spec.rope, None) is state.installed:
            setattr(module, spec.rope, state.original)
        del _ropes[spec]
