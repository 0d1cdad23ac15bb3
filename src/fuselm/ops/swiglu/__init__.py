from .op import geglu, geglu_packed, swiglu, swiglu_linear, swiglu_packed
from .reference import gated_reference, geglu_reference, swiglu_reference

__all__ = [
    "geglu",
    "geglu_packed",
    "gated_reference",
    "geglu_reference",
    "swiglu",
    "swiglu_linear",
    "swiglu_packed",
    "swiglu_reference",
]
