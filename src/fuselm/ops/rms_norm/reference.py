"""Pure-PyTorch RMSNorm: the spec, the CPU fallback, the test oracle and the benchmark baseline.

For a row x of H values (after the residual add, if any), scale w' = offset + weight:

    s    = x + residual              (in x's dtype, rounded: what a model's residual stream holds)
    rstd = 1 / sqrt(mean(s**2) + eps)
    y    = s * rstd * w'

`casting` says where the result is rounded, reproducing Hugging Face's code exactly:

- "llama" (LlamaRMSNorm): statistics and s * rstd in fp32, rounded to x's dtype, then multiplied
  by (offset + weight) in the promoted dtype of x and weight: `weight * h.to(input_dtype)`.
  The output has dtype torch.promote_types(x.dtype, weight.dtype) (fp32 for bf16 x and fp32
  weight, as in HF under autocast).
- "gemma" (GemmaRMSNorm): everything in fp32, `(s * rstd * (offset + weight.float())).type_as(x)`.
- "none": every step in x's dtype (`x * torch.rsqrt(x.pow(2).mean(-1) + eps) * w'`).

float64 inputs compute in float64 (the oracle of the tests).
"""

from __future__ import annotations

import torch

CASTINGS = ("llama", "gemma", "none")


def rms_norm_output_dtype(
    x_dtype: torch.dtype, weight_dtype: torch.dtype | None, casting: str
) -> torch.dtype:
    """The dtype of y: promoted with the weight's in "llama" mode (HF's `weight * h`), else x's."""
    if casting == "llama" and weight_dtype is not None:
        return torch.promote_types(x_dtype, weight_dtype)
    return x_dtype


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    casting: str = "llama",
):
    """RMSNorm over the last dimension of x [..., H]; returns y, or (y, x + residual) with a residual.

    Differentiable through autograd; the HF formulas written out (see the module docstring).
    """
    if residual is not None:
        x = x + residual
    summed = x
    dtype = x.dtype
    if casting == "none":
        variance = x.pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(variance + eps)
        if weight is not None:
            y = y * (weight.to(dtype) + offset)
    else:
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        h = x.to(compute)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        if casting == "llama":
            y = h.to(dtype)
            if weight is not None:
                y = (weight + offset if offset else weight) * y
        else:
            if weight is not None:
                h = h * (offset + weight.to(compute))
            y = h.to(dtype)
    return (y, summed) if residual is not None else y
