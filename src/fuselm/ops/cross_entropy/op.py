"""fuselm.cross_entropy: launchers -> custom ops -> autograd Function -> public function."""

from __future__ import annotations

import torch
import triton

from .._common.dispatch import interpret_mode, use_triton
from .._common.guard import FLOAT_DTYPES, check_loss_args, check_tensor, resolve_loss_dtype, rows_view
from .._common.launch import persistent_grid, row_launch
from .kernels import (
    cross_entropy_bwd_kernel,
    cross_entropy_bwd_kernel_scale,
    cross_entropy_fwd_kernel,
    cross_entropy_fwd_kernel_shard_stats,
)
from .reference import cross_entropy_reference, scale_keeping_zeros

# Launch configs measured on an H200 (benchmarks/scripts/tune_cross_entropy.py): rows of up to
# SINGLE_BLOCK_MAX columns are held in registers and read once; longer rows loop in blocks whose
# size grows with V, FWD_PROGRAMS_PER_SM rows in flight per multiprocessor (persistent grid).
SINGLE_BLOCK_MAX = 4096
LOOP_CONFIGS = ((65536, 16384, 16), (16384, 8192, 8), (0, 4096, 4))  # (min V, BLOCK_V, num_warps)
FWD_PROGRAMS_PER_SM = 4
BWD_BLOCK = 8192
SCALE_BLOCK = 8192


def _fwd_config(n_cols: int) -> tuple[bool, int, int, int]:
    """(row held in one block?, BLOCK_V, num_warps, programs per SM)."""
    block, num_warps = row_launch(n_cols, max_block=SINGLE_BLOCK_MAX)
    if block >= n_cols:
        return True, block, num_warps, FWD_PROGRAMS_PER_SM
    block, num_warps = next((b, w) for min_v, b, w in LOOP_CONFIGS if n_cols >= min_v)
    if interpret_mode():
        block, num_warps = row_launch(n_cols, max_block=SINGLE_BLOCK_MAX)
    return False, block, num_warps, FWD_PROGRAMS_PER_SM


