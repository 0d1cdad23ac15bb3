"""Pure-PyTorch cross-entropy: the spec, the CPU fallback, the test oracle and the benchmark baseline.

Per token i with logits x [V], target t, class weights w (ones if absent), smoothing eps,
z-loss coefficient zl and softcap c:

    z    = c * tanh(x / c)            (z = x without softcap)
    lse  = log sum_j exp(z_j)
    loss = (1 - eps) * w_t * (lse - z_t) + eps / V * sum_j w_j * (lse - z_j) + zl * lse**2

Tokens whose target is ignore_index have loss 0; a target outside [0, V) that is not ignored
gives that token a NaN loss and a zero gradient (no error, no host sync: the NaN shows in the loss, the
weights stay finite). reduction="mean" divides the sum by
sum of w_t over non-ignored tokens (their count without weights), as PyTorch does; a batch
with every token ignored gives NaN, like PyTorch.
"""

from __future__ import annotations

import torch


def scale_keeping_zeros(grad: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """grad * dloss where a zero stays zero whatever dloss: the gradient of an ignored token is 0 even for
    an inf or NaN upstream gradient, as PyTorch's (a summed loss divided by num_items_in_batch = 0)."""
    return torch.where(grad == 0, 0.0, grad * dloss)


def _softcapped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return softcap * torch.tanh(x / softcap) if softcap else x


def cross_entropy_loss_from_stats(
    lse: torch.Tensor,
    z_target: torch.Tensor,
    smooth_dot: torch.Tensor | None,
    target: torch.Tensor,
    *,
    n_classes: int,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Per-token loss [N] from the row statistics: lse, the target's (softcapped) logit z_t and
    smooth_dot = sum_j w_j z_j (used only with label smoothing). 0 for ignored tokens, NaN for a
    target outside [0, n_classes) (a constant: no gradient reaches that row). The one formula of the module
    docstring; the kernels implement it too."""
    valid = target != ignore_index
    ok = valid & (target >= 0) & (target < n_classes)
    t_safe = torch.where(ok, target, torch.zeros_like(target))
    w_t = weight.to(lse.dtype)[t_safe] if weight is not None else torch.ones_like(lse)
    loss = w_t * (lse - z_target)
    if label_smoothing > 0:
        weight_sum = weight.to(lse.dtype).sum() if weight is not None else n_classes
        smooth = weight_sum * lse - smooth_dot
        loss = (1 - label_smoothing) * loss + label_smoothing / n_classes * smooth
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(ok, loss, torch.zeros_like(loss))
    return torch.where(valid & ~ok, float("nan"), loss)


def cross_entropy_reference(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    loss_dtype: torch.dtype | None = None,
):
    """Cross-entropy in fp32 (fp64 for fp64 input); loss in ``loss_dtype`` (default: the input dtype),
    lse in fp32/fp64.

    input [..., V], target [...] (int). Differentiable through autograd.
    """
    n_cols = input.shape[-1]
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    z = _softcapped(input.reshape(-1, n_cols).to(compute), softcap)
    t = target.reshape(-1)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    t_safe = torch.where(valid & (t >= 0) & (t < n_cols), t, torch.zeros_like(t))
    smooth_dot = None
    if label_smoothing > 0:
        smooth_dot = (z * weight.to(compute)).sum(-1) if weight is not None else z.sum(-1)
    loss = cross_entropy_loss_from_stats(
        lse,
        z.gather(1, t_safe[:, None])[:, 0],
        smooth_dot,
        t,
        n_classes=n_cols,
        weight=weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
    )
    if reduction == "none":
        out = loss.reshape(target.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        w_t = weight.to(compute)[t_safe] if weight is not None else torch.ones_like(lse)
        out = loss.sum() / torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
    out = out.to(loss_dtype or input.dtype)
    if return_lse:
        return out, lse.reshape(target.shape)
    return out


# ---- a vocabulary shard (fuselm.distributed): the CPU counterparts of the shard kernels ----


def cross_entropy_shard_stats_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    col_offset: int,
    weight: torch.Tensor | None,
    label_smoothing: float,
    softcap: float | None,
) -> torch.Tensor:
    """[3, N] in fp32 (fp64 for fp64 logits): lse over the shard's classes col_offset .. col_offset + V_local
    (-inf when empty), the target logit if the shard holds it (else 0), sum_j w_j z_j (0 without smoothing).
    logits [N, V_local], target [N] (global class ids), weight None or [V] (global)."""
    n_cols = logits.shape[1]
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = _softcapped(logits.to(compute), softcap)
    local = target - col_offset
    owned = (local >= 0) & (local < n_cols)
    z_t = torch.zeros(z.shape[0], dtype=compute, device=z.device)
    if n_cols:
        z_t = torch.where(owned, z.gather(1, torch.where(owned, local, 0)[:, None])[:, 0], z_t)
    smooth_dot = torch.zeros_like(z_t)
    if label_smoothing > 0:
        w = weight[col_offset : col_offset + n_cols].to(compute) if weight is not None else 1.0
        smooth_dot = (z * w).sum(-1)
    return torch.stack([torch.logsumexp(z, dim=-1), z_t, smooth_dot])


def cross_entropy_shard_grad_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    col_offset: int,
    n_classes: int,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    dloss: torch.Tensor,
    dlse: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> torch.Tensor:
    """d(sum_i loss_i * grad_scale * dloss_i + lse_i * dlse_i) / d logits for a shard (classes
    col_offset .. col_offset + V_local of n_classes), in the logits' dtype; lse [N] is the global one,
    dloss [1] or [N]. Ignored rows and out-of-range targets get zeros (as the kernel)."""
    n_cols = logits.shape[1]
    compute = lse.dtype
    z = _softcapped(logits.to(compute), softcap)
    ok = (target != ignore_index) & (target >= 0) & (target < n_classes)
    t_safe = torch.where(ok, target, torch.zeros_like(target))
    w_t = weight.to(compute)[t_safe] if weight is not None else torch.ones_like(lse)
    scale = grad_scale.to(compute) * dloss.to(compute)
    p_coef, target_coef, smooth_coef = w_t, w_t * scale, torch.zeros_like(lse)
    if label_smoothing > 0:
        weight_sum = weight.to(compute).sum() if weight is not None else n_classes
        p_coef = (1 - label_smoothing) * w_t + label_smoothing / n_classes * weight_sum
        target_coef = (1 - label_smoothing) * w_t * scale
        smooth_coef = label_smoothing / n_classes * scale * torch.ones_like(lse)
    if z_loss:
        p_coef = p_coef + 2 * z_loss * lse
    p_coef = torch.where(ok, p_coef * scale, 0.0)
    if dlse is not None:
        p_coef = p_coef + dlse.to(compute)
    target_coef = torch.where(ok, target_coef, 0.0)
    smooth_coef = torch.where(ok, smooth_coef, 0.0)
    cols = torch.arange(col_offset, col_offset + n_cols, device=logits.device)
    g = torch.exp(z - lse[:, None]) * p_coef[:, None]
    g = g - (cols[None, :] == target[:, None]) * target_coef[:, None]
    if label_smoothing > 0:
        w = weight[col_offset : col_offset + n_cols].to(compute) if weight is not None else 1.0
        g = g - w * smooth_coef[:, None]
    if softcap:
        g = g * (1 - (z / softcap) ** 2)
    return g.to(logits.dtype)
