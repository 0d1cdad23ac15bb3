from .op import attention_output_mlp, norm_qkv_rotary
from .reference import attention_output_mlp_reference, norm_qkv_rotary_reference

__all__ = [
    "attention_output_mlp",
    "attention_output_mlp_reference",
    "norm_qkv_rotary",
    "norm_qkv_rotary_reference",
]
