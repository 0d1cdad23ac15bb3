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

from ..nn.mlp import ACTIVATIONS, gated_mlp, gated_packed, is_plain_linear
from ..ops.rms_norm import rms_norm
from ..ops.rope import apply_rotary
from .lora import lora_gated_mlp_forward, warn_fallback
from .registry import NORM_STYLES, FamilySpec


@functools.cache
def rms_norm_forward(spec: FamilySpec) -> Callable:
    """``forward(self, hidden_states)`` of the family's RMSNorm through :func:`fuselm.rms_norm`."""
    style = NORM_STYLES[spec.norm_style]
    eps_attr, offset, casting = style["eps_attr"], style["offset"], style["casting"]
    scale_flag = style.get("scale_flag")  # a bool attribute: False means no weight (Gemma 4's with_scale)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight if scale_flag is None or getattr(self, scale_flag) else None
        return rms_norm(hidden_states, weight, getattr(self, eps_attr), offset=offset, casting=casting)

    forward.__qualname__ = f"fuselm_{spec.rms_norm}.forward"
    return forward


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
    MLP and the reason.

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
            return original(self, x)
        if spec.packed_mlp:
            return self.down_proj(gated_packed(self.gate_up_proj(x), act))
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        plain = all(is_plain_linear(p) for p in projections)
        if not plain and gate_attr is None:  # PEFT LoRA / quantized projections: the fused LoRA MLP
            out = lora_gated_mlp_forward(self, x, act, chunk_rows=chunk_tokens)  # None: warned why not
            if out is not None:
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
    layouts = {1: "bhtd", 2: "bthd"}
    if spec.rope_one_tensor:
        return _one_tensor_rope_function(spec, original, layouts)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or unsqueeze_dim not in layouts or cos.dim() != 3:
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return apply_rotary(q, k, cos, sin, layout=layouts[unsqueeze_dim])

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb


def _one_tensor_rope_function(spec: FamilySpec, original: Callable, layouts: dict[int, str]) -> Callable:
    """``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (Gemma 4: q and k rotated by separate calls,
    also each axis part of the vision tower's 2-D RoPE) through :func:`fuselm.apply_rotary`, with a
    zero-head key beside ``x`` (the kernel skips it: one launch per call, nothing computed twice)."""

    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or unsqueeze_dim not in layouts or cos.dim() != 3 or x.dim() != 4:
            return original(x, cos, sin, unsqueeze_dim, *args, **kwargs)
        layout = layouts[unsqueeze_dim]
        no_heads = x.narrow(1 if layout == "bhtd" else 2, 0, 0)
        return apply_rotary(x, no_heads, cos, sin, layout=layout)[0]

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb
