"""The per-row math of the cross-entropy family as @triton.jit helpers: one definition, called by every
kernel of the family (ops/_common/loss/row_kernels.py, the fused tile plan of linear_cross_entropy, the
kernels of linear_log_probs, the vocabulary-shard statistics in fuselm.distributed). reference.py beside
this file holds the same functions in PyTorch. The math is in ops/cross_entropy/README.md.

With z = transform(x) the (softcapped, scaled) logits of a row, lse = log sum_j exp(z_j) and
p_j = exp(z_j - lse), every gradient of the family has the form

    d/dz_j = p_j * p_coef - 1[j = target] * t_coef - w_j * s_coef     (+ the entropy term of log-probs)

with per-row coefficients (p_coef, t_coef, s_coef) that :func:`loss_grad_coefs` computes for the losses.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh(a):
    """tanh in fp32 to a few ulp: an odd polynomial near 0 (where 1 - 2 / (exp(2a) + 1) would lose the
    low bits to cancellation), that formula elsewhere (it saturates cleanly to +-1)."""
    a2 = a * a
    poly = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    return tl.where(a2 < 0.0625, poly, 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0))


@triton.jit
def transform(u, logit_scale, softcap, inv_temp, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/du) of raw logits u (fp32): z = softcap * tanh(u * logit_scale / softcap) / temperature, or
    u * logit_scale / temperature without softcap (dz/du then a scalar)."""
    y = u * logit_scale
    if HAS_SOFTCAP:
        th = tanh(y / softcap)
        z = th * (softcap * inv_temp)
        dz_du = (1.0 - th * th) * (logit_scale * inv_temp)
    else:
        z = y * inv_temp
        dz_du = logit_scale * inv_temp
    return z, dz_du


@triton.jit
def softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/dx) of the losses' transform (no logit scale, no temperature): softcap * tanh(x / softcap),
    or x itself (dz/dx then 1)."""
    if HAS_SOFTCAP:
        z, dz_dx = transform(x, 1.0, softcap, 1.0, HAS_SOFTCAP)
    else:
        z = x
        dz_dx = 1.0
    return z, dz_dx


@triton.jit
def online_lse_step(m2, s, z):
    """Fold a block z (fp32, 1-D; -inf where masked) into the running (base-2 max m2, sum of
    exp2(z log2e - m2))."""
    m2_new = tl.maximum(m2, tl.max(z, axis=0) * LOG2E)
    m2_safe = tl.where(m2_new == float("-inf"), 0.0, m2_new)  # a block of -inf logits adds 0
    s = s * tl.exp2(m2 - m2_safe) + tl.sum(tl.exp2(z * LOG2E - m2_safe), axis=0)
    return m2_new, s


@triton.jit
def row_loss(
    lse,
    z_t,
    smooth_dot,
    w_t,
    weight_sum,
    valid,
    in_range,
    label_smoothing,
    z_loss,
    n_classes,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """A row's loss from its statistics: lse, the target's logit z_t, smooth_dot = sum_j w_j z_j and
    weight_sum = sum_j w_j (smoothing only), the target's class weight w_t. 0 for an ignored target
    (`valid` false), NaN for one outside [0, n_classes) (`in_range` false)."""
    loss = w_t * (lse - z_t)
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * loss + label_smoothing / n_classes * (weight_sum * lse - smooth_dot)
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    loss = tl.where(valid, loss, 0.0)
    return tl.where(valid & (in_range == 0), float("nan"), loss)


@triton.jit
def loss_grad_coefs(
    w_t,
    weight_sum,
    lse,
    scale,
    ok,
    label_smoothing,
    z_loss,
    n_classes,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """(p_coef, t_coef, s_coef) of d(loss * scale)/dz for a row whose target has class weight w_t, with
    weight_sum = sum_j w_j (used with smoothing). `ok`: the target is not ignored and in range; other rows
    get zeros (an out-of-range target's NaN loss leaves the weights alone)."""
    if HAS_SMOOTHING:
        p_coef = (1.0 - label_smoothing) * w_t + label_smoothing / n_classes * weight_sum
        t_coef = (1.0 - label_smoothing) * w_t * scale
        s_coef = label_smoothing / n_classes * scale
    else:
        p_coef = w_t
        t_coef = w_t * scale
        s_coef = 0.0
    if HAS_Z_LOSS:
        p_coef += 2.0 * z_loss * lse
    return tl.where(ok, p_coef * scale, 0.0), tl.where(ok, t_coef, 0.0), tl.where(ok, s_coef, 0.0)


@triton.jit
def softmax_grad(p, is_target, p_coef, t_coef):
    """p * p_coef - 1[target] * t_coef: the part of every gradient of the family that is not smoothing."""
    return p * p_coef - tl.where(is_target, t_coef, 0.0)


@triton.jit
def loss_logit_grad(
    z,
    dz_dx,
    lse,
    is_target,
    p_coef,
    t_coef,
    s_coef,
    w,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """d(loss * scale)/dx of a loss of the family on a block of logits (z = softcapped(x), dz/dx), from the
    row's lse and loss_grad_coefs; w: the block's class weights (1.0 without)."""
    g = softmax_grad(tl.exp2(z * LOG2E - lse * LOG2E), is_target, p_coef, t_coef)
    if HAS_SMOOTHING:
        g -= w * s_coef
    if HAS_SOFTCAP:
        g *= dz_dx
    return g
