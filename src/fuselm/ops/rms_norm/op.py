"""fuselm.rms_norm: launchers -> custom ops -> autograd Function -> public function."""

from __future__ import annotations

import math

import torch
import triton

from .._common.dispatch import use_triton
from .._common.dtensor import ROWWISE_HINT, has_dtensor, leading_dims_only, run_local
from .._common.guard import check_choice, rows_view
from .._common.launch import persistent_grid, resident_programs
from .._common.normalization import check_norm_args, tile_config
from .._common.partial_sums import reduce_partials_
from .kernels import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from .reference import CASTINGS, rms_norm_output_dtype, rms_norm_reference

# ---- launch configuration: module constants, tuned on the GPU (tile plan: _common/normalization.py) ----
# Rows of up to MAX_FUSED_H columns are held in registers and read once; longer rows are walked in
# blocks of LOOP_BLOCK_H columns (twice). Short rows share a program: a tile holds about FWD_TILE /
# BWD_TILE elements (rows per program = TILE // BLOCK_H, a power of two, at least 1).
MAX_FUSED_H = 16384
LOOP_BLOCK_H = 4096
FWD_TILE = 4096
BWD_TILE = 4096
# warps per program: tile elements / *_ELEMS_PER_WARP (512: 16 per thread), clamped (MIN/MAX_WARPS)
FWD_ELEMS_PER_WARP = 512
BWD_ELEMS_PER_WARP = 512
# Forward grid: 0 = one program per row block; k > 0 = persistent, k programs per multiprocessor.
FWD_PROGRAMS_PER_SM = 0
# Backward grid (persistent; the dweight partial buffer is [programs, H] fp32): 0 = as many programs
# as are resident at once (occupancy from the compiled kernel's registers), at most
# BWD_MAX_PROGRAMS_PER_SM per multiprocessor; k > 0 = exactly k per multiprocessor.
BWD_PROGRAMS_PER_SM = 0
BWD_MAX_PROGRAMS_PER_SM = 8
BWD_FALLBACK_PROGRAMS_PER_SM = 2  # when the occupancy cannot be read
# Backward, one row per program iteration (BLOCK_ROWS == 1) in 16-bit dtypes: load the next row
# before computing the current one (two rows in flight per program; +15 registers per thread).
BWD_PREFETCH = True

_CAST_CODES = {"llama": 0, "gemma": 1, "none": 2}


# ---- launchers ----


def rms_norm_fwd(x, residual, weight, eps, offset, casting):
    """y [N, H] (dtype by casting), x + residual [N, H] (or an empty tensor) and rstd [N] fp32.
    x, residual: [N, H] with stride(-1) == 1 (rows may be strided)."""
    n_rows, n_cols = x.shape
    assert x.stride(-1) == 1 or n_cols == 1
    y_dtype = rms_norm_output_dtype(x.dtype, weight.dtype if weight is not None else None, casting)
    y = torch.empty((n_rows, n_cols), dtype=y_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    has_res = residual is not None
    summed = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) if has_res else x.new_empty(0)
    if n_rows == 0:
        return y, summed, rstd
    if has_res:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1 or n_cols == 1
    single, block_rows, block_h, num_warps = tile_config(
        n_rows, n_cols, FWD_TILE, FWD_ELEMS_PER_WARP, MAX_FUSED_H, LOOP_BLOCK_H
    )
    n_blocks = triton.cdiv(n_rows, block_rows)
    grid = n_blocks if FWD_PROGRAMS_PER_SM <= 0 else persistent_grid(n_blocks, x.device, FWD_PROGRAMS_PER_SM)
    rms_norm_fwd_kernel[(grid,)](
        x_ptr=x,
        x_row_stride=x.stride(0),
        res_ptr=residual if has_res else x,
        res_row_stride=residual.stride(0) if has_res else 0,
        w_ptr=weight if weight is not None else x,
        y_ptr=y,
        y_row_stride=y.stride(0),
        sum_ptr=summed if has_res else y,
        sum_row_stride=summed.stride(0) if has_res else 0,
        rstd_ptr=rstd,
        n_rows=n_rows,
        n_cols=n_cols,
        inv_n_cols=1.0 / n_cols,
        eps=eps,
        offset=offset,
        CASTING=_CAST_CODES[casting],
        HAS_RESIDUAL=has_res,
        HAS_WEIGHT=weight is not None,
        SINGLE_BLOCK=single,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        num_warps=num_warps,
        enable_fp_fusion=False,  # mean + eps rounded twice, as PyTorch does (bit-exact with HF)
    )
    return y, summed, rstd


