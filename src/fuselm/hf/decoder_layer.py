"""The decoder layer of Llama's pre-norm layout, patched (``fuselm.hf.patch``):

- opt-in (``fused_layer=True``), as two autograd nodes around HF's attention
  (:func:`two_node_layer`: :mod:`fuselm.ops.decoder_layer`'s ``norm_qkv_rotary`` and
  ``attention_output_mlp``, HF's attention code between them): a small-batch step's host time;
- opt-in (``fused_residual=True``), for layers that run their modules: the add after the attention fused
  into the post-attention RMSNorm, ``hidden, residual = fuselm.rms_norm(attn_out, w, eps,
  residual=residual)`` (a quarter of a percent of a step,
  ``benchmarks/results/h100/tuning/e2e_fused_residual_ab.md``).

The layout is read from the installed transformers' source (:mod:`fuselm.hf.layer_layout`), and the
layer's wrappers are rebuilt around fuselm's forward: hence both are opt-in (the default patch reads no
source and leaves the layer HF's, its norms and MLP running fuselm's forwards).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..nn.mlp import ACTIVATIONS, is_plain_linear
from ..ops.decoder_layer import attention_output_mlp, norm_qkv_rotary
from ..ops.rms_norm import rms_norm
from ._common import hf_class, is_plain_tensor, warn_once
from .blocks import norm_operands, rms_norm_forward
from .layer_layout import llama_layer_layout, split_checkpointing
from .registry import NORM_STYLES, FamilySpec

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _hooked(module: nn.Module) -> bool:
    """Would calling the module run hooks (its own or global ones) that a fused path skips?"""
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return True
    if module._backward_pre_hooks:
        return True
    return any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS)


def _forward_function(module: nn.Module) -> Callable:
    """The function ``module(...)`` runs: its instance forward's (fuselm's instance patch: a
    ``functools.partial`` of it; a bound method) or its class's ``forward``."""
    own = module.__dict__.get("forward")
    if own is None:
        return type(module).forward
    func = getattr(own, "func", None)  # not isinstance: dynamo sees any partial as functools.partial
    return func if func is not None else getattr(own, "__func__", own)


def _same_function(fn: Callable, other: Callable) -> bool:
    """fn is other; by qualified name and module too, which torch.compile resolves while tracing (torch
    2.11's dynamo answers the identity False for the same one)."""
    if fn is other:
        return True
    return getattr(fn, "__qualname__", None) == other.__qualname__ and getattr(fn, "__module__", None) == (
        other.__module__
    )


def fused_norm_args(spec: FamilySpec, norm, norm_forward: Callable) -> tuple | None:
    """(weight, eps, offset, casting) with which :func:`fuselm.rms_norm` computes what ``norm(x)`` would,
    or None: ``norm`` is not the family's RMSNorm class (FSDP2's subclass of it aside) running fuselm's
    forward (``norm_forward``: :func:`rms_norm_forward` of the family, class- or instance-patched), it
    has hooks, or its weight is not a plain tensor (a DTensor, absent)."""
    if not isinstance(norm, nn.Module):
        return None
    cls = hf_class(norm)
    if cls.__name__ != spec.rms_norm or cls.__module__ != spec.module:
        return None
    if not _same_function(_forward_function(norm), norm_forward) or _hooked(norm):
        return None
    try:
        weight, eps = norm_operands(spec, norm)
    except AttributeError:  # its own forward says so (it runs HF's)
        return None
    if weight is not None and not is_plain_tensor(weight):
        return None
    style = NORM_STYLES[spec.norm_style]
    return weight, eps, style["offset"], style["casting"]


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(residual + x), residual + x)`` by one :func:`fuselm.rms_norm` call with ``residual=``,
    in the dtype HF's ``residual + x`` has (both cast to their promoted dtype first: under autocast an
    fp32 residual stream and a bf16 attention output add in fp32, as in HF).

    Shapes: x, residual ``[..., H]`` (the same); weight ``[H]``; returns two ``[..., H]`` tensors."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return rms_norm(x.to(dtype), weight, eps, residual=residual.to(dtype), offset=offset, casting=casting)


def _outermost(module: nn.Module, forward: Callable) -> bool:
    """Is ``forward`` what ``module(...)`` calls first (its instance forward, or its class's): then it
    checkpoints, as HF's wrapper does when it is the outermost one."""
    return _forward_function(module) is forward


