"""fuselm: fused Triton kernels for training language models."""

from . import nn
from .ops.cross_entropy import cross_entropy
from .ops.linear_cross_entropy import linear_cross_entropy

__version__ = "0.1.0"

__all__ = ["cross_entropy", "linear_cross_entropy", "nn", "__version__"]