def cross_entropy_fwd_into(
    logits, target, weight, weight_sum, grad_scale, grad, ignore_index, label_smoothing, z_loss, softcap
):
    """Per-row loss and lse (fp32 [N]); with `grad` (may be `logits` itself), also writes
    d(sum_i loss_i * grad_scale) / d logits into it. logits [N, V] with stride(-1) == 1, target [N]."""
    n_rows, n_cols = logits.shape
    assert logits.stride(-1) == 1 and target.is_contiguous()
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss, lse
    single, block, num_warps, per_sm = _fwd_config(n_cols)
    if grad is not None:
        assert grad.stride(-1) == 1 and grad.shape == logits.shape
    cross_entropy_fwd_kernel[(persistent_grid(n_rows, logits.device, per_sm),)](
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        target_ptr=target,
        weight_ptr=weight if weight is not None else logits,
        weight_sum_ptr=weight_sum if weight_sum is not None else grad_scale,
        grad_ptr=grad if grad is not None else logits,
        grad_row_stride=grad.stride(0) if grad is not None else 0,
        grad_scale_ptr=grad_scale,
        loss_ptr=loss,
        lse_ptr=lse,
        n_rows=n_rows,
        n_cols=n_cols,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        HAS_WEIGHT=weight is not None,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss != 0,
        HAS_SOFTCAP=softcap > 0,
        COMPUTE_GRAD=grad is not None,
        SINGLE_BLOCK=single,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return loss, lse


def cross_entropy_fwd(
    logits,
    target,
    weight,
    weight_sum,
    grad_scale,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    compute_grad,
):
    """Per-row loss and lse (fp32); with compute_grad, also d(sum of loss * grad_scale)/d logits."""
    grad = torch.empty_like(logits) if compute_grad else None
    loss, lse = cross_entropy_fwd_into(
        logits, target, weight, weight_sum, grad_scale, grad, ignore_index, label_smoothing, z_loss, softcap
    )
    return loss, lse, grad if grad is not None else logits.new_empty(0)


def cross_entropy_bwd(
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
    col_offset=0,
    n_classes=None,
):
    """Gradient from the saved lse into `grad` (may be `logits` itself): one read, one write per logit.
    A vocabulary shard: `logits` holds classes col_offset .. col_offset + V_local of `n_classes`; target,
    weight [n_classes] and lse are global."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return grad
    block, num_warps = row_launch(n_cols, max_block=BWD_BLOCK)
    cross_entropy_bwd_kernel[(n_rows,)](
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        target_ptr=target,
        weight_ptr=weight if weight is not None else logits,
        weight_sum_ptr=weight_sum if weight_sum is not None else grad_scale,
        grad_ptr=grad,
        grad_row_stride=grad.stride(0),
        grad_scale_ptr=grad_scale,
        dloss_ptr=dloss,
        dloss_stride=0 if dloss.numel() == 1 else 1,
        dlse_ptr=dlse if dlse is not None else lse,
        lse_ptr=lse,
        n_cols=n_cols,
        col_offset=col_offset,
        n_classes=n_cols if n_classes is None else n_classes,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        HAS_WEIGHT=weight is not None,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss != 0,
        HAS_SOFTCAP=softcap > 0,
        HAS_DLSE=dlse is not None,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return grad


def cross_entropy_shard_stats(logits, target, col_offset, weight, label_smoothing, softcap):
    """Per-row statistics of a vocabulary shard (classes col_offset .. col_offset + V_local of the
    vocabulary), fp32 [3, N]: shard lse, target logit if the shard holds it (else 0), sum_j w_j z_j
    (label smoothing only, else 0). logits [N, V_local] with stride(-1) == 1, target [N] (global ids),
    weight None or [V] (global)."""
    n_rows, n_cols = logits.shape
    assert logits.stride(-1) == 1 and target.is_contiguous()
    stats = torch.empty((3, n_rows), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return stats
    block, num_warps = row_launch(max(n_cols, 1), max_block=BWD_BLOCK)
    cross_entropy_fwd_kernel_shard_stats[(n_rows,)](
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        target_ptr=target,
        weight_ptr=weight if weight is not None else logits,
        stats_ptr=stats,
        n_rows=n_rows,
        n_cols=n_cols,
        col_offset=col_offset,
        softcap=softcap,
        HAS_WEIGHT=weight is not None,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_SOFTCAP=softcap > 0,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return stats


def cross_entropy_bwd_scale_(grad, dloss):
    """grad *= dloss (0-d or 1-element tensor), in place, skipped on the device when dloss == 1."""
    n_rows, n_cols = grad.shape
    if n_rows == 0:
        return
    block, num_warps = row_launch(n_cols, max_block=SCALE_BLOCK)
    cross_entropy_bwd_kernel_scale[(n_rows, triton.cdiv(n_cols, block))](
        grad_ptr=grad,
        grad_row_stride=grad.stride(0),
        dloss_ptr=dloss,
        n_cols=n_cols,
        BLOCK_V=block,
        num_warps=num_warps,
    )


# ---- custom ops: torch.compile sees one opaque node per launch, no graph break ----


@torch.library.custom_op("fuselm::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(
        logits,
        target,
        weight,
        weight_sum,
        grad_scale,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        compute_grad,
    )


@_ce_fwd_op.register_fake
def _(
    logits,
    target,
    weight,
    weight_sum,
    grad_scale,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    compute_grad,
):
    n = logits.shape[0]
    stats = logits.new_empty(n, dtype=torch.float32)
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
    return stats, logits.new_empty(n, dtype=torch.float32), grad


@torch.library.custom_op("fuselm::cross_entropy_fwd_inplace", mutates_args=("logits",))
def _ce_fwd_inplace_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd_into(
        logits, target, weight, weight_sum, grad_scale, logits, ignore_index, label_smoothing, z_loss, softcap
    )


@_ce_fwd_inplace_op.register_fake
def _(logits, target, weight, weight_sum, grad_scale, ignore_index, label_smoothing, z_loss, softcap):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("fuselm::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor,
    dloss: torch.Tensor,
    dlse: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> torch.Tensor:
    grad = torch.empty_like(logits)
    return cross_entropy_bwd(
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
    )


@_ce_bwd_op.register_fake
def _(
    logits,
    target,
    weight,
    weight_sum,
    grad_scale,
    dloss,
    dlse,
    lse,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
):
    return torch.empty_like(logits)


@torch.library.custom_op("fuselm::cross_entropy_bwd_inplace", mutates_args=("logits",))
def _ce_bwd_inplace_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor,
    dloss: torch.Tensor,
    dlse: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> None:
    cross_entropy_bwd(
        logits,
        target,
        weight,
        weight_sum,
        grad_scale,
        dloss,
        dlse,
        lse,
        logits,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    )


@torch.library.custom_op("fuselm::cross_entropy_bwd_scale_", mutates_args=("grad",))
def _ce_bwd_scale_op(grad: torch.Tensor, dloss: torch.Tensor) -> None:
    cross_entropy_bwd_scale_(grad, dloss)


# Eager calls launch directly (a custom op costs tens of microseconds of host time per call);
# under torch.compile the custom ops above stand in, so the graph has no break.


def _run_fwd(logits, target, weight, weight_sum, grad_scale, args, compute_grad, inplace):
    if torch.compiler.is_compiling():
        if inplace:
            return (*_ce_fwd_inplace_op(logits, target, weight, weight_sum, grad_scale, *args), logits)
        return _ce_fwd_op(logits, target, weight, weight_sum, grad_scale, *args, compute_grad)
    if inplace:
        loss, lse = cross_entropy_fwd_into(logits, target, weight, weight_sum, grad_scale, logits, *args)
        torch.autograd.graph.increment_version(logits)
        return loss, lse, logits
    return cross_entropy_fwd(logits, target, weight, weight_sum, grad_scale, *args, compute_grad)


def _run_bwd(inputs, args, inplace):
    logits = inputs[0]
    if torch.compiler.is_compiling():
        if inplace:
            _ce_bwd_inplace_op(*inputs, *args)
            return logits
        return _ce_bwd_op(*inputs, *args)
    grad = logits if inplace else torch.empty_like(logits)
    return cross_entropy_bwd(*inputs, grad, *args)


def _run_scale_(grad, dloss):
    """grad *= dloss in place, zeros kept (cross_entropy_bwd_scale_)."""
    if not use_triton(grad):  # a CPU vocabulary shard (fuselm.distributed on the reference path)
        grad.copy_(scale_keeping_zeros(grad, dloss))
    elif torch.compiler.is_compiling():
        _ce_bwd_scale_op(grad, dloss)
    else:
        cross_entropy_bwd_scale_(grad, dloss)


# ---- autograd ----


def loss_scales(target, weight, ignore_index, reduction, label_smoothing, n_cols):
    """Device tensors the kernels read, computed without a host sync: sum of the class weights
    ([1] fp32, when weights and smoothing are used, else None) and the gradient scale ([1] fp32:
    1 / (number of valid targets, or sum of their weights) for "mean", 1 otherwise)."""
    valid = target != ignore_index
    weight_sum = None
    if weight is not None:
        t_safe = torch.where(valid & (target >= 0) & (target < n_cols), target, 0)
        w_t = torch.where(valid, weight.float()[t_safe], 0.0)
        weight_sum = weight.float().sum().reshape(1) if label_smoothing > 0 else None
    if reduction == "mean":
        denom = w_t.sum() if weight is not None else valid.sum(dtype=torch.float32)
        return weight_sum, denom.reciprocal().reshape(1)
    return weight_sum, torch.ones(1, dtype=torch.float32, device=target.device)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd for [N, V] logits and [N] targets. Two plans:

    - gradient in forward (reduction mean/sum, no lse output, grad needed): the forward writes
      d loss / d logits (into the logits buffer with inplace_backward); the backward rescales it
      by grad_output in place, which the device skips when grad_output == 1.
    - gradient in backward (reduction none, or return_lse): the forward saves lse; the backward
      reads the logits once and writes the gradient once.

    `shard` (fuselm.distributed, eager only): the logits are one rank's vocabulary shard; its
    `fwd_into` / `bwd` replace cross_entropy_fwd_into / cross_entropy_bwd (same arguments, global
    statistics exchanged between ranks) and `n_classes` is the whole vocabulary.
    """

    @staticmethod
    def forward(
        ctx,
        logits,
        target,
        weight,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
        return_lse,
        inplace_backward,
        compute_grad,
        shard=None,
    ):
        n_classes = shard.n_classes if shard is not None else logits.shape[1]
        weight_sum, grad_scale = loss_scales(
            target, weight, ignore_index, reduction, label_smoothing, n_classes
        )
        grad_in_forward = compute_grad and reduction != "none" and not return_lse
        args = (ignore_index, label_smoothing, z_loss, softcap)
        if shard is None:
            loss, lse, grad = _run_fwd(
                logits,
                target,
                weight,
                weight_sum,
                grad_scale,
                args,
                grad_in_forward,
                grad_in_forward and inplace_backward,
            )
        else:
            grad = None
            if grad_in_forward:
                grad = logits if inplace_backward else torch.empty_like(logits)
            loss, lse = shard.fwd_into(logits, target, weight, weight_sum, grad_scale, grad, *args)
            if grad is logits:
                torch.autograd.graph.increment_version(logits)
        if grad_in_forward:
            ctx.save_for_backward(grad)
        else:
            ctx.save_for_backward(logits, target, weight, weight_sum, grad_scale, lse)
        ctx.grad_in_forward = grad_in_forward
        ctx.inplace = inplace_backward
        ctx.args = args
        ctx.shard = shard
        ctx.consumed = False
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            loss = loss.sum() * grad_scale[0]
        return loss, lse  # fp32; the caller casts to loss_dtype

    @staticmethod
    def backward(ctx, dloss, dlse):
        if ctx.consumed:
            raise RuntimeError(
                "fuselm.cross_entropy: backward ran twice through a graph whose gradient buffer was already "
                "used (gradient computed in forward or inplace_backward=True); recompute the loss instead of "
                "retain_graph=True"
            )
        if ctx.grad_in_forward or ctx.inplace:
            ctx.consumed = True
        if ctx.grad_in_forward:
            (grad,) = ctx.saved_tensors
            _run_scale_(grad, dloss.float().reshape(1))
        else:
            logits, target, weight, weight_sum, grad_scale, lse = ctx.saved_tensors
            dloss = dloss.float().reshape(-1).contiguous()
            dlse = dlse.float().reshape(-1).contiguous() if dlse is not None else None
            inputs = (logits, target, weight, weight_sum, grad_scale, dloss, dlse, lse)
            if ctx.shard is None:
                grad = _run_bwd(inputs, ctx.args, ctx.inplace)
            else:
                grad = ctx.shard.bwd(*inputs, logits if ctx.inplace else torch.empty_like(logits), *ctx.args)
        return grad, *([None] * 11)


def cross_entropy(
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
    inplace_backward: bool = False,
    loss_dtype: torch.dtype | None = None,
):
    """Cross-entropy between logits and class-index targets, fused into one pass per row.

    Same semantics as ``torch.nn.functional.cross_entropy`` (class-index targets), plus z-loss,
    softcapping and the log-sum-exp as a second output. The math is in ops/cross_entropy/README.md.

    Args:
        input: logits ``[..., V]`` (e.g. ``[B, T, V]`` or ``[N, V]``), float32 / float16 / bfloat16
            (float64 runs the PyTorch reference). Rows may be strided (``stride(-1) == 1``).
        target: class indices ``input.shape[:-1]``, int32 or int64. Entries equal to ``ignore_index``
            contribute no loss and get a zero gradient. Any other value outside ``[0, V)`` makes that
            token's loss NaN (so a mean or sum is NaN: visible) and its gradient zero (the weights stay
            finite), never an out-of-bounds read. No error by default, in eager mode too: the check would
            cost a host sync, which this op never makes; ``FUSELM_VALIDATE=1`` raises ValueError instead
            (one sync). (:func:`fuselm.linear_cross_entropy` raises in eager mode: it syncs anyway.)
        weight: optional class weights ``[V]``; ``mean`` divides by the sum of the targets' weights.
        ignore_index: target value to skip (any integer).
        reduction: ``"mean"`` (over non-ignored tokens; NaN when all are ignored, like PyTorch),
            ``"sum"`` or ``"none"`` (per-token losses of shape ``input.shape[:-1]``). Ignored tokens'
            gradients are zero whatever the upstream gradient, as PyTorch's (e.g. a sum divided by a count
            of 0: NaN loss, zero gradient).
        label_smoothing: in ``[0, 1]``, PyTorch's formula (also with ``weight``).
        z_loss: adds ``z_loss * lse**2`` to every non-ignored token's loss (PaLM).
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        return_lse: also return ``lse`` (float32, shape ``input.shape[:-1]``), differentiable.
        inplace_backward: write the gradient into ``input``'s buffer (no ``[N, V]`` allocation).
            ``input`` is overwritten by the forward (or backward) and must not be used afterwards;
            a second backward through the same graph raises RuntimeError.
        loss_dtype: the dtype of the returned loss: by default the input's (as PyTorch); the loss is
            accumulated in fp32, so ``torch.float32`` returns it unrounded (what Hugging Face's loss on
            ``logits.float()`` gives) without an fp32 copy of the logits.

    Returns:
        ``loss`` in ``loss_dtype`` (default: the dtype of ``input``; a scalar, or ``input.shape[:-1]``
        for ``"none"``), and ``lse`` when ``return_lse``.

    Example:
        >>> import torch, fuselm
        >>> logits = torch.randn(4, 10, requires_grad=True)
        >>> target = torch.tensor([1, 0, -100, 9])
        >>> loss = fuselm.cross_entropy(logits, target, label_smoothing=0.1)
        >>> loss.backward()
        >>> logits.grad.shape
        torch.Size([4, 10])
    """
    check_tensor("input", input, dtypes=(*FLOAT_DTYPES, torch.float64), min_ndim=1)
    loss_dtype = resolve_loss_dtype(loss_dtype, input)
    n_cols = input.shape[-1]
    if n_cols == 0:
        raise ValueError("input must have at least one class (last dimension is 0)")
    check_loss_args(
        input,
        target,
        n_cols,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
    )
    if input.dtype == torch.float64 or not use_triton(input):
        return cross_entropy_reference(
            input,
            target,
            weight=weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            return_lse=return_lse,
            loss_dtype=loss_dtype,
        )

    return apply_cross_entropy(
        input,
        target,
        weight,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
        return_lse,
        inplace_backward,
        loss_dtype,
    )


def apply_cross_entropy(
    input,
    target,
    weight,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
    return_lse,
    inplace_backward,
    loss_dtype,
    shard=None,
):
    """The Triton path of the public functions (arguments checked): rows view, CrossEntropyFunction,
    output shapes and dtype."""
    loss, lse = CrossEntropyFunction.apply(
        rows_view(input),
        target.reshape(-1).contiguous(),
        weight.contiguous() if weight is not None else None,
        ignore_index,
        reduction,
        float(label_smoothing),
        float(z_loss),
        float(softcap or 0.0),
        return_lse,
        inplace_backward,
        torch.is_grad_enabled() and input.requires_grad,
        shard,
    )
    loss = loss.to(loss_dtype)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    if return_lse:
        return loss, lse.reshape(target.shape)
    return loss
