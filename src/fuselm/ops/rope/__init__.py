from .op import apply_rotary, qkv_rotary, rope_bwd_rows, rope_fwd
from .reference import apply_rotary_reference, broadcast_tables

# rope_fwd / rope_bwd_rows: the launchers (no autograd), for the composite op ops/decoder_layer
__all__ = [
    "apply_rotary",
    "apply_rotary_reference",
    "broadcast_tables",
    "qkv_rotary",
    "rope_bwd_rows",
    "rope_fwd",
]
