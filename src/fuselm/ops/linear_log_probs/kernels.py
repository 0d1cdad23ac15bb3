"""Triton kernels of linear_log_probs. The math is in README.md; reference.py holds the same per-row
functions in PyTorch (row_statistics, row_logit_grad); the logit transform and the softmax gradient are
the family's (ops/_common/loss/row_math.py).

Forward: per vocabulary slab, programs of BLOCK_N rows read the slab's fp32 logits once and fold them
into every requested statistic, online over column blocks and over slabs (base-2 exponentials around
the running max; the per-row state crosses slabs in an fp32 [8, N] buffer).
Backward: one program per (row, column block) of a vocabulary slab's logits: one read, one write in
place of d/d(raw logits).
"""

import triton
import triton.language as tl

from .._common.loss.row_math import LN2, LOG2E, softmax_grad, transform


@triton.jit
def _row_stats_block(
    z,
    cols,
    mask,
    target,
    m2,
    s,
    sd,
    sq,
    z_sum,
    z_max,
    before,
    z_t,
    HAS_ENTROPY: tl.constexpr,
    HAS_SUM_SQ: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr,
):
    """Fold one block of logits z [BLOCK_N, BLOCK_V] (fp32; columns outside `mask` ignored) into the online
    statistics of its rows ([BLOCK_N] each): m2 = max_j z_j * log2(e); s = sum_j 2^(t_j) with
    t_j = z_j log2(e) - m2; sd = sum_j 2^(t_j) t_j; sq = sum_j 4^(t_j); z_sum = sum_j z_j; z_max = max_j z_j;
    before = max of z_j over j < target; z_t = z_target. cols [BLOCK_V] and target [BLOCK_N] are class ids
    counted from the same first class."""
    z = tl.where(mask, z, float("-inf"))
    x2 = z * LOG2E
    m2_new = tl.maximum(m2, tl.max(x2, axis=1))
    delta = tl.where(m2 == float("-inf"), 0.0, m2 - m2_new)  # first block: s = sd = sq = 0 anyway
    alpha = tl.exp2(delta)
    t = x2 - m2_new[:, None]
    e = tl.exp2(t)  # 0 on masked columns
    if HAS_ENTROPY:
        sd = (sd + s * delta) * alpha + tl.sum(e * tl.where(mask, t, 0.0), axis=1)
    if HAS_SUM_SQ:
        sq = sq * alpha * alpha + tl.sum(e * e, axis=1)
    s = s * alpha + tl.sum(e, axis=1)
    if HAS_MEAN:
        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
    if HAS_TOP1:
        z_max = tl.maximum(z_max, tl.max(z, axis=1))
        before = tl.maximum(
            before, tl.max(tl.where(cols[None, :] < target[:, None], z, float("-inf")), axis=1)
        )
    z_t += tl.sum(tl.where((cols[None, :] == target[:, None]) & mask, z, 0.0), axis=1)  # a target past the
    # slab's end may equal a masked column id of its last block
    return m2_new, s, sd, sq, z_sum, z_max, before, z_t


@triton.jit
def _row_logit_grad_block(
    z,
    is_target,
    lse,
    entropy,
    dlog_probs,
    dentropy,
    dlse,
    HAS_DENTROPY: tl.constexpr,
):
    """d(a log_probs + e entropy + l lse) / dz on a block of logits z [BLOCK_N, BLOCK_V] (fp32) from each
    row's lse and entropy ([BLOCK_N, 1]; a, e, l likewise): a (1[j = t] - p_j) + l p_j - e p_j (log p_j +
    entropy), with p_j = exp(z_j - lse)."""
    log_p = z - lse
    p = tl.exp2(log_p * LOG2E)
    g = softmax_grad(p, is_target, dlse - dlog_probs, -dlog_probs)
    if HAS_DENTROPY:
        g -= (dentropy * p) * (log_p + entropy)
    return g


