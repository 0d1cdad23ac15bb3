from .op import linear_projections
from .reference import linear_projections_reference

__all__ = ["linear_projections", "linear_projections_reference"]
