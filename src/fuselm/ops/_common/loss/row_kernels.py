"""The row kernels of the cross-entropy family: rows of logits in, per-row loss and lse out, and
d loss / d logits (in place or into another buffer). fuselm.cross_entropy runs them on its input, the
chunked plan of fuselm.linear_cross_entropy on each chunk's logits, a vocabulary shard
(fuselm.distributed) with the class offset of its slice. The per-row math is row_math.py; the loss
formula is in ops/cross_entropy/README.md.

One program per row. The forward walks the row once for the statistics (online max and
sum of exp) and, when the gradient is computed in the forward, once more to write it;
the second read hits L2 because a row (<= 256 KiB in bf16 for V = 128k) is read again at once.
Rows that fit one block are read once.
"""

import triton
import triton.language as tl

from .row_math import LOG2E, loss_grad_coefs, loss_logit_grad, online_lse_step, row_loss, softcapped


@triton.jit
def _row_grad_block(
    x,
    g_row,
    cols,
    n_cols,
    target,
    lse,
    p_coef,
    t_coef,
    s_coef,
    weight_ptr,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Write d(loss * scale)/dx of one block of a row (raw logits x) to g_row + cols."""
    mask = cols < n_cols
    z, dz_dx = softcapped(x.to(tl.float32), softcap, HAS_SOFTCAP)
    w = 1.0
    if HAS_SMOOTHING and HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    g = loss_logit_grad(z, dz_dx, lse, cols == target, p_coef, t_coef, s_coef, w, HAS_SMOOTHING, HAS_SOFTCAP)
    tl.store(g_row + cols, g.to(g_row.dtype.element_ty), mask=mask, eviction_policy="evict_first")


@triton.jit
def _load_row_block(x_row, cols, n_cols, EVICT: tl.constexpr):
    return tl.load(x_row + cols, mask=cols < n_cols, other=0.0, eviction_policy=EVICT)


@triton.jit
def cross_entropy_fwd_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    weight_ptr,
    weight_sum_ptr,
    grad_ptr,
    grad_row_stride,
    grad_scale_ptr,
    token_weight_ptr,
    loss_ptr,
    lse_ptr,
    predicted_ptr,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TOKEN_WEIGHT: tl.constexpr,
    HAS_PREDICTED: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FIND_SCALES: tl.constexpr = False,
    MEAN: tl.constexpr = False,
    WEIGHT_SUM: tl.constexpr = False,
):
    """FIND_SCALES: grad_scale_ptr (and weight_sum_ptr for WEIGHT_SUM) are not written yet: every program
    computes them from the targets (what loss_scales_kernel does, for a batch small enough that reading
    every target once per program costs less than a launch) and program 0 stores them."""
    if FIND_SCALES:
        grad_scale, weight_sum_all = batch_scale_values(
            target_ptr, weight_ptr, n_rows, n_cols, ignore_index, HAS_WEIGHT, MEAN, WEIGHT_SUM, 1024
        )
        if tl.program_id(0) == 0:
            tl.store(grad_scale_ptr, grad_scale)
            if WEIGHT_SUM:
                tl.store(weight_sum_ptr, weight_sum_all)
    else:
        grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
        weight_sum_all = 0.0
        if HAS_WEIGHT and HAS_SMOOTHING:
            weight_sum_all = tl.load(weight_sum_ptr).to(tl.float32)
    # persistent grid: a program walks rows pid, pid + grid, ... (bounds the rows in flight, so the
    # second read of a row hits L2)
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        x_row = logits_ptr + row * logits_row_stride
        target = tl.load(target_ptr + row).to(tl.int64)
        valid = target != ignore_index
        in_range = (target >= 0) & (target < n_cols)
        cols = tl.arange(0, BLOCK_V)

        # pass 1: lse = m + log(s), and sum_j w_j z_j for label smoothing   # [BLOCK_V] tiles
        smooth_dot = 0.0
        best = float("-inf")  # argmax of the raw logits (HAS_PREDICTED): the first maximal class
        best_col = 0
        if SINGLE_BLOCK:
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_PREDICTED:
                best_col = tl.argmax(tl.where(mask, x, float("-inf")), axis=0)
            z = tl.where(mask, softcapped(x, softcap, HAS_SOFTCAP)[0], float("-inf"))
            m = tl.max(z, axis=0)
            s = tl.sum(tl.exp(z - m), axis=0)
            if HAS_SMOOTHING:
                if HAS_WEIGHT:
                    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                    smooth_dot = tl.sum(tl.where(mask, w * z, 0.0), axis=0)
                else:
                    smooth_dot = tl.sum(tl.where(mask, z, 0.0), axis=0)
        else:
            # online softmax in base 2 (exp2(x * log2e - m2) is one FMA and one MUFU op per logit)
            m2 = float("-inf")
            s = 0.0
            for start in range(0, n_cols, BLOCK_V):
                c = start + cols
                x = tl.load(x_row + c, mask=c < n_cols, other=float("-inf"), eviction_policy="evict_last")
                z = x.to(tl.float32)
                if HAS_SOFTCAP:
                    z = tl.where(c < n_cols, softcapped(z, softcap, HAS_SOFTCAP)[0], float("-inf"))
                m2, s = online_lse_step(m2, s, z)
                if HAS_PREDICTED:  # x is -inf past the row's end
                    block_best = tl.max(x.to(tl.float32), axis=0)
                    block_col = start + tl.argmax(x.to(tl.float32), axis=0)
                    best_col = tl.where(block_best > best, block_col, best_col)
                    best = tl.maximum(best, block_best)
                if HAS_SMOOTHING:
                    if HAS_WEIGHT:
                        w = tl.load(weight_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
                        smooth_dot += tl.sum(tl.where(c < n_cols, w * z, 0.0), axis=0)
                    else:
                        smooth_dot += tl.sum(tl.where(c < n_cols, z, 0.0), axis=0)
            m = m2 / LOG2E
        lse = m + tl.log(s)

        # per-row loss
        t_safe = tl.where(valid & in_range, target, 0)
        z_t = softcapped(tl.load(x_row + t_safe).to(tl.float32), softcap, HAS_SOFTCAP)[0]
        w_t = 1.0
        weight_sum = n_cols * 1.0
        if HAS_WEIGHT:
            w_t = tl.load(weight_ptr + t_safe).to(tl.float32)
            if HAS_SMOOTHING:
                weight_sum = weight_sum_all
        loss = row_loss(
            lse,
            z_t,
            smooth_dot,
            w_t,
            weight_sum,
            valid,
            in_range,
            label_smoothing,
            z_loss,
            n_cols,
            HAS_SMOOTHING,
            HAS_Z_LOSS,
        )
        token_weight = 1.0
        if HAS_TOKEN_WEIGHT:  # multiplies the loss of a row that has one (ignored rows stay 0, bad ones NaN)
            token_weight = tl.load(token_weight_ptr + row).to(tl.float32)
            loss = tl.where(valid & in_range, loss * token_weight, loss)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
        if HAS_PREDICTED:  # -1 for an ignored row
            tl.store(predicted_ptr + row, tl.where(valid, best_col.to(tl.int64), -1))

        # pass 2: gradient of loss * grad_scale (zero on rows with an out-of-range target)
        if COMPUTE_GRAD:
            # every warp has read z_t before any warp overwrites the row with the gradient (in place):
            # without this barrier a late z_t read lost that race on an H200 (fp32, long rows)
            tl.debug_barrier()
            scale = grad_scale * token_weight
            p_coef, target_coef, smooth_coef = loss_grad_coefs(
                w_t,
                weight_sum,
                lse,
                scale,
                valid & in_range,
                label_smoothing,
                z_loss,
                n_cols,
                HAS_SMOOTHING,
                HAS_Z_LOSS,
            )
            g_row = grad_ptr + row * grad_row_stride
            if SINGLE_BLOCK:
                _row_grad_block(
                    x,
                    g_row,
                    cols,
                    n_cols,
                    target,
                    lse,
                    p_coef,
                    target_coef,
                    smooth_coef,
                    weight_ptr,
                    softcap,
                    HAS_WEIGHT,
                    HAS_SMOOTHING,
                    HAS_SOFTCAP,
                )
            else:
                # last block first: the end of the row is the part most likely still in L2
                for i in range(0, tl.cdiv(n_cols, BLOCK_V)):
                    c = (tl.cdiv(n_cols, BLOCK_V) - 1 - i) * BLOCK_V + cols
                    _row_grad_block(
                        _load_row_block(x_row, c, n_cols, "evict_first"),
                        g_row,
                        c,
                        n_cols,
                        target,
                        lse,
                        p_coef,
                        target_coef,
                        smooth_coef,
                        weight_ptr,
                        softcap,
                        HAS_WEIGHT,
                        HAS_SMOOTHING,
                        HAS_SOFTCAP,
                    )


@triton.jit
def cross_entropy_bwd_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    weight_ptr,
    weight_sum_ptr,
    grad_ptr,
    grad_row_stride,
    grad_scale_ptr,
    token_weight_ptr,
    dloss_ptr,
    dloss_stride,
    dlse_ptr,
    lse_ptr,
    n_cols,
    col_offset,
    n_classes,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TOKEN_WEIGHT: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Gradient from saved lse: one read of the logits, one write of the gradient.

    The row holds classes col_offset .. col_offset + n_cols of n_classes (a vocabulary shard; the
    whole row when col_offset == 0 and n_classes == n_cols); target, weight and lse are global."""
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row).to(tl.int64)
    ok = (target != ignore_index) & (target >= 0) & (target < n_classes)  # a row with a loss gradient
    lse = tl.load(lse_ptr + row)
    scale = tl.load(grad_scale_ptr).to(tl.float32) * tl.load(dloss_ptr + row * dloss_stride).to(tl.float32)
    if HAS_TOKEN_WEIGHT:
        scale *= tl.load(token_weight_ptr + row).to(tl.float32)
    t_safe = tl.where(ok, target, 0)
    weight_sum = 0.0
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t_safe).to(tl.float32)
        if HAS_SMOOTHING:
            weight_sum = tl.load(weight_sum_ptr).to(tl.float32)
    else:
        w_t = 1.0
        weight_sum = n_classes * 1.0
    p_coef, target_coef, smooth_coef = loss_grad_coefs(
        w_t,
        weight_sum,
        lse,
        scale,
        ok,
        label_smoothing,
        z_loss,
        n_classes,
        HAS_SMOOTHING,
        HAS_Z_LOSS,
    )
    if HAS_DLSE:
        p_coef += tl.load(dlse_ptr + row).to(tl.float32)
    g_row = grad_ptr + row * grad_row_stride
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        _row_grad_block(
            _load_row_block(x_row, start + cols, n_cols, "evict_first"),
            g_row,
            start + cols,
            n_cols,
            target - col_offset,
            lse,
            p_coef,
            target_coef,
            smooth_coef,
            weight_ptr + col_offset,
            softcap,
            HAS_WEIGHT,
            HAS_SMOOTHING,
            HAS_SOFTCAP,
        )


