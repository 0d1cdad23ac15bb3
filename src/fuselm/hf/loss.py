"""Hugging Face's causal-LM loss (``ForCausalLMLoss``) computed by fuselm: from the hidden states and the
lm_head's weight without the logits (:func:`causal_lm_loss`), or on materialized logits
(:func:`causal_lm_loss_from_logits`); :class:`LossOptions` says which, with what options."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops._common.guard import FLOAT_DTYPES, TargetRangeError, check_choice, validate_memory
from ..ops._common.loss.options import LossOptions as OpsLossOptions
from ..ops.cross_entropy import cross_entropy
from ..ops.linear_cross_entropy import linear_cross_entropy


@dataclass(frozen=True)
class LossOptions:
    """How the patched ``*ForCausalLM.forward`` computes its loss (hashable: factories are cached on it).

    Attributes:
        from_logits: HF's logits are made and returned, the loss on them by :func:`fuselm.cross_entropy`
            (``patch(..., cross_entropy=True)``); otherwise the fused loss from the hidden states.
        label_smoothing: PyTorch's label smoothing, applied inside the fused loss: a number in [0, 1].
        memory: the ``memory=`` plan of :func:`fuselm.linear_cross_entropy`: ``"auto"``, ``"min"`` or a
            positive int (bytes).
        accum_dtype: its ``accum_dtype=``: None, torch.float32 for an fp32 lm_head gradient accumulator,
            or the model's own dtype (the same as None).

    Checked when made (``fuselm.hf.patch`` makes one) by the ops' own validators, so a bad option fails
    at patch time, not at the first training step: ValueError naming the argument and its allowed values
    (an ``accum_dtype`` that is a float dtype other than float32 and the model's is refused by the loss
    at its first call, where the model's dtype is known).
    """

    from_logits: bool = False
    label_smoothing: float = 0.0
    memory: str | int = "auto"
    accum_dtype: torch.dtype | None = None

    def __post_init__(self):
        smoothing = OpsLossOptions.of(label_smoothing=self.label_smoothing).label_smoothing
        object.__setattr__(self, "label_smoothing", smoothing)  # frozen: one key for 0 and 0.0
        validate_memory(self.memory)
        check_choice("accum_dtype", self.accum_dtype, (None, *FLOAT_DTYPES))


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


def _labels_error(e: TargetRangeError) -> ValueError:
    return ValueError(
        f"labels hold {e.value}, outside [0, {e.n_classes}) (the rows of lm_head) and not "
        f"ignore_index={e.ignore_index}"
    )


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` of the logits ``hidden_states @ weight.T + bias``, computed by
    :func:`fuselm.linear_cross_entropy` without building them.

    Targets as :func:`shifted_targets`. With ``num_items_in_batch`` the loss is the sum over predicted
    tokens divided by it (HF's gradient-accumulation-correct normalization; a batch without targets and
    ``num_items_in_batch = 0`` gives 0 / 0 = NaN as HF's, with zero gradients); otherwise the mean.
    ``softcap``: Gemma 2/3's final logit softcapping; ``label_smoothing``: PyTorch's (what Trainer's
    ``label_smoothing_factor`` computes); ``memory``, ``accum_dtype``: those of
    :func:`fuselm.linear_cross_entropy`. The loss
    is fp32, as HF's (computed on ``logits.float()``). A label outside ``[0, V)`` that is not
    ``ignore_index`` raises ValueError in eager mode (see :func:`fuselm.linear_cross_entropy`).

    Shapes: hidden_states ``[B, T, H]``, weight ``[V, H]``, bias ``[V]``, labels ``[B, T]`` (int,
    ``ignore_index`` for no target); returns a scalar.
    """
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shifted_targets(labels, shift_labels, ignore_index, hidden.shape[0], hidden.device)
    try:
        loss = linear_cross_entropy(
            hidden,
            weight,
            target,
            linear_bias=bias,
            ignore_index=ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
            softcap=softcap,
            label_smoothing=label_smoothing,
            memory=memory,
            accum_dtype=accum_dtype,
            loss_dtype=torch.float32,
        )
    except TargetRangeError as e:
        raise _labels_error(e) from e
    return _per_item(loss, num_items_in_batch)


def causal_lm_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` on materialized logits ``[B, T, V]`` through :func:`fuselm.cross_entropy`:
    one pass per row, fp32 math and an fp32 loss without HF's fp32 copy of the logits. A label outside
    ``[0, V)`` gives a NaN loss and a zero gradient (no host sync, see :func:`fuselm.cross_entropy`)."""
    v = logits.shape[-1]
    target = shifted_targets(labels, shift_labels, ignore_index, logits.numel() // v, logits.device)
    loss = cross_entropy(
        logits.reshape(-1, v),
        target,
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        label_smoothing=label_smoothing,
        loss_dtype=torch.float32,
    )
    return _per_item(loss, num_items_in_batch)
