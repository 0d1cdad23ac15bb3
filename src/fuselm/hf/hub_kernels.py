"""fuselm and the ``kernels`` package that transformers >= 5.25 uses to swap layer forwards per instance.

transformers tags classes (``kernel_layer_name``: every Llama-style RMSNorm is ``"RMSNorm"``) and module-level
functions (``apply_rotary_pos_emb`` is ``"rotary_pos_emb"``), and ``kernelize`` (run by ``from_pretrained``
and again on every ``train()`` / ``eval()`` switch of a model loaded with kernels on) writes a hub kernel's
forward into each tagged module's ``__dict__``, or takes an instance forward out where nothing is mapped.
An instance attribute wins over a class attribute, so fuselm meets it three ways:

- :func:`guarded_condition`: the ``kernel_condition`` fuselm.hf gives the classes it swaps while a patch of
  their family lives (:mod:`fuselm.hf.installs`): ``kernelize`` skips the modules that run fuselm's
  forward, instance- or class-patched, dropping a hub forward kernelize put there before a class patch. A
  kernel mapped to such a layer is said once not to run.
- :func:`take_over` / :func:`give_back`: instance patching replaces the hub forward a module already has,
  and unpatching puts it back.
- :data:`layers` (``RMSNorm``, ``ApplyRotary``): fuselm's norm and RoPE as ``kernels`` layers, shipped as a
  local layer repository inside the wheel (``hub_layers/``), for
  ``from_pretrained(..., use_kernels=True, kernel_config=fuselm.hf.kernel_config())``
  (:mod:`fuselm.hf.hub_config`): then kernelize itself installs fuselm's forwards, offline.

What a module runs (:func:`what_runs`) is what :func:`fuselm.hf.report` shows; :func:`warn_shadowed` says
once per module when a block fuselm patched runs something else.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..ops.rope import apply_rotary
from ._common import (
    INSTANCE_PATCHED,
    hf_class,
    is_fuselm_forward,
    module_name,
    original_forward,
    warn_once,
)
from .blocks import rms_norm_forward, rope_layout
from .registry import family_of_module

HUB_LAYERS = Path(__file__).parent / "hub_layers"  # the kernels-format layer repository of :data:`layers`
_REPLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (hub forward, its repo)
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # the models warn_shadowed has looked at


# ---- what a module runs ----


def kernelized(module: nn.Module) -> bool:
    """Has ``kernelize`` put a kernel's forward in ``module``'s ``__dict__``?"""
    return "_kernel_repo" in vars(module)


def what_runs(module: nn.Module) -> str:
    """``"fuselm"``, ``"hub kernel <repo>"``, ``"Hugging Face's"`` or ``"another forward (<name>)"``: what
    ``module``'s forward resolves to now (an instance forward wins over the class's), so what ran in its
    last forward unless the model changed since."""
    own = vars(module).get("forward")
    if own is None:
        return "fuselm" if is_fuselm_forward(type(module).forward) else "Hugging Face's"
    if is_fuselm_forward(own):
        return "fuselm"
    if kernelized(module):
        return f"hub kernel {vars(module)['_kernel_repo']}"
    return f"another forward ({getattr(own, '__qualname__', type(own).__name__)})"


def meant_for_fuselm(module: nn.Module) -> bool:
    """Did a fuselm patch give ``module`` fuselm's forward (its instance, or its class)?"""
    return module in INSTANCE_PATCHED or is_fuselm_forward(type(module).forward)


def warn_shadowed(model: nn.Module) -> None:
    """One warning per module of ``model`` that a fuselm patch gave fuselm's forward but that runs
    something else (a hub kernel kernelize put there before a class patch, a forward assigned since);
    checked once per model (the patched ``*ForCausalLM`` forward calls it at every training forward)."""
    if torch.compiler.is_compiling() or model in _CHECKED:  # nothing traced
        return
    _CHECKED.add(model)
    for name, module in model.named_modules():
        if meant_for_fuselm(module):
            runs = what_runs(module)
            if runs != "fuselm":
                warn_once(
                    f"shadowed:{id(module)}",
                    f"fuselm.hf: {name or type(module).__name__} ({type(module).__name__}) runs {runs}, not "
                    "fuselm's forward its patch gave it: fuselm.hf.patch(model) on the model replaces it",
                )


# ---- kernelize ----


def guarded_condition(previous: Callable | None) -> Callable:
    """A ``kernel_condition`` for a class fuselm swaps: False (kernelize skips the module) when the module
    runs fuselm's forward, else what ``previous`` (the class's own condition, or None) says."""

    def kernel_condition(module: nn.Module) -> bool:
        if not _claim(module):
            return previous(module) if previous is not None else True
        layer = getattr(type(module), "kernel_layer_name", "?")
        if _mapped(layer):
            warn_once(
                f"kernelize:{layer}",
                f"fuselm.hf: kernelize leaves the {layer!r} layers fuselm patched ({module_name(module)} and "
                f"the like) on fuselm's forward, not the kernel mapped to {layer!r}; unpatch them "
                "(fuselm.hf.unpatch) to run that kernel",
            )
        return False

    kernel_condition.__wrapped__ = previous
    return kernel_condition


