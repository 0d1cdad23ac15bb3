"""PyTorch reference of the blockwise 4-bit dequantization (bitsandbytes' NF4 / FP4 layout), in the order of
operations bitsandbytes uses, so that it is bit-equal to bitsandbytes' own result."""

from __future__ import annotations

import torch


def absmax_reference(
    absmax: torch.Tensor,
    absmax_code: torch.Tensor | None,
    absmax_scale: torch.Tensor | None,
    absmax_blocksize: int,
    absmax_offset: torch.Tensor | None,
) -> torch.Tensor:
    """The fp32 block scales [blocks]: ``absmax`` itself, or, double-quantized (``absmax`` uint8 codes),
    ``absmax_code[absmax] * absmax_scale[block // absmax_blocksize]`` (rounded) ``+ absmax_offset``."""
    if absmax_code is None:
        return absmax.float()
    blocks = torch.arange(absmax.numel(), device=absmax.device) // absmax_blocksize
    scales = absmax_code.float()[absmax.long()] * absmax_scale.float()[blocks]
    return scales + absmax_offset.float()


def dequantize_4bit_reference(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    table: torch.Tensor,
    blocksize: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    absmax_code: torch.Tensor | None = None,
    absmax_scale: torch.Tensor | None = None,
    absmax_blocksize: int = 256,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``table[code] * scale`` in fp32 for each 4-bit code (the high nibble of a byte first), rounded once
    to ``dtype``; ``scale`` is the fp32 block scale of its block of ``blocksize`` values."""
    n = 1
    for s in shape:
        n *= s
    data = packed.reshape(-1).view(torch.uint8).long()
    codes = torch.stack((data >> 4, data & 15), dim=1).reshape(-1)[:n]
    scales = absmax_reference(absmax, absmax_code, absmax_scale, absmax_blocksize, absmax_offset)
    values = table.float()[codes] * scales[torch.arange(n, device=packed.device) // blocksize]
    return values.to(dtype).reshape(shape)
