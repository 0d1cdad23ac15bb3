"""fuselm.distributed.cross_entropy and linear_cross_entropy: the vocabulary split across the ranks of a
process group (tensor / vocabulary parallelism). Same arguments and results as fuselm's single-device
functions, plus the group; the ops' autograd Functions run with a VocabShard (shard.py) in place of the
cross-entropy kernel calls, so every feature and both gradient plans carry over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..ops._common.guard import (
    FLOAT_DTYPES,
    check_classes,
    check_tensor,
    linear_operands,
    resolve_loss_dtype,
    validate_memory,
)
from ..ops._common.loss.options import Extras, LossOptions
from ..ops.cross_entropy.op import apply_cross_entropy
from ..ops.linear_cross_entropy.op import apply_linear_cross_entropy
from ..ops.linear_cross_entropy.plan import choose_plan, fp32_accumulation
from .shard import VocabShard, gather_sizes


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def dtensor_shard_sizes(t, dim: int) -> list[int]:
    """Shard sizes along `dim` of a DTensor placed Shard(dim) on a 1-D mesh (torch.chunk's split: ranks get
    ceil(V / W) rows, the last ones fewer or none)."""
    from torch.distributed.tensor import Shard

    placements = tuple(t.placements)
    dim = dim % t.ndim
    if t.device_mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(dim):
        raise ValueError(
            f"a DTensor vocabulary shard must be placed (Shard({dim}),) on a 1-D device mesh, got placements "
            f"{placements} on a {t.device_mesh.ndim}-D mesh"
        )
    world = t.device_mesh.size()
    total = t.shape[dim]
    per = -(-total // world)
    return [max(0, min(per, total - r * per)) for r in range(world)]


def _local(name: str, t):
    """The local tensor of a replicated DTensor argument, or t itself."""
    if t is None or not _is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if any(p != Replicate() for p in t.placements):
        raise ValueError(f"{name} as a DTensor must be replicated (Replicate placements), got {t.placements}")
    return t.to_local()


def _vocab_shard(
    name: str, t, dim: int, process_group, vocab_sizes: Sequence[int] | None
) -> tuple[torch.Tensor, VocabShard]:
    """The local shard of `t` (vocabulary along `dim`) and its VocabShard."""
    if _is_dtensor(t):
        if process_group is not None:
            raise ValueError(f"{name} is a DTensor: its device mesh gives the group; pass no process_group")
        sizes = dtensor_shard_sizes(t, dim)
        group = t.device_mesh.get_group()
        local = t.to_local()
    else:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"fuselm.distributed needs an initialized process group ({name} is a plain tensor)"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        local = t
        sizes = list(vocab_sizes) if vocab_sizes is not None else gather_sizes(t.shape[dim], group, t.device)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sizes[rank] != local.shape[dim]:
        raise ValueError(
            f"vocab_sizes must list the {world} ranks' shard sizes in rank order, with this rank's "
            f"({name}.shape[{dim}] = {local.shape[dim]}) at index {rank}; got {sizes}"
        )
    check_classes(name, sum(sizes))
    return local, VocabShard.from_sizes(sizes, group)


def _check_eager() -> None:
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "fuselm.distributed losses run eagerly (wrap them in torch.compiler.disable)"
        )


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group=None,
    vocab_sizes: Sequence[int] | None = None,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    token_weights: torch.Tensor | None = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    loss_dtype: torch.dtype | None = None,
):
    """:func:`fuselm.cross_entropy` of logits whose classes are split across the ranks of a group.

    Every rank passes its own slice of the classes (rank r holds classes ``sum(vocab_sizes[:r])`` onward,
    contiguous, in rank order; uneven and empty slices allowed) and the same ``target``. Ranks exchange
    three fp32 numbers per token (their slice's log-sum-exp, the target logit if they hold it, the
    smoothing sum), never logits; each rank gets the full loss and the gradient of its own slice.

    Args:
        input: this rank's logits ``[..., V_r]`` (float32 / float16 / bfloat16), or a DTensor placed
            ``(Shard(-1),)`` on a 1-D device mesh (then the mesh gives the group).
        target: global class indices ``input.shape[:-1]``, the same on every rank.
        process_group: the group the vocabulary is split across (default: the world group).
        vocab_sizes: every rank's slice size in rank order; by default gathered from the ranks (a small
            all-gather and a host sync per call).
        weight: class weights ``[V]`` over the whole vocabulary (the same on every rank), or None.
        ignore_index, reduction, label_smoothing, z_loss, softcap, token_weights, return_lse, return_z_loss,
        inplace_backward, loss_dtype: as in :func:`fuselm.cross_entropy` (a target outside ``[0, V)``
            gives its token a NaN loss and a zero gradient).

    Returns:
        ``loss`` (the same on every rank); with ``return_lse`` (``input.shape[:-1]``, global) /
        ``return_z_loss`` a tuple ``(loss, lse, z_loss)`` of the requested ones.

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> import fuselm.distributed
        >>> path = os.path.join(tempfile.mkdtemp(), "init")
        >>> dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        >>> logits = torch.randn(4, 10, requires_grad=True)  # this rank's classes (here: all of them)
        >>> loss = fuselm.distributed.cross_entropy(logits, torch.tensor([1, 0, -100, 9]))
        >>> loss.backward()
        >>> bool(torch.allclose(loss, fuselm.cross_entropy(logits, torch.tensor([1, 0, -100, 9]))))
        True
        >>> dist.destroy_process_group()
    """
    _check_eager()
    check_tensor("input", input, dtypes=FLOAT_DTYPES, min_ndim=1)
    loss_dtype = resolve_loss_dtype(loss_dtype, input)
    target = _local("target", target)
    weight = _local("weight", weight)
    token_weights = _local("token_weights", token_weights)
    local, shard = _vocab_shard("input", input, -1, process_group, vocab_sizes)
    opts = LossOptions.of(weight, ignore_index, reduction, label_smoothing, z_loss, softcap, token_weights)
    opts = opts.checked(local, target, shard.n_classes)
    extras = Extras(return_lse, return_z_loss)
    return apply_cross_entropy(local, target, opts, inplace_backward, shard, extras, loss_dtype)


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group=None,
    vocab_sizes: Sequence[int] | None = None,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    ignore_index: int | None = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    token_weights: torch.Tensor | None = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
    loss_dtype: torch.dtype | None = None,
):
    """:func:`fuselm.linear_cross_entropy` with ``linear_weight`` split across the ranks of a group along
    the vocabulary (the lm_head of tensor parallelism); no rank ever holds more than its slice of any
    ``[N, V]`` tensor.

    Every rank passes the same ``input`` and ``target`` and its own rows of the weight (rank r: classes
    ``sum(vocab_sizes[:r])`` onward, contiguous, in rank order; uneven and empty slices allowed). Per chunk
    of tokens a rank computes its slice of the logits, the ranks exchange three fp32 numbers per token
    (never logits), and each rank writes the gradient of its slice in place; the input gradient is summed
    over the ranks (one all-reduce of ``[N, H]``), so ``input.grad`` is the full gradient on every rank and
    ``linear_weight.grad`` the gradient of this rank's rows.

    Args:
        input: hidden states ``[..., H]``, the same on every rank (a DTensor must be replicated).
        linear_weight: this rank's rows ``[V_r, H]``, or a DTensor placed ``(Shard(0),)`` on a 1-D device
            mesh (then the mesh gives the group and the slice sizes: no ``process_group`` needed).
        target: global class indices ``input.shape[:-1]``, the same on every rank.
        process_group: the group the vocabulary is split across (default: the world group).
        vocab_sizes: every rank's number of rows in rank order; by default gathered from the ranks (a small
            all-gather and a host sync per call).
        linear_bias: this rank's ``[V_r]`` (or a DTensor placed like the weight).
        weight: class weights ``[V]`` over the whole vocabulary (the same on every rank), or None.
        ignore_index, reduction, label_smoothing, z_loss, softcap, token_weights, return_lse, return_z_loss,
        accum_dtype, loss_dtype: as in :func:`fuselm.linear_cross_entropy` (token_weights the same on every
        rank).
        memory: ``"auto"`` (chunk buffer of 256 MiB; the free-memory query of the single-device function is
            skipped, so that every rank chunks alike), ``"min"`` (temporaries within 8 MiB: chunks of 8 MiB,
            the fused tile plan does not run split) or an int (bytes). The chunk rows follow the largest
            slice.

    Returns:
        ``loss`` (the same on every rank); with ``return_lse`` (global) / ``return_z_loss`` a tuple
        ``(loss, lse, z_loss)`` of the requested ones.

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> import fuselm.distributed
        >>> path = os.path.join(tempfile.mkdtemp(), "init")
        >>> dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        >>> hidden = torch.randn(6, 16, requires_grad=True)
        >>> lm_head_rows = torch.randn(100, 16, requires_grad=True)  # this rank's rows (here: all)
        >>> target = torch.randint(0, 100, (6,))
        >>> loss = fuselm.distributed.linear_cross_entropy(hidden, lm_head_rows, target)
        >>> loss.backward()
        >>> hidden.grad.shape, lm_head_rows.grad.shape
        (torch.Size([6, 16]), torch.Size([100, 16]))
        >>> dist.destroy_process_group()
    """
    _check_eager()
    validate_memory(memory)
    input = _local("input", input)
    target = _local("target", target)
    weight = _local("weight", weight)
    token_weights = _local("token_weights", token_weights)
    w_local, shard = _vocab_shard("linear_weight", linear_weight, 0, process_group, vocab_sizes)
    b_local = linear_bias
    if linear_bias is not None and _is_dtensor(linear_bias):
        b_local, _ = _vocab_shard("linear_bias", linear_bias, 0, None, None)
    input, w_local, b_local = linear_operands(input, w_local, b_local, dtypes=FLOAT_DTYPES)
    loss_dtype = resolve_loss_dtype(loss_dtype, input)
    if ignore_index is None:
        ignore_index = -100
    opts = LossOptions.of(weight, ignore_index, reduction, label_smoothing, z_loss, softcap, token_weights)
    opts = opts.checked(input, target, shard.n_classes)
    widest = max(shard.max_size, 1)
    fp32_weight_grad = fp32_accumulation(accum_dtype, input.dtype)
    itemsize = input.element_size()
    plan = choose_plan(memory, input.device, widest, input.shape[-1], itemsize, False, fp32_weight_grad)
    extras = Extras(return_lse, return_z_loss)
    return apply_linear_cross_entropy(
        input,
        w_local,
        b_local,
        target,
        opts=opts,
        plan=plan,
        backend=shard,
        extras=extras,
        loss_dtype=loss_dtype,
    )
