from .._common.guard import check_chunk_rows  # the MLP's chunk size, for fuselm.lora and fuselm.hf
from .mlp import ChunkedMLP, ChunkSums, swiglu_linear, swiglu_mlp
from .op import gated_backward, gated_forward, geglu, geglu_packed, swiglu, swiglu_packed
from .reference import ACTIVATIONS, gated_reference, geglu_reference, swiglu_reference

__all__ = [
    "ACTIVATIONS",
    "ChunkedMLP",
    "ChunkSums",
    "check_chunk_rows",
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
