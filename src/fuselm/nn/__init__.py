"""torch.nn.Module wrappers around the ops."""

from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .mlp import GeGLUMLP, SwiGLUMLP

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss", "SwiGLUMLP", "GeGLUMLP"]
