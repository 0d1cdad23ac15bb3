"""The row backend: what the family's autograd Functions call instead of row kernels. ``LocalRows`` (rows.py)
holds every class of a row on one device; ``fuselm.distributed.shard.VocabShard`` holds a slice of the
classes and exchanges three fp32 numbers per row with the other ranks. The same Function serves both, so
every option and both gradient ways (gradient in the forward, recompute) carry over.
``tests/ops/test_loss_backend.py`` checks that both implement this protocol, signature for signature."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .options import LossOptions, LossScales


@runtime_checkable
class RowBackend(Protocol):
    """Rows of logits [N, C] (C: this backend's classes) to losses and gradients over ``n_classes``."""

    n_classes: int  # the whole vocabulary

    def scales_for_forward(self, target: torch.Tensor, opts: LossOptions) -> LossScales:
        """The LossScales of the batch of the next :meth:`forward`, over all its rows (``target`` [N]):
        written now, or by that forward."""
        ...

    def forward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        opts: LossOptions,
        scales: LossScales,
        grad: str | None,
        predicted: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(loss [N] fp32, lse [N] fp32, d(sum_i loss_i * grad_scale) / d logits or None). grad: None (no
        gradient), "new" (a new tensor) or "inplace" (written over the logits); predicted: an int64 [N]
        buffer for each row's argmax (-1 on ignored rows), or None."""
        ...

    def backward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        opts: LossOptions,
        scales: LossScales,
        dloss: torch.Tensor,
        dlse: torch.Tensor | None,
        lse: torch.Tensor,
        inplace: bool,
    ) -> torch.Tensor:
        """d(sum_i loss_i * grad_scale * dloss_i + lse_i * dlse_i) / d logits from the saved lse (written
        over the logits when inplace)."""
        ...

    def reduce_input_grad_(self, dx: torch.Tensor) -> torch.Tensor:
        """The gradient of a linear op's input, summed over where the classes live (in place)."""
        ...
