"""Triton kernels of LayerNorm, optionally fused with the residual add. The math is in README.md.

Same plan as rms_norm (see ops/rms_norm/kernels.py): a program holds BLOCK_ROWS rows x BLOCK_H
columns; rows that fit one block are read once (two-pass mean / variance in registers); longer rows
are walked in column blocks (three walks forward: mean, centred variance, output; two backward).
The backward is persistent and writes per-program dweight / dbias partials [programs, H] in fp32,
summed by ops/_common/partial_sums.py (no atomics, deterministic). The tile plan and the helpers
shared with rms_norm are in ops/_common/normalization.py.
"""

import triton
import triton.language as tl

from .._common.normalization import col_block, load_norm_input, store_dx, tile_ptrs
from .._common.partial_sums import accumulate_partial_row


@triton.jit
def _load_affine(w_ptr, b_ptr, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """weight and bias [BLOCK_H] in fp32 (1 and 0 where absent)."""
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.full(cols.shape, 1.0, tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(cols.shape, tl.float32)
    return w, b


@triton.jit
def _affine(xhat, w, b, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """xhat [R, C] * weight + bias, in fp32."""
    y = xhat
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    return y


@triton.jit
def layer_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    res_ptr,
    res_row_stride,
    w_ptr,
    b_ptr,
    y_ptr,
    y_row_stride,
    sum_ptr,
    sum_row_stride,
    mean_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    inv_n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """y = (s - mean) * rstd * w + b with s = x [+ residual]; the sum (if residual), mean and rstd
    (fp32) are stored too."""
    n_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ids = tl.arange(0, BLOCK_ROWS)
    col_mask = cols < n_cols
    if SINGLE_BLOCK:
        w, b = _load_affine(w_ptr, b_ptr, cols, col_mask, HAS_WEIGHT, HAS_BIAS)  # once per program
    for rb in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        rows = tl.cast(rb, tl.int64) * BLOCK_ROWS + row_ids  # [BLOCK_ROWS] int64
        row_mask = rows < n_rows
        if SINGLE_BLOCK:
            mask = row_mask[:, None] & col_mask[None, :]
            s = load_norm_input(
                tile_ptrs(x_ptr, rows, x_row_stride, cols),
                tile_ptrs(res_ptr, rows, res_row_stride, cols),
                tile_ptrs(sum_ptr, rows, sum_row_stride, cols),
                mask,
                HAS_RESIDUAL,
                True,
            )
            mean = tl.sum(s, axis=1)[:, None] * inv_n_cols  # [BLOCK_ROWS, 1]
            d = tl.where(mask, s - mean, 0.0)
            rstd = tl.math.rsqrt(tl.sum(d * d, axis=1)[:, None] * inv_n_cols + eps)
            tl.store(mean_ptr + rows[:, None], mean, mask=row_mask[:, None])
            tl.store(rstd_ptr + rows[:, None], rstd, mask=row_mask[:, None])
            y = _affine(d * rstd, w, b, HAS_WEIGHT, HAS_BIAS)
            y_ptrs = tile_ptrs(y_ptr, rows, y_row_stride, cols)
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # pass 1: mean (and the residual sum, stored)
            acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_H):
                c, _, mask = col_block(start, cols, n_cols, row_mask)
                acc += load_norm_input(
                    tile_ptrs(x_ptr, rows, x_row_stride, c),
                    tile_ptrs(res_ptr, rows, res_row_stride, c),
                    tile_ptrs(sum_ptr, rows, sum_row_stride, c),
                    mask,
                    HAS_RESIDUAL,
                    True,
                )
            mean = tl.sum(acc, axis=1)[:, None] * inv_n_cols
            # pass 2: variance of the centred values (no cancellation)
            acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_H):
                c, _, mask = col_block(start, cols, n_cols, row_mask)
                s = load_norm_input(
                    tile_ptrs(x_ptr, rows, x_row_stride, c),
                    tile_ptrs(res_ptr, rows, res_row_stride, c),
                    sum_ptr,
                    mask,
                    HAS_RESIDUAL,
                    False,
                )
                d = tl.where(mask, s - mean, 0.0)
                acc += d * d
            rstd = tl.math.rsqrt(tl.sum(acc, axis=1)[:, None] * inv_n_cols + eps)
            tl.store(mean_ptr + rows[:, None], mean, mask=row_mask[:, None])
            tl.store(rstd_ptr + rows[:, None], rstd, mask=row_mask[:, None])
            # pass 3, last block first: output
            n_col_blocks = tl.cdiv(n_cols, BLOCK_H)
            for i in range(0, n_col_blocks):
                c, c_mask, mask = col_block((n_col_blocks - 1 - i) * BLOCK_H, cols, n_cols, row_mask)
                s = load_norm_input(
                    tile_ptrs(x_ptr, rows, x_row_stride, c),
                    tile_ptrs(res_ptr, rows, res_row_stride, c),
                    sum_ptr,
                    mask,
                    HAS_RESIDUAL,
                    False,
                )
                w, b = _load_affine(w_ptr, b_ptr, c, c_mask, HAS_WEIGHT, HAS_BIAS)
                y = _affine((s - mean) * rstd, w, b, HAS_WEIGHT, HAS_BIAS)
                y_ptrs = tile_ptrs(y_ptr, rows, y_row_stride, c)
                tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_bwd_kernel(
    x_ptr,
    x_row_stride,
    dy_ptr,
    dy_row_stride,
    dsum_ptr,
    dsum_row_stride,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dx_row_stride,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    inv_n_cols,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dsum] with xhat = (x - mean) * rstd and
    g = dy * w; this program's share of dweight (sum of dy * xhat) and dbias (sum of dy) goes to
    dw_part[pid] / db_part[pid] (fp32). Longer rows add into them block by block (zeroed by the caller)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ids = tl.arange(0, BLOCK_ROWS)
    dw_row = dw_part_ptr + tl.cast(pid, tl.int64) * n_cols
    db_row = db_part_ptr + tl.cast(pid, tl.int64) * n_cols
    if SINGLE_BLOCK:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        for rb in range(pid, n_blocks, tl.num_programs(0)):
            rows = tl.cast(rb, tl.int64) * BLOCK_ROWS + row_ids
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(tile_ptrs(x_ptr, rows, x_row_stride, cols), mask=mask, other=0.0)
            dy = tl.load(tile_ptrs(dy_ptr, rows, dy_row_stride, cols), mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            mean = tl.load(mean_ptr + rows[:, None], mask=row_mask[:, None], other=0.0)
            rstd = tl.load(rstd_ptr + rows[:, None], mask=row_mask[:, None], other=0.0)
            xhat = tl.where(mask, (x.to(tl.float32) - mean) * rstd, 0.0)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            c1 = tl.sum(g, axis=1)[:, None] * inv_n_cols
            c2 = tl.sum(g * xhat, axis=1)[:, None] * inv_n_cols
            dx = (g - c1 - xhat * c2) * rstd
            store_dx(
                dx,
                tile_ptrs(dx_ptr, rows, dx_row_stride, cols),
                tile_ptrs(dsum_ptr, rows, dsum_row_stride, cols),
                mask,
                HAS_DSUM,
            )
            if COMPUTE_DW:
                dw_acc += dy * xhat
            if COMPUTE_DB:
                db_acc += dy
        if COMPUTE_DW:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if COMPUTE_DB:
            tl.store(db_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        for rb in range(pid, n_blocks, tl.num_programs(0)):
            rows = tl.cast(rb, tl.int64) * BLOCK_ROWS + row_ids
            row_mask = rows < n_rows
            mean = tl.load(mean_ptr + rows[:, None], mask=row_mask[:, None], other=0.0)
            rstd = tl.load(rstd_ptr + rows[:, None], mask=row_mask[:, None], other=0.0)
            # pass 1: mean(g) and mean(g * xhat)
            acc1 = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_H):
                c_, c_mask, mask = col_block(start, cols, n_cols, row_mask)
                x = tl.load(tile_ptrs(x_ptr, rows, x_row_stride, c_), mask=mask, other=0.0)
                dy = tl.load(tile_ptrs(dy_ptr, rows, dy_row_stride, c_), mask=mask, other=0.0)
                g = dy.to(tl.float32)
                if HAS_WEIGHT:
                    g = g * tl.load(w_ptr + c_, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                acc1 += g
                acc2 += g * tl.where(mask, (x.to(tl.float32) - mean) * rstd, 0.0)
            c1 = tl.sum(acc1, axis=1)[:, None] * inv_n_cols
            c2 = tl.sum(acc2, axis=1)[:, None] * inv_n_cols
            # pass 2, last block first: dx, and the partials of this program
            n_col_blocks = tl.cdiv(n_cols, BLOCK_H)
            for i in range(0, n_col_blocks):
                c_, c_mask, mask = col_block((n_col_blocks - 1 - i) * BLOCK_H, cols, n_cols, row_mask)
                x = tl.load(tile_ptrs(x_ptr, rows, x_row_stride, c_), mask=mask, other=0.0)
                dy = tl.load(tile_ptrs(dy_ptr, rows, dy_row_stride, c_), mask=mask, other=0.0)
                dy = dy.to(tl.float32)
                xhat = tl.where(mask, (x.to(tl.float32) - mean) * rstd, 0.0)
                g = dy
                if HAS_WEIGHT:
                    g = g * tl.load(w_ptr + c_, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                dx = (g - c1 - xhat * c2) * rstd
                store_dx(
                    dx,
                    tile_ptrs(dx_ptr, rows, dx_row_stride, c_),
                    tile_ptrs(dsum_ptr, rows, dsum_row_stride, c_),
                    mask,
                    HAS_DSUM,
                )
                if COMPUTE_DW:
                    accumulate_partial_row(dw_row, c_, c_mask, dy * xhat)
                if COMPUTE_DB:
                    accumulate_partial_row(db_row, c_, c_mask, dy)
