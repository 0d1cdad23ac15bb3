"""Activation offloading in Hugging Face models: :func:`fuselm.offload.offloaded_checkpoint` as the
gradient-checkpointing function of every decoder layer (``GradientCheckpointingLayer``), so that the
layer inputs wait for the backward in pinned host memory: :func:`enable`, :func:`disable`,
:func:`is_enabled`. They work through HF's own checkpointing machinery (``_set_gradient_checkpointing``,
where every ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` ends), PEFT-wrapped
models and Trainer's ``gradient_checkpointing=True`` included."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from ..offload import checkpoint_fn, offloaded_checkpoint, recompute_checkpoint, selective_checkpoint
from ._common import warn_once

__all__ = ["enable", "disable", "is_enabled"]

_STATE = "_fuselm_offload"  # on each wrapped PreTrainedModel: the _State shared by them
_HF_FUNC = "_fuselm_hf_checkpointing_func"  # on each layer: the function HF set (restored by disable)
_MISSING = None  # no such instance attribute (HF never sets these functions to None)


@dataclass
class _State:
    turned_on: bool = False  # enable() switched HF's checkpointing on; disable() switches it off again
    input_grads: bool = False  # HF's input-embedding hooks were asked for: disable() registers them again


def _unpartial(func: Any) -> tuple[Any, dict]:
    """(function, keywords) of a ``functools.partial``; (func, {}) of anything else."""
    if isinstance(func, functools.partial):
        return func.func, func.keywords
    return func, {}


def _is_offloaded(func: Any) -> bool:
    return _unpartial(func)[0] is offloaded_checkpoint


def _is_fuselms(func: Any) -> bool:
    """Whether ``func`` is one of fuselm's checkpointing functions (offloading, recompute, selective)."""
    return _unpartial(func)[0] in (offloaded_checkpoint, recompute_checkpoint, selective_checkpoint)


def _fuselm_checkpointing(
    hf_func: Any, layer: torch.nn.Module, function: Any = offloaded_checkpoint
) -> functools.partial:
    """``function`` (one of fuselm's checkpoints) with the options of HF's function
    (``partial(checkpoint, **kwargs)``), checked."""
    inner, keywords = _unpartial(hf_func)
    if hf_func is not _MISSING and not (
        inner is torch_checkpoint.checkpoint or getattr(inner, "__module__", "").startswith("transformers.")
    ):
        name = getattr(inner, "__qualname__", type(inner).__name__)
        warn_once(
            f"offload-replaced:{name}",
            f"fuselm.hf.offload: {type(layer).__name__}'s checkpointing function {name} is replaced by "
            "offloaded_checkpoint (disable() restores it)",
        )
    return functools.partial(function, **checkpoint_fn(**keywords).keywords)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _install(model: torch.nn.Module) -> None:
    """offloaded_checkpoint as the checkpointing function of every layer of ``model`` (HF's kept aside)."""
    for layer in _layers(model):
        current = layer.__dict__.get("_gradient_checkpointing_func", _MISSING)
        if not _is_offloaded(current):
            if not _is_fuselms(current):
                setattr(layer, _HF_FUNC, current)
            hf_func = layer.__dict__.get(_HF_FUNC, current)
            layer._gradient_checkpointing_func = _fuselm_checkpointing(hf_func, layer)


class _SetGradientCheckpointing:
    """The instance-level ``_set_gradient_checkpointing`` of a model under offloading: HF's (every
    ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` / ``..._disable`` of
    transformers 5.x ends there), then offloaded_checkpoint installed over the function it set."""

    def __init__(self, model: torch.nn.Module, previous: Any) -> None:
        self.model = model
        self.previous = previous  # an instance-level function found there, or _MISSING

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if self.previous is not _MISSING:
            result = self.previous(*args, **kwargs)
        else:
            result = type(model)._set_gradient_checkpointing(model, *args, **kwargs)
        model.__dict__[_STATE].turned_on = False  # set by someone else: theirs to keep (enable() resets it)
        _install(model)
        return result


