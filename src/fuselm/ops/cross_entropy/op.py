"""fuselm.cross_entropy: the autograd Function over a row backend, and the public function.

The kernels are the family's row kernels (ops/_common/loss/): LocalRows runs them on one device;
fuselm.distributed passes a VocabShard instead, which runs them on a slice of the classes.
"""

from __future__ import annotations

import torch

from .._common.dispatch import kernels_run
from .._common.guard import (
    FLOAT_DTYPES,
    check_classes,
    check_tensor,
    refuse_double_backward,
    resolve_loss_dtype,
    rows_view,
)
from .._common.loss.backend import RowBackend
from .._common.loss.options import Extras, LossOptions, LossScales, loss_outputs
from .._common.loss.reference import z_loss_rows
from .._common.loss.rows import LocalRows, batch_scales, reduced_loss, scale_grad_
from .reference import cross_entropy_reference_of


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd for [N, C] logits and [N] targets through a row backend (LocalRows, or a vocabulary shard).
    `weight`, `token_weights` are opts.tensors(), passed beside the options because autograd Functions take
    tensors at the top level. Two plans:

    - gradient in forward (reduction mean/sum, no lse output, grad needed): the forward writes
      d loss / d logits (into the logits buffer with inplace_backward); the backward rescales it
      by grad_output in place, which the device skips when grad_output == 1.
    - gradient in backward (reduction none, or return_lse): the forward saves lse; the backward
      reads the logits once and writes the gradient once.
    """

    @staticmethod
    def forward(
        ctx,
        logits,
        target,
        weight,
        token_weights,
        opts,
        backend,
        extras,
        inplace_backward,
        compute_grad,
        loss_dtype,
    ):
        opts = opts.with_tensors(weight, token_weights)
        scales = backend.scales_for_forward(target, opts)
        grad_in_forward = compute_grad and opts.reduction != "none" and not extras.lse
        mode = ("inplace" if inplace_backward else "new") if grad_in_forward else None
        predicted = target.new_empty(target.shape[0], dtype=torch.int64) if extras.argmax else None
        loss, lse, grad = backend.forward(logits, target, opts, scales, mode, predicted)
        if mode == "inplace" and not torch.compiler.is_compiling():
            torch.autograd.graph.increment_version(logits)
        if grad_in_forward:
            ctx.save_for_backward(grad)
        else:
            ctx.save_for_backward(logits, target, weight, token_weights, *scales, lse)
        ctx.grad_in_forward = grad_in_forward
        ctx.inplace = inplace_backward
        ctx.opts = opts.with_tensors(None, None)
        ctx.backend = backend
        ctx.consumed = False
        return reduced_loss(loss, opts, scales, loss_dtype), lse, predicted

    @staticmethod
    def backward(ctx, dloss, dlse, _):
        refuse_double_backward(
            "cross_entropy", "Triton row kernels", "torch.nn.functional.cross_entropy (eager PyTorch)"
        )
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
            scale_grad_(grad, dloss.reshape(1))  # dloss in the loss dtype: the kernel reads it in fp32
        else:
            logits, target, weight, token_weights, weight_sum, grad_scale, lse = ctx.saved_tensors
            dloss = dloss.float().reshape(-1).contiguous()
            dlse = dlse.float().reshape(-1).contiguous() if dlse is not None else None
            opts = ctx.opts.with_tensors(weight, token_weights)
            scales = LossScales(weight_sum, grad_scale)
            grad = ctx.backend.backward(logits, target, opts, scales, dloss, dlse, lse, ctx.inplace)
        return grad, *([None] * 9)


_DTYPES = (*FLOAT_DTYPES, torch.float64)


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
    token_weights: torch.Tensor | None = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
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
        token_weights: optional per-token loss weights of the target's shape (any float dtype, no
            gradient): each token's loss and gradient are multiplied by its weight; ``"mean"`` keeps its
            denominator (the count of non-ignored tokens, or the sum of their class weights), so the weights
            scale tokens without renormalizing. DFT-style token scaling (each token weighted by the detached
            probability of its target) is ``token_weights=p_target`` computed without a graph: see the
            README of ops/cross_entropy.
        return_lse: also return ``lse`` (float32, shape ``input.shape[:-1]``), differentiable.
        return_z_loss: also return the z-loss part of the loss (``z_loss * lse**2`` summed over the
            non-ignored tokens and reduced as the loss; with class weights, "mean" divides it by the sum of
            the targets' weights like the rest of the loss), detached: for logging.
        return_token_accuracy: also return the token accuracy: the fraction of non-ignored tokens whose
            argmax class is the target (``"sum"``: their number, ``"none"``: 1.0 / 0.0 per token), fp32,
            no gradient, class and token weights not applied. The argmax is found by the kernel in its
            pass over the row (no extra pass).
        return_predicted_tokens: also return each token's argmax class (int64, the target's shape; the
            first maximal class, as ``torch.argmax``; -1 for ignored tokens).
        inplace_backward: write the gradient into ``input``'s buffer (no ``[N, V]`` allocation).
            ``input`` is overwritten by the forward (or backward) and must not be used afterwards;
            a second backward through the same graph raises RuntimeError.
        loss_dtype: the dtype of the returned loss: by default the input's (as PyTorch), and float32 under
            ``torch.autocast`` (as ``torch.nn.functional.cross_entropy``, which autocast runs in float32);
            the loss is accumulated in fp32, so ``torch.float32`` returns it unrounded (what Hugging Face's
            loss on ``logits.float()`` gives) without an fp32 copy of the logits.

    Double backward: not supported on the Triton path (CUDA, or ``TRITON_INTERPRET=1``): a backward with
    ``create_graph=True`` (higher-order gradients, e.g. a gradient penalty) raises RuntimeError naming it,
    as the kernels' gradient is not differentiable; use ``torch.nn.functional.cross_entropy`` there. The
    PyTorch reference path (CPU tensors without ``TRITON_INTERPRET``, float64) is plain autograd and
    supports it.

    Returns:
        ``loss`` in ``loss_dtype`` (default: the dtype of ``input``; a scalar, or ``input.shape[:-1]``
        for ``"none"``); with any ``return_*`` a tuple ``(loss, lse, z_loss, token_accuracy,
        predicted_tokens)`` of the requested ones, in that order.

    Example:
        >>> import torch, fuselm
        >>> logits = torch.randn(4, 10, requires_grad=True)
        >>> target = torch.tensor([1, 0, -100, 9])
        >>> loss = fuselm.cross_entropy(logits, target, label_smoothing=0.1)
        >>> loss.backward()
        >>> logits.grad.shape
        torch.Size([4, 10])
    """
    check_tensor("input", input, dtypes=_DTYPES, min_ndim=1)
    loss_dtype = resolve_loss_dtype(loss_dtype, input)
    n_cols = input.shape[-1]
    check_classes("input", n_cols)
    opts = LossOptions.of(weight, ignore_index, reduction, label_smoothing, z_loss, softcap, token_weights)
    opts = opts.checked(input, target, n_cols)
    extras = Extras(return_lse, return_z_loss, return_token_accuracy, return_predicted_tokens)
    if not kernels_run(input):
        return cross_entropy_reference_of(input, target, opts, extras, loss_dtype)
    return apply_cross_entropy(input, target, opts, inplace_backward, LocalRows(n_cols), extras, loss_dtype)


def apply_cross_entropy(
    input, target, opts: LossOptions, inplace_backward, backend: RowBackend, extras: Extras, loss_dtype
):
    """The Triton path of the public functions (arguments checked): rows view, CrossEntropyFunction over
    `backend`, the outputs asked for (loss_outputs)."""
    t1 = target if target.dim() == 1 and target.is_contiguous() else target.reshape(-1).contiguous()
    loss, lse, predicted = CrossEntropyFunction.apply(
        rows_view(input),
        t1,
        *opts.tensors(),
        opts.with_tensors(None, None),
        backend,
        extras,
        inplace_backward,
        torch.is_grad_enabled() and input.requires_grad,
        loss_dtype,
    )
    z_loss = None
    if extras.z_loss:
        n_classes = backend.n_classes
        z_rows = z_loss_rows(lse, t1, n_classes, opts)
        z_loss = reduced_loss(z_rows, opts, batch_scales(t1, opts, n_classes), loss_dtype)
    return loss_outputs(loss, lse, target, opts, loss_dtype, extras, z_loss, predicted)
