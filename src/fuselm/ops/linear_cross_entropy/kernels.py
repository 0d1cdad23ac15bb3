"""Triton kernels of the fused tile plan (memory="min"): logits exist only as on-chip tiles.

- ``lce_stats_kernel``: per (row block, vocabulary split) program, logit tiles ``x W^T`` by tl.dot over
  H, then the online softmax statistics of the tile (max and sum of exp, base 2), the target's logit
  and the label-smoothing dot; partials per split, combined on the host side in torch ([splits, N]).
- ``lce_tile_grad_kernel``: per [BLOCK_M, BLOCK_V] tile, the logits again, the gradient tile G from
  the saved lse and per-row coefficients, then ``dX[rows] += G W[cols]`` and ``dW[cols] += G^T X[rows]``
  by atomic adds in the gradients' dtype (and ``db[cols] += sum_rows G`` in fp32).

The math and the costs are in README.md.
"""

import triton
import triton.language as tl

from .._common.loss.row_math import LOG2E, loss_logit_grad, softcapped


@triton.jit
def _logit_tile(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride,
    rows,
    cols,
    h,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_V] = x[rows] @ w[cols]^T; rows / cols are int64 indices of existing rows."""
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + rows[:, None] * x_stride + offs_h[None, :]
    w_ptrs = w_ptr + cols[None, :] * w_stride + offs_h[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(h, BLOCK_H)):
        if EVEN_H:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            h_mask = offs_h < h - k * BLOCK_H
            a = tl.load(x_ptrs, mask=h_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=h_mask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")  # fp32 inputs: no TF32, as torch's matmul
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    return acc


@triton.jit
def _tile_rows(rows_ptr, rb, n, BLOCK_M: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Work rows rb*BLOCK_M.. : (in-range mask, int64 work index, int64 row of x)."""
    i = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < n
    i_safe = tl.where(i_mask, i, 0).to(tl.int64)
    if HAS_ROWS:
        rows = tl.load(rows_ptr + i_safe).to(tl.int64)
    else:
        rows = i_safe
    return i_mask, i_safe, rows


