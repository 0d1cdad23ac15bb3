"""Pure-PyTorch cross-entropy: the spec, the CPU fallback, the test oracle and the benchmark baseline.

Per token i with logits x [V], target t, class weights w (ones if absent), smoothing eps,
z-loss coefficient zl and softcap c:

    z    = c * tanh(x / c)            (z = x without softcap)
    lse  = log sum_j exp(z_j)
    loss = (1 - eps) * w_t * (lse - z_t) + eps / V * sum_j w_j * (lse - z_j) + zl * lse**2

Tokens whose target is ignore_index have loss 0; a target outside [0, V) that is not ignored
gives that token a NaN loss and gradient (no error, no host sync). reduction="mean" divides the sum by
sum of w_t over non-ignored tokens (their count without weights), as PyTorch does; a batch
with every token ignored gives NaN, like PyTorch.
"""

from __future__ import annotations

import torch


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
    z = input.reshape(-1, n_cols).to(compute)
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    # a target outside [0, V) that is not ignored: NaN loss and gradient for that token, as in the kernels
    bad = valid & ((t < 0) | (t >= n_cols))
    t_safe = torch.where(valid & ~bad, t, torch.zeros_like(t))
    z_t = z.gather(1, t_safe[:, None])[:, 0]
    w_t = weight.to(compute)[t_safe] if weight is not None else torch.ones_like(lse)
    loss = torch.where(bad, float("nan"), w_t) * (lse - z_t)
    if label_smoothing > 0:
        if weight is not None:
            smooth = (weight.to(compute) * (lse[:, None] - z)).sum(-1)
        else:
            smooth = n_cols * lse - z.sum(-1)
        loss = (1 - label_smoothing) * loss + label_smoothing / n_cols * smooth
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        out = loss.reshape(target.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = loss.sum() / torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
    out = out.to(loss_dtype or input.dtype)
    if return_lse:
        return out, lse.reshape(target.shape)
    return out