def rms_norm_bwd(x, dy, dsum, weight, rstd, eps, offset, compute_dw):
    """dx [N, H] (x's dtype; it is also d residual) and dweight [H] (weight's dtype; an empty tensor
    when not compute_dw). x is what was normalized (the residual sum when there was one)."""
    n_rows, n_cols = x.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    compute_dw = bool(compute_dw) and weight is not None
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else x.new_empty(0)
        return dx, dw
    for t in (x, dy, dsum):
        assert t is None or t.stride(-1) == 1 or n_cols == 1
    single, block_rows, block_h, num_warps = tile_config(
        n_rows, n_cols, BWD_TILE, BWD_ELEMS_PER_WARP, MAX_FUSED_H, LOOP_BLOCK_H
    )
    n_blocks = triton.cdiv(n_rows, block_rows)
    kwargs = dict(
        x_ptr=x,
        x_row_stride=x.stride(0),
        dy_ptr=dy,
        dy_row_stride=dy.stride(0),
        dsum_ptr=dsum if dsum is not None else dy,
        dsum_row_stride=dsum.stride(0) if dsum is not None else 0,
        w_ptr=weight if weight is not None else x,
        rstd_ptr=rstd,
        dx_ptr=dx,
        dx_row_stride=dx.stride(0),
        dw_part_ptr=rstd,  # stand-in until the grid is known
        n_rows=n_rows,
        n_cols=n_cols,
        inv_n_cols=1.0 / n_cols,
        eps=eps,
        offset=offset,
        HAS_DSUM=dsum is not None,
        HAS_WEIGHT=weight is not None,
        COMPUTE_DW=compute_dw,
        SINGLE_BLOCK=single,
        PREFETCH=bool(BWD_PREFETCH) and single and block_rows == 1 and x.element_size() <= 2,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    grid = resident_programs(
        rms_norm_bwd_kernel,
        kwargs,
        n_blocks,
        x.device,
        BWD_PROGRAMS_PER_SM,
        BWD_MAX_PROGRAMS_PER_SM,
        BWD_FALLBACK_PROGRAMS_PER_SM,
    )
    if compute_dw:
        alloc = torch.empty if single else torch.zeros  # single-block programs write their row once
        part = alloc((grid, n_cols), dtype=torch.float32, device=x.device)
        kwargs["dw_part_ptr"] = part
    rms_norm_bwd_kernel[(grid,)](**kwargs)
    if not compute_dw:
        return dx, x.new_empty(0)
    return dx, reduce_partials_(part, torch.empty_like(weight))


# ---- custom ops: torch.compile sees one opaque node per launch, no graph break ----


@torch.library.custom_op("fuselm::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rms_norm_fwd(x, residual, weight, eps, offset, casting)


@_rms_norm_fwd_op.register_fake
def _(x, residual, weight, eps, offset, casting):
    n_rows, n_cols = x.shape
    y_dtype = rms_norm_output_dtype(x.dtype, weight.dtype if weight is not None else None, casting)
    y = x.new_empty((n_rows, n_cols), dtype=y_dtype)
    summed = x.new_empty((n_rows, n_cols)) if residual is not None else x.new_empty(0)
    return y, summed, x.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op("fuselm::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    x: torch.Tensor,
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_bwd(x, dy, dsum, weight, rstd, eps, offset, compute_dw)


@_rms_norm_bwd_op.register_fake
def _(x, dy, dsum, weight, rstd, eps, offset, compute_dw):
    dw = torch.empty_like(weight) if compute_dw and weight is not None else x.new_empty(0)
    return x.new_empty(x.shape), dw


# Eager calls launch directly (a custom op costs host time per call); under torch.compile the custom
# ops above stand in, so the graph has no break.


def _run_fwd(*args):
    if torch.compiler.is_compiling():
        return _rms_norm_fwd_op(*args)
    return rms_norm_fwd(*args)


def _run_bwd(*args):
    if torch.compiler.is_compiling():
        return _rms_norm_bwd_op(*args)
    return rms_norm_bwd(*args)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A gradient as [N, H] with unit column stride (a copy only when it has none)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# ---- autograd ----


class RMSNormFunction(torch.autograd.Function):
    """Autograd for x [N, H] (and residual [N, H]): saves what was normalized (x, or the sum, which is
    also an output) and rstd [N] fp32; the backward reads it, dy (and d sum) once and writes dx once,
    which is also the gradient of the residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting):
        y, summed, rstd = _run_fwd(x, residual, weight, eps, offset, casting)
        has_res = residual is not None
        ctx.save_for_backward(summed if has_res else x, weight, rstd)
        ctx.has_res = has_res
        ctx.eps, ctx.offset = eps, offset
        ctx.set_materialize_grads(False)
        if has_res:
            return y, summed
        return y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, rstd = ctx.saved_tensors
        if dy is None and dsum is None:
            return None, None, None, None, None, None
        if dy is None:  # only the sum was used
            dy = torch.zeros_like(x)
        compute_dw = ctx.needs_input_grad[2]
        dx, dw = _run_bwd(
            x,
            _rows(dy),
            _rows(dsum) if dsum is not None else None,
            weight,
            rstd,
            ctx.eps,
            ctx.offset,
            compute_dw,
        )
        return dx, (dx if ctx.has_res else None), (dw if compute_dw else None), None, None, None


def _check_args(x, weight, eps, offset, residual, casting) -> None:
    check_norm_args(x, {"weight": weight}, residual, eps)
    check_choice("casting", casting, CASTINGS)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"offset must be a finite number, got {offset!r}")
    if weight is None and offset != 0:
        raise ValueError(f"offset={offset} needs a weight (offset + weight scales the output)")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    casting: str = "llama",
):
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    ``y = s / sqrt(mean(s**2) + eps) * (offset + weight)`` with ``s = x`` or ``s = x + residual``.
    ``casting`` reproduces the rounding of Hugging Face's implementations exactly; the math and the
    kernel plan are in ops/rms_norm/README.md.

    Args:
        x: ``[..., H]`` (any leading shape), float32 / float16 / bfloat16 (float64 runs the PyTorch
            reference). Rows may be strided (``stride(-1) == 1``) without a copy.
        weight: ``[H]``, any float dtype (need not match x), or None for no scale (then ``offset``
            must be 0).
        eps: added to the mean square, ``>= 0``.
        offset: added to the weight: ``offset=1.0`` is Gemma's ``(1 + weight)``.
        residual: optional ``[..., H]`` like x (same shape and dtype). Then the function returns
            ``(y, x + residual)``: the sum (rounded to x's dtype) is what is normalized and is returned
            as the new residual stream, from one kernel. Its gradient flows to both x and residual.
        casting: ``"llama"`` (LlamaRMSNorm: statistics in fp32, ``x * rstd`` cast to x's dtype, then
            ``weight * that`` in the promoted dtype, so y is float32 for bf16 x with an fp32 weight, as
            in HF under autocast), ``"gemma"`` (GemmaRMSNorm: all in fp32, cast to x's dtype at the end)
            or ``"none"`` (every step in x's dtype).

    Returns:
        ``y`` of shape ``x.shape`` (dtype: x's, or promoted with weight's for ``"llama"``); with
        ``residual``, the tuple ``(y, x + residual)``.

    DTensor: x (and residual, with x's placements) may be DTensors replicated or sharded on leading
    dimensions (sequence parallel: ``Shard(1)`` of ``[B, T, H]``), with weight a plain tensor or a
    ``Replicate()`` DTensor: each rank normalizes its rows, outputs have x's placements, weight's
    gradient is ``Partial()`` over the sharded mesh dimensions. Sharding on H or a sharded weight
    raises ValueError saying what to pass (ops/_common/dtensor.py).

    The backward saves only what was normalized (x, or the sum, which is an output anyway) and
    rstd (float32, one per row); dweight is reduced in fp32 without atomics.

    Example:
        >>> import torch, fuselm
        >>> x, w = torch.randn(2, 5, 64, requires_grad=True), torch.rand(64, requires_grad=True)
        >>> y = fuselm.rms_norm(x, w, eps=1e-6)
        >>> y.shape
        torch.Size([2, 5, 64])
        >>> res = torch.randn(2, 5, 64)
        >>> y, new_res = fuselm.rms_norm(x, w, residual=res, offset=1.0, casting="gemma")
        >>> torch.allclose(new_res, x + res)
        True
        >>> (y.sum() + new_res.sum()).backward()
        >>> x.grad.shape, w.grad.shape
        (torch.Size([2, 5, 64]), torch.Size([64]))
    """
    if has_dtensor(x, residual, weight):
        return run_local(
            "rms_norm",
            lambda x, residual, weight: rms_norm(
                x, weight, eps, offset=offset, residual=residual, casting=casting
            ),
            {"x": x, "residual": residual},
            {"weight": weight},
            shardable=leading_dims_only,
            hint=ROWWISE_HINT,
        )
    _check_args(x, weight, eps, offset, residual, casting)
    eps, offset = float(eps), float(offset)
    if (
        x.dtype == torch.float64
        or (weight is not None and weight.dtype == torch.float64)
        or not use_triton(x)
    ):
        return rms_norm_reference(x, weight, eps, offset=offset, residual=residual, casting=casting)
    shape = x.shape
    out = RMSNormFunction.apply(
        rows_view(x),
        rows_view(residual) if residual is not None else None,
        weight.contiguous() if weight is not None else None,
        eps,
        offset,
        casting,
    )
    if residual is not None:
        y, summed = out
        return y.reshape(shape), summed.reshape(shape)
    return out.reshape(shape)
