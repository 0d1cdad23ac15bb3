"""What several modules of fuselm.hf share: one-time warnings, the warnings of a block that runs another
forward than fuselm's (recorded for :func:`fuselm.hf.report`), module names, HF's own forward of a patched
class, a family's modeling module, a module's Hugging Face class (through FSDP2's subclasses), and PEFT's
classes when PEFT is in use."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
import weakref
from collections.abc import Callable

from torch import nn

# the attribute of a family's root module in an instance-patched model: its patch record (fuselm.hf.patching)
INSTANCE_MARK = "_fuselm_patch"

_warned: set[str] = set()
_FALLBACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {reason: what runs}
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> qualified name
MISSING = object()  # a class attribute that was not in the class's own __dict__
INSTANCE_PATCHED: weakref.WeakSet = weakref.WeakSet()  # the modules instance patching gave fuselm's forward
# a class's own (HF's) forward while fuselm's class patch replaces it (fuselm.hf.class_patch keeps it)
ORIGINAL_FORWARDS: dict[type, Callable] = {}


def warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def register_module_names(model: nn.Module, prefix: str = "") -> None:
    """Remember the qualified names of ``model``'s modules for fuselm's warnings and report.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2)); register_module_names(m); module_name(m[0])
        '0'
    """
    for name, module in model.named_modules(prefix=prefix):
        _NAMES[module] = name or type(module).__name__


def module_name(module: nn.Module) -> str:
    """The registered name of ``module`` (:func:`register_module_names`), else its class name.

    Example:
        >>> module_name(nn.Linear(2, 2))
        'Linear'
    """
    try:
        return _NAMES.get(module) or type(module).__name__
    except TypeError:  # not weak-referenceable
        return type(module).__name__


def warn_fallback(module: nn.Module, reason: str, what: str = "PEFT's forward") -> None:
    """``warnings.warn`` once per (module, reason): "fuselm.hf: <name> runs <what>: <reason>"; the
    reason is kept for :func:`fuselm.hf.report` (:func:`fallbacks`).

    Example:
        >>> m = nn.Linear(2, 2)
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn_fallback(m, "a reason"); warn_fallback(m, "a reason")
        >>> [str(x.message) for x in w]
        ["fuselm.hf: Linear runs PEFT's forward: a reason"]
    """
    if record_fallback(module, reason, what):
        warnings.warn(f"fuselm.hf: {module_name(module)} runs {what}: {reason}", stacklevel=3)


def record_fallback(module: nn.Module, reason: str, what: str) -> bool:
    """Keep for :func:`fuselm.hf.report` that ``module`` runs ``what`` for ``reason``; False when it was
    kept before."""
    seen = _FALLBACKS.setdefault(module, {})
    if reason in seen:
        return False
    seen[reason] = what
    return True


def fallbacks(module: nn.Module) -> dict[str, str]:
    """The fallbacks :func:`warn_fallback` reported for ``module``: {reason: what ran instead}."""
    return dict(_FALLBACKS.get(module, {}))


def original_forward(cls: type) -> Callable:
    """HF's own forward of a class, also while fuselm's class patch replaces it."""
    return ORIGINAL_FORWARDS.get(cls) or cls.forward


def is_fuselm_forward(forward) -> bool:
    """Is ``forward`` (a function, a bound method, an instance forward of fuselm.hf) fuselm's code?"""
    fn = getattr(forward, "__func__", None) or getattr(forward, "func", None) or forward
    # fuselm's forwards made with functools.wraps keep HF's module but take a "fuselm_" qualified name
    return getattr(fn, "__module__", "").startswith("fuselm.") or getattr(fn, "__qualname__", "").startswith(
        "fuselm_"
    )


def modeling_module(spec) -> types.ModuleType:
    """The modeling module of a :class:`~fuselm.hf.registry.FamilySpec`; ImportError saying what to install
    when this transformers has no such module."""
    try:
        return importlib.import_module(spec.module)
    except ImportError as e:
        raise ImportError(
            f"fuselm.hf needs transformers with the {spec.model_type!r} family ({spec.module}); "
            f'pip install "fuselm[hf]" (or a newer transformers)'
        ) from e


def hf_class(module: nn.Module) -> type:
    """The module's Hugging Face class: FSDP2's fully_shard (and replicate) swap a module's class for a
    subclass (FSDPModule, cls) defined in torch; look through that one, not through user subclasses."""
    return unsharded_class(type(module))


def unsharded_class(cls: type) -> type:
    """``cls``, or the class FSDP2 made it from when it is FSDP2's subclass (FSDPModule, that class)."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ in ("FSDPModule", "ReplicateModule"):
        return bases[1]
    return cls


def sharded_classes(cls: type) -> list[type]:
    """The classes FSDP2 made from ``cls`` (torch caches one per class) that hold a ``forward`` of their
    own: transformers 5.23's ``GradientCheckpointingLayer`` wraps a subclass's forward when the subclass is
    made, so such a class keeps the forward ``cls`` had then (a later class patch would not reach it)."""
    return [s for s in cls.__subclasses__() if unsharded_class(s) is cls and "forward" in vars(s)]


# PEFT's classes fuselm.hf looks for, by the module that defines them
_PEFT_CLASSES = {
    "ModulesToSaveWrapper": "peft.utils.other",  # modules_to_save: a trained copy beside the original
    "Linear": "peft.tuners.lora",  # a LoRA layer on an nn.Linear
    "PeftModel": "peft.peft_model",  # get_peft_model's wrapper (PeftModelForCausalLM, ...)
    "BaseTuner": "peft.tuners.tuners_utils",  # its base_model (LoraModel, ...), around the HF model
}


def peft_class(name: str) -> type | None:
    """A PEFT class (a key of ``_PEFT_CLASSES``) when PEFT is imported (a module cannot be one of its
    instances otherwise), else None."""
    if "peft" not in sys.modules:
        return None
    return getattr(importlib.import_module(_PEFT_CLASSES[name]), name)


def is_peft_wrapper(target: nn.Module | type) -> bool:
    """Is ``target`` (a module or a class) one of PEFT's wrappers around a model: a ``PeftModel``
    (``PeftModelForCausalLM``, ...) or its ``base_model``, a tuner (``LoraModel``, ...)? Their forwards
    call the wrapped model's; fuselm.hf patches what is inside, never them."""
    cls = target if isinstance(target, type) else type(target)
    wrappers = [peft_class("PeftModel"), peft_class("BaseTuner")]
    return any(w is not None and issubclass(cls, w) for w in wrappers)
