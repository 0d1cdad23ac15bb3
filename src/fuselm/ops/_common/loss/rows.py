"""Launchers of the row kernels, their custom ops (what torch.compile sees), and LocalRows: the row backend
of one device.

A row backend turns rows of logits [N, C] into per-row losses and lse, and into d loss / d logits: the
contract the autograd Functions of cross_entropy and linear_cross_entropy are written against. LocalRows
holds every class of a row (C = V); fuselm.distributed's VocabShard holds a slice of them and exchanges
per-row statistics with the other ranks. Both take a LossOptions and the LossScales of the batch.
"""

from __future__ import annotations

import functools

import torch

from ..dispatch import compiled_or_launcher, interpret_mode, use_triton
from ..launch import cdiv, launcher, persistent_grid, row_launch
from .options import (
    LossOptions,
    LossScales,
    family_custom_op,
    family_fake,
    loss_scales,
    options_of,
    reduce_rows,
)
from .reference import scale_keeping_zeros
from .row_kernels import (
    cross_entropy_bwd_kernel,
    cross_entropy_bwd_kernel_scale,
    cross_entropy_fwd_kernel,
    loss_reduce_kernel,
    loss_scales_kernel,
)

# Launch configs measured on an H200 and an H100 (benchmarks/scripts/tune_cross_entropy.py,
# ce_configs_graph.py): rows of up to SINGLE_BLOCK_MAX columns are held in registers and read once
# (longer rows held whole spill: 0.47-0.67x copy at V = 32000 against 0.84x looped); longer rows loop
# in blocks whose size grows with V, FWD_PROGRAMS_PER_SM rows in flight per multiprocessor (persistent
# grid). V = 32000 on an H100: 16384 / 16 warps 0.818 ms, 8192 / 8 warps 0.828 ms.
SINGLE_BLOCK_MAX = 4096
LOOP_CONFIGS = ((16384, 16384, 16), (0, 4096, 4))  # (min V, BLOCK_V, num_warps)
FWD_PROGRAMS_PER_SM = 4
BWD_BLOCK = 8192
SCALE_BLOCK = 8192
# The forward kernel finds the batch's scales itself (every program reads every target: programs x rows
# loads, L2-resident) up to this many loads, instead of one more launch (tens of microseconds of host time)
FIND_SCALES_MAX_LOADS = 1 << 20

# cached launch bindings of the kernels (ops/_common/launch.py)
cross_entropy_fwd_launch = launcher(cross_entropy_fwd_kernel)
cross_entropy_bwd_launch = launcher(cross_entropy_bwd_kernel)
cross_entropy_bwd_scale_launch = launcher(cross_entropy_bwd_kernel_scale)
loss_scales_launch = launcher(loss_scales_kernel)
loss_reduce_launch = launcher(loss_reduce_kernel)


@functools.lru_cache(maxsize=256)  # host time: once per width
def _fwd_config(n_cols: int) -> tuple[bool, int, int, int]:
    """(row held in one block?, BLOCK_V, num_warps, programs per SM); benchmarks/scripts/tune_cross_entropy.py
    replaces it to try configs."""
    block, num_warps = row_launch(n_cols, max_block=SINGLE_BLOCK_MAX)
    if block >= n_cols:
        return True, block, num_warps, FWD_PROGRAMS_PER_SM
    block, num_warps = next((b, w) for min_v, b, w in LOOP_CONFIGS if n_cols >= min_v)
    if interpret_mode():
        block, num_warps = row_launch(n_cols, max_block=SINGLE_BLOCK_MAX)
    return False, block, num_warps, FWD_PROGRAMS_PER_SM


def _kernel_options(opts: LossOptions, scales: LossScales) -> dict:
    """The arguments every row kernel takes from the options and the scales."""
    return dict(
        weight_ptr=opts.weight if opts.weight is not None else scales.grad_scale,
        weight_sum_ptr=scales.weight_sum if scales.weight_sum is not None else scales.grad_scale,
        grad_scale_ptr=scales.grad_scale,
        token_weight_ptr=opts.token_weights if opts.token_weights is not None else scales.grad_scale,
        ignore_index=opts.ignore_index,
        label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss,
        softcap=opts.softcap,
        HAS_WEIGHT=opts.weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0,
        HAS_Z_LOSS=opts.z_loss != 0,
        HAS_SOFTCAP=opts.softcap > 0,
        HAS_TOKEN_WEIGHT=opts.token_weights is not None,
    )


