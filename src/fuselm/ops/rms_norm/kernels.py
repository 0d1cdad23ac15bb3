"""Triton kernels of RMSNorm, optionally fused with the residual add. The math is in README.md.

A program holds a tile of BLOCK_ROWS rows x BLOCK_H columns. Rows that fit one block
(SINGLE_BLOCK) are read once and stay in registers; several short rows share a program. Longer
rows (BLOCK_ROWS == 1) are walked in column blocks twice, the second walk in reverse order so that
it starts with the part most likely still in L2.

The backward is persistent: each program walks row blocks pid, pid + grid, ... and keeps its
share of dweight in fp32 registers, written once at the end into a [programs, H] fp32 buffer that
ops/_common/partial_sums.py sums over the programs (no atomics, deterministic). The tile plan and the
helpers shared with layer_norm are in ops/_common/normalization.py.
"""

import triton
import triton.language as tl

from .._common.normalization import col_block, load_norm_input, store_dx, tile_ptrs
from .._common.partial_sums import accumulate_partial_row

# casting modes (the `casting` argument): where the PyTorch code being reproduced rounds
CAST_LLAMA = tl.constexpr(0)  # fp32 statistics, x * rstd rounded to x's dtype, then * weight
CAST_GEMMA = tl.constexpr(1)  # everything in fp32, rounded once at the end
CAST_NONE = tl.constexpr(2)  # every step rounded to x's dtype


