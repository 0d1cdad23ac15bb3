from .op import (
    gated_backward,
    gated_forward,
    geglu,
    geglu_packed,
    swiglu,
    swiglu_linear,
    swiglu_mlp,
    swiglu_packed,
)
from .reference import ACTIVATIONS, gated_reference, geglu_reference, swiglu_reference

__all__ = [
    "ACTIVATIONS",
    "gated_backward",
    "gated_forward",
    "geglu",
    "geglu_packed",
    "gated_reference",
    "geglu_reference",
    "swiglu",
    "swiglu_linear",
    "swiglu_mlp",
    "swiglu_packed",
    "swiglu_reference",
]
