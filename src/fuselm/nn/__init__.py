"""torch.nn.Module wrappers around the ops."""

from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .mlp import GeGLUMLP, SwiGLUMLP
from .norm import LayerNorm, RMSNorm

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss", "SwiGLUMLP", "GeGLUMLP", "RMSNorm", "LayerNorm"]
