from .op import apply_rotary
from .reference import apply_rotary_reference

__all__ = ["apply_rotary", "apply_rotary_reference"]
