"""The block forwards fuselm puts in place of Hugging Face's: RMSNorm, gated MLP, rotary function.

Each factory takes a :class:`~fuselm.hf.registry.FamilySpec` (and, for what can fall back, the original)
and returns a plain function with the original's signature, usable as a class attribute (class patching)
or bound to one instance (instance patching). Factories are cached so one family always gets the same
function object: patching twice is idempotent and unpatching can check identity.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..nn.mlp import ACTIVATIONS, gated_mlp, gated_packed, is_plain_linear
from ..offload import note_unread_output, output_may_go_unread, remakeable
from ..ops.rms_norm import rms_norm
from ..ops.rope import apply_rotary
from ._common import hf_class, original_forward, warn_fallback
from .lora import lora_gated_mlp_forward
from .registry import EPS_NAMES, NORM_STYLES, FamilySpec


def norm_operands(spec: FamilySpec, module: nn.Module) -> tuple[torch.Tensor | None, float]:
    """``(weight or None, eps)``: what the family's RMSNorm forward reads of ``module`` (the one place that
    reads them; the epsilon goes by one of :data:`~fuselm.hf.registry.EPS_NAMES`). AttributeError naming
    the attribute ``module`` lacks."""
    scale_flag = NORM_STYLES[spec.norm_style].get("scale_flag")  # False: no weight (Gemma 4's with_scale)
    weight = module.weight if scale_flag is None or getattr(module, scale_flag) else None
    for name in EPS_NAMES:
        eps = getattr(module, name, None)
        if eps is not None:
            return weight, eps
    raise AttributeError(f"{type(module).__name__} has no epsilon attribute ({' or '.join(EPS_NAMES)})")


@functools.cache
def rms_norm_forward(spec: FamilySpec) -> Callable:
    """``forward(self, hidden_states)`` of the family's RMSNorm through :func:`fuselm.rms_norm`. A module
    without the attributes it reads (:func:`norm_operands`) runs HF's forward, said once."""
    style = NORM_STYLES[spec.norm_style]
    offset, casting = style["offset"], style["casting"]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        try:
            weight, eps = norm_operands(spec, self)
        except AttributeError as e:
            warn_fallback(self, str(e), "Hugging Face's forward")
            return original_forward(hf_class(self))(self, hidden_states)
        out = rms_norm(hidden_states, weight, eps, offset=offset, casting=casting)
        # in a kept decoder layer the backward makes it again from its input (which the norm saves)
        return remakeable(out, rms_norm, hidden_states, weight, eps, offset=offset, casting=casting)

    forward.__qualname__ = f"fuselm_{spec.rms_norm}.forward"
    return forward


def unreadable(spec: FamilySpec, module: nn.Module) -> str | None:
    """Why fuselm's forward for ``module`` (of a class the family swaps) cannot run it, checked when an
    instance is patched: an attribute the forward reads is missing, or the MLP's activation has no fuselm
    kernel; None when it can."""
    name = hf_class(module).__name__
    try:
        if name == spec.rms_norm:
            norm_operands(spec, module)
        elif name == spec.mlp:
            return _mlp_unreadable(spec, module)
    except AttributeError as e:
        return str(e)
    return None


def _no_kernel(activation: object) -> str:
    return f"activation {activation!r} has no fuselm kernel"


def _mlp_unreadable(spec: FamilySpec, module: nn.Module) -> str | None:
    activation = getattr(module.config, spec.act_attr)
    if activation not in ACTIVATIONS:
        return _no_kernel(activation)
    names = ("gate_up_proj", "down_proj") if spec.packed_mlp else ("gate_proj", "up_proj", "down_proj")
    for attr in names + (spec.mlp_multipliers or ()):
        getattr(module, attr)
    return None


