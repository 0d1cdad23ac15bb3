"""The per-row math of the cross-entropy family in PyTorch: the spec, the reference paths' building blocks,
the test oracles' core. row_math.py holds the same functions as @triton.jit helpers.

Per token with logits x [V], target t, class weights w (ones if absent), smoothing eps, z-loss
coefficient zl and softcap c:

    z    = c * tanh(x / c)            (z = x without softcap)
    lse  = log sum_j exp(z_j)
    loss = (1 - eps) * w_t * (lse - z_t) + eps / V * sum_j w_j * (lse - z_j) + zl * lse**2

An ignored target (ignore_index) has loss 0 and gradient 0; a target outside [0, V) that is not ignored
has a NaN loss and a zero gradient (no host sync, the weights stay finite). Token weights (one per row)
multiply a row's loss and gradient; they change no denominator.
"""

from __future__ import annotations

import torch

from .options import LossOptions


def scale_keeping_zeros(grad: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """grad * dloss where a zero stays zero whatever dloss: the gradient of an ignored token is 0 even for
    an inf or NaN upstream gradient, as PyTorch's (a summed loss divided by num_items_in_batch = 0)."""
    return torch.where(grad == 0, 0.0, grad * dloss)


def transform_logits(u, logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0):
    """(z, dz/du): z = softcap * tanh(u * logit_scale / softcap) / temperature, or u * logit_scale /
    temperature without softcap. dz/du is a tensor like u with softcap, else a Python float."""
    y = u * logit_scale
    if softcap:
        th = torch.tanh(y / softcap)
        return th * (softcap / temperature), (1.0 - th * th) * (logit_scale / temperature)
    return y / temperature, logit_scale / temperature


def _target_rows(target, n_classes: int, opts: LossOptions, dtype):
    """(valid, ok, safe target, class weight of the target) per row: valid = not ignored, ok = valid and
    in [0, n_classes)."""
    valid = target != opts.ignore_index
    ok = valid & (target >= 0) & (target < n_classes)
    t_safe = torch.where(ok, target, torch.zeros_like(target))
    if opts.weight is not None:
        w_t = opts.weight.to(dtype)[t_safe]
    else:
        w_t = torch.ones(target.shape, dtype=dtype, device=target.device)
    return valid, ok, t_safe, w_t


def _weight_sum(opts: LossOptions, n_classes: int, dtype, weight_sum=None):
    if weight_sum is not None:
        return weight_sum
    return opts.weight.to(dtype).sum() if opts.weight is not None else n_classes


def loss_from_stats(lse, z_target, smooth_dot, target, n_classes: int, opts: LossOptions) -> torch.Tensor:
    """Per-row loss from the row statistics: lse, the target's (softcapped) logit z_t and smooth_dot =
    sum_j w_j z_j (used only with label smoothing). 0 for ignored rows, NaN for a target outside
    [0, n_classes) (a constant: no gradient reaches that row)."""
    valid, ok, _, w_t = _target_rows(target, n_classes, opts, lse.dtype)
    loss = w_t * (lse - z_target)
    if opts.label_smoothing > 0:
        smooth = _weight_sum(opts, n_classes, lse.dtype) * lse - smooth_dot
        loss = (1 - opts.label_smoothing) * loss + opts.label_smoothing / n_classes * smooth
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    if opts.token_weights is not None:
        loss = loss * opts.token_weights.to(loss.dtype)
    loss = torch.where(ok, loss, torch.zeros_like(loss))
    return torch.where(valid & ~ok, float("nan"), loss)


def loss_grad_coefs(lse, target, n_classes: int, opts: LossOptions, scale, dlse=None, weight_sum=None):
    """(p_coef, t_coef, s_coef) per row, each like lse, of d(loss * scale + lse * dlse)/dz = p * p_coef -
    onehot * t_coef - w * s_coef, the loss with its token weight (scale: a tensor of one or of every row).
    Zeros (but dlse) on ignored rows and out-of-range targets. weight_sum: sum_j w_j if already known."""
    _, ok, _, w_t = _target_rows(target, n_classes, opts, lse.dtype)
    if opts.token_weights is not None:
        scale = scale * opts.token_weights.to(lse.dtype)
    ls = opts.label_smoothing
    zero = torch.zeros_like(lse)
    if ls > 0:
        p_coef = (1 - ls) * w_t + ls / n_classes * _weight_sum(opts, n_classes, lse.dtype, weight_sum)
        t_coef = (1 - ls) * w_t * scale
        s_coef = ls / n_classes * scale + zero
    else:
        p_coef, t_coef, s_coef = w_t, w_t * scale, zero
    if opts.z_loss:
        p_coef = p_coef + 2 * opts.z_loss * lse
    p_coef = torch.where(ok, p_coef * scale, zero)
    if dlse is not None:
        p_coef = p_coef + dlse
    return p_coef, torch.where(ok, t_coef, zero), torch.where(ok, s_coef, zero)


def z_loss_rows(lse, target, n_classes: int, opts: LossOptions) -> torch.Tensor:
    """The z-loss term of each row's loss, detached: z_loss * lse**2 where the loss is defined, 0 for an
    ignored target, NaN for one outside [0, n_classes) (as the loss)."""
    valid, ok, _, _ = _target_rows(target, n_classes, opts, lse.dtype)
    z = opts.z_loss * lse.detach() * lse.detach()
    if opts.token_weights is not None:
        z = z * opts.token_weights.to(z.dtype)
    z = torch.where(ok, z, 0.0)
    return torch.where(valid & ~ok, float("nan"), z)


def predicted_tokens(logits, target, opts: LossOptions) -> torch.Tensor:
    """int64 [N]: the argmax of each row of logits [N, V] (the first maximal class, as torch.argmax), -1 on
    ignored rows."""
    return torch.where(target != opts.ignore_index, logits.detach().argmax(dim=-1), -1)


def softmax_grad(p, is_target, p_coef, t_coef):
    """p * p_coef - 1[target] * t_coef (coefficients broadcast over the row)."""
    return p * p_coef - torch.where(is_target, t_coef, 0.0)


def row_losses(logits: torch.Tensor, target: torch.Tensor, opts: LossOptions):
    """(loss, lse) per row of logits [N, V] in their dtype (the caller picks fp32 or fp64), differentiable
    through autograd: the loss formula of the module docstring, from its statistics."""
    n_classes = logits.shape[-1]
    z, _ = transform_logits(logits, softcap=opts.softcap or None)
    lse = torch.logsumexp(z, dim=-1)
    _, _, t_safe, _ = _target_rows(target, n_classes, opts, z.dtype)
    smooth_dot = None
    if opts.label_smoothing > 0:
        smooth_dot = (z * opts.weight.to(z.dtype)).sum(-1) if opts.weight is not None else z.sum(-1)
    z_t = z.gather(1, t_safe[:, None])[:, 0]
    return loss_from_stats(lse, z_t, smooth_dot, target, n_classes, opts), lse
