"""fuselm.linear_cross_entropy: the autograd Function over a plan and a row backend, and the public
function. The plans (plan.py: chunked.py, fused.py) and the math and costs (README.md) are beside it.
"""

from __future__ import annotations

import torch

from .._common.dispatch import compaction_allowed, kernels_run
from .._common.guard import (
    FLOAT_DTYPES,
    check_classes,
    linear_operands,
    refuse_double_backward,
    resolve_loss_dtype,
    rows_view,
    validate_memory,
)
from .._common.loss.backend import RowBackend
from .._common.loss.compaction import kept_rows
from .._common.loss.options import Extras, LossOptions, LossScales, loss_outputs
from .._common.loss.reference import scale_keeping_zeros, z_loss_rows
from .._common.loss.rows import LocalRows, batch_scales, reduced_loss, scale_grad_
from .plan import Plan, choose_plan, fp32_accumulation, reference_chunk_rows, run_backward, run_forward
from .reference import DOUBLE_BACKWARD, linear_cross_entropy_reference_of


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for x [N, H], w [V, H], b [V] or None, target [N], through a plan and a row backend
    (LocalRows, or a vocabulary shard whose rows w, b are). `weight`, `token_weights` are opts.tensors()
    (tensors go at the top level). Two ways:

    - gradient in forward (reduction mean/sum, no lse output, some gradient needed): the forward
      computes dX, dW, db of the loss; the backward multiplies them by grad_output in place (the
      device skips it when grad_output == 1). 6NHV FLOPs with the chunked plan.
    - recompute (reduction none, or return_lse): the forward keeps lse; the backward recomputes
      the logits and writes the gradient over them. 8NHV FLOPs.

    `rows` (eager only): indices of the non-ignored rows, or None to compute every row.
    """

    @staticmethod
    def forward(
        ctx, x, w, b, target, weight, token_weights, rows, opts, plan, backend, extras, needs, loss_dtype
    ):
        n = x.shape[0]
        opts = opts.with_tensors(weight, token_weights)
        scales = batch_scales(target, opts, backend.n_classes)
        grad_in_forward = any(needs) and opts.reduction != "none" and not extras.lse
        n_work = n if rows is None else rows.shape[0]
        predicted = target.new_empty(n_work if extras.argmax else 0, dtype=torch.int64)
        loss, lse, dx, dw, db = run_forward(
            plan,
            x,
            w,
            b,
            target,
            rows,
            opts,
            scales,
            backend,
            grad_in_forward,
            needs,
            predicted if extras.argmax else None,
        )
        if extras.argmax and rows is not None:  # back to one per token: -1 on the ignored ones
            predicted = predicted.new_full((n,), -1).index_copy_(0, rows, predicted)
        ctx.backend = backend
        ctx.plan = plan
        ctx.grad_in_forward = grad_in_forward
        ctx.needs = needs
        ctx.opts = opts.with_tensors(None, None)
        ctx.bias_dtype = b.dtype if b is not None else None
        ctx.consumed = False
        if grad_in_forward:
            ctx.save_for_backward(dx, dw, db)
        else:
            ctx.save_for_backward(x, w, b, target, weight, token_weights, *scales, lse, rows)
        if not extras.lse:
            ctx.mark_non_differentiable(lse)
        if opts.reduction == "none" and rows is not None:
            loss = loss.new_zeros(n).index_copy_(0, rows, loss)  # ignored rows: loss 0
        return reduced_loss(loss, opts, scales, loss_dtype), lse, predicted

    @staticmethod
    def backward(ctx, dloss, dlse, _):
        refuse_double_backward(*DOUBLE_BACKWARD)
        if ctx.consumed:
            raise RuntimeError(
                "fuselm.linear_cross_entropy: backward ran twice through a graph whose gradients were "
                "computed in the forward and already handed out; recompute the loss instead of "
                "retain_graph=True"
            )
        if ctx.grad_in_forward:
            ctx.consumed = True
            dx, dw, db = ctx.saved_tensors
            dl = dloss.reshape(1)  # in the loss dtype: the kernels read it in fp32
            if dx is not None:
                scale_grad_(dx, dl)
            if dw is not None:
                scale_grad_(dw, dl)
            if db is not None:
                db = scale_keeping_zeros(db, dl)  # [V], kept in fp32 until here
        else:
            x, w, b, target, weight, token_weights, weight_sum, grad_scale, lse, rows = ctx.saved_tensors
            dloss = dloss.float().reshape(-1)
            if dloss.numel() != 1 and rows is not None:
                dloss = dloss.index_select(0, rows)
            dloss = dloss.contiguous()
            dlse = dlse.float().reshape(-1).contiguous() if dlse is not None else None
            opts = ctx.opts.with_tensors(weight, token_weights)
            scales = LossScales(weight_sum, grad_scale)
            dx, dw, db = run_backward(
                ctx.plan, x, w, b, target, rows, opts, scales, ctx.backend, dloss, dlse, lse, ctx.needs
            )
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dx, dw, db, *([None] * 10)


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
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
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
    loss_dtype: torch.dtype | None = None,
):
    """Cross-entropy of a linear layer's output, ``cross_entropy(input @ linear_weight.T + linear_bias,
    target, ...)``, without ever materializing the ``[N, V]`` logits.

    A drop-in for ``torch.nn.functional.linear_cross_entropy`` (same argument names, same loss) with
    the options of :func:`fuselm.cross_entropy` (z-loss, softcap, lse output). Tokens are processed in
    chunks of C rows: cuBLAS writes a chunk's logits into one reused ``[C, V]`` buffer, a Triton kernel
    turns them in place into d loss / d logits, and cuBLAS accumulates the gradients of ``input``,
    ``linear_weight`` and ``linear_bias`` (6NHV FLOPs in all, the cost of the three GEMMs). The math
    and the costs are in ops/linear_cross_entropy/README.md.

    Args:
        input: hidden states ``[..., H]`` (e.g. ``[B, T, H]``), float32 / float16 / bfloat16 (float64
            runs the PyTorch reference).
        linear_weight: ``[V, H]``, same dtype and device as ``input`` (e.g. the lm_head weight; if it
            is also used elsewhere, such as tied embeddings, autograd sums both gradients).
        target: class indices of shape ``input.shape[:-1]``, int32 or int64. Entries equal to
            ``ignore_index`` add no loss and get a zero gradient. Any other value outside ``[0, V)``:
            in eager mode, ValueError naming the value (found by the host sync that compacts the ignored
            rows, below: no extra sync); where no sync is allowed (``torch.compile``, CUDA graph capture,
            and ``return_lse``, which skips the compaction), that token's loss is NaN (so a mean or sum is
            NaN: visible) and its gradient zero (the weights stay finite), never an out-of-bounds read.
            ``FUSELM_VALIDATE=1`` raises ValueError in every mode (one more sync).
        linear_bias: optional ``[V]``, same dtype as ``input``.
        weight: optional class weights ``[V]`` (any float dtype); ``"mean"`` divides by the sum of the
            non-ignored targets' weights, as PyTorch does.
        ignore_index: target value to skip (any integer; ``None`` means -100, as in
            ``torch.nn.functional.linear_cross_entropy``).
        reduction: ``"mean"`` (over non-ignored tokens; NaN when all are ignored, like PyTorch), ``"sum"``
            or ``"none"`` (per-token losses of shape ``input.shape[:-1]``, 0 for ignored tokens). Ignored
            tokens' gradients are zero whatever the upstream gradient, as PyTorch's (a sum divided by a
            count of 0, as Hugging Face does for a batch without targets: NaN loss, zero gradients).
        label_smoothing: in ``[0, 1]``, PyTorch's formula (also with ``weight``).
        z_loss: adds ``z_loss * lse**2`` to every non-ignored token's loss (PaLM); ``>= 0``.
        softcap: if set (``> 0``), logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        token_weights: optional per-token loss weights of the target's shape, as in
            :func:`fuselm.cross_entropy` (each token's loss and gradient times its weight, the ``"mean"``
            denominator unchanged).
        return_lse: also return the log-sum-exp of each token's logits (float32, shape
            ``input.shape[:-1]``), differentiable.
        return_z_loss: also return the z-loss part of the loss, detached (as :func:`fuselm.cross_entropy`);
            it comes from the lse the op computes anyway (no extra pass, the plan is unchanged).
        return_token_accuracy, return_predicted_tokens: as in :func:`fuselm.cross_entropy` (the argmax is
            found by the row kernel in its pass over each chunk; under ``memory="min"`` they run the
            chunked plan with 8 MiB chunks, as the fused tile plan does not track it).
        memory: how much memory the temporaries may take (the plan follows from it).

            - ``"auto"`` (default): the chunked plan, a ``[C, V]`` chunk buffer of ``min(256 MiB, a quarter
              of the free device memory)``.
            - an int: the chunked plan within that many bytes.
            - ``"min"``: temporaries within 8 MiB whatever N. On a GPU (Triton path) that is the fused tile
              plan, O(N) extra memory: Triton kernels compute logit tiles on chip (lse first, then every
              tile again for the gradient, 8NHV FLOPs) and add dX, dW into the gradients with atomics (dX
              of 16-bit inputs accumulated in fp16 with per-row scales; see README.md). On the CPU
              reference path: chunks of 8 MiB.

            A chunk has ``C = budget // (V * itemsize)`` rows (at least 16, a multiple of 16, at most
            N). Its buffer is the only tensor of V columns, in the input dtype; with gathered ignored
            rows (below) two ``[C, H]`` temporaries come with it.
        loss_dtype: the dtype of the returned loss: by default the input's (as PyTorch), float32 under
            ``torch.autocast`` (below); the loss is accumulated in fp32 (fp64 for fp64 input), so
            ``torch.float32`` returns it unrounded, as Hugging Face's loss (on ``logits.float()``) is.

    Autocast: under ``torch.autocast``, ``input``, ``linear_weight`` and ``linear_bias`` are cast to the
    autocast dtype first, as ``F.linear`` would (the gradients flow back to their own dtypes), and the loss
    is returned in float32 for every reduction (unless ``loss_dtype`` says otherwise), as
    ``torch.nn.functional.linear_cross_entropy`` returns it (its cross-entropy runs in float32 under
    autocast).

    Plans: for ``"mean"``/``"sum"`` without ``return_lse``, the gradients are computed in the forward
    (the backward only multiplies them by the upstream gradient, skipped when it is 1); on the Triton
    path a second backward through the same graph raises RuntimeError. For ``"none"`` or
    ``return_lse`` the forward keeps the lse and the backward recomputes the logits (8NHV FLOPs). The
    gradient of ``linear_weight`` is accumulated over chunks by cuBLAS in fp32 within a chunk and
    rounded to its dtype once per chunk (fewer chunks, i.e. a larger budget, round less); the bias
    gradient is summed in fp32. Under ``"mean"`` the chunk gradient already carries the 1/count factor,
    so in float16 very small softmax entries can underflow, exactly as in eager float16 PyTorch.

    Ignored tokens: in eager mode (not under ``torch.compile``, not while capturing a CUDA graph) the
    non-ignored rows are found first, at the cost of one host synchronization, and only they go through
    the GEMMs, so ignored tokens (padding, prompt tokens) cost no FLOPs. Under ``torch.compile`` and CUDA
    graph capture every row is computed (no sync; ignored rows still get a zero loss and gradient). With
    ``return_lse`` every row is computed as well (the lse of every row is returned).

    Double backward: not supported on any path: a backward with ``create_graph=True`` (higher-order
    gradients) raises RuntimeError naming it (the gradients come from kernels or from the forward, not
    from a differentiable graph); use ``torch.nn.functional.linear_cross_entropy`` or
    ``F.cross_entropy(F.linear(...))`` for those.

    Returns:
        ``loss`` in ``loss_dtype`` (a scalar, or ``input.shape[:-1]`` for ``"none"``); with any ``return_*`` a
        tuple ``(loss, lse, z_loss, token_accuracy, predicted_tokens)`` of the requested ones, in that order.

    Example:
        >>> import torch
        >>> from fuselm.ops.linear_cross_entropy import linear_cross_entropy
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> lm_head = torch.randn(100, 16, requires_grad=True)
        >>> target = torch.randint(0, 100, (2, 5))
        >>> target[0, :2] = -100
        >>> loss = linear_cross_entropy(hidden, lm_head, target, label_smoothing=0.1)
        >>> loss.backward()
        >>> hidden.grad.shape, lm_head.grad.shape
        (torch.Size([2, 5, 16]), torch.Size([100, 16]))
    """
    input, linear_weight, linear_bias = linear_operands(
        input, linear_weight, linear_bias, dtypes=(*FLOAT_DTYPES, torch.float64)
    )
    loss_dtype = resolve_loss_dtype(loss_dtype, input)
    h = input.shape[-1]
    v = linear_weight.shape[0]
    check_classes("linear_weight", v)
    if ignore_index is None:  # torch.nn.functional.linear_cross_entropy's default, which means -100
        ignore_index = -100
    opts = LossOptions.of(weight, ignore_index, reduction, label_smoothing, z_loss, softcap, token_weights)
    opts = opts.checked(input, target, v)
    validate_memory(memory)
    fp32_weight_grad = fp32_accumulation(accum_dtype, input.dtype)
    extras = Extras(return_lse, return_z_loss, return_token_accuracy, return_predicted_tokens)

    if not kernels_run(input):
        if not return_lse and compaction_allowed(input.device):  # eager: the range check, as on Triton
            kept_rows(target.reshape(-1), v, ignore_index)
        compute_itemsize = 8 if input.dtype == torch.float64 else 4
        chunk_rows = reference_chunk_rows(memory, v, h, compute_itemsize)
        return linear_cross_entropy_reference_of(
            input, linear_weight, target, linear_bias, opts, chunk_rows, extras, loss_dtype
        )
    plan = choose_plan(
        memory, input.device, v, h, input.element_size(), True, fp32_weight_grad, extras.argmax
    )
    return apply_linear_cross_entropy(
        input,
        linear_weight,
        linear_bias,
        target,
        opts=opts,
        plan=plan,
        backend=LocalRows(v),
        extras=extras,
        loss_dtype=loss_dtype,
    )


def apply_linear_cross_entropy(
    input,
    linear_weight,
    linear_bias,
    target,
    opts: LossOptions,
    plan: Plan,
    backend: RowBackend,
    extras: Extras,
    loss_dtype: torch.dtype,
):
    """The Triton path of the public functions (arguments checked): rows view, compaction of ignored rows
    (eager), LinearCrossEntropyFunction, the outputs asked for (loss_outputs)."""
    t1 = target.reshape(-1).contiguous()
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and input.requires_grad,
        grad_on and linear_weight.requires_grad,
        grad_on and linear_bias is not None and linear_bias.requires_grad,
    )
    rows = None
    if not extras.lse and compaction_allowed(input.device):
        rows = kept_rows(t1, backend.n_classes, opts.ignore_index)  # the one host sync (and the range check)
    loss, lse, predicted = LinearCrossEntropyFunction.apply(
        rows_view(input),
        linear_weight,
        linear_bias,
        t1,
        *opts.tensors(),
        rows,
        opts.with_tensors(None, None),
        plan,
        backend,
        extras,
        needs,
        loss_dtype,
    )
    z_loss = None
    if extras.z_loss:  # from the lse of the computed rows (the others add 0)
        n_classes = backend.n_classes
        z_rows = z_loss_rows(lse, t1 if rows is None else t1.index_select(0, rows), n_classes, opts)
        if rows is not None:
            z_rows = z_rows.new_zeros(t1.shape[0]).index_copy_(0, rows, z_rows)
        z_loss = reduced_loss(z_rows, opts, batch_scales(t1, opts, n_classes), loss_dtype)
    return loss_outputs(loss, lse, target, opts, loss_dtype, extras, z_loss, predicted)
