"""Triton kernel of the blockwise 4-bit dequantization (README.md has the layout and the math).

dequantize_4bit_kernel: one program per BLOCK packed bytes (2 x BLOCK values): the bytes are read once
(contiguous), each block scale is made where it is used (double quantization: the uint8 code looked up in
the 256-entry second-level table, times the scale of its group, plus the offset: the same fp32 roundings
as bitsandbytes, launched without FMA contraction), the two nibbles of a byte looked up in the 16-entry
table and scaled, and the values stored contiguous in the output dtype. One launch per weight, whatever
the quantization depth.
"""

import triton
import triton.language as tl


@triton.jit
def dequantize_4bit_kernel(
    packed_ptr,  # uint8 [n_bytes]
    absmax_ptr,  # fp32 [blocks], or uint8 [blocks] (NESTED)
    table_ptr,  # fp32 [16]
    code_ptr,  # fp32 [256] (NESTED)
    scale_ptr,  # fp32 [blocks / ABSMAX_BLOCKSIZE] (NESTED)
    offset_ptr,  # fp32 [1] (NESTED)
    out_ptr,  # [n] in the output dtype
    n,
    BLOCK: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    ABSMAX_BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # byte index
    n_bytes = (n + 1) // 2
    in_range = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=in_range, other=0).to(tl.int32)
    block = (offs * 2) // BLOCKSIZE  # both values of a byte are in one block (BLOCKSIZE is even)
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=in_range, other=0).to(tl.int32)
        scale = tl.load(code_ptr + q) * tl.load(
            scale_ptr + block // ABSMAX_BLOCKSIZE, mask=in_range, other=0.0
        )
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=in_range, other=0.0)
    high = tl.load(table_ptr + (byte >> 4)) * scale
    low = tl.load(table_ptr + (byte & 15)) * scale
    values = tl.interleave(high, low).to(out_ptr.dtype.element_ty)  # value 2i: high nibble of byte i
    out_offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, values, mask=out_offs < n)
