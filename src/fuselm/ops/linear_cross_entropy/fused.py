"""The fused tile plan (memory="min" on one device): O(N) extra memory, logits only as on-chip tiles.

Forward: ``lce_stats_kernel`` (2NHV FLOPs) writes per-split softmax statistics, torch combines them
into lse and the per-row loss and gradient coefficients ([4, N] fp32); with the gradient wanted,
``lce_tile_grad_kernel`` recomputes every logit tile and accumulates dX, dW (atomics, in their dtype)
and db (fp32): 6NHV more FLOPs. The math and the costs are in README.md.
"""

from __future__ import annotations

import math

import torch

from .._common.dispatch import interpret_mode
from .._common.launch import cdiv, launcher, persistent_grid
from .._common.loss.options import LossOptions, LossScales
from .._common.loss.reference import loss_from_stats, loss_grad_coefs
from .._common.loss.rows import LocalRows
from .chunked import weight_grad
from .kernels import lce_dx_unscale_kernel, lce_stats_kernel, lce_tile_grad_kernel

# Tile configs (tuned on the H200, see benchmarks/NOTES.md). fp32 inputs take half the H block (the
# shared-memory stages of a tile hold 4-byte elements). The interpreter runs tiny tiles.
GPU_CONFIG = dict(BLOCK_M=128, BLOCK_V=256, BLOCK_H=64, BLOCK_HG=64, GROUP_M=8, num_warps=8, num_stages=3)
GPU_FP32_CONFIG = dict(GPU_CONFIG, BLOCK_V=128, BLOCK_H=32)
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_V=16, BLOCK_H=16, BLOCK_HG=16, GROUP_M=2, num_warps=4, num_stages=1)
STATS_WAVES = 2  # the stats grid (row blocks x vocabulary splits) aims at this many programs per SM
# 16-bit dX is accumulated in fp16 (8x finer rounding than bf16) inside dX's own buffer, each row scaled
# by a power of two that keeps a bound on every partial sum of the row at or below this
DX_ACC_LIMIT = 2.0**14
UNSCALE_BLOCK_H = 1024

# cached launch bindings of the kernels (ops/_common/launch.py)
lce_stats_launch = launcher(lce_stats_kernel)
lce_tile_grad_launch = launcher(lce_tile_grad_kernel)
lce_dx_unscale_launch = launcher(lce_dx_unscale_kernel)


def _config(x: torch.Tensor) -> dict:
    if interpret_mode():
        return dict(INTERPRET_CONFIG)
    return dict(GPU_FP32_CONFIG if x.dtype == torch.float32 else GPU_CONFIG)


