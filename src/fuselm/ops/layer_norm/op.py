"""fuselm.layer_norm: launchers -> custom ops -> autograd Function -> public function."""

from __future__ import annotations

import torch

from .._common.dispatch import compiled_or_launcher, kernels_run
from .._common.dtensor import ROWWISE_HINT, has_dtensor, leading_dims_only, run_local
from .._common.guard import launch_rows, row_stride, rows_shape
from .._common.launch import cdiv, launcher, resident_programs
from .._common.normalization import check_norm_args, forward_plan, tile_config
from .._common.partial_sums import reduce_partials_
from .kernels import layer_norm_bwd_kernel, layer_norm_fwd_kernel
from .reference import layer_norm_reference

# ---- launch configuration (as rms_norm's; the tile plan is ops/_common/normalization.py) ----
MAX_FUSED_H = 16384  # rows up to this many columns are held in registers and read once
LOOP_BLOCK_H = 4096  # column block of longer rows
FWD_TILE = 4096  # elements a forward program holds (several short rows per program)
BWD_TILE = 4096
FWD_ELEMS_PER_WARP = 512  # num_warps = tile elements / this (clamped to normalization.MIN/MAX_WARPS)
BWD_ELEMS_PER_WARP = 512
FWD_PROGRAMS_PER_SM = 0  # 0: one program per row block; k > 0: persistent, k per multiprocessor
BWD_PROGRAMS_PER_SM = 0  # 0: as many as are resident at once (at most BWD_MAX_PROGRAMS_PER_SM); k > 0: k
BWD_MAX_PROGRAMS_PER_SM = 8

# cached launch bindings of the kernels (ops/_common/launch.py)
layer_norm_fwd_launch = launcher(layer_norm_fwd_kernel)
layer_norm_bwd_launch = launcher(layer_norm_bwd_kernel)


# ---- launchers ----


