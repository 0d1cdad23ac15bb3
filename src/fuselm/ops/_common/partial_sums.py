"""Deterministic column sums without atomics: per-program partial rows, summed by one small kernel.

A persistent kernel that reduces over its rows (the weight and bias gradients of rms_norm and
layer_norm) gives each program one fp32 row of a [programs, H] buffer: single-block programs store
their row once (`tl.store(part_row + cols, ...)`), programs that walk a row in column blocks add into
it block by block (`accumulate_partial_row`, the buffer zeroed by the caller). `reduce_partials_`
then sums the rows into the parameter's dtype: fixed order, so the same result on every run. Two such
buffers (layer_norm's dweight and dbias) are summed by one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import interpret_mode
from .launch import cdiv, launcher

# reduction of the partials: BLOCK_P partial rows x BLOCK_C columns per step
REDUCE_BLOCK_P, REDUCE_BLOCK_C, REDUCE_WARPS = 128, 32, 4
INTERPRET_REDUCE_BLOCK_C = 1024


@triton.jit
def accumulate_partial_row(part_row, cols, col_mask, values):
    """part_row[cols] += the column sums of values [R, C] (fp32)."""
    part = tl.load(part_row + cols, mask=col_mask, other=0.0)
    tl.store(part_row + cols, part + tl.sum(values, axis=0), mask=col_mask)


@triton.jit
def reduce_partials_kernel(
    part_ptr,
    out_ptr,
    out2_ptr,
    n_parts,
    n_cols,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PAIR: tl.constexpr,
):
    """out[c] = sum_p part[p, c] (fp32 sums, stored in out's dtype). PAIR: part holds two [P, C] buffers
    one after the other; programs of axis 1 = 1 sum the second into out2."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    second = False
    if PAIR:
        second = tl.program_id(1) == 1
    if second:
        part_ptr += tl.cast(n_parts, tl.int64) * n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        p = tl.cast(start, tl.int64) + tl.arange(0, BLOCK_P)
        mask = (p < n_parts)[:, None] & col_mask[None, :]
        acc += tl.load(part_ptr + p[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if second:
        tl.store(out2_ptr + cols, total.to(out2_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


reduce_partials_launch = launcher(reduce_partials_kernel)


def reduce_partials_(part: torch.Tensor, out: torch.Tensor, out2: torch.Tensor | None = None):
    """out[:] = part.sum(0) (fp32 sums, stored in out's dtype); part [P, H] fp32 contiguous, out [H].
    With out2: part [2, P, H], out = part[0].sum(0) and out2 = part[1].sum(0) in one launch; returns
    (out, out2)."""
    n_parts, n_cols = part.shape[-2:]
    block_c = INTERPRET_REDUCE_BLOCK_C if interpret_mode() else REDUCE_BLOCK_C
    pair = out2 is not None
    reduce_partials_launch(
        (cdiv(n_cols, block_c), 2 if pair else 1),
        part_ptr=part,
        out_ptr=out,
        out2_ptr=out2 if pair else out,
        n_parts=n_parts,
        n_cols=n_cols,
        BLOCK_P=REDUCE_BLOCK_P,
        BLOCK_C=block_c,
        PAIR=pair,
        num_warps=REDUCE_WARPS,
    )
    return (out, out2) if pair else out
