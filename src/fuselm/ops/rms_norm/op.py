"""fuselm.rms_norm: launchers -> custom ops -> autograd Function -> public function."""

from __future__ import annotations

import weakref

import torch

from .._common.dispatch import compiled_or_launcher, kernels_run
from .._common.dtensor import ROWWISE_HINT, has_dtensor, leading_dims_only, run_local
from .._common.guard import check_bool, check_choice, check_number, launch_rows, row_stride, rows_shape
from .._common.launch import cdiv, launcher, resident_programs
from .._common.normalization import check_norm_args, forward_plan, tile_config
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

# cached launch bindings of the kernels (ops/_common/launch.py)
rms_norm_fwd_launch = launcher(rms_norm_fwd_kernel)
rms_norm_bwd_launch = launcher(rms_norm_bwd_kernel)


# ---- launchers ----


def rms_norm_fwd(x, residual, weight, eps, offset, casting):
    """y (dtype by casting), x + residual (or None without residual), both of x's shape and contiguous,
    and rstd [N] fp32. x, residual: rows of H (launch_rows: [N, H] with stride(-1) == 1, rows may be
    strided, or contiguous of any shape)."""
    n_rows, n_cols = rows_shape(x)
    assert x.stride(-1) == 1 or n_cols == 1
    y_dtype = rms_norm_output_dtype(x.dtype, weight.dtype if weight is not None else None, casting)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    has_res = residual is not None
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if has_res else None
    if n_rows == 0:
        return y, summed, rstd
    grid, single, block_rows, block_h, num_warps = forward_plan(
        x, residual, FWD_TILE, FWD_ELEMS_PER_WARP, MAX_FUSED_H, LOOP_BLOCK_H, FWD_PROGRAMS_PER_SM
    )
    rms_norm_fwd_launch(
        (grid,),
        x_ptr=x,
        x_row_stride=row_stride(x),
        res_ptr=residual if has_res else x,
        res_row_stride=row_stride(residual) if has_res else 0,
        w_ptr=weight if weight is not None else x,
        y_ptr=y,
        y_row_stride=n_cols,
        sum_ptr=summed if has_res else y,
        sum_row_stride=n_cols if has_res else 0,
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


def rms_norm_bwd(x, dy, dsum, weight, rstd, eps, offset, compute_dw, in_place=False):
    """dx (x's shape, contiguous, x's dtype; it is also d residual) and dweight [H] (weight's dtype; None
    when not compute_dw). x is what was normalized (the residual sum when there was one); x, dy, dsum:
    rows of H (launch_rows). in_place: dx is written over dy and dy is returned as dx (dy then
    contiguous of x's shape and dtype; the caller has checked that nothing the backward reads shares its
    memory: in_place_refusal)."""
    n_rows, n_cols = rows_shape(x)
    if in_place:
        assert dy.is_contiguous() and dy.dtype == x.dtype and dy.shape == x.shape
        dx = dy
    else:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    compute_dw = bool(compute_dw) and weight is not None
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        return dx, dw
    for t in (x, dy, dsum):
        assert t is None or t.stride(-1) == 1 or n_cols == 1
    single, block_rows, block_h, num_warps = tile_config(
        n_rows, n_cols, BWD_TILE, BWD_ELEMS_PER_WARP, MAX_FUSED_H, LOOP_BLOCK_H
    )
    n_blocks = cdiv(n_rows, block_rows)
    prefetch = bool(BWD_PREFETCH) and single and block_rows == 1 and x.element_size() <= 2
    has_dsum, has_weight = dsum is not None, weight is not None
    kwargs = dict(
        x_ptr=x,
        x_row_stride=row_stride(x),
        dy_ptr=dy,
        dy_row_stride=row_stride(dy),
        dsum_ptr=dsum if has_dsum else dy,
        dsum_row_stride=row_stride(dsum) if has_dsum else 0,
        w_ptr=weight if has_weight else x,
        rstd_ptr=rstd,
        dx_ptr=dx,
        dx_row_stride=n_cols,
        dw_part_ptr=rstd,  # stand-in until the grid is known
        n_rows=n_rows,
        n_cols=n_cols,
        inv_n_cols=1.0 / n_cols,
        eps=eps,
        offset=offset,
        HAS_DSUM=has_dsum,
        HAS_WEIGHT=has_weight,
        COMPUTE_DW=compute_dw,
        SINGLE_BLOCK=single,
        PREFETCH=prefetch,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        IN_PLACE=bool(in_place),
        num_warps=num_warps,
    )
    # what decides the compiled variant's registers (the occupancy is computed once per variant)
    variant = (x.dtype, dy.dtype, has_dsum and dsum.dtype, has_weight and weight.dtype, compute_dw, single)
    variant += (prefetch, block_rows, block_h, bool(in_place), num_warps)
    grid = resident_programs(
        rms_norm_bwd_kernel,
        kwargs,
        n_blocks,
        x.device,
        BWD_PROGRAMS_PER_SM,
        BWD_MAX_PROGRAMS_PER_SM,
        BWD_FALLBACK_PROGRAMS_PER_SM,
        variant=variant,
    )
    if compute_dw:
        alloc = torch.empty if single else torch.zeros  # single-block programs write their row once
        part = alloc((grid, n_cols), dtype=torch.float32, device=x.device)
        kwargs["dw_part_ptr"] = part
    rms_norm_bwd_launch((grid,), **kwargs)
    if not compute_dw:
        return dx, None
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
    x2 = launch_rows(x)
    r2 = launch_rows(residual) if residual is not None else None
    y, summed, rstd = rms_norm_fwd(x2, r2, weight, eps, offset, casting)
    return _shaped(y, x), _shaped(summed, x) if summed is not None else x.new_empty(0), rstd


def _shaped(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t (contiguous, like's number of elements) in like's shape."""
    return t if t.shape == like.shape else t.view(like.shape)


@_rms_norm_fwd_op.register_fake
def _(x, residual, weight, eps, offset, casting):
    y_dtype = rms_norm_output_dtype(x.dtype, weight.dtype if weight is not None else None, casting)
    y = x.new_empty(x.shape, dtype=y_dtype)
    summed = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return y, summed, x.new_empty(rows_shape(x)[0], dtype=torch.float32)


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
    dsum = launch_rows(dsum) if dsum is not None else None
    dx, dw = rms_norm_bwd(launch_rows(x), launch_rows(dy), dsum, weight, rstd, eps, offset, compute_dw)
    return _shaped(dx, x), dw if dw is not None else x.new_empty(0)


@_rms_norm_bwd_op.register_fake
def _(x, dy, dsum, weight, rstd, eps, offset, compute_dw):
    dw = torch.empty_like(weight) if compute_dw and weight is not None else x.new_empty(0)
    return x.new_empty(x.shape), dw


# Eager calls launch directly (a custom op costs host time per call); under torch.compile the custom
# ops above stand in, so the graph has no break.


_run_fwd = compiled_or_launcher(_rms_norm_fwd_op, rms_norm_fwd)
_run_bwd = compiled_or_launcher(_rms_norm_bwd_op, rms_norm_bwd)


# ---- in_place: may the backward write dx over dy? ----


def _memory_range(storage) -> tuple[int, int]:
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def input_storages(*tensors) -> tuple:
    """Weak references to the storages of the call's tensors (x, residual, weight as the caller passed
    them): the backward refuses to write over memory any of them still holds, without keeping it alive
    (a tensor freed since the forward no longer counts, so a gradient that reuses its memory may be
    written over)."""
    return tuple(weakref.ref(t.untyped_storage()) for t in tensors if t is not None)


def in_place_refusal(dy, dsum, saved, storages) -> str | None:
    """Why dx may not be written over dy (None: it may). Structural checks only, no reference counts
    and no sync: dy must be a dense [N, H] tensor (contiguous, no zero stride: not the expanded
    gradient of a sum) of x's dtype, outside any graph (not requiring grad), sharing no memory with
    the tensors the backward reads (saved: what was normalized, the weight) or with the call's inputs
    still alive (storages: x, residual, weight), and d sum (the residual variant) either dy itself or
    apart from it. That dy is not read after this backward (by the caller or another branch of the
    graph) is the caller's promise (in_place=True); fuselm cannot see it."""
    if torch.compiler.is_compiling():
        return "torch.compile: the backward graph is functionalized (the out-of-place op runs)"
    if dy.requires_grad:
        return "dy requires grad (double backward)"
    x = saved[0]
    if dy.dtype != x.dtype:
        return f"dy is {dy.dtype}, dx is {x.dtype}"
    if dy.shape != x.shape or not dy.is_contiguous() or 0 in dy.stride():
        return "dy is not a contiguous [N, H] tensor (strided, expanded or overlapping)"
    if dy.numel() == 0:
        return None
    dy_range = _memory_range(dy.untyped_storage())
    for name, t in zip(("x", "weight"), saved, strict=True):
        if t is not None and t.numel() and _overlap(dy_range, _memory_range(t.untyped_storage())):
            return f"dy shares memory with the saved {name}"
    for ref in storages:
        storage = ref()
        if storage is not None and storage.nbytes() and _overlap(dy_range, _memory_range(storage)):
            return "dy shares memory with an input (x, residual or weight)"
    if dsum is not None and _overlap(dy_range, _memory_range(dsum.untyped_storage())):
        same_view = (
            dsum.data_ptr() == dy.data_ptr() and dsum.stride() == dy.stride() and dsum.dtype == dy.dtype
        )
        if not same_view:
            return "d sum overlaps dy without being dy"
    return None


# ---- autograd ----


class RMSNormFunction(torch.autograd.Function):
    """Autograd for x [..., H] (and residual, x's shape): saves what was normalized (x, or the sum, which
    is also an output) and rstd [N] fp32; the backward reads it, dy (and d sum) once and writes dx once,
    which is also the gradient of the residual. Contiguous inputs are launched as they are; others as
    [N, H] rows views made inside the Function (no view nodes in the graph)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting, in_place=False, storages=()):
        has_res = residual is not None
        x2 = launch_rows(x)
        y, summed, rstd = _run_fwd(
            x2, launch_rows(residual) if has_res else None, weight, eps, offset, casting
        )
        ctx.save_for_backward(summed if has_res else x2, weight, rstd)
        ctx.shape = None if x2 is x else x.shape  # dx is made in x2's shape
        ctx.has_res = has_res
        ctx.eps, ctx.offset = eps, offset
        ctx.in_place, ctx.storages = in_place, storages
        ctx.set_materialize_grads(False)
        if ctx.shape is not None:
            y = y.view(x.shape)
        if has_res:
            return y, summed if ctx.shape is None else summed.view(x.shape)
        return y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, rstd = ctx.saved_tensors
        if dy is None and dsum is None:
            return None, None, None, None, None, None, None, None
        if dy is None:  # only the sum was used
            dy = torch.zeros_like(x)
        compute_dw = ctx.needs_input_grad[2]
        dsum = launch_rows(dsum) if dsum is not None else None
        args = (x, dy, dsum, weight, rstd, ctx.eps, ctx.offset, compute_dw)
        if ctx.in_place and in_place_refusal(dy, dsum, (x, weight), ctx.storages) is None:
            dx, dw = rms_norm_bwd(*args, in_place=True)  # dx is dy
            torch.autograd.graph.increment_version(dy)  # a saved view of dy now fails loudly on unpack
        else:
            dx, dw = _run_bwd(x, launch_rows(dy), *args[2:])
        if ctx.shape is not None:
            dx = dx.view(ctx.shape)
        none = (None,) * 5
        return dx, (dx if ctx.has_res else None), (dw if compute_dw else None), *none


def _check_args(x, weight, eps, offset, residual, casting, in_place) -> None:
    check_norm_args(x, {"weight": weight}, residual, eps)
    check_choice("casting", casting, CASTINGS)
    check_bool("in_place", in_place)
    check_number("offset", offset)
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
    in_place: bool = False,
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
        in_place: the backward writes dx over the memory of dy (the gradient of y) and returns it as
            the gradient of x (and of residual): one ``[N, H]`` allocation less in the backward, as
            Liger-Kernel's ``in_place``. With ``True`` you promise that nothing reads dy after this
            backward: not your own tensor passed as ``y.backward(g)`` / ``grad_outputs`` (it then holds
            dx), not another branch of the graph that receives the same gradient (``y + z`` hands one
            gradient to both: Liger sets ``in_place=False`` for Gemma 2's norms for this reason), not a
            hook keeping it. fuselm still computes a new dx, with the same result, where writing over
            dy could not be right: dy of another dtype than x (e.g. float32 y from ``"llama"`` with
            an fp32 weight), not a contiguous ``[N, H]`` tensor (strided, or the expanded gradient
            of ``y.sum()``), requiring grad (double backward), or sharing memory with x, the
            residual, the weight or the saved sum (``in_place_refusal`` in op.py says why). dy's
            version counter is bumped, so a saved view of it raises at its unpacking. Eager Triton
            path only: under ``torch.compile`` the backward graph is functionalized (a kernel
            writing over the tangent would run on a copy of it: a pass more, no memory saved, and
            fake tensors have no addresses to check) and Inductor plans its buffers itself, so the
            out-of-place op runs; the PyTorch reference path (CPU, float64) ignores the flag.

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
                x, weight, eps, offset=offset, residual=residual, casting=casting, in_place=in_place
            ),
            {"x": x, "residual": residual},
            {"weight": weight},
            shardable=leading_dims_only,
            hint=ROWWISE_HINT,
        )
    _check_args(x, weight, eps, offset, residual, casting, in_place)
    eps, offset = float(eps), float(offset)
    if not kernels_run(x, weight):
        return rms_norm_reference(x, weight, eps, offset=offset, residual=residual, casting=casting)
    in_place = in_place and not torch.compiler.is_compiling()  # see the docstring
    return RMSNormFunction.apply(
        x,
        residual,
        weight.contiguous() if weight is not None else None,
        eps,
        offset,
        casting,
        in_place,
        input_storages(x, residual, weight) if in_place else (),
    )
