"""fuselm.distributed.linear_log_probs: per-token log-probabilities (and entropy, lse, ...) of a linear
layer whose classes are split across the ranks of a process group.

Each rank runs the single-device op (:func:`fuselm.linear_log_probs`, every plan and kernel of it) on its
own rows of the weight, giving per-token statistics of its slice of the classes; one all-gather of those
``[k, N]`` fp32 numbers follows, and every rank combines them in the same order into the global ones.
The combination is plain differentiable PyTorch, so the backward is autograd's: each rank's upstream
gradient on its slice statistics flows into the single-device backward, and the input gradient is
summed over the ranks (one all-reduce of ``[N, H]``). The math is in README.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..ops._common.guard import FLOAT_DTYPES, check_target, check_target_range, check_tensor
from ..ops.linear_log_probs import LogProbs
from ..ops.linear_log_probs import linear_log_probs as local_linear_log_probs
from ..ops.linear_log_probs.op import check_outputs
from .losses import _check_eager, _is_dtensor, _local, _vocab_shard
from .shard import _all_gather_into


class _SumInputGradOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks: the input is replicated and each rank's
    slice of the classes contributes one part of its gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherSliceStats(torch.autograd.Function):
    """[k, N] fp32 statistics of this rank's slice -> [W, k, N] of every rank. Every rank combines them
    into the same outputs, so its upstream gradient for its own slice is already complete: backward
    returns that slice, no exchange."""

    @staticmethod
    def forward(ctx, stats, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = stats.new_empty((world * stats.shape[0], *stats.shape[1:]))
        _all_gather_into(out, stats.contiguous(), group)
        return out.view(world, *stats.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad[dist.get_rank(ctx.group)], None


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group=None,
    vocab_sizes: Sequence[int] | None = None,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs: Sequence[str] = ("log_probs",),
    memory: str | int = "auto",
) -> LogProbs:
    """:func:`fuselm.linear_log_probs` with ``linear_weight`` split across the ranks of a group along the
    vocabulary (the lm_head of tensor parallelism); no rank holds more than its slice of any ``[N, V]``
    tensor.

    Every rank passes the same ``input`` and ``target`` and its own rows of the weight (rank r: classes
    ``sum(vocab_sizes[:r])`` onward, contiguous, in rank order; uneven and empty slices allowed). Per token
    the ranks exchange a few fp32 numbers (never logits); the outputs are the global ones, the same on every
    rank; ``input.grad`` is the full gradient on every rank and ``linear_weight.grad`` the gradient of this
    rank's rows.

    Args:
        input: hidden states ``[..., H]``, the same on every rank (a DTensor must be replicated).
        linear_weight: this rank's rows ``[V_r, H]``, or a DTensor placed ``(Shard(0),)`` on a 1-D device mesh
            (then the mesh gives the group and the slice sizes: no ``process_group``).
        target: global class indices ``input.shape[:-1]``, the same on every rank.
        process_group: the group the vocabulary is split across (default: the world group).
        vocab_sizes: every rank's number of rows in rank order; by default gathered (a small all-gather and a
            host sync per call).
        linear_bias: this rank's ``[V_r]`` (or a DTensor placed like the weight).
        ignore_index, temperature, softcap, logit_scale, memory: as in :func:`fuselm.linear_log_probs`.
        outputs: as in :func:`fuselm.linear_log_probs`, except ``"is_top1"`` (ValueError: the global argmax
            would need every slice's largest logit).

    Returns:
        :class:`fuselm.LogProbs`, global values, the same on every rank. In eager mode a target outside
        ``[0, V)`` that is not ``ignore_index`` raises ValueError (one host sync).

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> import fuselm.distributed
        >>> path = os.path.join(tempfile.mkdtemp(), "init")
        >>> dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        >>> hidden = torch.randn(6, 16, requires_grad=True)
        >>> lm_head_rows = torch.randn(100, 16, requires_grad=True)  # this rank's rows (here: all)
        >>> target = torch.randint(0, 100, (6,))
        >>> both = ("log_probs", "entropy")
        >>> out = fuselm.distributed.linear_log_probs(hidden, lm_head_rows, target, outputs=both)
        >>> (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        >>> hidden.grad.shape, lm_head_rows.grad.shape
        (torch.Size([6, 16]), torch.Size([100, 16]))
        >>> dist.destroy_process_group()
    """
    _check_eager()
    names = check_outputs(outputs)
    if "is_top1" in names:
        raise ValueError(
            "outputs: 'is_top1' is not available split across ranks (the global argmax needs every slice's "
            "maximum logit); compute it from fuselm.linear_log_probs on the whole weight"
        )
    input = _local("input", input)
    target = _local("target", target)
    w_local, shard = _vocab_shard("linear_weight", linear_weight, 0, process_group, vocab_sizes)
    b_local = linear_bias
    if linear_bias is not None and _is_dtensor(linear_bias):
        b_local, _ = _vocab_shard("linear_bias", linear_bias, 0, None, None)
    check_tensor("input", input, dtypes=(*FLOAT_DTYPES, torch.float64), min_ndim=1)
    check_target(target, input)
    n_classes = shard.n_classes
    check_target_range(target, n_classes, ignore_index)  # the host sync of the eager check
    kept = target != ignore_index
    held = kept & (target >= shard.start) & (target < shard.start + shard.size)
    # Rows whose target another rank holds are computed here too (their lse is needed): any class of the
    # slice will do as their local target, its log-prob is masked out below. Ignored rows stay ignored,
    # under a local ignore index outside [0, V_r) (the caller's could be a valid local class).
    local_ignore = -1
    local_target = torch.where(kept, torch.where(held, target - shard.start, 0), local_ignore)
    if shard.size == 0:
        # An empty slice adds nothing, but the rank runs the same code (argument checks, the backward's
        # all-reduce of d input) on one zero row, which the combination leaves out; the concatenation
        # keeps the empty weight (and bias) in the graph, so they get their (empty) gradients.
        w_local = torch.cat([w_local, w_local.new_zeros((1, w_local.shape[-1]))])
        b_local = None if b_local is None else torch.cat([b_local, b_local.new_zeros(1)])
    wanted = ["log_probs", "lse", *(n for n in names if n in ("entropy", "log_sum_sq_probs", "mean_logits"))]
    local = local_linear_log_probs(
        _SumInputGradOverRanks.apply(input, shard.group),
        w_local,
        local_target,
        linear_bias=b_local,
        ignore_index=local_ignore,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        outputs=tuple(wanted),
        memory=memory,
    )
    rows = {name: getattr(local, name).reshape(-1) for name in wanted}
    rows["log_probs"] = torch.where(held.reshape(-1), rows["log_probs"] + rows["lse"], 0.0)  # z_target
    if "mean_logits" in rows:
        rows["mean_logits"] = rows["mean_logits"] * shard.size  # the slice's sum of logits
    gathered = _GatherSliceStats.apply(torch.stack([rows[name] for name in wanted]), shard.group)
    live = [r for r, size in enumerate(shard.sizes) if size > 0]  # the ranks with classes
    by_name = {name: gathered[live, i] for i, name in enumerate(wanted)}  # [ranks with classes, N]
    return LogProbs(**_combine(by_name, kept.reshape(-1), n_classes, names, target.shape))


def _combine(stats: dict, kept: torch.Tensor, n_classes: int, names, shape) -> dict:
    """The global statistics [N] from every rank's slice statistics [R, N] (R ranks with classes):

    lse = logsumexp_r lse_r,                  log_probs = sum_r z_t,r - lse
    entropy = lse - sum_r exp(lse_r - lse) (lse_r - entropy_r)
    log_sum_sq_probs = logsumexp_r (log_sum_sq_r + 2 lse_r) - 2 lse,   mean_logits = sum_r sums_r / V
    """
    lse_r = stats["lse"]
    lse = torch.logsumexp(lse_r, dim=0)
    out = {"log_probs": stats["log_probs"].sum(dim=0) - lse}
    if "entropy" in names:
        weights = torch.exp(lse_r - lse)
        out["entropy"] = lse - (weights * (lse_r - stats["entropy"])).sum(dim=0)
    if "lse" in names:
        out["lse"] = lse
    if "log_sum_sq_probs" in names:
        out["log_sum_sq_probs"] = torch.logsumexp(stats["log_sum_sq_probs"] + 2.0 * lse_r, dim=0) - 2.0 * lse
    if "mean_logits" in names:
        out["mean_logits"] = stats["mean_logits"].sum(dim=0) / n_classes
    return {name: torch.where(kept, value, 0.0).reshape(shape) for name, value in out.items()}
