"""The ops: one folder each (reference, kernels, op, README)."""

from .cross_entropy import cross_entropy
from .linear_cross_entropy import linear_cross_entropy

__all__ = ["cross_entropy", "linear_cross_entropy"]