def layer_norm_fwd(x, residual, weight, bias, eps):
    """y (x's shape and dtype, contiguous), x + residual (the same; None without residual), mean [N] and
    rstd [N] (fp32). x, residual: rows of H (launch_rows: [N, H] with stride(-1) == 1, rows may be
    strided, or contiguous of any shape)."""
    n_rows, n_cols = rows_shape(x)
    assert x.stride(-1) == 1 or n_cols == 1
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    has_res = residual is not None
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if has_res else None
    if n_rows == 0:
        return y, summed, mean, rstd
    grid, single, block_rows, block_h, num_warps = forward_plan(
        x, residual, FWD_TILE, FWD_ELEMS_PER_WARP, MAX_FUSED_H, LOOP_BLOCK_H, FWD_PROGRAMS_PER_SM
    )
    layer_norm_fwd_launch(
        (grid,),
        x_ptr=x,
        x_row_stride=row_stride(x),
        res_ptr=residual if has_res else x,
        res_row_stride=row_stride(residual) if has_res else 0,
        w_ptr=weight if weight is not None else x,
        b_ptr=bias if bias is not None else x,
        y_ptr=y,
        y_row_stride=n_cols,
        sum_ptr=summed if has_res else y,
        sum_row_stride=n_cols if has_res else 0,
        mean_ptr=mean,
        rstd_ptr=rstd,
        n_rows=n_rows,
        n_cols=n_cols,
        inv_n_cols=1.0 / n_cols,
        eps=eps,
        HAS_RESIDUAL=has_res,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        SINGLE_BLOCK=single,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return y, summed, mean, rstd


def layer_norm_bwd(x, dy, dsum, weight, bias, mean, rstd, compute_dw, compute_db):
    """dx (x's shape and dtype, contiguous; also d residual), dweight [H] and dbias [H] (their dtypes;
    None when not computed). x is what was normalized (the residual sum when there was one); x, dy,
    dsum: rows of H (launch_rows)."""
    n_rows, n_cols = rows_shape(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    compute_dw = bool(compute_dw) and weight is not None
    compute_db = bool(compute_db) and bias is not None
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        db = torch.zeros_like(bias) if compute_db else None
        return dx, dw, db
    for t in (x, dy, dsum):
        assert t is None or t.stride(-1) == 1 or n_cols == 1
    single, block_rows, block_h, num_warps = tile_config(
        n_rows, n_cols, BWD_TILE, BWD_ELEMS_PER_WARP, MAX_FUSED_H, LOOP_BLOCK_H
    )
    n_blocks = cdiv(n_rows, block_rows)
    kwargs = dict(
        x_ptr=x,
        x_row_stride=row_stride(x),
        dy_ptr=dy,
        dy_row_stride=row_stride(dy),
        dsum_ptr=dsum if dsum is not None else dy,
        dsum_row_stride=row_stride(dsum) if dsum is not None else 0,
        w_ptr=weight if weight is not None else x,
        mean_ptr=mean,
        rstd_ptr=rstd,
        dx_ptr=dx,
        dx_row_stride=n_cols,
        dw_part_ptr=rstd,  # stand-ins until the grid is known
        db_part_ptr=rstd,
        n_rows=n_rows,
        n_cols=n_cols,
        inv_n_cols=1.0 / n_cols,
        HAS_DSUM=dsum is not None,
        HAS_WEIGHT=weight is not None,
        COMPUTE_DW=compute_dw,
        COMPUTE_DB=compute_db,
        SINGLE_BLOCK=single,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    # what decides the compiled variant's registers (the occupancy is computed once per variant)
    variant = (x.dtype, dy.dtype, dsum is not None and dsum.dtype, weight is not None and weight.dtype)
    variant += (compute_dw, compute_db, single, block_rows, block_h, num_warps)
    grid = resident_programs(
        layer_norm_bwd_kernel,
        kwargs,
        n_blocks,
        x.device,
        BWD_PROGRAMS_PER_SM,
        BWD_MAX_PROGRAMS_PER_SM,
        variant=variant,
    )
    alloc = torch.empty if single else torch.zeros  # single-block programs write their row once
    n_parts = int(compute_dw) + int(compute_db)
    part = alloc((max(n_parts, 1), grid, n_cols), dtype=torch.float32, device=x.device) if n_parts else None
    if compute_dw:
        kwargs["dw_part_ptr"] = part[0]
    if compute_db:
        kwargs["db_part_ptr"] = part[n_parts - 1]
    layer_norm_bwd_launch((grid,), **kwargs)
    if compute_dw and compute_db:  # both sums in one launch
        dw, db = reduce_partials_(part, torch.empty_like(weight), torch.empty_like(bias))
        return dx, dw, db
    dw = reduce_partials_(part[0], torch.empty_like(weight)) if compute_dw else None
    db = reduce_partials_(part[0], torch.empty_like(bias)) if compute_db else None
    return dx, dw, db


# ---- custom ops: torch.compile sees one opaque node per launch, no graph break ----


@torch.library.custom_op("fuselm::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r2 = launch_rows(residual) if residual is not None else None
    y, summed, mean, rstd = layer_norm_fwd(launch_rows(x), r2, weight, bias, eps)
    summed = _shaped(summed, x) if summed is not None else x.new_empty(0)
    return _shaped(y, x), summed, mean, rstd


def _shaped(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t (contiguous, like's number of elements) in like's shape."""
    return t if t.shape == like.shape else t.view(like.shape)


@_layer_norm_fwd_op.register_fake
def _(x, residual, weight, bias, eps):
    n_rows = rows_shape(x)[0]
    summed = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    stats = [x.new_empty(n_rows, dtype=torch.float32) for _ in range(2)]
    return x.new_empty(x.shape), summed, *stats


@torch.library.custom_op("fuselm::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(
    x: torch.Tensor,
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dw: bool,
    compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dsum = launch_rows(dsum) if dsum is not None else None
    dx, dw, db = layer_norm_bwd(
        launch_rows(x), launch_rows(dy), dsum, weight, bias, mean, rstd, compute_dw, compute_db
    )
    return _shaped(dx, x), dw if dw is not None else x.new_empty(0), db if db is not None else x.new_empty(0)


@_layer_norm_bwd_op.register_fake
def _(x, dy, dsum, weight, bias, mean, rstd, compute_dw, compute_db):
    dw = torch.empty_like(weight) if compute_dw and weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if compute_db and bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


_run_fwd = compiled_or_launcher(_layer_norm_fwd_op, layer_norm_fwd)
_run_bwd = compiled_or_launcher(_layer_norm_bwd_op, layer_norm_bwd)


# ---- autograd ----


class LayerNormFunction(torch.autograd.Function):
    """Autograd for x [..., H] (and residual, x's shape): saves what was normalized (x, or the sum, which
    is also an output), mean and rstd [N] fp32; the backward reads it, dy (and d sum) once and writes dx
    once, which is also the gradient of the residual. Contiguous inputs are launched as they are; others
    as [N, H] rows views made inside the Function (no view nodes in the graph)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        has_res = residual is not None
        x2 = launch_rows(x)
        y, summed, mean, rstd = _run_fwd(x2, launch_rows(residual) if has_res else None, weight, bias, eps)
        ctx.save_for_backward(summed if has_res else x2, weight, bias, mean, rstd)
        ctx.shape = None if x2 is x else x.shape  # dx is made in x2's shape
        ctx.has_res = has_res
        ctx.set_materialize_grads(False)
        if ctx.shape is not None:
            y = y.view(x.shape)
        if has_res:
            return y, summed if ctx.shape is None else summed.view(x.shape)
        return y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None and dsum is None:
            return None, None, None, None, None
        if dy is None:  # only the sum was used
            dy = torch.zeros_like(x)
        compute_dw, compute_db = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dsum = launch_rows(dsum) if dsum is not None else None
        dx, dw, db = _run_bwd(x, launch_rows(dy), dsum, weight, bias, mean, rstd, compute_dw, compute_db)
        if ctx.shape is not None:
            dx = dx.view(ctx.shape)
        return (
            dx,
            dx if ctx.has_res else None,
            dw if compute_dw else None,
            db if compute_db else None,
            None,
        )


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
):
    """LayerNorm over the last dimension, optionally fused with the residual add before it.

    ``y = (s - mean(s)) / sqrt(var(s) + eps) * weight + bias`` with ``s = x`` or ``s = x + residual``
    (biased variance, as ``torch.nn.functional.layer_norm(x, (H,), weight, bias, eps)``). Statistics in
    fp32; the math and the kernel plan are in ops/layer_norm/README.md.

    Args:
        x: ``[..., H]`` (any leading shape), float32 / float16 / bfloat16 (float64 runs the PyTorch
            reference). Rows may be strided (``stride(-1) == 1``) without a copy.
        weight: ``[H]`` (any float dtype) or None (no scale).
        bias: ``[H]`` (any float dtype) or None (no shift).
        eps: added to the variance, ``>= 0``.
        residual: optional ``[..., H]`` like x (same shape and dtype). Then the function returns
            ``(y, x + residual)``: the sum (rounded to x's dtype) is what is normalized and is returned
            as the new residual stream, from one kernel. Its gradient flows to both x and residual.

    Returns:
        ``y`` with the shape and dtype of x; with ``residual``, the tuple ``(y, x + residual)``.

    DTensor: as :func:`fuselm.rms_norm` (x and residual sharded on leading dimensions or replicated,
    weight and bias plain or ``Replicate()``; anything else raises ValueError saying what to pass).

    The backward saves only what was normalized (x, or the sum) and mean and rstd (float32, one per
    row); dweight and dbias are reduced in fp32 without atomics.

    Example:
        >>> import torch, fuselm
        >>> x = torch.randn(2, 5, 64, requires_grad=True)
        >>> w, b = torch.rand(64, requires_grad=True), torch.randn(64, requires_grad=True)
        >>> y = fuselm.layer_norm(x, w, b, eps=1e-5)
        >>> torch.allclose(y, torch.nn.functional.layer_norm(x, (64,), w, b, 1e-5), atol=1e-5)
        True
        >>> y, new_res = fuselm.layer_norm(x, None, None, residual=torch.randn(2, 5, 64))
        >>> (y.sum() + new_res.sum()).backward()
        >>> x.grad.shape
        torch.Size([2, 5, 64])
    """
    if has_dtensor(x, residual, weight, bias):
        return run_local(
            "layer_norm",
            lambda x, residual, weight, bias: layer_norm(x, weight, bias, eps, residual=residual),
            {"x": x, "residual": residual},
            {"weight": weight, "bias": bias},
            shardable=leading_dims_only,
            hint=ROWWISE_HINT,
        )
    check_norm_args(x, {"weight": weight, "bias": bias}, residual, eps)
    eps = float(eps)
    if not kernels_run(x, weight, bias):
        return layer_norm_reference(x, weight, bias, eps, residual=residual)
    return LayerNormFunction.apply(
        x,
        residual,
        weight.contiguous() if weight is not None else None,
        bias.contiguous() if bias is not None else None,
        eps,
    )
