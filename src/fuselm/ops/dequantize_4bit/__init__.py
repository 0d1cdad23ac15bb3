from .op import dequantize_4bit
from .reference import dequantize_4bit_reference

__all__ = ["dequantize_4bit", "dequantize_4bit_reference"]
