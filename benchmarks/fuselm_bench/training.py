"""Building a Hugging Face causal LM and its step's forward: what ``e2e`` and ``finetune``
share (:mod:`fuselm_bench.step_timing` times the steps)."""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand cached blocks back (CUDA), between runs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


Forward = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
"""One step's forward: batch -> (the loss to backpropagate, the detached values to log for the step)."""


FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def causal_lm_config(family: str, model: dict[str, Any], attn_implementation: str = "sdpa"):
    """A ``transformers`` config of ``family`` (no cache) from keyword arguments with ``rope_theta`` and
    optionally ``rope_scaling``, given as ``rope_parameters`` where the installed config takes them (5.x).

    Example:
        >>> c = causal_lm_config("qwen3", {"vocab_size": 64, "hidden_size": 16, "rope_theta": 1e6})
        >>> type(c).__name__, c.vocab_size, c.use_cache, c._attn_implementation
        ('Qwen3Config', 64, False, 'sdpa')
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    config_class = getattr(transformers, FAMILIES[family][0])
    kwargs = dict(model)
    theta, scaling = kwargs.pop("rope_theta"), kwargs.pop("rope_scaling", None)
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        kwargs["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    else:
        kwargs.update(rope_theta=theta, rope_scaling=scaling)
    config = config_class(use_cache=False, **kwargs)
    config._attn_implementation = attn_implementation
    return config


def build_causal_lm(config, device: str | torch.device, dtype: torch.dtype):
    """The causal LM of ``config`` on ``device`` in training mode, built under the default dtype ``dtype`` as
    ``from_pretrained(dtype=...)`` does (rotary buffers stay fp32); its init draws from the global RNG."""
    import transformers

    model_class = getattr(transformers, FAMILIES[config.model_type][1])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def causal_lm_loss(model) -> Forward:
    """A step's forward: ``model(input_ids=ids, labels=ids).loss``, logging it detached; the output (its
    logits) is dropped at once, so the logits do not outlive the forward."""
    device = next(model.parameters()).device

    def forward(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = ids.to(device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        return loss, loss.detach()

    return forward
