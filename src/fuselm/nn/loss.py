"""Loss modules: hold the options, call the ops."""

from __future__ import annotations

import torch

from ..ops.cross_entropy import cross_entropy
from ..ops.linear_cross_entropy import linear_cross_entropy


class _LossModule(torch.nn.Module):
    """The options every loss module of the family holds (class weights as a buffer)."""

    OPTIONS = (
        "ignore_index",
        "reduction",
        "label_smoothing",
        "z_loss",
        "softcap",
        "return_lse",
        "return_z_loss",
        "return_token_accuracy",
        "return_predicted_tokens",
    )

    def __init__(self, weight, **options) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        for name in self.OPTIONS:
            setattr(self, name, options[name])

    def loss_options(self) -> dict:
        """The keyword arguments of the functional loss that this module holds."""
        return dict(weight=self.weight, **{name: getattr(self, name) for name in self.OPTIONS})


class CrossEntropyLoss(_LossModule):
    """Module form of :func:`fuselm.cross_entropy`, argument for argument like ``torch.nn.CrossEntropyLoss``.

    Example:
        >>> import torch, fuselm
        >>> loss_fn = fuselm.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
        >>> loss_fn(torch.randn(3, 5), torch.tensor([0, 4, -100])).shape
        torch.Size([])
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
        return_lse: bool = False,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        inplace_backward: bool = False,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in self.OPTIONS}
        super().__init__(weight, **options)
        self.inplace_backward = inplace_backward

    def forward(self, input: torch.Tensor, target: torch.Tensor, token_weights: torch.Tensor | None = None):
        options = self.loss_options()
        return cross_entropy(
            input, target, token_weights=token_weights, inplace_backward=self.inplace_backward, **options
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}"
        )


class LinearCrossEntropyLoss(_LossModule):
    """Module form of :func:`fuselm.linear_cross_entropy`: the loss of ``input @ linear_weight.T + bias``.

    The projection weight is an argument of ``forward`` (usually the model's ``lm_head.weight``), so
    tied embeddings and existing modules keep their parameters.

    Example:
        >>> import torch, fuselm
        >>> loss_fn = fuselm.nn.LinearCrossEntropyLoss(ignore_index=-100)
        >>> hidden, lm_head = torch.randn(6, 16), torch.randn(50, 16)
        >>> loss_fn(hidden, lm_head, torch.tensor([1, 2, 3, -100, 4, 49])).shape
        torch.Size([])
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
        return_lse: bool = False,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        memory: str | int = "auto",
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in self.OPTIONS}
        super().__init__(weight, **options)
        self.memory = memory
        self.accum_dtype = accum_dtype

    def forward(
        self,
        input: torch.Tensor,
        linear_weight: torch.Tensor,
        target: torch.Tensor,
        linear_bias: torch.Tensor | None = None,
        token_weights: torch.Tensor | None = None,
    ):
        options = dict(self.loss_options(), linear_bias=linear_bias, token_weights=token_weights)
        options.update(memory=self.memory, accum_dtype=self.accum_dtype)
        return linear_cross_entropy(input, linear_weight, target, **options)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, memory={self.memory!r}"
