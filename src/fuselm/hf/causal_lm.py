"""The patched ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward: HF's own forward runs with the
lm_head and the loss function standing in for one call, then fuselm's loss is taken from the last hidden
states (:func:`causal_lm_forward`). What the fused loss reads: the lm_head's operands (plain, PEFT's
``modules_to_save`` and LoRA: :func:`head_operands`) and the logit transforms of HF's forward
(:func:`head_facts`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..nn.mlp import is_plain_linear
from ._common import INSTANCE_MARK, peft_class, warn_once
from .attention import training_attention
from .hub_kernels import warn_shadowed
from .loss import LossOptions, causal_lm_loss, causal_lm_loss_from_logits
from .registry import FamilySpec

# ---- the lm_head: which weight the fused loss reads ----

# (x [N, H], weight [V, H'], bias [V] or None) -> the operands of the fused loss, x widened to H' columns
HeadOperands = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def head_operands(head: nn.Module) -> HeadOperands | str:
    """How the fused loss computes the logits of ``head``, or why it cannot (a one-line reason).

    - a plain ``nn.Linear``: its weight and bias;
    - PEFT's ``modules_to_save`` wrapper: the active copy (the original when adapters are disabled);
    - a PEFT LoRA ``Linear`` (vanilla LoRA, any dropout, any number of active adapters): the base
      weight and each adapter's ``B`` side by side, ``[W, B_1, ...]`` of shape ``[V, H + r_1 + ...]``,
      and the input ``[x, s_1 A_1(dropout(x)), ...]``: the logits ``x W^T + sum_k s_k B_k A_k dropout(x)``
      exactly as PEFT computes them. The widened weight is a temporary copy of W, and its gradient is
      computed in full even when W is frozen (2NHV more FLOPs than needed); a merged or disabled adapter
      reads the base weight alone.
    """
    if is_plain_linear(head):
        return lambda x: (x, head.weight, head.bias)
    if head._forward_hooks or head._forward_pre_hooks:
        return f"lm_head ({type(head).__name__}) has hooks"
    wrapper = peft_class("ModulesToSaveWrapper")
    if wrapper is not None and isinstance(head, wrapper):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return head_operands(head.original_module)
        return head_operands(head.modules_to_save[active[0]])
    lora = peft_class("Linear")
    if lora is not None and isinstance(head, lora):
        return _lora_operands(head)
    return f"lm_head is a {type(head).__name__}"


def _lora_operands(head: nn.Module) -> HeadOperands | str:
    base = head.base_layer
    if not is_plain_linear(base):
        return f"lm_head is LoRA on a {type(base).__name__}"
    if head.disable_adapters or head.merged:
        return head_operands(base)
    adapters = [a for a in head.active_adapters if a in head.lora_A]
    if any(a in head.lora_variant for a in adapters):
        return "lm_head is a LoRA variant (DoRA, ...)"

    def operands(x):
        xs, ws, b = [x], [base.weight], base.bias
        for a in adapters:
            lora_a, lora_b, s = head.lora_A[a], head.lora_B[a], head.scaling[a]
            low = lora_a(head.lora_dropout[a](x.to(lora_a.weight.dtype))) * s  # [N, r]
            xs.append(low.to(x.dtype))
            ws.append(lora_b.weight.to(base.weight.dtype))
            if lora_b.bias is not None:  # lora_bias=True: B's bias is scaled with its output
                b_lora = (lora_b.bias * s).to(base.weight.dtype)
                b = b_lora if b is None else b + b_lora
        if len(xs) == 1:
            return x, base.weight, b
        return torch.cat(xs, dim=-1), torch.cat(ws, dim=1), b

    return operands


# ---- what HF's forward does with its logits ----

# Config attributes HF's CausalLM forwards apply to the logits: scale them by (multiplied or divided),
# or softcap them with (Gemma 2/3).
MULTIPLIERS = ("logit_scale", "lm_head_multiplier")  # Cohere 1/2, Falcon-H1
DIVISORS = ("logits_scaling",)  # Granite, Granite MoE
SOFTCAP = "final_logit_softcapping"  # Gemma 2 / 3


@dataclass(frozen=True)
class HeadFacts:
    """What HF's forward does after its backbone, read from its compiled code (the names it uses).

    Attributes:
        transforms: the config attributes among :data:`MULTIPLIERS`, :data:`DIVISORS` and :data:`SOFTCAP`
            it applies to the logits: those its code names (Gemma 3's multimodal wrapper, for one, does
            not softcap although its text config has the attribute).
        calls_loss_function: its loss comes from ``self.loss_function`` (HF's template), which fuselm
            stands in for.
    """

    transforms: frozenset[str]
    calls_loss_function: bool


def _code_names(code: types.CodeType) -> set[str]:
    """Every attribute, global, local name and string constant of a code object and of the functions and
    comprehensions defined in it (``getattr(config, "final_logit_softcapping", None)`` names it too)."""
    names = {*code.co_names, *code.co_varnames}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
        elif isinstance(const, str):
            names.add(const)
    return names


@functools.cache
def head_facts(forward: Callable) -> HeadFacts:
    """:class:`HeadFacts` of an HF forward, from the names its code object uses (decorators unwrapped; no
    source is read): every transform and a loss function when it is not a Python function."""
    transforms = (*MULTIPLIERS, *DIVISORS, SOFTCAP)
    code = getattr(inspect.unwrap(forward), "__code__", None)
    if code is None:
        return HeadFacts(frozenset(transforms), True)
    names = _code_names(code)
    return HeadFacts(frozenset(n for n in transforms if n in names), "loss_function" in names)


def _logit_scale_and_softcap(config, transforms: frozenset[str]) -> tuple[float, float | None]:
    """(scale, softcap): HF's logits are softcap(scale * (x W^T + b)); from the (text) config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    for name in transforms:
        value = getattr(text, name, None)
        if value is None or name == SOFTCAP:
            continue
        scale = scale * value if name in MULTIPLIERS else scale / value
    softcap = getattr(text, SOFTCAP, None) if SOFTCAP in transforms else None
    return scale, softcap


# ---- the patched CausalLM forward ----


class _HiddenCapture(nn.Module):
    """Stands in for the lm_head during one call of HF's forward: keeps the hidden states it is given and
    returns an empty ``[..., 0]`` tensor for the logits (HF's scaling or softcap of it costs nothing)."""

    def __init__(self):
        super().__init__()
        self.hidden = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden_states
        return hidden_states[..., :0]


def _head_name(model: nn.Module) -> str | None:
    """The attribute name of the model's output embedding (``lm_head``) among its direct children."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else model._modules.get("lm_head")
    return next((n for n, m in model._modules.items() if m is head and head is not None), None)


@functools.cache
def _signature(forward: Callable) -> inspect.Signature:
    return inspect.signature(forward)


def _call_args(forward: Callable, self, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call by name (positional ones bound to the forward's signature)."""
    if not args:
        return kwargs
    return {**_signature(forward).bind_partial(self, *args).arguments, **kwargs}


def _fallback_reason(model: nn.Module, facts: HeadFacts) -> str | None:
    if "_loss_function" in vars(model):
        return "the model has its own loss_function"
    if not facts.calls_loss_function:
        return "its forward computes the loss without self.loss_function"
    return None


@functools.cache
def causal_lm_forward(spec: FamilySpec, original: Callable, options: LossOptions = LossOptions()) -> Callable:
    """A ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward whose training loss is fuselm's.

    When the model is training (``model.train()``, gradients enabled) and gets ``labels`` (or
    ``shift_labels``), HF's own forward runs (backbone, multimodal inputs, MoE router auxiliary loss, the
    output class HF returns) with two of its members standing in, for that call only:

    - ``lm_head`` (``from_logits=False``): keeps the last hidden states and gives HF an empty tensor for
      the logits, so the returned ``logits`` is None: no ``[B, T, V]`` tensor is made;
    - ``loss_function``: keeps HF's arguments (labels, ``num_items_in_batch``, ...) and returns 0, to
      which HF's MoE forwards add ``router_aux_loss_coef * aux_loss`` as they do to their loss.

    Then the loss is added: :func:`causal_lm_loss` on the kept hidden states, with the logit transforms
    of HF's forward (:func:`head_facts`: ``logit_scale``, ``lm_head_multiplier``, ``logits_scaling``
    folded into the hidden states as ``x * scale``, which in bf16 rounds x once;
    ``final_logit_softcapping`` as ``softcap``) and the lm_head's weight (PEFT heads:
    :func:`head_operands`); or, ``from_logits=True``, :func:`causal_lm_loss_from_logits` on HF's logits
    (returned). The sum equals HF's ``loss + coef * aux_loss`` bit for bit in its order of terms.

    Otherwise (eval, ``torch.no_grad``, no labels, ``logits_to_keep`` set) HF's forward runs unchanged:
    evaluation and prediction get HF's logits and loss. So does a model whose loss fuselm cannot take
    over (another lm_head, a ``loss_function`` of the user's), with a one-time warning saying why.
    Training without labels (Trainer's label smoother pops them) warns once: the full logits are made for
    a loss computed outside the model.
    """
    facts = head_facts(original)
    from_logits, smoothing, memory = options.from_logits, options.label_smoothing, options.memory
    accum_dtype = options.accum_dtype

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        record = vars(self).get(INSTANCE_MARK)
        if record is not None:
            record.sync()  # LoRA layers PEFT added after the patch get fuselm's forward
        call = _call_args(original, self, args, kwargs)
        labels, shift_labels = call.get("labels"), call.get("shift_labels")
        training = self.training and torch.is_grad_enabled()
        if training:
            warn_shadowed(self)  # once per model: a patched block running something else says so
        if training and labels is None and shift_labels is None:
            warn_once(
                "no-labels",
                f"fuselm.hf: {type(self).__name__} is training without labels, so its full logits are "
                "made for a loss computed outside the model (e.g. Trainer's label_smoothing_factor): pass "
                "the labels instead, with fuselm.hf.patch(model, label_smoothing=...) for label smoothing",
            )
        if (
            not training
            or (labels is None and shift_labels is None)
            or not _keeps_all(call.get("logits_to_keep", 0))
        ):
            return original(self, *args, **kwargs)
        name = operands = None
        reason = _fallback_reason(self, facts)
        if reason is None and not from_logits:
            name = _head_name(self)
            operands = head_operands(self._modules[name]) if name else "no lm_head among the model's children"
            reason = operands if isinstance(operands, str) else None
        if reason is not None:
            warn_once(
                f"fallback:{reason}",
                f"fuselm.hf: {reason}, so {type(self).__name__}'s loss is HF's, on the full logits "
                "(fuselm fuses it for an nn.Linear lm_head, PEFT's modules_to_save and LoRA)",
            )
            return original(self, *args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        if labels is None:  # shift_labels alone: HF computes a loss only when it sees labels
            kwargs["labels"] = shift_labels
        seen = {}

        def loss_function(logits, labels=None, vocab_size=None, **loss_kwargs):
            seen.update(loss_kwargs, labels=labels)
            return torch.zeros((), dtype=torch.float32, device=logits.device)

        head = self._modules[name] if name else None
        capture = _HiddenCapture() if name else None
        if name:
            self._modules[name] = capture
        self.__dict__["_loss_function"] = loss_function
        try:
            with training_attention(self.config, call):
                out = original(self, *args, return_dict=True, **kwargs)
        finally:
            del self.__dict__["_loss_function"]
            if name:
                self._modules[name] = head
        loss_kwargs = dict(
            shift_labels=seen.get("shift_labels"),
            num_items_in_batch=seen.get("num_items_in_batch"),
            ignore_index=seen.get("ignore_index", -100),
            label_smoothing=smoothing,
        )
        if from_logits:
            loss = causal_lm_loss_from_logits(out.logits, seen["labels"], **loss_kwargs)
            return _finish(out, out.loss + loss, out.logits, return_dict)
        x, weight, bias = operands(capture.hidden)
        scale, softcap = _logit_scale_and_softcap(self.config, facts.transforms)
        if scale != 1.0:
            x = x * scale
            bias = bias * scale if bias is not None else None
        loss = causal_lm_loss(
            x,
            weight,
            seen["labels"],
            bias=bias,
            softcap=softcap,
            memory=memory,
            accum_dtype=accum_dtype,
            **loss_kwargs,
        )
        return _finish(out, out.loss + loss, None, return_dict)

    owner = original.__qualname__.split(".")[0]
    forward.__qualname__ = f"fuselm_{owner}.forward" + ("[logits]" if from_logits else "")
    return forward


def _finish(out, loss, logits, return_dict: bool):
    """HF's output with fuselm's loss (HF's ``loss + coef * aux_loss`` order: ``aux + loss``) and logits."""
    out = dataclasses.replace(out, loss=loss, logits=logits)
    return out if return_dict else out.to_tuple()


def _keeps_all(logits_to_keep) -> bool:
    """HF's ``logits_to_keep`` default (0 = every position)."""
    return isinstance(logits_to_keep, int) and logits_to_keep == 0