def _checkpoint(module: nn.Module, inner: Callable, args: tuple, kwargs: dict):
    """``inner(module, *args, **kwargs)`` under the layer's gradient checkpointing function, with the
    cache arguments transformers' ``GradientCheckpointingLayer`` turns off (and its warning)."""
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("`use_cache=False`")
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in ("past_key_values", "cache", "layer_past"):  # the cache's names (5.24: cache)
            if kwargs.get(name) is not None:
                kwargs[name] = None
                changed.append(f"`{name}=None`")
    if changed:
        from transformers.utils import logging

        logging.get_logger("transformers.modeling_layers").warning_once(
            f"Caching is incompatible with gradient checkpointing in {type(module).__name__}. Setting "
            + ", ".join(changed)
            + "."
        )
    return module._gradient_checkpointing_func(functools.partial(inner, module, **kwargs), *args)


def _layer_weights(layer: nn.Module, spec: FamilySpec, in_norm: tuple, post_norm: tuple):
    """The operands of the two-node layer (:func:`two_node_layer`) other than the activations, or a reason
    why the layer runs its modules instead."""
    attn, mlp = layer.self_attn, layer.mlp
    if _hooked(attn) or _hooked(mlp):
        return "its attention or MLP has hooks"
    core = getattr(_forward_function(attn), "fuselm_core", None)
    if core is None:
        return "its attention does not run fuselm's forward of Llama's layout"
    if _forward_function(mlp).__qualname__ != f"fuselm_{spec.mlp}.forward":
        return "its MLP does not run fuselm's forward"
    activation = ACTIVATIONS.get(getattr(mlp.config, spec.act_attr, None))
    if activation is None:
        return "its MLP's activation has no fuselm kernel"
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(is_plain_linear(p) and is_plain_tensor(p.weight) for p in linears):
        return "its projections are not plain nn.Linear layers"  # PEFT / bitsandbytes: fuselm.lora runs
    if in_norm[2] != post_norm[2] or in_norm[3] != post_norm[3]:
        return "its two norms differ in style"
    return core, activation, linears


def two_node_layer(
    layer: nn.Module,
    spec: FamilySpec,
    in_norm: tuple,
    post_norm: tuple,
    named: dict,
    passed: dict,
    kwargs: dict,
):
    """The layer's output through :func:`fuselm.ops.decoder_layer.norm_qkv_rotary`, HF's attention between
    the q, k, v input and ``o_proj`` (its own code, cut from its forward: the cache, the attention
    interface, the mask) and :func:`fuselm.ops.decoder_layer.attention_output_mlp`; or a string saying why
    the layer runs its modules instead. ``in_norm`` / ``post_norm``: the norms' :func:`fused_norm_args`;
    ``named``: the layer's arguments bound to its parameters; ``passed`` (and ``kwargs``): what HF's layer
    passes on to its attention by name."""
    x = named["hidden_states"]
    embeddings = named.get("position_embeddings")
    if not (
        is_plain_tensor(x) and x.dim() == 3 and isinstance(embeddings, tuple) and embeddings[0].dim() == 3
    ):
        return "its input is not a plain [B, T, H] tensor with [B, T, D] cos / sin"
    operands = _layer_weights(layer, spec, in_norm, post_norm)
    if isinstance(operands, str):
        return operands
    core, activation, (wq, wk, wv, wo, wg, wu, wd) = operands
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != x.dtype:
        # autocast to the activations' own dtype (Trainer's bf16=True on a bf16 model) casts nothing
        return (
            f"autocast to {torch.get_autocast_dtype(device_type)} over {x.dtype} activations (the two "
            "nodes take one dtype: load the model in its compute dtype)"
        )
    attn = layer.self_attn
    q, k, v = norm_qkv_rotary(
        x,
        in_norm[0],
        wq.weight,
        wk.weight,
        wv.weight,
        *embeddings,
        head_dim=attn.head_dim,
        eps=in_norm[1],
        q_bias=wq.bias,
        k_bias=wk.bias,
        v_bias=wv.bias,
        norm_offset=in_norm[2],
        norm_casting=in_norm[3],
    )
    out, _ = core(attn, x, _fuselm_qkv=(q, k, v), **passed, **kwargs)
    return attention_output_mlp(
        out,
        x,
        wo.weight,
        post_norm[0],
        wg.weight,
        wu.weight,
        wd.weight,
        eps=post_norm[1],
        activation=activation,
        o_bias=wo.bias,
        gate_bias=wg.bias,
        up_bias=wu.bias,
        down_bias=wd.bias,
        norm_offset=post_norm[2],
        norm_casting=post_norm[3],
    )


