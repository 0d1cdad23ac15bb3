from .op import linear_cross_entropy
from .reference import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]
