"""The PyTorch composition linear_projections replaces: one F.linear per projection of the same input."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_projections_reference(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))``.

    Example:
        >>> x = torch.randn(2, 3, 8)
        >>> q, k = linear_projections_reference(x, (torch.randn(4, 8), torch.randn(2, 8)))
        >>> q.shape, k.shape
        (torch.Size([2, 3, 4]), torch.Size([2, 3, 2]))
    """
    biases = biases if biases is not None else (None,) * len(weights)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