def _work_rows(target: torch.Tensor, rows: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """(number of work rows, their targets)."""
    if rows is None:
        return target.shape[0], target
    return rows.shape[0], target.index_select(0, rows)


def _common_args(x, w, b, rows, target, opts, config):
    return dict(
        x_ptr=x,
        x_stride=x.stride(0),
        w_ptr=w,
        w_stride=w.stride(0),
        b_ptr=b if b is not None else w,
        rows_ptr=rows if rows is not None else target,
        target_ptr=target,
        class_weight_ptr=opts.weight if opts.weight is not None else w,
        v=w.shape[0],
        h=x.shape[1],
        softcap=opts.softcap,
        HAS_ROWS=rows is not None,
        HAS_BIAS=b is not None,
        HAS_WEIGHT=opts.weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0,
        HAS_SOFTCAP=opts.softcap > 0,
        EVEN_H=x.shape[1] % config["BLOCK_H"] == 0,
        IEEE=x.dtype == torch.float32,
    )


def fused_stats(x, w, b, target, rows, opts: LossOptions):
    """(lse, target logit, sum_j w_j z_j) per work row, fp32 [n] each."""
    n, _ = _work_rows(target, rows)
    v = w.shape[0]
    config = _config(x)
    n_rb = cdiv(n, config["BLOCK_M"])
    n_vt = cdiv(v, config["BLOCK_V"])
    # STATS_WAVES programs per SM in all (every tile its own program when there are fewer tiles)
    splits = cdiv(persistent_grid(n_rb * n_vt, x.device, STATS_WAVES), n_rb)
    tiles_per_split = cdiv(n_vt, splits)
    splits = cdiv(n_vt, tiles_per_split)
    part = torch.empty((4, splits, n), dtype=torch.float32, device=x.device)
    lce_stats_launch(
        (n_rb * splits,),
        **_common_args(x, w, b, rows, target, opts, config),
        part_ptr=part,
        n=n,
        n_splits=splits,
        tiles_per_split=tiles_per_split,
        BLOCK_M=config["BLOCK_M"],
        BLOCK_V=config["BLOCK_V"],
        BLOCK_H=config["BLOCK_H"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    m2, s = part[0], part[1]
    top = m2.max(dim=0).values
    lse = (top + torch.log2((s * torch.exp2(m2 - top)).sum(dim=0))) * math.log(2.0)
    return lse, part[2].sum(dim=0), part[3].sum(dim=0)


def row_terms(lse, z_t, smooth_dot, target_rows, opts: LossOptions, scales: LossScales, dloss, dlse, n_cols):
    """Per work row: the loss (fp32 [n]; None when z_t is None) and the gradient coefficients
    coef [4, n] = (lse, p_coef, t_coef, s_coef) of d loss / d z = softmax * p_coef - onehot * t_coef -
    w * s_coef, scaled by grad_scale * dloss (and the token weights; plus dlse on p_coef): the family's
    per-row math (ops/_common/loss/reference.py). opts: those of the work rows."""
    loss = None
    if z_t is not None:
        loss = loss_from_stats(lse, z_t, smooth_dot, target_rows, n_cols, opts)
    scale = scales.grad_scale * dloss
    coefs = loss_grad_coefs(lse, target_rows, n_cols, opts, scale, dlse, scales.weight_sum)
    return loss, torch.stack([lse, *coefs])


def dx_row_scales(coef, w, opts):
    """Per work row, a power of two s with s * B <= DX_ACC_LIMIT, where B bounds |partial sums of dX_i|:
    |sum_v G_iv W_v| <= (|p_coef| + |t_coef| + |s_coef| * sum_v |w_v|) * max |W| (softmax sums to 1,
    softcap' <= 1). 1 where the bound is 0 or not finite (ignored rows, bad targets)."""
    w_sum = opts.weight.float().abs().sum() if opts.weight is not None else float(w.shape[0])
    row_sum = coef[1].abs() + coef[2].abs()
    if opts.label_smoothing > 0:
        row_sum = row_sum + coef[3].abs() * w_sum
    w_min, w_max = torch.aminmax(w)  # max |W| without an |W| temporary
    bound = row_sum * torch.maximum(w_max.float(), -w_min.float())
    scale = torch.exp2(torch.floor(torch.log2(DX_ACC_LIMIT / bound)))
    return torch.where(torch.isfinite(scale) & (bound > 0), scale, 1.0).contiguous()


def fused_tile_grads(x, w, b, target, rows, coef, opts: LossOptions, needs, fp32_weight_grad=False):
    """dx [N, H] (x's dtype; zero on rows not in `rows`), dw [V, H] (w's dtype; atomics into an fp32 buffer
    with fp32_weight_grad), db [V] fp32: the gradients of sum_i loss_i as weighted by coef [4, n] (see
    row_terms); None where not needed."""
    need_dx, need_dw, need_db = needs
    n, _ = _work_rows(target, rows)
    v, h = w.shape
    dx = torch.zeros((x.shape[0], h), dtype=x.dtype, device=x.device) if need_dx else None
    dw_dtype = torch.float32 if fp32_weight_grad else w.dtype
    dw = torch.zeros((v, h), dtype=dw_dtype, device=w.device) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=x.device) if need_db else None
    if n == 0 or not (need_dx or need_dw or need_db):
        return dx, weight_grad(dw, w), db
    config = _config(x)
    dx_scaled = need_dx and dx.dtype in (torch.float16, torch.bfloat16)
    dx_scale = dx_row_scales(coef, w, opts) if dx_scaled else None
    grid = (cdiv(n, config["BLOCK_M"]) * cdiv(v, config["BLOCK_V"]),)
    lce_tile_grad_launch(
        grid,
        **_common_args(x, w, b, rows, target, opts, config),
        coef_ptr=coef,
        dx_ptr=(dx.view(torch.float16) if dx_scaled else dx) if dx is not None else x,
        dx_stride=dx.stride(0) if dx is not None else 0,
        dx_scale_ptr=dx_scale if dx_scaled else coef,
        dw_ptr=dw if dw is not None else w,
        dw_stride=dw.stride(0) if dw is not None else 0,
        db_ptr=db if db is not None else coef,
        n=n,
        NEED_DX=need_dx,
        NEED_DW=need_dw,
        NEED_DB=need_db,
        DX_SCALED=dx_scaled,
        **config,
    )
    if dx_scaled:
        lce_dx_unscale_launch(
            (n, cdiv(h, UNSCALE_BLOCK_H)),
            acc_ptr=dx.view(torch.float16),
            dx_ptr=dx,
            dx_stride=dx.stride(0),
            rows_ptr=rows if rows is not None else coef,
            dx_scale_ptr=dx_scale,
            h=h,
            HAS_ROWS=rows is not None,
            BLOCK_H=UNSCALE_BLOCK_H,
        )
    return dx, weight_grad(dw, w), db


def forward(
    plan,
    x,
    w,
    b,
    target,
    rows,
    opts: LossOptions,
    scales: LossScales,
    backend,
    compute_grad,
    needs,
    predicted=None,
):
    """The fused plan's forward, with the contract of chunked.forward (one device only: no chunks to
    exchange statistics for; no predicted tokens: choose_plan picks the chunked plan for them)."""
    assert isinstance(backend, LocalRows), "the fused tile plan runs on one device"
    assert predicted is None, "the fused tile plan does not compute predicted tokens"
    n, target_rows = _work_rows(target, rows)
    if n == 0:
        lse = torch.empty(0, dtype=torch.float32, device=x.device)
        loss = lse
        coef = torch.empty((4, 0), dtype=torch.float32, device=x.device)
    else:
        lse, z_t, smooth_dot = fused_stats(x, w, b, target, rows, opts)
        one = torch.ones(1, dtype=torch.float32, device=x.device)
        work_opts = opts.for_rows(rows) if rows is not None else opts
        loss, coef = row_terms(lse, z_t, smooth_dot, target_rows, work_opts, scales, one, None, w.shape[0])
    if not compute_grad:
        return loss, lse, None, None, None
    return loss, lse, *fused_tile_grads(x, w, b, target, rows, coef, opts, needs, plan.fp32_weight_grad)


def backward(plan, x, w, b, target, rows, opts, scales, backend, dloss, dlse, lse, needs):
    """The fused plan's recompute backward, with the contract of chunked.backward."""
    _, target_rows = _work_rows(target, rows)
    work_opts = opts.for_rows(rows) if rows is not None else opts
    _, coef = row_terms(lse, None, None, target_rows, work_opts, scales, dloss, dlse, w.shape[0])
    return fused_tile_grads(x, w, b, target, rows, coef, opts, needs, plan.fp32_weight_grad)