class _EnableInputRequireGrads:
    """The instance-level ``enable_input_require_grads`` of a model under offloading: noted, not done.
    HF's hook makes the input embeddings' output require grad so that reentrant checkpointing passes
    gradients to frozen-base layers; offloaded_checkpoint does not need it (parameters get gradients
    anyway), and with it the embedding output, a leaf then, stays on the device through the whole
    backward (its AccumulateGrad holds it) and gets a gradient of its own at the end: one [B, T, H]
    tensor and layer 0's input gradient for nothing."""

    def __init__(self, model: torch.nn.Module, previous: Any) -> None:
        self.model = model
        self.previous = previous  # an instance-level function found there, or _MISSING

    def __call__(self) -> None:
        self.model.__dict__[_STATE].input_grads = True


# the forward hooks that make the input embeddings' output require grad: HF's enable_input_require_grads
# and PEFT's own when a model lacks it (a second call of HF's keeps only the last call's handles: the hooks
# are found on the embeddings by name)
_INPUT_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def _drop_input_grad_hooks(m: torch.nn.Module, state: _State) -> None:
    """Remove the input-embedding hooks registered before offloading (noted for :func:`disable`)."""
    if getattr(m, "_require_grads_hooks", None) or getattr(m, "_require_grads_hook", None) is not None:
        type(m).disable_input_require_grads(m)
        state.input_grads = True
    try:
        embeddings = m.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without input embeddings
        embeddings = None
    hooks = getattr(embeddings, "_forward_hooks", {})
    for key in [k for k, hook in hooks.items() if getattr(hook, "__name__", None) in _INPUT_GRAD_HOOKS]:
        del hooks[key]
        state.input_grads = True