@triton.jit
def cross_entropy_bwd_kernel_scale(
    grad_ptr,
    grad_row_stride,
    dloss_ptr,
    n_cols,
    BLOCK_V: tl.constexpr,
):
    """grad *= dloss (a scalar on the device), in place; nothing is read or written when dloss == 1. A zero
    stays zero whatever dloss (PyTorch's gradient of an ignored token is 0 even for an inf or NaN upstream
    gradient, e.g. a summed loss divided by num_items_in_batch = 0)."""
    dloss = tl.load(dloss_ptr).to(tl.float32)
    if dloss != 1.0:
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        ptr = grad_ptr + row * grad_row_stride + cols
        g = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        g = tl.where(g == 0.0, 0.0, g * dloss)
        tl.store(ptr, g.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def batch_scale_values(
    target_ptr,
    weight_ptr,
    n_rows,
    n_classes,
    ignore_index,
    HAS_WEIGHT: tl.constexpr,
    MEAN: tl.constexpr,
    WEIGHT_SUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """(the gradient scale: 1 / the mean's denominator, the number of non-ignored targets or the sum of
    their class weights, 1 for other reductions; the sum of the class weights for WEIGHT_SUM (label
    smoothing with class weights), else 0), read from every target (and class weight) by one program."""
    offs = tl.arange(0, BLOCK)
    scale = 1.0
    if MEAN:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_rows, BLOCK):
            r = start + offs
            t = tl.load(target_ptr + r, mask=r < n_rows, other=0).to(tl.int64)
            valid = (t != ignore_index) & (r < n_rows)
            if HAS_WEIGHT:  # an out-of-range target counts class 0's weight (its loss is NaN anyway)
                t_safe = tl.where(valid & (t >= 0) & (t < n_classes), t, 0)
                acc += tl.where(
                    valid, tl.load(weight_ptr + t_safe, mask=valid, other=0.0).to(tl.float32), 0.0
                )
            else:
                acc += valid.to(tl.float32)
        scale = 1.0 / tl.sum(acc, axis=0)
    weight_sum = 0.0
    if WEIGHT_SUM:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_classes, BLOCK):
            c = start + offs
            acc += tl.load(weight_ptr + c, mask=c < n_classes, other=0.0).to(tl.float32)
        weight_sum = tl.sum(acc, axis=0)
    return scale, weight_sum


@triton.jit
def loss_scales_kernel(
    target_ptr,
    weight_ptr,
    out_ptr,
    n_rows,
    n_classes,
    ignore_index,
    HAS_WEIGHT: tl.constexpr,
    MEAN: tl.constexpr,
    WEIGHT_SUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: out[0] = the gradient scale, out[1] = the sum of the class weights (WEIGHT_SUM):
    batch_scale_values."""
    scale, weight_sum = batch_scale_values(
        target_ptr, weight_ptr, n_rows, n_classes, ignore_index, HAS_WEIGHT, MEAN, WEIGHT_SUM, BLOCK
    )
    tl.store(out_ptr, scale)
    if WEIGHT_SUM:
        tl.store(out_ptr + 1, weight_sum)


@triton.jit
def loss_reduce_kernel(loss_ptr, scale_ptr, out_ptr, n_rows, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """One program: out[0] = the sum of the per-row losses (fp32, in a fixed order), times the gradient
    scale for MEAN, in out's dtype."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        r = start + offs
        acc += tl.load(loss_ptr + r, mask=r < n_rows, other=0.0)
    total = tl.sum(acc, axis=0)
    if MEAN:
        total = total * tl.load(scale_ptr)
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))
