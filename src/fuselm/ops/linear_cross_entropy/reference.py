"""Pure-PyTorch linear cross-entropy: the spec, the CPU fallback, the float64 test oracle.

    logits = input @ linear_weight.T + linear_bias            # [N, V], never held whole
    loss   = cross_entropy(logits, target, ...)               # fuselm.cross_entropy semantics

Tokens are processed in chunks of `chunk_rows` rows, so at most a few [chunk_rows, V] tensors
exist at a time (never [N, V]). The per-row math is the family's `row_losses`
(ops/_common/loss/reference.py); its gradient d loss / d logits comes from autograd on one chunk at a time.

Two plans, the same as the Triton path (see README.md):
- reduction "mean"/"sum" without lse output: the forward computes each chunk's gradient G and
  accumulates dX = G W, dW = G^T X, db = sum_rows G in fp32 (fp64 for fp64 input); the backward
  only multiplies them by grad_output.
- reduction "none" or return_lse: the forward keeps lse; the backward recomputes each chunk's logits
  and its gradient with the per-token grad_output and the lse gradient.
"""

from __future__ import annotations

import torch

from .._common.guard import refuse_double_backward
from .._common.loss.options import Extras, LossOptions, loss_outputs, loss_scales, reduce_rows
from .._common.loss.reference import predicted_tokens, row_losses, scale_keeping_zeros, z_loss_rows

# refuse_double_backward's arguments, for the reference's Function and the op's
DOUBLE_BACKWARD = (
    "linear_cross_entropy",
    "fused kernels, or gradients computed in the forward",
    "torch.nn.functional.linear_cross_entropy, or F.cross_entropy(F.linear(input, linear_weight, "
    "linear_bias), target) (eager PyTorch)",
)

# Default working-set budget of the reference: a chunk's fp32 logits take at most this many bytes.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_loss_grad(logits, target, opts: LossOptions, dloss, dlse):
    """One chunk: (loss_rows, lse, grad) with grad = d(sum(loss_rows * dloss) + sum(lse * dlse)) / d logits.

    logits [C, V] in the compute dtype; dloss is a scalar or [C] tensor (None: no gradient), dlse [C] or None.
    """
    if dloss is None:
        with torch.no_grad():
            return (*row_losses(logits, target, opts), None)

    def objective(z):
        loss, lse = row_losses(z, target, opts)
        total = (loss * dloss).sum() + ((lse * dlse).sum() if dlse is not None else 0)
        return total, (loss, lse)

    if torch.compiler.is_compiling():  # torch.compile traces torch.func.grad, not torch.autograd.grad
        grad, (loss, lse) = torch.func.grad(objective, has_aux=True)(logits.detach())
    else:  # torch.func refuses saved-tensor hooks (activation offloading, the demo's meter)
        with torch.enable_grad():
            z = logits.detach().requires_grad_()
            total, (loss, lse) = objective(z)
            (grad,) = torch.autograd.grad(total, z)
    return loss.detach(), lse.detach(), grad


class _LinearCrossEntropyReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, target, weight, token_weights, opts, chunk_rows, return_lse, argmax):
        with torch.autocast(x.device.type, enabled=False):  # fp32 math whatever autocast says
            cd = _compute_dtype(x.dtype)
            n, v = x.shape[0], w.shape[0]
            wc = w.to(cd)
            bc = b.to(cd) if b is not None else None
            opts = opts.with_tensors(weight, token_weights)
            reduction = opts.reduction
            valid = target != opts.ignore_index
            if weight is not None:
                t_safe = torch.where(valid & (target >= 0) & (target < v), target, 0)
                denom = torch.where(valid, weight.to(cd)[t_safe], 0).sum()
            else:
                denom = valid.sum().to(cd)
            scale = 1.0 / denom if reduction == "mean" else torch.ones((), dtype=cd, device=x.device)
            needs = ctx.needs_input_grad[:3]
            grad_in_forward = any(needs) and reduction != "none" and not return_lse
            loss = torch.empty(n, dtype=cd, device=x.device)
            predicted = torch.empty(n if argmax else 0, dtype=torch.int64, device=x.device)
            lse = torch.empty(n, dtype=cd, device=x.device)
            dx = torch.zeros((n, x.shape[1]), dtype=cd, device=x.device) if grad_in_forward else None
            dw = torch.zeros((v, w.shape[1]), dtype=cd, device=x.device) if grad_in_forward else None
            db = torch.zeros(v, dtype=cd, device=x.device) if grad_in_forward and b is not None else None
            for s in range(0, n, chunk_rows):
                e = min(s + chunk_rows, n)
                xc = x[s:e].to(cd)
                logits = xc @ wc.T if bc is None else torch.addmm(bc, xc, wc.T)  # [C, V]
                loss[s:e], lse[s:e], g = chunk_loss_grad(
                    logits, target[s:e], opts.for_rows(slice(s, e)), scale if grad_in_forward else None, None
                )
                if argmax:
                    predicted[s:e] = predicted_tokens(logits, target[s:e], opts)
                if grad_in_forward:
                    dx[s:e] = g @ wc
                    dw += g.T @ xc
                    if db is not None:
                        db += g.sum(0)
            ctx.grad_in_forward = grad_in_forward
            ctx.device_type = x.device.type
            ctx.dtypes = (x.dtype, w.dtype, b.dtype if b is not None else None)
            ctx.args = (chunk_rows, opts.with_tensors(None, None), return_lse)
            if grad_in_forward:
                ctx.save_for_backward(dx, dw, db)
            else:
                ctx.save_for_backward(x, w, b, target, weight, token_weights, scale)
            if not return_lse:
                ctx.mark_non_differentiable(lse)
            if reduction == "sum":
                out = loss.sum()
            elif reduction == "mean":
                out = loss.sum() * scale
            else:
                out = loss
            return out, lse, predicted  # compute dtype; the caller casts to loss_dtype

    @staticmethod
    def backward(ctx, dloss, dlse, _):
        refuse_double_backward(*DOUBLE_BACKWARD)
        with torch.autocast(ctx.device_type, enabled=False):
            chunk_rows, opts, return_lse = ctx.args
            if ctx.grad_in_forward:
                dx, dw, db = ctx.saved_tensors
                d = dloss.to(dx.dtype)
                x_dtype, w_dtype, b_dtype = ctx.dtypes
                db = scale_keeping_zeros(db, d).to(b_dtype) if db is not None else None
                dx, dw = scale_keeping_zeros(dx, d).to(x_dtype), scale_keeping_zeros(dw, d).to(w_dtype)
                return dx, dw, db, *([None] * 7)
            x, w, b, target, weight, token_weights, scale = ctx.saved_tensors
            opts = opts.with_tensors(weight, token_weights)
            cd = _compute_dtype(x.dtype)
            n, v = x.shape[0], w.shape[0]
            wc = w.to(cd)
            bc = b.to(cd) if b is not None else None
            dloss = dloss.to(cd)
            dlse = dlse.to(cd) if return_lse and dlse is not None else None
            dx = torch.zeros((n, x.shape[1]), dtype=cd, device=x.device)
            dw = torch.zeros((v, w.shape[1]), dtype=cd, device=x.device)
            db = torch.zeros(v, dtype=cd, device=x.device) if b is not None else None
            for s in range(0, n, chunk_rows):
                e = min(s + chunk_rows, n)
                xc = x[s:e].to(cd)
                logits = xc @ wc.T if bc is None else torch.addmm(bc, xc, wc.T)
                coef = dloss[s:e] if opts.reduction == "none" else dloss * scale
                dlse_c = dlse[s:e] if dlse is not None else None
                _, _, g = chunk_loss_grad(logits, target[s:e], opts.for_rows(slice(s, e)), coef, dlse_c)
                dx[s:e] = g @ wc
                dw += g.T @ xc
                if db is not None:
                    db += g.sum(0)
            x_dtype, w_dtype, b_dtype = ctx.dtypes
            db = db.to(b_dtype) if db is not None else None
            return dx.to(x_dtype), dw.to(w_dtype), db, *([None] * 7)


