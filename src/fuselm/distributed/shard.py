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
from ..ops._common.launch import row_launch
from ..ops._common.loss.options import LossOptions, LossScales
from ..ops._common.loss.reference import loss_from_stats, loss_grad_coefs, softmax_grad, transform_logits
from ..ops._common.loss.rows import BWD_BLOCK, batch_scales, rows_bwd_into
from .kernels import shard_stats_kernel


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


def shard_stats(logits, target, col_offset: int, opts: LossOptions) -> torch.Tensor:
    """Per-row statistics of a vocabulary shard (classes col_offset .. col_offset + V_local), fp32 [3, N]:
    the shard's lse (-inf when empty), the target logit if the shard holds it (else 0), sum_j w_j z_j (label
    smoothing only, else 0). logits [N, V_local] with stride(-1) == 1, target [N] (global ids)."""
    n_rows, n_cols = logits.shape
    if not use_triton(logits):
        return shard_stats_reference(logits, target, col_offset, opts)
    assert logits.stride(-1) == 1 and target.is_contiguous()
    stats = torch.empty((3, n_rows), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return stats
    block, num_warps = row_launch(max(n_cols, 1), max_block=BWD_BLOCK)
    shard_stats_kernel[(n_rows,)](
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        target_ptr=target,
        weight_ptr=opts.weight if opts.weight is not None else logits,
        stats_ptr=stats,
        n_rows=n_rows,
        n_cols=n_cols,
        col_offset=col_offset,
        softcap=opts.softcap,
        HAS_WEIGHT=opts.weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0,
        HAS_SOFTCAP=opts.softcap > 0,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return stats


def _slice_weights(opts: LossOptions, col_offset: int, n_cols: int, dtype):
    return opts.weight[col_offset : col_offset + n_cols].to(dtype) if opts.weight is not None else 1.0


def shard_stats_reference(logits, target, col_offset: int, opts: LossOptions) -> torch.Tensor:
    """shard_stats in PyTorch (fp32; fp64 for fp64 logits): the CPU path of a shard."""
    n_cols = logits.shape[1]
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z, _ = transform_logits(logits.to(compute), softcap=opts.softcap or None)
    local = target - col_offset
    owned = (local >= 0) & (local < n_cols)
    z_t = torch.zeros(z.shape[0], dtype=compute, device=z.device)
    if n_cols:
        z_t = torch.where(owned, z.gather(1, torch.where(owned, local, 0)[:, None])[:, 0], z_t)
    smooth_dot = torch.zeros_like(z_t)
    if opts.label_smoothing > 0:
        smooth_dot = (z * _slice_weights(opts, col_offset, n_cols, compute)).sum(-1)
    return torch.stack([torch.logsumexp(z, dim=-1), z_t, smooth_dot])


def shard_grad_reference(logits, target, col_offset, n_classes, opts, scales, dloss, dlse, lse):
    """d(sum_i loss_i * grad_scale * dloss_i + lse_i * dlse_i) / d logits of a shard in PyTorch, in the
    logits' dtype, from the global lse: the family's coefficients (loss_grad_coefs) on the slice."""
    n_cols = logits.shape[1]
    compute = lse.dtype
    z, dz_dx = transform_logits(logits.to(compute), softcap=opts.softcap or None)
    scale = scales.grad_scale.to(compute) * dloss.to(compute)
    dlse = dlse.to(compute) if dlse is not None else None
    p_coef, t_coef, s_coef = loss_grad_coefs(lse, target, n_classes, opts, scale, dlse)
    cols = torch.arange(col_offset, col_offset + n_cols, device=logits.device)
    is_target = cols[None, :] == target[:, None]
    g = softmax_grad(torch.exp(z - lse[:, None]), is_target, p_coef[:, None], t_coef[:, None])
    if opts.label_smoothing > 0:
        g = g - _slice_weights(opts, col_offset, n_cols, compute) * s_coef[:, None]
    return (g * dz_dx).to(logits.dtype)


@dataclass(frozen=True)
class VocabShard:
    """This rank's classes [start, start + size) of n_classes, and the group that holds the others.

    A row backend (ops/_common/loss/backend.py: scales_for_forward, forward, backward, reduce_input_grad_,
    n_classes), the vocabulary-split counterpart of LocalRows: the ops' autograd Functions run on it
    unchanged."""

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

    def global_stats(self, logits, target, opts: LossOptions):
        """(lse, z_target, smooth_dot) [N] of every token over the whole vocabulary: the shard's
        statistics, gathered from all ranks and combined (in the same order on every rank)."""
        local = shard_stats(logits, target, self.start, opts).contiguous()  # [3, N]
        world = dist.get_world_size(self.group)
        every = local.new_empty(world * local.numel())
        _all_gather_into(every, local.reshape(-1), self.group)
        every = every.view(world, *local.shape)
        return torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(0), every[:, 2].sum(0)

    def scales_for_forward(self, target, opts: LossOptions) -> LossScales:
        """The batch's LossScales over the whole vocabulary (rows.batch_scales), written now."""
        return batch_scales(target, opts, self.n_classes)

    def forward(
        self, logits, target, opts: LossOptions, scales: LossScales, grad: str | None, predicted=None
    ):
        """The row-backend forward (ops/_common/loss/rows.py) of this rank's slice: global statistics, the
        loss, and with `grad` ("new" or "inplace") the gradient of the slice from the global lse. No
        predicted tokens: the global argmax would need every slice's maximum (the split losses do not
        offer them)."""
        assert predicted is None, "a vocabulary shard does not compute predicted tokens"
        lse, z_target, smooth_dot = self.global_stats(logits, target, opts)
        loss = loss_from_stats(lse, z_target, smooth_dot, target, self.n_classes, opts)
        g = None
        if grad is not None:
            one = torch.ones(1, dtype=torch.float32, device=logits.device)
            g = self.backward(logits, target, opts, scales, one, None, lse, grad == "inplace")
        return loss.float(), lse.float(), g

    def backward(
        self, logits, target, opts: LossOptions, scales: LossScales, dloss, dlse, lse, inplace: bool
    ):
        """The row-backend backward of this rank's slice (the row kernel with the class offset)."""
        grad = logits if inplace else torch.empty_like(logits)
        if use_triton(logits):
            return rows_bwd_into(
                logits, target, opts, scales, dloss, dlse, lse, grad, self.start, self.n_classes
            )
        g = shard_grad_reference(logits, target, self.start, self.n_classes, opts, scales, dloss, dlse, lse)
        return grad.copy_(g)

    def reduce_input_grad_(self, dx: torch.Tensor) -> torch.Tensor:
        """The linear ops' input gradient: each rank holds its slice's part; summed over the ranks."""
        dist.all_reduce(dx, group=self.group)
        return dx
