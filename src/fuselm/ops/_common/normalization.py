"""What the row normalizations (rms_norm, layer_norm) share: the checks of their arguments, the tile
plan of their kernels and the Triton helpers that walk those tiles.

A program holds BLOCK_ROWS rows x BLOCK_H columns. Rows of up to `max_fused` columns are held whole
(SINGLE_BLOCK, read once; several short rows share a program); longer rows are walked in column
blocks of `loop_block` (BLOCK_ROWS == 1). Each op keeps its own tuned constants (tile, elements per
warp, max_fused, loop_block) at the top of its op.py and passes them here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .dispatch import interpret_mode
from .guard import FLOAT_DTYPES, check_number, check_tensor, rows_shape
from .launch import cdiv, next_pow2, persistent_grid

MAX_BLOCK_ROWS = 64
# warps per program: tile elements / elems_per_warp, clamped to [MIN_WARPS, MAX_WARPS]
MIN_WARPS, MAX_WARPS = 4, 32
# the interpreter (CPU tests): rows longer than this are looped, in blocks of this many columns
INTERPRET_MAX_FUSED_H, INTERPRET_LOOP_BLOCK_H = 256, 512


def num_warps_for(tile: int, elems_per_warp: int) -> int:
    return max(MIN_WARPS, min(MAX_WARPS, tile // elems_per_warp))


def tile_config(
    n_rows: int, n_cols: int, tile: int, elems_per_warp: int, max_fused: int, loop_block: int
) -> tuple[bool, int, int, int]:
    """(row held in one block?, BLOCK_ROWS, BLOCK_H, num_warps) for rows of n_cols columns: a tile of
    about `tile` elements, one warp per `elems_per_warp` of them.

    Under the interpreter (numpy) rows longer than INTERPRET_MAX_FUSED_H are looped in blocks of
    INTERPRET_LOOP_BLOCK_H, so that CPU tests walk the looped path with short rows.
    """
    return _tile_config(
        int(n_rows), int(n_cols), tile, elems_per_warp, max_fused, loop_block, interpret_mode()
    )


@functools.lru_cache(maxsize=256)  # host time: called twice per forward + backward
def _tile_config(n_rows, n_cols, tile, elems_per_warp, fused, loop, interpret):
    if interpret:
        fused, loop = min(fused, INTERPRET_MAX_FUSED_H), min(loop, INTERPRET_LOOP_BLOCK_H)
    block_h = next_pow2(n_cols)
    if block_h > fused:  # walk the row in blocks
        block_h = min(block_h, loop)
        return False, 1, block_h, num_warps_for(block_h, elems_per_warp)
    block_rows = max(1, min(tile // block_h, MAX_BLOCK_ROWS, next_pow2(n_rows)))
    return True, block_rows, block_h, num_warps_for(block_rows * block_h, elems_per_warp)


def forward_plan(
    x, residual, tile: int, elems_per_warp: int, max_fused: int, loop_block: int, programs_per_sm: int
) -> tuple[int, bool, int, int, int]:
    """(grid, SINGLE_BLOCK, BLOCK_ROWS, BLOCK_H, num_warps) of a normalization's forward over the rows of x
    (launch_rows; residual None or rows like x, asserted): the tile plan of :func:`tile_config`, one program
    per block of rows, or ``programs_per_sm`` persistent programs per multiprocessor when that is > 0."""
    n_rows, n_cols = rows_shape(x)
    if residual is not None:
        assert residual.numel() == x.numel() and residual.dtype == x.dtype
        assert residual.stride(-1) == 1 or n_cols == 1
    single, block_rows, block_h, num_warps = tile_config(
        n_rows, n_cols, tile, elems_per_warp, max_fused, loop_block
    )
    n_blocks = cdiv(n_rows, block_rows)
    grid = n_blocks if programs_per_sm <= 0 else persistent_grid(n_blocks, x.device, programs_per_sm)
    return grid, single, block_rows, block_h, num_warps


_DTYPES = (*FLOAT_DTYPES, torch.float64)


def check_norm_args(x, params: dict, residual, eps) -> None:
    """ValueError naming the argument unless x is [..., H] (H > 0), each of `params` (name -> tensor
    or None) None or [H], residual None or like x, and eps a finite number >= 0."""
    check_tensor("x", x, dtypes=_DTYPES, min_ndim=1)
    n_cols = x.shape[-1]
    if n_cols == 0:
        raise ValueError(
            f"x must have a non-empty last dimension (the normalized one), got shape {tuple(x.shape)}"
        )
    for name, t in params.items():
        if t is not None:
            check_tensor(name, t, dtypes=_DTYPES, ndim=1, device=x.device)
            if t.shape[0] != n_cols:
                raise ValueError(f"{name} must have shape [{n_cols}] (x.shape[-1]), got {tuple(t.shape)}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
    if check_number("eps", eps) < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


# ---- Triton helpers of the kernels ----


@triton.jit
def load_norm_input(x_ptrs, r_ptrs, s_ptrs, mask, HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """The tile that is normalized, in fp32: x, or x + residual rounded to x's dtype (stored if asked)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if STORE_SUM:
            tl.store(s_ptrs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def col_block(start, cols, n_cols, row_mask):
    """Columns start + cols of a looped row: (columns, their mask [C], the tile's mask [R, C])."""
    c = start + cols
    c_mask = c < n_cols
    return c, c_mask, row_mask[:, None] & c_mask[None, :]


@triton.jit
def tile_ptrs(ptr, rows, row_stride, cols):
    """The pointers of the tile rows x cols [R, C] of a row-major tensor whose rows are row_stride apart."""
    return ptr + rows[:, None] * row_stride + cols[None, :]


@triton.jit
def store_dx(dx, dx_ptrs, ds_ptrs, mask, HAS_DSUM: tl.constexpr):
    """Store dx [+ the gradient of the residual sum, loaded here from ds_ptrs] in dx's dtype."""
    if HAS_DSUM:
        dx += tl.load(ds_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptrs, dx.to(dx_ptrs.dtype.element_ty), mask=mask)