@triton.jit
def _load_scale(w_ptr, cols, mask, offset, x_ptr, CASTING: tl.constexpr):
    """offset + weight as fp32 [BLOCK_H], rounded where the casting mode's PyTorch code rounds it."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if CASTING == CAST_NONE:
        x_dtype = x_ptr.dtype.element_ty
        scale = (w.to(x_dtype).to(tl.float32) + offset).to(x_dtype).to(tl.float32)
    elif CASTING == CAST_LLAMA:
        scale = (w.to(tl.float32) + offset).to(w.dtype).to(tl.float32)  # (offset + w) in w's dtype
    else:
        scale = w.to(tl.float32) + offset
    return scale


@triton.jit
def _normalize(s, mean_sq, rstd, scale, eps, x_ptr, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """y in fp32 from s [R, C], mean_sq and rstd [R, 1], scale [C]; rounded like the casting mode."""
    x_dtype = x_ptr.dtype.element_ty
    if CASTING == CAST_NONE:
        var = mean_sq.to(x_dtype).to(tl.float32)
        r = tl.math.rsqrt((var + eps).to(x_dtype).to(tl.float32)).to(x_dtype).to(tl.float32)
        y = (s * r).to(x_dtype).to(tl.float32)
        if HAS_WEIGHT:
            y = (y * scale[None, :]).to(x_dtype).to(tl.float32)
    else:
        y = s * rstd
        if CASTING == CAST_LLAMA:
            y = y.to(x_dtype).to(tl.float32)
        if HAS_WEIGHT:
            y = y * scale[None, :]
    return y


@triton.jit
def _bwd_tile(x_ptrs, dy_ptrs, ds_ptrs, rstd_ptrs, row_mask, col_mask, HAS_DSUM: tl.constexpr):
    """x, dy, d sum [R, C] (as stored) and rstd [R, 1] of one row block (masked off past the last row)."""
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0)
    if HAS_DSUM:
        ds = tl.load(ds_ptrs, mask=mask, other=0.0)
    else:
        ds = dy
    rstd = tl.load(rstd_ptrs, mask=row_mask[:, None], other=0.0)
    return x, dy, ds, rstd


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    res_ptr,
    res_row_stride,
    w_ptr,
    y_ptr,
    y_row_stride,
    sum_ptr,
    sum_row_stride,
    rstd_ptr,
    n_rows,
    n_cols,
    inv_n_cols,
    eps,
    offset,
    CASTING: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """y = normalize(x [+ residual]) * scale; the sum (if residual) and rstd (fp32) are stored too."""
    n_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ids = tl.arange(0, BLOCK_ROWS)
    if SINGLE_BLOCK:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            scale = _load_scale(w_ptr, cols, col_mask, offset, x_ptr, CASTING)  # [BLOCK_H], once
        else:
            scale = col_mask
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
            mean_sq = tl.sum(s * s, axis=1)[:, None] * inv_n_cols  # [BLOCK_ROWS, 1]
            rstd = tl.math.rsqrt(mean_sq + eps)
            tl.store(rstd_ptr + rows[:, None], rstd, mask=row_mask[:, None])
            y = _normalize(s, mean_sq, rstd, scale, eps, x_ptr, CASTING, HAS_WEIGHT)
            y_ptrs = tile_ptrs(y_ptr, rows, y_row_stride, cols)
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # pass 1: sum of squares (and the residual sum, stored)
            acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_H):
                c, _, mask = col_block(start, cols, n_cols, row_mask)
                s = load_norm_input(
                    tile_ptrs(x_ptr, rows, x_row_stride, c),
                    tile_ptrs(res_ptr, rows, res_row_stride, c),
                    tile_ptrs(sum_ptr, rows, sum_row_stride, c),
                    mask,
                    HAS_RESIDUAL,
                    True,
                )
                acc += s * s
            mean_sq = tl.sum(acc, axis=1)[:, None] * inv_n_cols
            rstd = tl.math.rsqrt(mean_sq + eps)
            tl.store(rstd_ptr + rows[:, None], rstd, mask=row_mask[:, None])
            # pass 2, last block first: normalize and store
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
                if HAS_WEIGHT:
                    scale = _load_scale(w_ptr, c, c_mask, offset, x_ptr, CASTING)
                else:
                    scale = c_mask
                y = _normalize(s, mean_sq, rstd, scale, eps, x_ptr, CASTING, HAS_WEIGHT)
                y_ptrs = tile_ptrs(y_ptr, rows, y_row_stride, c)
                tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    x_ptr,
    x_row_stride,
    dy_ptr,
    dy_row_stride,
    dsum_ptr,
    dsum_row_stride,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dx_row_stride,
    dw_part_ptr,
    n_rows,
    n_cols,
    inv_n_cols,
    eps,
    offset,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IN_PLACE: tl.constexpr = False,
):
    """dx = rstd * (g - n * mean(g * n)) [+ dsum] with n = x * rstd, g = dy * (offset + w); this
    program's share of dweight = sum over its rows of dy * n, into dw_part[pid] (fp32).
    x is what was normalized (the residual sum when there was one). Longer rows (not SINGLE_BLOCK)
    add their dweight share into dw_part[pid] block by block (the buffer is zeroed by the caller).
    PREFETCH (single block): the loads of the next row block are issued before the current one is
    computed, so that a program keeps two row blocks in flight (latency hiding at low occupancy).
    IN_PLACE: dx_ptr is dy_ptr with dx_row_stride == dy_row_stride (dx written over dy; d sum may be dy
    too). Safe because a row block belongs to one program, which reads every element of it (dy, d sum)
    before writing dx there: the prefetch reads row block rb + programs, which this same program writes
    only in its next iteration; a looped row reads all of dy in pass 1, and pass 2 writes a column
    block only after reading it, never reading it again; dweight comes from dy in registers. What is
    left is a thread writing dx over an element that another thread of the program (a replica in a
    layout wider than the tile) has yet to load: a barrier before each store of dx."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ids = tl.arange(0, BLOCK_ROWS)
    part_row = dw_part_ptr + tl.cast(pid, tl.int64) * n_cols
    if SINGLE_BLOCK:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            scale = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        n_programs = tl.num_programs(0)
        if PREFETCH:  # the first row block; each iteration then loads the next one before computing
            r = tl.cast(pid, tl.int64) * BLOCK_ROWS + row_ids
            x_n, dy_n, ds_n, rstd_n = _bwd_tile(
                tile_ptrs(x_ptr, r, x_row_stride, cols),
                tile_ptrs(dy_ptr, r, dy_row_stride, cols),
                tile_ptrs(dsum_ptr, r, dsum_row_stride, cols),
                rstd_ptr + r[:, None],
                r < n_rows,
                col_mask,
                HAS_DSUM,
            )
        for rb in range(pid, n_blocks, n_programs):
            if PREFETCH:  # compute the row block loaded by the previous iteration, load the next one
                x, dy, ds, rstd = x_n, dy_n, ds_n, rstd_n
            r = tl.cast(rb + n_programs if PREFETCH else rb, tl.int64) * BLOCK_ROWS + row_ids
            x_n, dy_n, ds_n, rstd_n = _bwd_tile(
                tile_ptrs(x_ptr, r, x_row_stride, cols),
                tile_ptrs(dy_ptr, r, dy_row_stride, cols),
                tile_ptrs(dsum_ptr, r, dsum_row_stride, cols),
                rstd_ptr + r[:, None],
                r < n_rows,
                col_mask,
                HAS_DSUM,
            )
            if not PREFETCH:  # the row block just loaded is this one
                x, dy, ds, rstd = x_n, dy_n, ds_n, rstd_n
            rows = tl.cast(rb, tl.int64) * BLOCK_ROWS + row_ids
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            dy = dy.to(tl.float32)
            n = x.to(tl.float32) * rstd
            if HAS_WEIGHT:
                g = dy * scale[None, :]
            else:
                g = dy
            if n_cols == 1:
                # n = +-(1 - O(eps)): g - n * c = g * (1 - n**2) = g * eps * rstd**2 without the cancellation
                dx = g * (eps * rstd * rstd) * rstd
            else:
                c = tl.sum(g * n, axis=1)[:, None] * inv_n_cols
                dx = (g - n * c) * rstd
            if HAS_DSUM:
                dx += ds.to(tl.float32)
            if IN_PLACE:  # every thread has loaded this row block's dy (and d sum) before it is overwritten
                tl.debug_barrier()
            dx_ptrs = tile_ptrs(dx_ptr, rows, dx_row_stride, cols)
            tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += dy * n
        if COMPUTE_DW:
            tl.store(part_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        for rb in range(pid, n_blocks, tl.num_programs(0)):
            rows = tl.cast(rb, tl.int64) * BLOCK_ROWS + row_ids
            row_mask = rows < n_rows
            rstd = tl.load(rstd_ptr + rows[:, None], mask=row_mask[:, None], other=0.0)
            # pass 1: c = mean(g * n)
            acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_H):
                c_, c_mask, mask = col_block(start, cols, n_cols, row_mask)
                x = tl.load(tile_ptrs(x_ptr, rows, x_row_stride, c_), mask=mask, other=0.0)
                dy = tl.load(tile_ptrs(dy_ptr, rows, dy_row_stride, c_), mask=mask, other=0.0)
                g = dy.to(tl.float32)
                if HAS_WEIGHT:
                    g = g * (tl.load(w_ptr + c_, mask=c_mask, other=0.0).to(tl.float32) + offset)[None, :]
                acc += g * (x.to(tl.float32) * rstd)
            c = tl.sum(acc, axis=1)[:, None] * inv_n_cols
            # pass 2, last block first: dx, and dweight into this program's partial row
            n_col_blocks = tl.cdiv(n_cols, BLOCK_H)
            for i in range(0, n_col_blocks):
                c_, c_mask, mask = col_block((n_col_blocks - 1 - i) * BLOCK_H, cols, n_cols, row_mask)
                x = tl.load(tile_ptrs(x_ptr, rows, x_row_stride, c_), mask=mask, other=0.0)
                dy = tl.load(tile_ptrs(dy_ptr, rows, dy_row_stride, c_), mask=mask, other=0.0)
                dy = dy.to(tl.float32)
                n = x.to(tl.float32) * rstd
                g = dy
                if HAS_WEIGHT:
                    g = g * (tl.load(w_ptr + c_, mask=c_mask, other=0.0).to(tl.float32) + offset)[None, :]
                dx = (g - n * c) * rstd
                if IN_PLACE:  # d sum (possibly dy itself) loaded by every thread, then the barrier, then dx
                    if HAS_DSUM:
                        ds_ptrs = tile_ptrs(dsum_ptr, rows, dsum_row_stride, c_)
                        dx += tl.load(ds_ptrs, mask=mask, other=0.0).to(tl.float32)
                    tl.debug_barrier()
                    dx_ptrs = tile_ptrs(dx_ptr, rows, dx_row_stride, c_)
                    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                else:
                    store_dx(
                        dx,
                        tile_ptrs(dx_ptr, rows, dx_row_stride, c_),
                        tile_ptrs(dsum_ptr, rows, dsum_row_stride, c_),
                        mask,
                        HAS_DSUM,
                    )
                if COMPUTE_DW:
                    accumulate_partial_row(part_row, c_, c_mask, dy * n)