@functools.cache
def mlp_forward(spec: FamilySpec, original: Callable, chunk_tokens: int | None = None) -> Callable:
    """``forward(self, x)`` of the family's gated MLP with the fused activation (and, for split
    gate/up projections, the down projection's input recomputed in backward). An activation fuselm has
    no kernel for (``config.<act_attr>`` not in ``fuselm.nn.mlp.ACTIVATIONS``) runs the original.
    ``spec.mlp_multipliers`` names the module attributes read at each call (as HF's forward reads them)
    for the gate and down multipliers of :func:`fuselm.nn.mlp.gated_mlp` (Falcon-H1).
    Projections that are not plain ``nn.Linear`` (PEFT LoRA layers, bitsandbytes 4/8-bit bases) run
    :func:`fuselm.lora.lora_gated_mlp` (the LoRA updates added in the GEMMs, only x, gate, up and the
    rank-r products saved); what it does not cover runs HF's projections after one warning naming the
    MLP and the reason. In the recompute of a checkpointed layer (:func:`fuselm.offload.recompute_checkpoint`,
    :func:`fuselm.offload.offloaded_checkpoint`) the fused LoRA MLP computes nothing when nothing after it
    saves a tensor (:func:`fuselm.offload.output_may_go_unread`): its backward makes gate, up and the
    product (see :func:`fuselm.lora.lora_gated_mlp`'s ``output``).

    ``chunk_tokens`` (``patch(..., mlp_chunk_tokens=)``): the MLP runs over chunks of that many tokens
    (:func:`fuselm.ops.swiglu.swiglu_mlp` / :func:`fuselm.lora.lora_gated_mlp` ``chunk_rows``): no
    ``[tokens, I]`` tensor, for the longest sequences; an MLP that cannot run chunked (multipliers,
    hooked projections, down_proj LoRA dropout) says so once and runs whole.

    Shapes: x ``[..., H]`` in, ``[..., H]`` out."""
    gate_attr, down_attr = spec.mlp_multipliers or (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = getattr(self.config, spec.act_attr, None)
        act = ACTIVATIONS.get(activation)
        if act is None:
            warn_fallback(self, _no_kernel(activation), "Hugging Face's forward")
            return original(self, x)
        if spec.packed_mlp:
            return self.down_proj(gated_packed(self.gate_up_proj(x), act))
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        plain = all(is_plain_linear(p) for p in projections)
        if not plain and gate_attr is None:  # PEFT LoRA / quantized projections: the fused LoRA MLP
            # in a recompute that reads no output of the layer, the MLP leaves its work to the backward
            unread = output_may_go_unread()
            out = lora_gated_mlp_forward(self, x, act, chunk_rows=chunk_tokens, output=not unread)
            if out is not None:  # (None: warned why not)
                if unread:
                    note_unread_output()
                return out
        elif not plain:
            warn_fallback(self, "MLP multipliers with LoRA or quantized projections", "HF's projections")
        multipliers = {}
        if gate_attr is not None:
            multipliers = dict(
                gate_multiplier=getattr(self, gate_attr), down_multiplier=getattr(self, down_attr)
            )
        if chunk_tokens is not None and (gate_attr is not None or not plain):
            warn_fallback(
                self, "mlp_chunk_tokens with MLP multipliers or hooked projections", "the whole MLP"
            )
        return gated_mlp(x, *projections, activation, chunk_rows=chunk_tokens, **multipliers)

    forward.__qualname__ = f"fuselm_{spec.mlp}.forward"
    return forward


@functools.cache
def rope_function(spec: FamilySpec, original: Callable) -> Callable:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through :func:`fuselm.apply_rotary`
    (both layouts HF uses: ``unsqueeze_dim=1`` is ``[B, heads, T, D]``, ``2`` is ``[B, T, heads, D]``);
    any other call (extra arguments, another ``unsqueeze_dim``) runs the original."""
    if spec.rope_one_tensor:
        return _one_tensor_rope_function(spec, original)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        layout = None if args or kwargs else rope_layout(cos, unsqueeze_dim)
        if layout is None:
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return apply_rotary(q, k, cos, sin, layout=layout)

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb


def rope_layout(cos: torch.Tensor, unsqueeze_dim: int) -> str | None:
    """The :func:`fuselm.apply_rotary` layout of HF's ``apply_rotary_pos_emb(..., cos, sin, unsqueeze_dim)``
    call (``unsqueeze_dim=1`` is ``[B, heads, T, D]``, ``2`` is ``[B, T, heads, D]``), or None: a call it
    does not cover (another ``unsqueeze_dim``, tables that are not ``[B, T, D]``)."""
    return _ROPE_LAYOUTS.get(unsqueeze_dim) if cos.dim() == 3 else None


_ROPE_LAYOUTS = {1: "bhtd", 2: "bthd"}


def _one_tensor_rope_function(spec: FamilySpec, original: Callable) -> Callable:
    """``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (Gemma 4: q and k rotated by separate calls,
    also each axis part of the vision tower's 2-D RoPE) through :func:`fuselm.apply_rotary`, with a
    zero-head key beside ``x`` (the kernel skips it: one launch per call, nothing computed twice)."""

    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        layout = None if args or kwargs or x.dim() != 4 else rope_layout(cos, unsqueeze_dim)
        if layout is None:
            return original(x, cos, sin, unsqueeze_dim, *args, **kwargs)
        no_heads = x.narrow(1 if layout == "bhtd" else 2, 0, 0)
        return apply_rotary(x, no_heads, cos, sin, layout=layout)[0]

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb
