from .op import apply_rotary, qkv_rotary
from .reference import apply_rotary_reference

__all__ = ["apply_rotary", "apply_rotary_reference", "qkv_rotary"]
