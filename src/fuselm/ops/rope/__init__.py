from .op import apply_rotary, qkv_rotary, qkv_rotary_bwd, qkv_rotary_fwd
from .reference import apply_rotary_reference, broadcast_tables

# qkv_rotary_fwd / qkv_rotary_bwd: the launchers (no autograd), for the composite op ops/decoder_layer
__all__ = [
    "apply_rotary",
    "apply_rotary_reference",
    "broadcast_tables",
    "qkv_rotary",
    "qkv_rotary_bwd",
    "qkv_rotary_fwd",
]