def linear_cross_entropy_reference(
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
    chunk_rows: int | None = None,
    loss_dtype: torch.dtype | None = None,
):
    """cross_entropy(input @ linear_weight.T + linear_bias, target, ...) in chunks of tokens, in PyTorch.

    input [..., H], linear_weight [V, H], linear_bias [V] or None, target input.shape[:-1] (int).
    Math in fp32 (fp64 for fp64 input); loss in ``loss_dtype`` (default: the input dtype), lse in
    fp32 (fp64); gradients in the dtypes of input, linear_weight, linear_bias. Arguments as in
    ``fuselm.linear_cross_entropy``; ``chunk_rows`` tokens per chunk (default: a chunk's fp32 logits
    take at most 256 MiB). Memory: a few [chunk_rows, V] tensors in the compute dtype (logits,
    autograd's softmax and gradient) plus compute-dtype copies of linear_weight and the gradient
    accumulators, O(VH); never O(NV). Autocast does not reach the math (fp32 whatever it says).
    A target outside [0, V) that is not ignore_index: NaN loss for that token, zero gradient
    (``fuselm.linear_cross_entropy`` raises ValueError first in eager mode).

    Example:
        >>> import torch
        >>> x, w = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8)
        >>> linear_cross_entropy_reference(x, w, torch.randint(0, 20, (6,)), chunk_rows=4).backward()
    """
    v = linear_weight.shape[0]
    ignore_index = -100 if ignore_index is None else ignore_index
    if chunk_rows is None:
        chunk_rows = DEFAULT_CHUNK_BYTES // (
            v * torch.tensor([], dtype=_compute_dtype(input.dtype)).element_size()
        )
    per_token = token_weights.reshape(-1) if token_weights is not None else None  # [N], as checked() gives
    opts = LossOptions.of(weight, ignore_index, reduction, label_smoothing, z_loss, softcap, per_token)
    outputs = (Extras(return_lse, return_z_loss, return_token_accuracy, return_predicted_tokens), loss_dtype)
    return linear_cross_entropy_reference_of(
        input, linear_weight, target, linear_bias, opts, chunk_rows, *outputs
    )


def linear_cross_entropy_reference_of(
    input, w, target, b, opts: LossOptions, chunk_rows, extras: Extras, loss_dtype
):
    """linear_cross_entropy_reference with the options as one LossOptions and chunk_rows given (what
    fuselm.linear_cross_entropy calls)."""
    h = input.shape[-1]
    t1 = target.reshape(-1)
    loss, lse, predicted = _LinearCrossEntropyReference.apply(
        input.reshape(-1, h),
        w,
        b,
        t1,
        *opts.tensors(),
        opts.with_tensors(None, None),
        max(1, int(chunk_rows)),
        extras.lse,
        extras.argmax,
    )
    z_loss = None
    if extras.z_loss:
        v = w.shape[0]
        z_loss = reduce_rows(z_loss_rows(lse, t1, v, opts), opts, loss_scales(t1, opts, v))
    return loss_outputs(loss, lse, target, opts, loss_dtype or input.dtype, extras, z_loss, predicted)