def _claim(module: nn.Module) -> bool:
    """Does ``module`` run fuselm's forward? A class-patched module's hub forward that kernelize put there
    before the class patch is dropped first (the class's forward, fuselm's, runs again)."""
    own = vars(module).get("forward")
    if own is not None and is_fuselm_forward(own):
        return True
    if not is_fuselm_forward(type(module).forward):
        return False
    if own is not None:
        if not kernelized(module):
            return False  # someone else's instance forward: left to kernelize, as without fuselm
        del vars(module)["forward"], vars(module)["_kernel_repo"]
    return True


def _mapped(layer: str) -> bool:
    """Is any kernel mapped to ``layer`` in the mapping kernelize reads now? (True when the ``kernels``
    internals holding it cannot be read: then the warning is said rather than not.)"""
    try:
        from kernels._internals.layer.globals import _KERNEL_MAPPING
    except ImportError:
        return True
    return layer in _KERNEL_MAPPING.get()


def take_over(module: nn.Module) -> None:
    """Instance patching is about to give ``module`` fuselm's forward: keep a hub kernel's forward that
    kernelize put there (:func:`give_back` restores it when the patch is taken out)."""
    if kernelized(module):
        _REPLACED[module] = (vars(module).pop("forward"), vars(module).pop("_kernel_repo"))


def give_back(module: nn.Module) -> None:
    saved = _REPLACED.pop(module, None)
    if saved is not None and "forward" not in vars(module):
        vars(module)["forward"], vars(module)["_kernel_repo"] = saved


# ---- fuselm's kernels layers ----


@functools.cache
def _norm_forward(cls: type) -> Callable | None:
    spec = family_of_module(cls.__module__)
    return rms_norm_forward(spec) if spec is not None and spec.rms_norm == cls.__name__ else None


class RMSNorm(nn.Module):
    """The ``kernels`` layer of every RMSNorm tagged ``"RMSNorm"``: fuselm's forward of the module's family
    (its formula: Llama's, Gemma's ``1 + weight``, ...); a class of a family fuselm does not know runs its
    own forward, said once. ``x [..., H] -> [..., H]``."""

    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        cls = hf_class(self)
        forward = _norm_forward(cls)
        if forward is None:
            warn_once(
                f"layer:{cls.__qualname__}",
                f"fuselm.hf: {cls.__name__} is no RMSNorm fuselm knows: its own forward runs",
            )
            return original_forward(cls)(self, hidden_states)
        return forward(self, hidden_states)


class ApplyRotary(nn.Module):
    """The ``kernels`` layer of ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (tagged
    ``"rotary_pos_emb"``): :func:`fuselm.apply_rotary` in the families whose RoPE fuselm computes (HF's
    ``rotate_half`` form); another family's function, or a call fuselm does not cover, runs HF's function."""

    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        spec = family_of_module(type(self).__module__)  # the function-module takes its function's module
        layout = rope_layout(cos, unsqueeze_dim) if spec is not None and spec.rope else None
        if layout is None:
            if spec is None or not spec.rope:
                warn_once(
                    f"layer:{type(self).__module__}",
                    f"fuselm.hf: the rotary function of {type(self).__module__} is not one fuselm computes: "
                    "Hugging Face's runs",
                )
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return apply_rotary(q, k, cos, sin, layout=layout)


layers = types.SimpleNamespace(RMSNorm=RMSNorm, ApplyRotary=ApplyRotary)  # what hub_layers/ exports


def kernel_config(devices: tuple[str, ...] = ("cuda",)):
    """transformers' ``KernelConfig`` that makes fuselm's RMSNorm and RoPE the ``kernels`` layers of a model
    (transformers >= 5.25, or an earlier 5.x with ``pip install kernels``), offline-safe: the layers load
    from the repository inside fuselm's wheel and nothing else is mapped (no Hub lookup).

    Args:
        devices: where fuselm's layers run, of ``("cuda", "cpu")``; on another device the model keeps its
            own forwards. ``"cpu"`` runs fuselm's PyTorch reference (the same math as HF's).

    Returns:
        a ``transformers.KernelConfig`` (:class:`fuselm.hf.hub_config.FuselmKernelConfig`).

    Raises:
        ValueError: ``devices`` is not a non-empty tuple of those names.
        ImportError: transformers has no ``KernelConfig`` or ``kernels`` is not installed.

    Example:
        >>> import fuselm.hf
        >>> from transformers import AutoModelForCausalLM                                # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(
        ...     "meta-llama/Llama-3.2-1B", device_map="cuda", use_kernels=True,
        ...     kernel_config=fuselm.hf.kernel_config())                                  # doctest: +SKIP
        >>> fuselm.hf.patch(model)  # the MLP, the fused loss, LoRA: fuselm's patch      # doctest: +SKIP
    """
    try:
        from .hub_config import FuselmKernelConfig
    except ImportError as e:
        raise ImportError(
            "fuselm.hf.kernel_config needs transformers with KernelConfig and the kernels package "
            "(transformers >= 5.25 installs it; before: pip install kernels)"
        ) from e
    return FuselmKernelConfig(devices)
