"""torch.nn.Module wrappers around the ops."""

from .log_probs import LinearLogProbs
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .mlp import GeGLUMLP, SwiGLUMLP
from .norm import LayerNorm, RMSNorm

__all__ = [
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "LinearLogProbs",
    "SwiGLUMLP",
    "GeGLUMLP",
    "RMSNorm",
    "LayerNorm",
]
