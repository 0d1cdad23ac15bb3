"""What several modules of fuselm.hf share: one-time warnings, a family's modeling module, a module's Hugging
Face class (through FSDP2's subclasses), and PEFT's classes when PEFT is in use."""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import torch
from torch import nn

# the attribute of a family's root module in an instance-patched model: its patch record (fuselm.hf.patching)
INSTANCE_MARK = "_fuselm_patch"

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


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


def is_plain_tensor(t) -> bool:
    """A plain tensor or parameter (not a DTensor or another subclass): what fuselm's fused paths take."""
    return type(t) is torch.Tensor or type(t) is nn.Parameter


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
