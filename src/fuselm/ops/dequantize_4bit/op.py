"""fuselm.dequantize_4bit: argument checks -> the Triton launcher or the reference."""

from __future__ import annotations

import math

import torch

from .._common.dispatch import kernels_run
from .._common.guard import check_choice, check_tensor
from .._common.launch import cdiv, launcher
from .kernels import dequantize_4bit_kernel
from .reference import dequantize_4bit_reference

# packed bytes per program (2 x BLOCK values) and its warps: chosen, not swept; 2.3-2.5 TB/s on an H100 for
# the large weights of an 8B model (README.md)
BLOCK = 1024
NUM_WARPS = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

dequantize_4bit_launch = launcher(dequantize_4bit_kernel)


def _check(name: str, t: object, numel: int, dtypes: tuple[torch.dtype, ...], device: torch.device):
    """:func:`check_tensor` (a tensor of ``dtypes`` on ``device``), then ``numel`` elements, contiguous."""
    check_tensor(name, t, dtypes=dtypes, device=device)
    if t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()} (shape {tuple(t.shape)})")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    table: torch.Tensor,
    blocksize: int,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.bfloat16,
    *,
    absmax_code: torch.Tensor | None = None,
    absmax_scale: torch.Tensor | None = None,
    absmax_blocksize: int = 256,
    absmax_offset: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blockwise 4-bit dequantization in bitsandbytes' layout (NF4 or FP4, single or double quantization),
    one launch, bit-equal to ``bitsandbytes.functional.dequantize_4bit``: value ``i`` is
    ``table[code_i] * scale[i // blocksize]`` in fp32 rounded once to ``dtype``, ``code_i`` the high nibble
    of byte ``i // 2`` for even ``i``, the low one for odd ``i``.

    Args:
        packed: the codes, two per byte: ``ceil(n / 2)`` bytes (or more) of any dtype, contiguous
            (``Params4bit.data``; n = the product of ``shape``).
        absmax: the block scales, ``[ceil(n / blocksize)]`` fp32; or their uint8 codes when
            double-quantized (then ``absmax_code``, ``absmax_scale`` and ``absmax_offset`` are required).
        table: ``[16]`` fp32, the value of each code (``bitsandbytes.functional.get_4bit_type``).
        blocksize: values per block scale (a power of two >= 2).
        shape: the output's shape; dtype: its dtype (bf16, fp16, fp32; fp64 runs the reference).
        absmax_code: ``[256]`` fp32, the value of each scale code (``quant_state.state2.code``).
        absmax_scale: ``[ceil(blocks / absmax_blocksize)]`` fp32 (``quant_state.state2.absmax``).
        absmax_blocksize: block scales per second-level scale (``quant_state.state2.blocksize``).
        absmax_offset: one fp32 value added to every block scale (``quant_state.offset``).
        out: a contiguous tensor of ``shape`` and ``dtype`` on packed's device to write into.

    Returns the ``shape`` tensor (``out`` when given).

    Example:
        >>> import torch
        >>> from fuselm.ops.dequantize_4bit import dequantize_4bit
        >>> table = torch.linspace(-1, 1, 16)
        >>> packed = torch.tensor([0x0F, 0xF0], dtype=torch.uint8)     # codes 0, 15, 15, 0
        >>> dequantize_4bit(packed, torch.tensor([2.0, 0.5]), table, 2, (4,), torch.float32)
        tensor([-2.0000,  2.0000,  0.5000, -0.5000])
    """
    check_tensor("packed", packed)
    device = packed.device
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape must not be negative, got {shape}")
    check_choice("dtype", dtype, _DTYPES)
    if (
        isinstance(blocksize, bool)
        or not isinstance(blocksize, int)
        or blocksize < 2
        or blocksize & (blocksize - 1)
    ):
        raise ValueError(f"blocksize must be a power of two >= 2, got {blocksize!r}")
    if not packed.is_contiguous() or packed.numel() * packed.element_size() < (n + 1) // 2:
        raise ValueError(
            f"packed must be contiguous with at least {(n + 1) // 2} bytes for shape {shape}, got "
            f"{packed.numel() * packed.element_size()}"
        )
    blocks = cdiv(n, blocksize)
    nested = absmax_code is not None or absmax_scale is not None or absmax_offset is not None
    if nested:
        if absmax_code is None or absmax_scale is None or absmax_offset is None:
            raise ValueError(
                "absmax_code, absmax_scale and absmax_offset come together (double quantization)"
            )
        if (
            isinstance(absmax_blocksize, bool)
            or not isinstance(absmax_blocksize, int)
            or absmax_blocksize < 1
        ):
            raise ValueError(f"absmax_blocksize must be an int >= 1, got {absmax_blocksize!r}")
        _check("absmax", absmax, blocks, (torch.uint8,), device)
        _check("absmax_code", absmax_code, 256, (torch.float32,), device)
        _check("absmax_scale", absmax_scale, cdiv(blocks, absmax_blocksize), (torch.float32,), device)
        _check("absmax_offset", absmax_offset, 1, (torch.float32,), device)
    else:
        _check("absmax", absmax, blocks, (torch.float32,), device)
    _check("table", table, 16, (torch.float32,), device)
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be a {dtype} tensor of shape {shape}, got {got}")
        if out.device != device or not out.is_contiguous():
            raise ValueError(f"out must be contiguous on packed's device {device}")
    if not kernels_run(packed) or dtype == torch.float64:
        w = dequantize_4bit_reference(
            packed, absmax, table, blocksize, shape, dtype, absmax_code, absmax_scale, absmax_blocksize,
            absmax_offset,
        )  # fmt: skip
        return w if out is None else out.copy_(w)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    if n == 0:
        return out
    dequantize_4bit_launch(
        (cdiv((n + 1) // 2, BLOCK),),
        packed_ptr=packed.view(-1).view(torch.uint8),
        absmax_ptr=absmax,
        table_ptr=table,
        code_ptr=absmax_code if nested else table,
        scale_ptr=absmax_scale if nested else table,
        offset_ptr=absmax_offset if nested else table,
        out_ptr=out,
        n=n,
        BLOCK=BLOCK,
        BLOCKSIZE=blocksize,
        ABSMAX_BLOCKSIZE=absmax_blocksize if nested else 1,
        NESTED=nested,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # the scale's product is rounded before its offset is added, as bitsandbytes
    )
    return out
