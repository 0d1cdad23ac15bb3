"""The forwards fuselm puts in place of Hugging Face's: RMSNorm, gated MLP, rotary function, CausalLM.

Each factory takes a :class:`~fuselm.hf.registry.FamilySpec` (and, for what can fall back, the
original) and returns a plain function with the original's signature, usable as a class attribute
(class patching) or bound to one instance (instance patching). Factories are cached so one family
always gets the same function object: patching twice is idempotent and unpatching can check identity.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.mlp import ACTIVATIONS, gated_mlp, gated_packed, is_plain_linear
from ..ops.cross_entropy import cross_entropy
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.rms_norm import rms_norm
from ..ops.rope import apply_rotary
from .registry import NORM_STYLES, FamilySpec

# Keyword arguments HF routes to its loss function; the base model never needs them.
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


@functools.cache
def rms_norm_forward(spec: FamilySpec) -> Callable:
    """``forward(self, hidden_states)`` of the family's RMSNorm through :func:`fuselm.rms_norm`."""
    style = NORM_STYLES[spec.norm_style]
    eps_attr, offset, casting = style["eps_attr"], style["offset"], style["casting"]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, getattr(self, eps_attr), offset=offset, casting=casting)

    forward.__qualname__ = f"fuselm_{spec.rms_norm}.forward"
    return forward


@functools.cache
def mlp_forward(spec: FamilySpec, original: Callable) -> Callable:
    """``forward(self, x)`` of the family's gated MLP with the fused activation (and, for split
    gate/up projections, the down projection's input recomputed in backward). An activation fuselm has
    no kernel for (``config.<act_attr>`` not in ``fuselm.nn.mlp.ACTIVATIONS``) runs the original."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS.get(getattr(self.config, spec.act_attr, None))
        if act is None:
            return original(self, x)
        if spec.packed_mlp:
            return self.down_proj(gated_packed(self.gate_up_proj(x), act))
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, getattr(self.config, spec.act_attr))

    forward.__qualname__ = f"fuselm_{spec.mlp}.forward"
    return forward


@functools.cache
def rope_function(spec: FamilySpec, original: Callable) -> Callable:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through :func:`fuselm.apply_rotary`
    (both layouts HF uses: ``unsqueeze_dim=1`` is ``[B, heads, T, D]``, ``2`` is ``[B, T, heads, D]``);
    any other call (extra arguments, another ``unsqueeze_dim``) runs the original."""
    layouts = {1: "bhtd", 2: "bthd"}

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or unsqueeze_dim not in layouts or cos.dim() != 3:
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return apply_rotary(q, k, cos, sin, layout=layouts[unsqueeze_dim])

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb


def shifted_targets(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int, n_tokens: int, device
) -> torch.Tensor:
    """``[n_tokens]`` targets of HF's causal-LM loss: token ``t`` predicts ``labels[..., t + 1]`` (the last
    position predicts nothing), or ``shift_labels[..., t]`` when given (already shifted, as HF's
    sequence-parallel path passes them)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device)
    if target.shape[0] != n_tokens:
        got = target.shape[0]
        raise ValueError(f"labels must give one target per token: {n_tokens} tokens, {got} targets")
    return target


def _per_item(loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """HF's normalization: the summed loss divided by ``num_items_in_batch`` (when given)."""
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` computed from hidden states, never building the logits.

    Targets as :func:`shifted_targets`. With ``num_items_in_batch`` the loss is the sum over predicted
    tokens divided by it (HF's gradient-accumulation-correct normalization); otherwise the mean.
    ``softcap``: Gemma 2/3's final logit softcapping. The loss is fp32, as HF's (computed on
    ``logits.float()``).

    Shapes: hidden_states ``[B, T, H]``, labels ``[B, T]`` (int, ``ignore_index`` for no target);
    returns a scalar.
    """
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shifted_targets(labels, shift_labels, ignore_index, hidden.shape[0], hidden.device)
    loss = linear_cross_entropy(
        hidden,
        lm_head.weight,
        target,
        linear_bias=lm_head.bias,
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        softcap=softcap,
        loss_dtype=torch.float32,
    )
    return _per_item(loss, num_items_in_batch)


def causal_lm_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` on materialized logits ``[B, T, V]`` through :func:`fuselm.cross_entropy`:
    one pass per row, fp32 math and an fp32 loss without HF's fp32 copy of the logits."""
    v = logits.shape[-1]
    target = shifted_targets(labels, shift_labels, ignore_index, logits.numel() // v, logits.device)
    loss = cross_entropy(
        logits.reshape(-1, v),
        target,
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        loss_dtype=torch.float32,
    )
    return _per_item(loss, num_items_in_batch)


@dataclass(frozen=True)
class LossOptions:
    """How the patched ``*ForCausalLM.forward`` computes its loss (hashable: factories are cached on it).

    Attributes:
        from_logits: HF's logits are made and returned, the loss on them by :func:`fuselm.cross_entropy`
            (``patch(..., cross_entropy=True)``); otherwise the fused loss from the hidden states.
        label_smoothing: PyTorch's label smoothing, applied inside the fused loss.
        memory: the ``memory=`` plan of :func:`fuselm.linear_cross_entropy`.
    """

    from_logits: bool = False
    label_smoothing: float = 0.0
    memory: str | int = "auto"


@functools.cache
def causal_lm_forward(spec: FamilySpec, original: Callable, options: LossOptions = LossOptions()) -> Callable:
    """The family's ``*ForCausalLM.forward`` with labels (or ``shift_labels``):

    - ``from_logits=False``: the loss comes from the last hidden states through :func:`causal_lm_loss`
      and ``logits`` is None (no ``[B, T, V]`` tensor is made); an lm_head that is not a plain
      ``nn.Linear`` (an adapter wraps it) runs the original forward instead;
    - ``from_logits=True``: HF's logits (softcapped as HF does), returned, and the loss on them through
      :func:`causal_lm_loss_from_logits`.

    Without labels, or with ``logits_to_keep`` set, the original forward runs unchanged."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from_logits = options.from_logits

    @functools.wraps(original)
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        wants_loss = labels is not None or kwargs.get("shift_labels") is not None
        head_ok = from_logits or is_plain_linear(self.lm_head)  # the fused loss reads lm_head.weight itself
        if not wants_loss or not head_ok or not _keeps_all(logits_to_keep):
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        loss_kwargs = {k: kwargs.pop(k) for k in LOSS_KWARGS if k in kwargs}
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        softcap = getattr(self.config, spec.softcap_attr) if spec.softcap_attr else None
        logits = None
        if from_logits:
            logits = self.lm_head(outputs.last_hidden_state)
            if softcap is not None:  # HF's own ops, so the returned logits are HF's
                logits = torch.tanh(logits / softcap) * softcap
            loss = causal_lm_loss_from_logits(logits, labels, **loss_kwargs)
        else:
            hidden = outputs.last_hidden_state
            loss = causal_lm_loss(hidden, self.lm_head, labels, softcap=softcap, **loss_kwargs)
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()

    forward.__qualname__ = f"fuselm_{spec.causal_lm}.forward" + ("[logits]" if from_logits else "")
    return forward


def _keeps_all(logits_to_keep) -> bool:
    """HF's ``logits_to_keep`` default (0 = every position)."""
    return isinstance(logits_to_keep, int) and logits_to_keep == 0
