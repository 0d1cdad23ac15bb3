"""The one kernel only a vocabulary shard needs: per-row statistics of its slice of the classes. The
gradient of a slice is the family's row backward kernel with the slice's class offset
(ops/_common/loss/rows.py)."""

import triton
import triton.language as tl

from ..ops._common.loss.row_math import LOG2E, online_lse_step, softcapped


@triton.jit
def shard_stats_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    weight_ptr,
    stats_ptr,
    n_rows,
    n_cols,
    col_offset,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Statistics of one row of a vocabulary shard (classes col_offset .. col_offset + n_cols), into
    stats [3, n_rows] fp32: lse over the shard (-inf for an empty one), the target logit when the
    shard holds the target (else 0), sum_j w_j z_j over the shard (0 without smoothing). Ranks
    combine them (logsumexp, sum, sum) into the row's global statistics."""
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * logits_row_stride
    cols = tl.arange(0, BLOCK_V)
    m2 = float("-inf")
    s = 0.0
    smooth_dot = 0.0
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        mask = c < n_cols
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, softcapped(x, softcap, HAS_SOFTCAP)[0], float("-inf"))
        m2, s = online_lse_step(m2, s, z)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + col_offset + c, mask=mask, other=0.0).to(tl.float32)
                smooth_dot += tl.sum(tl.where(mask, w * z, 0.0), axis=0)
            else:
                smooth_dot += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m2 / LOG2E + tl.log(s)
    local = tl.load(target_ptr + row).to(tl.int64) - col_offset
    owned = (local >= 0) & (local < n_cols)
    x_t = tl.load(x_row + tl.where(owned, local, 0), mask=owned, other=0.0).to(tl.float32)
    z_t = tl.where(owned, softcapped(x_t, softcap, HAS_SOFTCAP)[0], 0.0)
    tl.store(stats_ptr + row, lse)
    tl.store(stats_ptr + n_rows + row, z_t)
    tl.store(stats_ptr + 2 * n_rows + row, smooth_dot)
