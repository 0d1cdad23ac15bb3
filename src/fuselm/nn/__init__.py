"""torch.nn.Module wrappers around the ops."""

from .loss import CrossEntropyLoss

__all__ = ["CrossEntropyLoss"]
