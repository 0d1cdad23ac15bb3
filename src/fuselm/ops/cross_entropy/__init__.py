from .op import cross_entropy
from .reference import cross_entropy_reference

__all__ = ["cross_entropy", "cross_entropy_reference"]
