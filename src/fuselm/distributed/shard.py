"""A rank's share of the vocabulary, and the exchange of per-token statistics between the ranks.

Each rank of the group holds a contiguous slice of the classes, in rank order (rank r: classes
start_r .. start_r + size_r; uneven sizes allowed, empty ones too). Per token, a rank computes on its
logits only: the log-sum-exp of its slice, the target logit if it holds the target (else 0) and, for
label smoothing, sum_j w_j z_j of its slice: three fp32 numbers. One all-gather of those [3, N] and
every rank combines them the same way (logsumexp, sum, sum) into the token's global statistics, from
which the loss follows and the gradient of the rank's logits (the kernels take the class offset).
The math is in README.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops._common.dispatch import use_triton
from ..ops.cross_entropy.op import cross_entropy_bwd, cross_entropy_shard_stats
from ..ops.cross_entropy.reference import (
    cross_entropy_loss_from_stats,
    cross_entropy_shard_grad_reference,
    cross_entropy_shard_stats_reference,
)


def _all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
    gather(out, t, group=group)


def gather_sizes(local_size: int, group, device: torch.device) -> list[int]:
    """Every rank's shard size, in rank order (one small all-gather and a host sync)."""
    world = dist.get_world_size(group)
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather_into(sizes, torch.tensor([local_size], dtype=torch.int64, device=device), group)
    return sizes.tolist()


@dataclass(frozen=True)
class VocabShard:
    """This rank's classes [start, start + size) of n_classes, and the group that holds the others.

    fwd_into / bwd have the arguments and results of cross_entropy_fwd_into / cross_entropy_bwd (the
    ops' autograd Functions call them in their place); all_reduce_ sums the input gradient."""

    group: object
    start: int
    size: int
    n_classes: int
    sizes: tuple[int, ...]  # every rank's slice size, in rank order

    @classmethod
    def from_sizes(cls, sizes: Sequence[int], group) -> VocabShard:
        rank = dist.get_rank(group)
        return cls(group, sum(sizes[:rank]), sizes[rank], sum(sizes), tuple(sizes))

    @property
    def max_size(self) -> int:
        """The largest slice: chunk sizes derived from it are the same on every rank."""
        return max(self.sizes)

    def _stats(self, logits, target, weight, label_smoothing, softcap) -> torch.Tensor:
        if use_triton(logits):
            return cross_entropy_shard_stats(logits, target, self.start, weight, label_smoothing, softcap)
        return cross_entropy_shard_stats_reference(
            logits, target, self.start, weight, label_smoothing, softcap
        )

    def global_stats(self, logits, target, weight, label_smoothing, softcap):
        """(lse, z_target, smooth_dot) [N] of every token over the whole vocabulary: the shard's
        statistics, gathered from all ranks and combined (in the same order on every rank)."""
        local = self._stats(logits, target, weight, label_smoothing, softcap).contiguous()  # [3, N]
        world = dist.get_world_size(self.group)
        every = local.new_empty(world * local.numel())
        _all_gather_into(every, local.reshape(-1), self.group)
        every = every.view(world, *local.shape)
        return torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(0), every[:, 2].sum(0)

    def fwd_into(
        self,
        logits,
        target,
        weight,
        weight_sum,
        grad_scale,
        grad,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    ):
        lse, z_target, smooth_dot = self.global_stats(logits, target, weight, label_smoothing, softcap)
        loss = cross_entropy_loss_from_stats(
            lse,
            z_target,
            smooth_dot,
            target,
            n_classes=self.n_classes,
            weight=weight,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
        )
        if grad is not None:
            one = torch.ones(1, dtype=torch.float32, device=logits.device)
            args = (ignore_index, label_smoothing, z_loss, softcap)
            self.bwd(logits, target, weight, weight_sum, grad_scale, one, None, lse, grad, *args)
        return loss.float(), lse.float()

    def bwd(
        self,
        logits,
        target,
        weight,
        weight_sum,
        grad_scale,
        dloss,
        dlse,
        lse,
        grad,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    ):
        args = (ignore_index, label_smoothing, z_loss, softcap)
        if use_triton(logits):
            inputs = (logits, target, weight, weight_sum, grad_scale, dloss, dlse, lse, grad)
            return cross_entropy_bwd(*inputs, *args, col_offset=self.start, n_classes=self.n_classes)
        g = cross_entropy_shard_grad_reference(
            logits, target, self.start, self.n_classes, weight, grad_scale, dloss, dlse, lse, *args
        )
        return grad.copy_(g)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t
