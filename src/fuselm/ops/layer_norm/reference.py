"""Pure-PyTorch LayerNorm: the spec, the CPU fallback, the test oracle and the benchmark baseline.

For a row x of H values (after the residual add, if any):

    s    = x + residual              (in x's dtype, rounded: what a model's residual stream holds)
    mean = sum(s) / H,  var = sum((s - mean)**2) / H   (biased, as torch.nn.LayerNorm)
    y    = (s - mean) / sqrt(var + eps) * weight + bias

Statistics and y are computed in fp32 (float64 for float64 inputs), y is returned in x's dtype
(torch.nn.functional.layer_norm's numerics); weight and bias may have any float dtype, or be None.
Written out rather than calling F.layer_norm so that degenerate rows differentiate exactly: with
H = 1, s - mean is exactly 0 and so are dx and dweight (F.layer_norm's fused backward leaves
rounding noise there).
"""

from __future__ import annotations

import torch


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
):
    """LayerNorm over the last dimension of x [..., H]; returns y, or (y, x + residual) with a residual.

    Differentiable through autograd.
    """
    if residual is not None:
        x = x + residual
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(compute)
    d = h - h.mean(-1, keepdim=True)
    y = d * torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    y = y.to(x.dtype)
    return (y, x) if residual is not None else y
