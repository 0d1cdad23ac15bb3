from .op import rms_norm
from .reference import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]