@triton.jit
def _tile_logits(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride,
    b_ptr,
    rows,
    vt,
    v,
    h,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Vocabulary tile vt of the rows: (class indices, their mask, safe int64 indices, logits z after
    bias and softcap and dz/d(logits); fp32 [BLOCK_M, BLOCK_V])."""
    c = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    c_mask = c < v
    c_safe = tl.where(c_mask, c, 0).to(tl.int64)
    z = _logit_tile(
        x_ptr, x_stride, w_ptr, w_stride, rows, c_safe, h, BLOCK_M, BLOCK_V, BLOCK_H, EVEN_H, IEEE
    )
    if HAS_BIAS:
        z += tl.load(b_ptr + c_safe).to(tl.float32)[None, :]
    z, dz_dx = softcapped(z, softcap, HAS_SOFTCAP)
    return c, c_mask, c_safe, z, dz_dx


@triton.jit
def lce_stats_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride,
    b_ptr,
    rows_ptr,
    target_ptr,
    class_weight_ptr,
    part_ptr,
    n,
    v,
    h,
    n_splits,
    tiles_per_split,
    softcap,
    HAS_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """part [4, n_splits, n] fp32: per split, the base-2 max m2 and sum of exp2(z log2e - m2), the
    target's logit (0 when the target is not in the split) and sum_j w_j z_j (label smoothing)."""
    # consecutive programs share a row block (its x rows stay in L2 while the splits stream W)
    pid = tl.program_id(0)
    split = pid % n_splits
    rb = pid // n_splits
    i_mask, i_safe, rows = _tile_rows(rows_ptr, rb, n, BLOCK_M, HAS_ROWS)
    t = tl.load(target_ptr + rows).to(tl.int64)
    m2 = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    z_t = tl.zeros((BLOCK_M,), tl.float32)
    smooth_dot = tl.zeros((BLOCK_M,), tl.float32)
    for j in range(0, tiles_per_split):
        c, c_mask, c_safe, z, _ = _tile_logits(
            x_ptr,
            x_stride,
            w_ptr,
            w_stride,
            b_ptr,
            rows,
            split * tiles_per_split + j,
            v,
            h,
            softcap,
            HAS_BIAS,
            HAS_SOFTCAP,
            BLOCK_M,
            BLOCK_V,
            BLOCK_H,
            EVEN_H,
            IEEE,
        )
        zm = tl.where(c_mask[None, :], z, float("-inf"))
        m2_new = tl.maximum(m2, tl.max(zm, axis=1) * LOG2E)
        m2_safe = tl.where(m2_new == float("-inf"), 0.0, m2_new)  # a tile past the end adds 0
        s = s * tl.exp2(m2 - m2_safe) + tl.sum(tl.exp2(zm * LOG2E - m2_safe[:, None]), axis=1)
        m2 = m2_new
        z_t += tl.sum(tl.where(c[None, :] == t[:, None], z, 0.0), axis=1)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w_c = tl.load(class_weight_ptr + c_safe, mask=c_mask, other=0.0).to(tl.float32)
                smooth_dot += tl.sum(tl.where(c_mask[None, :], w_c[None, :] * z, 0.0), axis=1)
            else:
                smooth_dot += tl.sum(tl.where(c_mask[None, :], z, 0.0), axis=1)
    out = part_ptr + split * n + i_safe
    plane = n_splits * n
    tl.store(out, m2, mask=i_mask)
    tl.store(out + plane, s, mask=i_mask)
    tl.store(out + 2 * plane, z_t, mask=i_mask)
    tl.store(out + 3 * plane, smooth_dot, mask=i_mask)


@triton.jit
def lce_tile_grad_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride,
    b_ptr,
    rows_ptr,
    target_ptr,
    class_weight_ptr,
    coef_ptr,
    dx_ptr,
    dx_stride,
    dx_scale_ptr,
    dw_ptr,
    dw_stride,
    db_ptr,
    n,
    v,
    h,
    softcap,
    HAS_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    DX_SCALED: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HG: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """G = (softmax * p_coef - onehot * t_coef - w * s_coef) * softcap' on one tile, from coef [4, n]
    fp32 (lse, p_coef, t_coef, s_coef per work row), then the atomic updates of dX, dW, db.
    DX_SCALED: dx_ptr is an fp16 accumulator; row i's contributions are multiplied by dx_scale[i]."""
    pid = tl.program_id(0)
    n_rb = tl.cdiv(n, BLOCK_M)
    n_vt = tl.cdiv(v, BLOCK_V)
    # grouped order: GROUP_M row blocks walk the vocabulary together (their dX rows stay in L2,
    # each W tile is read from DRAM once per group)
    per_group = GROUP_M * n_vt
    first = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(n_rb - first, GROUP_M)
    rb = first + (pid % per_group) % group_rows
    vt = (pid % per_group) // group_rows

    i_mask, i_safe, rows = _tile_rows(rows_ptr, rb, n, BLOCK_M, HAS_ROWS)
    c, c_mask, c_safe, z, dz_dx = _tile_logits(
        x_ptr,
        x_stride,
        w_ptr,
        w_stride,
        b_ptr,
        rows,
        vt,
        v,
        h,
        softcap,
        HAS_BIAS,
        HAS_SOFTCAP,
        BLOCK_M,
        BLOCK_V,
        BLOCK_H,
        EVEN_H,
        IEEE,
    )
    lse = tl.load(coef_ptr + i_safe, mask=i_mask, other=0.0)
    p_coef = tl.load(coef_ptr + n + i_safe, mask=i_mask, other=0.0)
    t_coef = tl.load(coef_ptr + 2 * n + i_safe, mask=i_mask, other=0.0)
    t = tl.load(target_ptr + rows).to(tl.int64)
    s_coef = 0.0
    w_c = 1.0
    if HAS_SMOOTHING:
        s_coef = tl.load(coef_ptr + 3 * n + i_safe, mask=i_mask, other=0.0)[:, None]
        if HAS_WEIGHT:
            w_c = tl.load(class_weight_ptr + c_safe, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    g = loss_logit_grad(
        z,
        dz_dx,
        lse[:, None],
        c[None, :] == t[:, None],
        p_coef[:, None],
        t_coef[:, None],
        s_coef,
        w_c,
        HAS_SMOOTHING,
        HAS_SOFTCAP,
    )
    g = tl.where(i_mask[:, None] & c_mask[None, :], g, 0.0)
    if NEED_DB:
        tl.atomic_add(db_ptr + c_safe, tl.sum(g, axis=0), mask=c_mask, sem="relaxed")
    g_in = g.to(x_ptr.dtype.element_ty)
    offs = tl.arange(0, BLOCK_HG)
    if NEED_DX:
        if DX_SCALED:
            dx_scale = tl.load(dx_scale_ptr + i_safe, mask=i_mask, other=1.0)
        # dX[rows, hs] += G @ W[cols, hs]
        for h0 in range(0, h, BLOCK_HG):
            hs = h0 + offs
            h_mask = hs < h
            w_tile = tl.load(
                w_ptr + c_safe[:, None] * w_stride + hs[None, :], mask=h_mask[None, :], other=0.0
            )
            if IEEE:
                part = tl.dot(g_in, w_tile, input_precision="ieee")
            else:
                part = tl.dot(g_in, w_tile)
            if DX_SCALED:
                part *= dx_scale[:, None]
            tl.atomic_add(
                dx_ptr + rows[:, None] * dx_stride + hs[None, :],
                part.to(dx_ptr.dtype.element_ty),
                mask=i_mask[:, None] & h_mask[None, :],
                sem="relaxed",
            )
    if NEED_DW:
        # dW[cols, hs] += G^T @ X[rows, hs]
        g_t = tl.trans(g_in)
        for h0 in range(0, h, BLOCK_HG):
            hs = h0 + offs
            h_mask = hs < h
            x_tile = tl.load(x_ptr + rows[:, None] * x_stride + hs[None, :], mask=h_mask[None, :], other=0.0)
            if IEEE:
                part = tl.dot(g_t, x_tile, input_precision="ieee")
            else:
                part = tl.dot(g_t, x_tile)
            tl.atomic_add(
                dw_ptr + c_safe[:, None] * dw_stride + hs[None, :],
                part.to(dw_ptr.dtype.element_ty),
                mask=c_mask[:, None] & h_mask[None, :],
                sem="relaxed",
            )


@triton.jit
def lce_dx_unscale_kernel(
    acc_ptr,
    dx_ptr,
    dx_stride,
    rows_ptr,
    dx_scale_ptr,
    h,
    HAS_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dx[row] = acc[row] / dx_scale[i] in place: acc is the fp16 view of dx's own memory (every element
    is read before it is overwritten, by the same program)."""
    i = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i
    inv = 1.0 / tl.load(dx_scale_ptr + i)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = hs < h
    acc = tl.load(acc_ptr + row * dx_stride + hs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + row * dx_stride + hs, (acc * inv).to(dx_ptr.dtype.element_ty), mask=mask)
