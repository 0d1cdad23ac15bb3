"""Pure-PyTorch cross-entropy: the spec, the CPU fallback, the test oracle and the benchmark baseline.

The per-token formula (softcap, class weights, label smoothing, z-loss) and the handling of ignored and
out-of-range targets are the family's, written once in ops/_common/loss/reference.py (row_losses).
reduction="mean" divides the sum by the sum of w_t over non-ignored tokens (their count without
weights), as PyTorch does; a batch with every token ignored gives NaN, like PyTorch.
"""

from __future__ import annotations

import torch

from .._common.loss.options import Extras, LossOptions, loss_outputs
from .._common.loss.reference import predicted_tokens, row_losses, z_loss_rows


def cross_entropy_reference(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    token_weights: torch.Tensor | None = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    loss_dtype: torch.dtype | None = None,
):
    """Cross-entropy in fp32 (fp64 for fp64 input); loss in ``loss_dtype`` (default: the input dtype),
    lse in fp32/fp64.

    input [..., V], target [...] (int). Differentiable through autograd.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> cross_entropy_reference(logits, torch.tensor([0, -100]))
        tensor(0.2395)
    """
    per_token = token_weights.reshape(-1) if token_weights is not None else None  # [N], as checked() gives
    opts = LossOptions.of(weight, ignore_index, reduction, label_smoothing, z_loss, softcap, per_token)
    extras = Extras(return_lse, return_z_loss, return_token_accuracy, return_predicted_tokens)
    return cross_entropy_reference_of(input, target, opts, extras, loss_dtype)


def cross_entropy_reference_of(input, target, opts: LossOptions, extras: Extras, loss_dtype):
    """cross_entropy_reference with the options as one LossOptions (what fuselm.cross_entropy calls)."""
    n_cols = input.shape[-1]
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    weight, ignore_index, reduction = opts.weight, opts.ignore_index, opts.reduction
    t = target.reshape(-1)
    loss, lse = row_losses(input.reshape(-1, n_cols).to(compute), t, opts)
    valid = (t != ignore_index) & (t >= 0) & (t < n_cols)
    w_t = weight.to(compute)[torch.where(valid, t, 0)] if weight is not None else torch.ones_like(lse)
    denominator = torch.where(t != ignore_index, w_t, torch.zeros_like(w_t)).sum()

    def reduce(rows):
        if reduction == "sum":
            return rows.sum()
        return rows.sum() / denominator if reduction == "mean" else rows

    z_loss = reduce(z_loss_rows(lse, t, n_cols, opts)) if extras.z_loss else None
    predicted = predicted_tokens(input.reshape(-1, n_cols), t, opts) if extras.argmax else None
    return loss_outputs(reduce(loss), lse, target, opts, loss_dtype or input.dtype, extras, z_loss, predicted)
