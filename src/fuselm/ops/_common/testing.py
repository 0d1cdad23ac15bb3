"""The numerics rule of docs/design.md section 5, the only tolerance rule of the test suite.

    err(fuselm) <= 2 * err(torch eager in the same dtype) + ATOL[dtype]

err is the relative norm error against a float64 reference: ||a - ref|| / ||ref||
(the max abs error when ||ref|| is 0). ATOL is about twice the unit roundoff of the dtype
(the error of rounding a correct result once); fp32 gets 1e-5 for long reductions.
"""

from __future__ import annotations

import torch

ATOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    a = actual.detach().to(torch.float64).cpu()
    r = reference.detach().to(torch.float64).cpu()
    if a.shape != r.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != reference shape {tuple(r.shape)}")
    if not torch.equal(torch.isnan(a), torch.isnan(r)):  # NaN exactly where the reference has NaN
        return float("inf")
    diff = (a - r).nan_to_num(0.0) if torch.isnan(r).any() else a - r
    if torch.isnan(diff).any():
        return float("inf")
    rn = torch.linalg.vector_norm(r.nan_to_num(0.0)).item()
    dn = torch.linalg.vector_norm(diff).item()
    return dn / rn if rn > 0 else diff.abs().max().item() if diff.numel() else 0.0


def assert_numerics(
    name: str,
    ours: torch.Tensor,
    eager: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """Check the numerics rule for one output; returns (err_ours, err_eager)."""
    dtype = dtype or eager.dtype
    e_ours = rel_err(ours, reference)
    e_eager = rel_err(eager, reference)
    bound = 2 * e_eager + ATOL[dtype]
    if not e_ours <= bound:
        raise AssertionError(
            f"{name}: err {e_ours:.3e} > 2 * eager err {e_eager:.3e} + atol {ATOL[dtype]:.0e} ({dtype})"
        )
    return e_ours, e_eager
