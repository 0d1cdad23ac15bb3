"""Loss modules: hold the options, call the ops."""

from __future__ import annotations

import torch

from ..ops.cross_entropy import cross_entropy


class CrossEntropyLoss(torch.nn.Module):
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
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.return_lse = return_lse
        self.inplace_backward = inplace_backward

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(
            input, target, weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            return_lse=self.return_lse, inplace_backward=self.inplace_backward,
        )

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