def rows_fwd_into(
    logits, target, opts: LossOptions, scales: LossScales, grad, predicted=None, find_scales=False
):
    """Per-row loss and lse (fp32 [N]) of logits [N, V] (stride(-1) == 1), target [N]; with `grad` (may be
    `logits` itself), also writes d(sum_i loss_i * grad_scale) / d logits into it; with `predicted` (int64
    [N]), the argmax of each row's logits (the first maximal class; -1 on ignored rows). find_scales: the
    `scales` buffers are not written yet: the kernel computes them (N > 0) and writes them."""
    n_rows, n_cols = logits.shape
    assert logits.stride(-1) == 1 and target.is_contiguous()
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss, lse
    single, block, num_warps, per_sm = _fwd_config(n_cols)
    if grad is not None:
        assert grad.stride(-1) == 1 and grad.shape == logits.shape
    cross_entropy_fwd_launch(
        (persistent_grid(n_rows, logits.device, per_sm),),
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        target_ptr=target,
        grad_ptr=grad if grad is not None else logits,
        grad_row_stride=grad.stride(0) if grad is not None else 0,
        loss_ptr=loss,
        lse_ptr=lse,
        predicted_ptr=predicted if predicted is not None else lse,
        n_rows=n_rows,
        n_cols=n_cols,
        HAS_PREDICTED=predicted is not None,
        COMPUTE_GRAD=grad is not None,
        SINGLE_BLOCK=single,
        BLOCK_V=block,
        FIND_SCALES=find_scales,
        MEAN=find_scales and opts.reduction == "mean",
        WEIGHT_SUM=find_scales and scales.weight_sum is not None,
        num_warps=num_warps,
        **_kernel_options(opts, scales),
    )
    return loss, lse


