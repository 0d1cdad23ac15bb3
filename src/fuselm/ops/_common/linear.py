"""The backward of several projections of one input (``y_i = x W_i^T + b_i``), what the ops that fuse
projections into one autograd node share (ops/projections, ops/rope's qkv_rotary)."""

from __future__ import annotations

import torch


def projections_backward(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    douts: tuple[torch.Tensor, ...],
    need_x: bool,
    need_weights: tuple[bool, ...],
    need_biases: tuple[bool, ...],
) -> tuple[torch.Tensor | None, list, list]:
    """(dx [N, H] or None, each weight's gradient or None, each bias's or None) for x [N, H] and the
    outputs' gradients dy_i [N, out_i]: ``dx = sum_i dy_i W_i`` in one buffer (mm, then addmm_),
    ``dW_i = dy_i^T x``, ``db_i = dy_i.sum(0)``."""
    dx = None
    if need_x:
        for d, w in zip(douts, weights, strict=True):
            dx = torch.mm(d, w) if dx is None else dx.addmm_(d, w)
    dw = [torch.mm(d.t(), x) if need else None for d, need in zip(douts, need_weights, strict=True)]
    db = [d.sum(0) if need else None for d, need in zip(douts, need_biases, strict=True)]
    return dx, dw, db