@functools.cache
def decoder_layer_forward(spec: FamilySpec, original: Callable, two_nodes: bool, fused_residual: bool):
    """The forward of a decoder layer of Llama's layout, or None (with a one-time warning) when
    ``original`` (the class's forward) is not that layout in the installed transformers
    (:func:`llama_layer_layout`).

    ``two_nodes`` (``patch(..., fused_layer=True)``, opt-in): the layer runs as two autograd nodes
    around HF's attention (:func:`two_node_layer`) when its norms, attention and MLP run fuselm's forwards
    without hooks, its projections are plain ``nn.Linear`` layers of plain tensors (not PEFT /
    bitsandbytes layers, not DTensors), cos / sin are ``[B, T, D]``, autocast is off or to the
    activations' own dtype (another autocast dtype: said once) and
    torch.compile is not tracing (compiled graphs pay no host time per node); otherwise as below.

    ``fused_residual`` (opt-in): HF's forward with one change: ``hidden_states = residual + attn_out;
    residual = hidden_states; hidden_states = post_attention_layernorm(hidden_states)`` is
    ``hidden_states, residual = fuselm.rms_norm(attn_out, weight, eps, residual=residual, ...)`` (one
    kernel: the sum is rounded to the activations' dtype as HF's add rounds it, and the backward gives the
    gradient of both operands, the residual stream's gradient added in fp32 before its one rounding).
    Everything else is HF's: the arguments are bound to HF's signature and passed on to ``self_attn`` as
    HF's forward passes them, ``input_layernorm``, ``self_attn`` and ``mlp`` are called as modules (PEFT's
    LoRA layers, hooks and patches on them run), a tensor is returned. HF's add and norm run when the
    attention output and the residual are not plain tensors of one shape and device (DTensors). Without
    it, HF's forward runs.

    Under gradient checkpointing (transformers 5.23 checkpoints in the layer's forward, which this
    replaces) it checkpoints itself, with HF's rules. Both paths need the norms to be the family's RMSNorm
    running fuselm's forward without hooks, with a plain weight (:func:`fused_norm_args`); else HF's
    forward runs.

    Shapes: ``hidden_states`` ``[B, T, H]`` in, ``[B, T, H]`` out (HF's other arguments as HF takes them).
    """
    layer = spec.decoder_layer
    split = split_checkpointing(original)
    layout = split if isinstance(split, str) else llama_layer_layout(split[0])
    if isinstance(layout, str):
        warn_once(
            f"layer:{spec.module}.{layer}",
            f"fuselm.hf: {layer} in this transformers version: {layout}, so it stays Hugging Face's "
            "(the norms, RoPE and MLP inside still run fuselm's)",
        )
        return None
    raw, checkpoints, rewrap = split
    attn_args, attn_var_kw = layout.attn_args, layout.attn_var_kw
    norm_forward = rms_norm_forward(spec)  # here, not in the forward: torch.compile traces through caches

    def inner(self, *args, **kwargs):
        post_norm = fused_norm_args(spec, getattr(self, "post_attention_layernorm", None), norm_forward)
        if post_norm is None:
            return raw(self, *args, **kwargs)
        named, kwargs = layout.bind(args, kwargs)
        if two_nodes and not torch.compiler.is_compiling():
            in_norm = fused_norm_args(spec, getattr(self, "input_layernorm", None), norm_forward)
            passed = {name: named[name] for name in attn_args}
            out = (
                "its input norm"
                if in_norm is None
                else two_node_layer(
                    self, spec, in_norm, post_norm, named, passed, kwargs if attn_var_kw else {}
                )
            )
            if not isinstance(out, str):
                return out
            if out.startswith("autocast"):
                warn_once(
                    f"layer-autocast:{spec.module}.{layer}", f"fuselm.hf: {layer} runs its modules: {out}"
                )
        if not fused_residual:
            return raw(self, **named, **kwargs)
        return _fused_residual_layer(self, named, kwargs, post_norm, attn_args, attn_var_kw)

    inner.__name__ = inner.__qualname__ = "forward"  # HF's rename warnings name the layer's forward
    inner = rewrap(inner)  # HF's keyword renames (5.24: past_key_values -> cache) before fuselm's code

    @functools.wraps(raw)
    def forward(self, *args, **kwargs):
        if checkpoints and self.gradient_checkpointing and self.training and _outermost(self, forward):
            return _checkpoint(self, inner, args, kwargs)
        return inner(self, *args, **kwargs)

    forward.__qualname__ = f"fuselm_{layer}.forward"
    return forward


def _fused_residual_layer(self, named: dict, kwargs: dict, post_norm: tuple, attn_args, attn_var_kw: bool):
    """HF's layer forward with the add after the attention inside the post-attention RMSNorm."""
    hidden_states = named["hidden_states"]
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    passed = {name: named[name] for name in attn_args}
    if attn_var_kw:
        passed.update(kwargs)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **passed)
    if (
        is_plain_tensor(hidden_states)
        and is_plain_tensor(residual)
        and hidden_states.shape == residual.shape
        and hidden_states.device == residual.device
    ):
        hidden_states, residual = residual_rms_norm(hidden_states, residual, *post_norm)
    else:  # HF's add and norm
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states
