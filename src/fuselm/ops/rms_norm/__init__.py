from .op import rms_norm
from .reference import CASTINGS, rms_norm_reference

__all__ = ["CASTINGS", "rms_norm", "rms_norm_reference"]
