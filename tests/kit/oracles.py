"""Implementations the op suites compare against, shared by the single-device and the distributed suites:
eager PyTorch in the input's dtype, and the float64 oracles."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuselm.ops.cross_entropy import cross_entropy_reference
from fuselm.ops.linear_log_probs import LogProbs


def eager_cross_entropy(
    x,
    t,
    *,
    weight=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    return_lse=False,
    inplace_backward=False,
    token_weights=None,
):
    """Eager PyTorch in the dtype of x: F.cross_entropy, plus tanh / logsumexp for what it lacks."""
    n_cols = x.shape[-1]
    z = x.reshape(-1, n_cols)
    tt = t.reshape(-1).long()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ce_kw = dict(weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if not z_loss and not return_lse and token_weights is None:
        loss = F.cross_entropy(z, tt, reduction=reduction, **ce_kw)
        return loss.reshape(t.shape) if reduction == "none" else loss
    per_token = F.cross_entropy(z, tt, reduction="none", **ce_kw)
    lse = torch.logsumexp(z, dim=-1)
    valid = tt != ignore_index
    if z_loss:
        per_token = per_token + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if token_weights is not None:  # multiplies each token's loss; the mean's denominator is unchanged
        per_token = per_token * token_weights.reshape(-1).to(per_token.dtype)
    if reduction == "none":
        loss = per_token.reshape(t.shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        if weight is None:
            denom = valid.sum()
        else:
            w_t = weight[torch.where(valid, tt, torch.zeros_like(tt))]
            denom = torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
        loss = per_token.sum() / denom
    return (loss, lse.reshape(t.shape)) if return_lse else loss


def reference64(x, t, **kw):
    """The oracle: cross_entropy_reference on float64 copies."""
    kw = dict(kw)
    kw.pop("inplace_backward", None)
    for name in ("weight", "token_weights"):
        if kw.get(name) is not None:
            kw[name] = kw[name].double()
    return cross_entropy_reference(x.double(), t, **kw)


def naive_log_probs(
    x, w, t, *, linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0
):
    """The full-logits formula, in x's dtype (eager) or float64 (reference): the six statistics."""
    z = F.linear(x, w, linear_bias) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    valid = t != ignore_index
    ts = torch.where(valid, t, 0).long()
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    stats = (
        logp.gather(-1, ts.unsqueeze(-1)).squeeze(-1),
        -(p * logp).sum(-1),
        torch.logsumexp(z, dim=-1),
        torch.logsumexp(2 * logp, dim=-1),
        z.mean(-1),
    )
    out = [torch.where(valid, s, zero) for s in stats]
    return LogProbs(*out, is_top1=(z.argmax(-1) == ts) & valid)


def split_sizes(world: int, how: str, n_classes: int) -> list[int]:
    """Class counts of each rank's vocabulary slice: "uneven" (deliberately), "empty" (one rank without
    classes), "dtensor" (torch.chunk's split, what Shard(0) does)."""
    if how == "empty":  # one rank without classes
        return [n_classes - 5, 0, 5][:world] if world == 3 else [n_classes, 0]
    if how == "dtensor":  # torch.chunk's split, what Shard(0) does
        per = -(-n_classes // world)
        return [max(0, min(per, n_classes - r * per)) for r in range(world)]
    base = [n_classes // world + (1 if r < n_classes % world else 0) for r in range(world)]
    return [base[0] + 2, *base[1:-1], base[-1] - 2]  # deliberately uneven


class ExactTrlHead:
    """TRL's chunked LM-head kernel contract (``trl.trainer.utils._ChunkedLogProbFunction.apply``) by
    definition, in the dtype of the inputs (float64 for a reference run): the [N, V] logits, log_softmax,
    gather; the statistics without a graph."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        z = torch.nn.functional.linear(hidden, weight, bias) * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        log_p = z.log_softmax(-1)
        log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            log_sum_sq = (2 * log_p).logsumexp(-1) if "log_sum_sq_probs" in outputs else None
            mean_logits = z.mean(-1) if "mean_logits" in outputs else None
            is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1