def _pretrained(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers import PreTrainedModel

    found = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not found:
        raise TypeError(
            f"model: {type(model).__name__} holds no transformers PreTrainedModel (activation offloading "
            "installs itself through HF's gradient checkpointing)"
        )
    return found


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Gradient checkpointing with the layer inputs offloaded to pinned host memory, on ``model``.

    Every ``GradientCheckpointingLayer`` gets :func:`fuselm.offload.offloaded_checkpoint` as its
    ``_gradient_checkpointing_func``, with the options of the function HF had set (``use_reentrant``...).
    HF's checkpointing, if off, is switched on first (``use_reentrant=False``); ``every_n_layers`` set
    earlier is kept. Later switches of HF's checkpointing (by the user, PEFT's
    ``prepare_model_for_kbit_training``, Trainer's ``gradient_checkpointing=True``, any kwargs) keep
    offloading installed: the model's ``_set_gradient_checkpointing`` is wrapped on the instance. Calling
    ``enable`` again is a no-op. HF's input-embedding hooks (``enable_input_require_grads``, which HF's
    checkpointing and PEFT switch on) are off while offloading is on (the hooks are removed, later calls
    noted): the embedding output then needs no gradient and is freed after the forward instead of waiting
    on the device through the whole backward; :func:`disable` puts the hooks back.

    Args:
        model: a transformers model, or a module holding one (a PEFT ``PeftModel``: the first
            ``PreTrainedModel`` among its modules is switched); HF checkpoints in ``train()`` mode only.

    Returns:
        ``model``.

    Raises:
        TypeError: no ``PreTrainedModel`` in ``model``.
        ValueError: the model does not support gradient checkpointing, has no
            ``GradientCheckpointingLayer``, or was set with checkpointing options offloading does not
            support (``context_fn``).

    Example:
        >>> import torch, transformers
        >>> from fuselm.hf import offload
        >>> from fuselm.offload import host_memory_stats
        >>> config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100)
        >>> model = offload.enable(transformers.Qwen3ForCausalLM(config).train())
        >>> model.model.layers[0]._gradient_checkpointing_func.func.__name__
        'offloaded_checkpoint'
        >>> offload.is_enabled(model), model.model.layers[1].gradient_checkpointing
        (True, True)
        >>> ids = torch.randint(0, 100, (2, 16))
        >>> before = host_memory_stats()["in_use_bytes"]
        >>> loss = model(input_ids=ids, labels=ids).loss   # the 2 layer inputs [2, 16, 32] on the host
        >>> host_memory_stats()["in_use_bytes"] - before == 2 * 2 * 16 * 32 * 4
        True
        >>> loss.backward()
    """
    found = _pretrained(model)
    top = found[0]
    if not getattr(top, "supports_gradient_checkpointing", False):
        raise ValueError(f"model: {type(top).__name__} does not support gradient checkpointing")
    layers = _layers(top)
    if not layers:
        raise ValueError(f"model: {type(top).__name__} has no GradientCheckpointingLayer to checkpoint")
    state = top.__dict__.get(_STATE)
    if state is None:
        state = _State()
        for m in found:
            if _STATE in m.__dict__:  # a sub-model enabled on its own before: taken over
                _unwrap(m)
            m.__dict__[_STATE] = state
            previous = m.__dict__.get("_set_gradient_checkpointing", _MISSING)
            m.__dict__["_set_gradient_checkpointing"] = _SetGradientCheckpointing(m, previous)
            previous = m.__dict__.get("enable_input_require_grads", _MISSING)
            m.__dict__["enable_input_require_grads"] = _EnableInputRequireGrads(m, previous)
            _drop_input_grad_hooks(m, state)
    if any(layer.gradient_checkpointing for layer in layers):
        _install(top)
        return model
    hf_enable = getattr(top, "activation_checkpointing_enable", None) or top.gradient_checkpointing_enable
    hf_enable({"use_reentrant": False})  # the checkpointing kwargs (their name changed in 5.24)
    state.turned_on = True  # after the wrapper (which installed offloading) reset it
    return model


def _unwrap(m: torch.nn.Module) -> None:
    for name, kind in (
        ("_set_gradient_checkpointing", _SetGradientCheckpointing),
        ("enable_input_require_grads", _EnableInputRequireGrads),
    ):
        wrapper = m.__dict__.pop(name, None)
        if isinstance(wrapper, kind) and wrapper.previous is not _MISSING:
            m.__dict__[name] = wrapper.previous
    m.__dict__.pop(_STATE, None)


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable`: HF's checkpointing function back on every layer that has offloading.

    The function restored is the one HF set last (at :func:`enable`, or by a later
    ``gradient_checkpointing_enable``); checkpointing is switched off only if :func:`enable` switched it
    on and nobody set it since. A model without offloading is returned unchanged.

    Args:
        model: the model given to :func:`enable`.

    Returns:
        ``model``.

    Example:
        >>> import transformers
        >>> from fuselm.hf import offload
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
        >>> model = offload.disable(offload.enable(transformers.LlamaForCausalLM(config)))
        >>> offload.is_enabled(model), model.model.layers[0].gradient_checkpointing
        (False, False)
    """
    found = _pretrained(model)
    top = found[0]
    state = top.__dict__.get(_STATE)
    if state is None:
        return model
    for m in found:
        if m.__dict__.get(_STATE) is state:
            _unwrap(m)
    for layer in _layers(top):
        hf_func = layer.__dict__.pop(_HF_FUNC, _MISSING)
        if _is_fuselms(layer.__dict__.get("_gradient_checkpointing_func")):
            del layer._gradient_checkpointing_func
            if hf_func is not _MISSING:
                layer._gradient_checkpointing_func = hf_func
    if state.turned_on:
        (getattr(top, "activation_checkpointing_disable", None) or top.gradient_checkpointing_disable)()
    elif state.input_grads:
        top.enable_input_require_grads()  # HF's hooks, as checkpointing without offloading wants them
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Does ``model``'s training forward offload: :func:`enable` applied (not undone) and at least one
    layer checkpointing with :func:`fuselm.offload.offloaded_checkpoint`?

    Example:
        >>> import torch
        >>> from fuselm.hf import offload
        >>> offload.is_enabled(torch.nn.Linear(2, 2))
        False
    """
    try:
        top = _pretrained(model)[0]
    except TypeError:
        return False
    return _STATE in top.__dict__ and any(
        layer.gradient_checkpointing and _is_offloaded(layer.__dict__.get("_gradient_checkpointing_func"))
        for layer in _layers(top)
    )