def rows_bwd_into(
    logits,
    target,
    opts: LossOptions,
    scales: LossScales,
    dloss,
    dlse,
    lse,
    grad,
    col_offset=0,
    n_classes=None,
):
    """d(sum_i loss_i * grad_scale * dloss_i + lse_i * dlse_i) / d logits from the saved lse into `grad` (may
    be `logits` itself): one read, one write per logit. dloss: fp32 [1] or [N]; dlse fp32 [N] or None.
    A vocabulary shard: `logits` holds classes col_offset .. col_offset + C of `n_classes`; target, weight
    [n_classes] and lse are global."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return grad
    block, num_warps = row_launch(n_cols, max_block=BWD_BLOCK)
    cross_entropy_bwd_launch(
        (n_rows,),
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        target_ptr=target,
        grad_ptr=grad,
        grad_row_stride=grad.stride(0),
        dloss_ptr=dloss,
        dloss_stride=0 if dloss.numel() == 1 else 1,
        dlse_ptr=dlse if dlse is not None else lse,
        lse_ptr=lse,
        n_cols=n_cols,
        col_offset=col_offset,
        n_classes=n_cols if n_classes is None else n_classes,
        HAS_DLSE=dlse is not None,
        BLOCK_V=block,
        num_warps=num_warps,
        **_kernel_options(opts, scales),
    )
    return grad


def _scale_grad_kernel_(grad, dloss):
    n_rows, n_cols = grad.shape
    if n_rows == 0:
        return
    block, num_warps = row_launch(n_cols, max_block=SCALE_BLOCK)
    cross_entropy_bwd_scale_launch(
        (n_rows, cdiv(n_cols, block)),
        grad_ptr=grad,
        grad_row_stride=grad.stride(0),
        dloss_ptr=dloss,
        n_cols=n_cols,
        BLOCK_V=block,
        num_warps=num_warps,
    )


def _one_launch(t: torch.Tensor) -> bool:
    """Run the reduction helpers as one Triton launch each? Eager calls on the Triton path only: under
    torch.compile the torch ops fuse, and the CPU reference path has no launches to save."""
    return use_triton(t) and not torch.compiler.is_compiling()


def batch_scales(target: torch.Tensor, opts: LossOptions, n_classes: int) -> LossScales:
    """options.loss_scales of target [N] (contiguous) in one launch (eager, Triton path)."""
    if not _one_launch(target):
        return loss_scales(target, opts, n_classes)
    scales = _scales_buffer(target, opts)
    loss_scales_launch(
        (1,),
        target_ptr=target,
        weight_ptr=opts.weight if opts.weight is not None else scales.grad_scale,
        out_ptr=scales.grad_scale,
        n_rows=target.numel(),
        n_classes=n_classes,
        ignore_index=opts.ignore_index,
        HAS_WEIGHT=opts.weight is not None,
        MEAN=opts.reduction == "mean",
        WEIGHT_SUM=scales.weight_sum is not None,
        BLOCK=1024,
        num_warps=4,
    )
    return scales


def _scales_buffer(target: torch.Tensor, opts: LossOptions) -> LossScales:
    """LossScales over one unwritten fp32 [2] buffer: grad_scale [1], then weight_sum [1] when label
    smoothing has class weights (else None)."""
    out = torch.empty(2, dtype=torch.float32, device=target.device)
    return LossScales(out[1:] if opts.weight is not None and opts.has_smoothing else None, out[:1])


def reduced_loss(
    loss: torch.Tensor, opts: LossOptions, scales: LossScales, dtype: torch.dtype
) -> torch.Tensor:
    """options.reduce_rows of per-row losses [N] (fp32, contiguous), cast to dtype, in one launch for
    "mean" and "sum" (eager, Triton path)."""
    if opts.reduction == "none" or not _one_launch(loss):
        reduced = reduce_rows(loss, opts, scales)
        # no `.to` of the same dtype: returned from an autograd.Function traced by torch.compile, that
        # alias of an intermediate made the backward's gradients zero on CUDA (torch 2.11, fp32 losses)
        return reduced if reduced.dtype == dtype else reduced.to(dtype)
    out = torch.empty((), dtype=dtype, device=loss.device)
    loss_reduce_launch(
        (1,),
        loss_ptr=loss,
        scale_ptr=scales.grad_scale,
        out_ptr=out,
        n_rows=loss.numel(),
        MEAN=opts.reduction == "mean",
        BLOCK=1024,
        num_warps=4,
    )
    return out


# ---- custom ops: torch.compile sees one opaque node per launch, no graph break. Their schemas come
# from LossOptions (family_custom_op); options travel as LossOptions / LossScales.op_kwargs(). ----


@family_custom_op(
    "fuselm::loss_rows_fwd",
    tensors="Tensor logits, Tensor target",
    flags="bool compute_grad, bool compute_predicted",
    returns="(Tensor, Tensor, Tensor, Tensor)",
)
def _fwd_op(logits, target, weight, token_weights, weight_sum, grad_scale, **named):
    opts = options_of(named, weight, token_weights)
    grad = torch.empty_like(logits) if named["compute_grad"] else None
    predicted = _new_predicted(logits, named["compute_predicted"])
    loss, lse = rows_fwd_into(logits, target, opts, LossScales(weight_sum, grad_scale), grad, predicted)
    return (
        loss,
        lse,
        grad if grad is not None else logits.new_empty(0),
        _or_empty_predicted(predicted, logits),
    )


def _new_predicted(logits, wanted: bool):
    return torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device) if wanted else None


def _or_empty_predicted(predicted, logits):
    return predicted if predicted is not None else logits.new_empty(0, dtype=torch.int64)


def _fake_rows(logits, compute_predicted: bool):
    """(loss, lse, predicted) of a fake: fp32 [N] twice, int64 [N] or [0]."""
    n = logits.shape[0]
    predicted = logits.new_empty(n if compute_predicted else 0, dtype=torch.int64)
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32), predicted


@family_fake(_fwd_op)
def _(logits, target, weight, token_weights, weight_sum, grad_scale, **named):
    loss, lse, predicted = _fake_rows(logits, named["compute_predicted"])
    return loss, lse, torch.empty_like(logits) if named["compute_grad"] else logits.new_empty(0), predicted


@family_custom_op(
    "fuselm::loss_rows_fwd_inplace",
    tensors="Tensor(a!) logits, Tensor target",
    flags="bool compute_predicted",
    returns="(Tensor, Tensor, Tensor)",
    mutates_args=("logits",),
)
def _fwd_inplace_op(logits, target, weight, token_weights, weight_sum, grad_scale, **named):
    opts = options_of(named, weight, token_weights)
    predicted = _new_predicted(logits, named["compute_predicted"])
    loss, lse = rows_fwd_into(logits, target, opts, LossScales(weight_sum, grad_scale), logits, predicted)
    return loss, lse, _or_empty_predicted(predicted, logits)


@family_fake(_fwd_inplace_op)
def _(logits, target, weight, token_weights, weight_sum, grad_scale, **named):
    return _fake_rows(logits, named["compute_predicted"])


_BWD_TENSORS = "Tensor dloss, Tensor? dlse, Tensor lse"


@family_custom_op(
    "fuselm::loss_rows_bwd", tensors="Tensor logits, Tensor target", after=_BWD_TENSORS, returns="Tensor"
)
def _bwd_op(logits, target, weight, token_weights, weight_sum, grad_scale, dloss, dlse, lse, **named):
    opts = options_of(named, weight, token_weights)
    scales = LossScales(weight_sum, grad_scale)
    return rows_bwd_into(logits, target, opts, scales, dloss, dlse, lse, torch.empty_like(logits))


@family_fake(_bwd_op)
def _(logits, *tensors, **named):
    return torch.empty_like(logits)


@family_custom_op(
    "fuselm::loss_rows_bwd_inplace",
    tensors="Tensor(a!) logits, Tensor target",
    after=_BWD_TENSORS,
    returns="()",
    mutates_args=("logits",),
)
def _bwd_inplace_op(logits, target, weight, token_weights, weight_sum, grad_scale, dloss, dlse, lse, **named):
    opts = options_of(named, weight, token_weights)
    rows_bwd_into(logits, target, opts, LossScales(weight_sum, grad_scale), dloss, dlse, lse, logits)


@torch.library.custom_op("fuselm::scale_grad_", mutates_args=("grad",))
def _scale_grad_op(grad: torch.Tensor, dloss: torch.Tensor) -> None:
    _scale_grad_kernel_(grad, dloss)


_run_scale_grad = compiled_or_launcher(_scale_grad_op, _scale_grad_kernel_)


def scale_grad_(grad: torch.Tensor, dloss: torch.Tensor) -> None:
    """grad *= dloss (fp32 [1] on the device) in place, a zero kept zero whatever dloss (PyTorch's gradient of
    an ignored token is 0 even for an inf or NaN upstream gradient); the device skips it when dloss == 1."""
    if not use_triton(grad):  # a CPU vocabulary shard (fuselm.distributed on the reference path)
        grad.copy_(scale_keeping_zeros(grad, dloss))
    else:
        _run_scale_grad(grad, dloss)


class LocalRows:
    """The row backend of one device: every class of a row is here (n_classes = the logits' width).

    Eager calls launch the kernels directly (a custom op costs tens of microseconds of host time per
    call); under torch.compile the custom ops stand in, so the graph has no break."""

    def __init__(self, n_classes: int):
        self.n_classes = n_classes
        self._unwritten = None  # scales that the next forward's kernel finds (scales_for_forward)

    def scales_for_forward(self, target: torch.Tensor, opts: LossOptions) -> LossScales:
        """The LossScales of a batch whose rows (all of them, with these targets) the next :meth:`forward`
        gets (:func:`batch_scales`). On the eager Triton path, when every program of the forward kernel
        can read every target (FIND_SCALES_MAX_LOADS), unwritten buffers that this forward's kernel fills:
        one launch less."""
        n_rows = target.numel()
        if (
            n_rows
            and _one_launch(target)
            and n_rows * persistent_grid(n_rows, target.device, FWD_PROGRAMS_PER_SM) <= FIND_SCALES_MAX_LOADS
        ):
            self._unwritten = _scales_buffer(target, opts)
            return self._unwritten
        return batch_scales(target, opts, self.n_classes)

    def forward(
        self, logits, target, opts: LossOptions, scales: LossScales, grad: str | None, predicted=None
    ):
        """(loss, lse, grad or None) of logits [N, V]; grad None: no gradient, "new": d(sum_i loss_i *
        grad_scale)/d logits in a new tensor, "inplace": written over the logits. predicted: an int64 [N]
        tensor to fill with each row's argmax (-1 on ignored rows), or None."""
        if torch.compiler.is_compiling():
            named = {**opts.op_kwargs(), **scales.op_kwargs(), "compute_predicted": predicted is not None}
            if grad == "inplace":
                loss, lse, pred = _fwd_inplace_op(logits, target, **named)
                g = logits
            else:
                loss, lse, g, pred = _fwd_op(logits, target, **named, compute_grad=grad is not None)
                g = g if grad is not None else None
            if predicted is not None:
                predicted.copy_(pred)
            return loss, lse, g
        buf = logits if grad == "inplace" else (torch.empty_like(logits) if grad else None)
        find_scales = scales is self._unwritten
        self._unwritten = None
        return (*rows_fwd_into(logits, target, opts, scales, buf, predicted, find_scales), buf)

    def backward(
        self, logits, target, opts: LossOptions, scales: LossScales, dloss, dlse, lse, inplace: bool
    ):
        """d(sum_i loss_i * grad_scale * dloss_i + lse_i * dlse_i) / d logits, written over the logits when
        inplace."""
        if torch.compiler.is_compiling():
            named = {**opts.op_kwargs(), **scales.op_kwargs(), "dloss": dloss, "dlse": dlse, "lse": lse}
            if inplace:
                _bwd_inplace_op(logits, target, **named)
                return logits
            return _bwd_op(logits, target, **named)
        grad = logits if inplace else torch.empty_like(logits)
        return rows_bwd_into(logits, target, opts, scales, dloss, dlse, lse, grad)

    def reduce_input_grad_(self, dx: torch.Tensor) -> torch.Tensor:
        """The gradient of the linear ops' input, summed over where the classes live: here, nothing to do."""
        return dx