@triton.jit
def linear_log_probs_fwd_kernel(
    logits_ptr,
    logits_row_stride,
    bias_ptr,
    target_ptr,
    state_ptr,
    log_probs_ptr,
    entropy_ptr,
    lse_ptr,
    log_sum_sq_ptr,
    mean_ptr,
    top1_ptr,
    n_rows,
    n_cols,
    col_offset,
    n_classes,
    ignore_index,
    logit_scale,
    softcap,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_SUM_SQ: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr,
    IS_FIRST: tl.constexpr,
    IS_LAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Fold BLOCK_N rows of a vocabulary slab's raw logits (fp32 [n_rows, n_cols], classes col_offset ..
    col_offset + n_cols of n_classes, bias not yet added) into each row's online statistics, each logit
    read once. The statistics of the slabs before are read from state [8, n_rows] (unless IS_FIRST) and
    written back for the next slab (unless IS_LAST); after the last slab the outputs are written: ignored
    rows get 0 (False) everywhere, a row whose target is outside [0, n_classes) a NaN log_probs and 0
    elsewhere."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    local = target - col_offset
    u_rows = logits_ptr + rows[:, None] * logits_row_stride  # [BLOCK_N, 1]
    cols = tl.arange(0, BLOCK_V)
    if IS_FIRST:
        m2 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        sd = tl.zeros((BLOCK_N,), tl.float32)
        sq = tl.zeros((BLOCK_N,), tl.float32)
        z_sum = tl.zeros((BLOCK_N,), tl.float32)
        z_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        before = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        z_t = tl.zeros((BLOCK_N,), tl.float32)
    else:
        m2 = tl.load(state_ptr + rows, mask=row_mask, other=0.0)
        s = tl.load(state_ptr + n_rows + rows, mask=row_mask, other=0.0)
        sd = tl.load(state_ptr + 2 * n_rows + rows, mask=row_mask, other=0.0)
        sq = tl.load(state_ptr + 3 * n_rows + rows, mask=row_mask, other=0.0)
        z_sum = tl.load(state_ptr + 4 * n_rows + rows, mask=row_mask, other=0.0)
        z_max = tl.load(state_ptr + 5 * n_rows + rows, mask=row_mask, other=0.0)
        before = tl.load(state_ptr + 6 * n_rows + rows, mask=row_mask, other=0.0)
        z_t = tl.load(state_ptr + 7 * n_rows + rows, mask=row_mask, other=0.0)
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        mask = (c < n_cols)[None, :] & (rows >= 0)[:, None]  # [BLOCK_N, BLOCK_V]
        u = tl.load(
            u_rows + c[None, :], mask=mask & row_mask[:, None], other=0.0, eviction_policy="evict_first"
        )
        if HAS_BIAS:
            u += tl.load(bias_ptr + col_offset + c, mask=c < n_cols, other=0.0).to(tl.float32)[None, :]
        z, _ = transform(u, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
        m2, s, sd, sq, z_sum, z_max, before, z_t = _row_stats_block(
            z,
            c,
            mask,
            local,
            m2,
            s,
            sd,
            sq,
            z_sum,
            z_max,
            before,
            z_t,
            HAS_ENTROPY,
            HAS_SUM_SQ,
            HAS_MEAN,
            HAS_TOP1,
        )
    if IS_LAST:
        in_range = (target >= 0) & (target < n_classes)
        valid = (target != ignore_index) & in_range
        bad = (target != ignore_index) & (in_range == 0)
        log_s = tl.log(s)
        lse = m2 * LN2 + log_s
        log_probs = tl.where(valid, z_t - lse, 0.0)
        tl.store(log_probs_ptr + rows, tl.where(bad, float("nan"), log_probs), mask=row_mask)
        tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=row_mask)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + rows, tl.where(valid, log_s - sd * LN2 / s, 0.0), mask=row_mask)
        if HAS_SUM_SQ:
            tl.store(log_sum_sq_ptr + rows, tl.where(valid, tl.log(sq) - 2.0 * log_s, 0.0), mask=row_mask)
        if HAS_MEAN:
            tl.store(mean_ptr + rows, tl.where(valid, z_sum / n_classes, 0.0), mask=row_mask)
        if HAS_TOP1:
            tl.store(top1_ptr + rows, valid & (z_t >= z_max) & (z_t > before), mask=row_mask)
    else:
        tl.store(state_ptr + rows, m2, mask=row_mask)
        tl.store(state_ptr + n_rows + rows, s, mask=row_mask)
        tl.store(state_ptr + 2 * n_rows + rows, sd, mask=row_mask)
        tl.store(state_ptr + 3 * n_rows + rows, sq, mask=row_mask)
        tl.store(state_ptr + 4 * n_rows + rows, z_sum, mask=row_mask)
        tl.store(state_ptr + 5 * n_rows + rows, z_max, mask=row_mask)
        tl.store(state_ptr + 6 * n_rows + rows, before, mask=row_mask)
        tl.store(state_ptr + 7 * n_rows + rows, z_t, mask=row_mask)


@triton.jit
def linear_log_probs_bwd_kernel(
    logits_ptr,
    logits_row_stride,
    bias_ptr,
    target_ptr,
    lse_ptr,
    entropy_ptr,
    dlog_probs_ptr,
    dentropy_ptr,
    dlse_ptr,
    n_rows,
    n_cols,
    col_offset,
    n_classes,
    ignore_index,
    logit_scale,
    softcap,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DLOG_PROBS: tl.constexpr,
    HAS_DENTROPY: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_V] tile of a vocabulary slab (classes col_offset .. col_offset + n_cols of
    n_classes): raw logits in, d(sum of upstream * outputs)/d(raw logits) out, in place, in the buffer's
    dtype. Ignored rows and out-of-range targets get 0."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    ptr = logits_ptr + rows[:, None] * logits_row_stride + cols[None, :]
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = (target != ignore_index) & (target >= 0) & (target < n_classes)
    u = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_BIAS:
        u += tl.load(bias_ptr + col_offset + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    z, dz_du = transform(u, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
    dlog_probs = tl.zeros((BLOCK_N,), tl.float32)
    dentropy = tl.zeros((BLOCK_N,), tl.float32)
    dlse = tl.zeros((BLOCK_N,), tl.float32)
    entropy = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_DLOG_PROBS:
        dlog_probs = tl.load(dlog_probs_ptr + rows, mask=row_mask, other=0.0)
    if HAS_DENTROPY:
        dentropy = tl.load(dentropy_ptr + rows, mask=row_mask, other=0.0)
        entropy = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)
    if HAS_DLSE:
        dlse = tl.load(dlse_ptr + rows, mask=row_mask, other=0.0)
    g = _row_logit_grad_block(
        z,
        cols[None, :] == (target - col_offset)[:, None],
        tl.load(lse_ptr + rows, mask=row_mask, other=0.0)[:, None],
        entropy[:, None],
        dlog_probs[:, None],
        dentropy[:, None],
        dlse[:, None],
        HAS_DENTROPY,
    )
    g = tl.where(valid[:, None], g * dz_du, 0.0)
    tl.store(ptr, g.to(logits_ptr.dtype.element_ty), mask=mask)
