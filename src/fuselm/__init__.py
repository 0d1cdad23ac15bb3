"""fuselm: fused Triton kernels for training language models."""

from . import distributed, nn
from .graph_step import CapturedStep
from .ops.cross_entropy import cross_entropy
from .ops.layer_norm import layer_norm
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.linear_log_probs import LogProbs, linear_log_probs
from .ops.rms_norm import rms_norm
from .ops.rope import apply_rotary
from .ops.swiglu import geglu, geglu_packed, swiglu, swiglu_packed

__version__ = "0.1.0"

__all__ = [
    "cross_entropy",
    "linear_cross_entropy",
    "linear_log_probs",
    "LogProbs",
    "apply_rotary",
    "swiglu",
    "geglu",
    "swiglu_packed",
    "geglu_packed",
    "rms_norm",
    "layer_norm",
    "CapturedStep",
    "nn",
    "distributed",
    "__version__",
]
