"""Fused LoRA / QLoRA projections (framework-agnostic math; the PEFT side is ``fuselm.hf.peft_operands``
and ``fuselm.hf.lora``).

``lora_linear`` is one projection ``x W^T + b + s * (drop(x) A^T) B^T`` and ``lora_gated_mlp`` a gated
MLP of three, over frozen base weights that are dense tensors or quantized (``Bnb4bitWeight``,
``Bnb8bitWeight``: dequantized on the fly into one shared scratch buffer per device and dtype).
README.md gives the math and exactly what each function saves for backward.
"""

from .frozen import (
    Bnb4bitWeight,
    Bnb8bitWeight,
    FrozenWeight,
    dense,
    holding_dense,
    keep_resident,
    release_scratch,
    scratch,
    scratch_bytes,
)
from .functions import ACTIVATIONS, LoraAdapter, dropout_mask, lora_gated_mlp, lora_linear, lora_projections
from .reference import dropout_reference, lora_gated_mlp_reference, lora_linear_reference

__all__ = [
    "ACTIVATIONS",
    "Bnb4bitWeight",
    "Bnb8bitWeight",
    "FrozenWeight",
    "LoraAdapter",
    "dense",
    "dropout_mask",
    "dropout_reference",
    "holding_dense",
    "keep_resident",
    "lora_gated_mlp",
    "lora_gated_mlp_reference",
    "lora_linear",
    "lora_linear_reference",
    "lora_projections",
    "release_scratch",
    "scratch",
    "scratch_bytes",
]
