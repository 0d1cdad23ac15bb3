"""Products of 16-bit (or fp32) operands into fp32 outputs, summed and kept in fp32 by cuBLAS: what the linear
ops use where a result must not be rounded to 16 bits (fp32 logits, fp32 gradient accumulators)."""

from __future__ import annotations

import torch


def mm_fp32_into(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    """out (fp32) = a @ b, or out += a @ b with ``accumulate``, the product summed in fp32 and never rounded
    to a's dtype. On CUDA cuBLAS takes the 16-bit operands directly (``out_dtype``); elsewhere (the CPU
    interpreter path) they are upcast first. Operands of out's own dtype (fp32, or fp64 into an fp64 out)
    are multiplied as they are."""
    if a.dtype == out.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if a.is_cuda:
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    a, b = a.float(), b.float()
    return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
