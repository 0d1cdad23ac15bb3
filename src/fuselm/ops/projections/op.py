"""fuselm.ops.projections.linear_projections: several projections of one input as one autograd node."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._common.dtensor import has_dtensor
from .._common.guard import FLOAT_DTYPES, cast_for_autocast, check_tensor
from .._common.linear import projections_backward


class ProjectionsFunction(torch.autograd.Function):
    """y_i = x W_i^T + b_i for x [N, H]. Saves x and the weights (parameters: no memory); the backward
    accumulates dX over the projections in one buffer (mm, then addmm_) and gives each weight's and
    bias's gradient (one GEMM, one sum)."""

    @staticmethod
    def forward(ctx, x, n, *weights_and_biases):
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.n = n
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *douts):
        x, *weights = ctx.saved_tensors
        n, need = ctx.n, ctx.needs_input_grad
        dx, dw, db = projections_backward(x, tuple(weights), douts, need[0], need[2 : 2 + n], need[2 + n :])
        return dx, None, *dw, *db


_DTYPES = (*FLOAT_DTYPES, torch.float64)


def linear_projections(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """Several projections of one input, ``tuple(F.linear(x, w, b) for w, b in ...)``, as one autograd
    node: an attention's q, k and v projections of the same hidden states.

    The GEMMs are eager PyTorch's; what changes is the host path: one node where eager PyTorch builds four
    or five per ``nn.Linear`` on a 3-D input (the matmul's views, the mm, the transpose of the weight),
    each costing host time in every backward of a small-batch step. dX is the projections' gradients
    accumulated in one buffer (``mm``, then ``addmm_``: one rounding per projection, as eager's sum of
    three tensors). Saved for backward: x (and the weights, parameters). Under autocast every operand is
    cast to the autocast dtype first, as ``nn.Linear`` does.

    Args:
        x: ``[..., H]`` float32 / float16 / bfloat16 / float64.
        weights: one ``[out_i, H]`` weight per projection (x's dtype and device), at least one.
        biases: None, or one ``[out_i]`` bias or None per projection.

    Returns:
        a tuple of ``[..., out_i]`` tensors in x's dtype (the autocast dtype under autocast).

    Example:
        >>> import torch
        >>> from fuselm.ops.projections import linear_projections
        >>> x = torch.randn(2, 3, 8, requires_grad=True)
        >>> q, k, v = linear_projections(x, (torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8)))
        >>> q.shape, k.shape
        (torch.Size([2, 3, 4]), torch.Size([2, 3, 2]))
        >>> (q.sum() + k.sum() + v.sum()).backward(); x.grad.shape
        torch.Size([2, 3, 8])
    """
    if not isinstance(weights, (tuple, list)) or not weights:
        raise ValueError(f"weights must be a non-empty tuple of tensors, got {type(weights).__name__}")
    weights = tuple(weights)
    biases = tuple(biases) if biases is not None else (None,) * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"biases must have one entry per weight ({len(weights)}), got {len(biases)}")
    if has_dtensor(x, *weights, *biases):
        raise ValueError(
            "linear_projections does not take DTensors: run the projections as modules, or pass "
            ".to_local() of every input"
        )
    check_tensor("x", x, dtypes=_DTYPES, min_ndim=1)
    n = len(weights)
    (x, *cast), autocast = cast_for_autocast(x.device.type, x, *weights, *biases)
    weights, biases = tuple(cast[:n]), tuple(cast[n:])
    hidden = x.shape[-1]
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        check_tensor(f"weights[{i}]", w, dtypes=(x.dtype,), ndim=2, device=x.device)
        if w.shape[1] != hidden:
            raise ValueError(
                f"weights[{i}] must have shape [out, {hidden}] (x has H={hidden}), got {list(w.shape)}"
            )
        if b is not None:
            check_tensor(f"biases[{i}]", b, dtypes=(x.dtype,), ndim=1, device=x.device)
            if b.shape[0] != w.shape[0]:
                raise ValueError(f"biases[{i}] must have shape [{w.shape[0]}], got {list(b.shape)}")
    x2 = x.reshape(-1, hidden)
    if autocast:
        with torch.autocast(x.device.type, enabled=False):
            outs = ProjectionsFunction.apply(x2, len(weights), *weights, *biases)
    else:
        outs = ProjectionsFunction.apply(x2, len(weights), *weights, *biases)
    lead = x.shape[:-1]
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)
