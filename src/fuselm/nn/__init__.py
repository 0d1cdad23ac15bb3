"""torch.nn.Module wrappers around the ops."""

from .loss import CrossEntropyLoss, LinearCrossEntropyLoss

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss"]
