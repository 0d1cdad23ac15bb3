"""The plans of linear_cross_entropy, chosen once by name, and the custom ops that stand for them under
torch.compile.

- ``"chunked"`` (chunked.py): token chunks through one reused [C, V] buffer; any row backend.
- ``"fused"`` (fused.py): logit tiles on chip, O(N) extra memory; one device only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._common.loss.budget import MIN_BUDGET, memory_budget
from .._common.loss.options import (
    NEEDS_SCHEMA,
    LossScales,
    family_custom_op,
    family_fake,
    fields_schema,
    from_named,
    options_of,
)
from .._common.loss.rows import LocalRows
from . import chunked, fused

PLANS = {"chunked": chunked, "fused": fused}


class Plan(NamedTuple):
    """A plan by kind ("chunked" or "fused"), with the chunk rows of the chunked plan (0 for the fused one),
    and whether the weight gradient is accumulated in an fp32 buffer (rounded to the weight's dtype once,
    at the end). The custom ops take its fields by name (options.fields_schema)."""

    kind: str
    chunk_rows: int = 0
    fp32_weight_grad: bool = False


def choose_plan(
    memory,
    device: torch.device,
    n_classes: int,
    hidden: int,
    itemsize: int,
    one_device: bool,
    fp32_weight_grad: bool = False,
    argmax: bool = False,
) -> Plan:
    """memory="min" on one device: the fused tile plan; else chunks sized for the
    budget (memory_budget; free memory is asked on one device only, so that the ranks of a vocabulary
    split chunk alike; `n_classes`: the widest slice of the vocabulary). fp32_weight_grad: sum dW in fp32.
    argmax (predicted tokens wanted): chunks, also under "min" (8 MiB ones: the fused plan has no argmax)."""
    if memory == "min" and one_device and not argmax:
        return Plan("fused", fp32_weight_grad=fp32_weight_grad)
    budget = memory_budget(memory, device, query_free=one_device)
    chunk_rows = chunked.chunk_rows_for(budget, n_classes, hidden, itemsize)
    return Plan("chunked", chunk_rows=chunk_rows, fp32_weight_grad=fp32_weight_grad)


def fp32_accumulation(accum_dtype, input_dtype: torch.dtype) -> bool:
    """Does ``accum_dtype`` ask for an fp32 weight-gradient accumulator? None or the input's dtype: no;
    torch.float32: yes; anything else: ValueError."""
    if accum_dtype is None or accum_dtype == input_dtype:
        return False
    if accum_dtype == torch.float32:
        return True
    raise ValueError(f"accum_dtype must be None or torch.float32, got {accum_dtype!r}")


def reference_chunk_rows(memory, n_classes: int, hidden: int, itemsize: int) -> int:
    """Chunk rows of the PyTorch reference path (fp32 or fp64 temporaries of `itemsize` bytes)."""
    budget = MIN_BUDGET if memory == "min" else memory_budget(memory, torch.device("cpu"))
    return chunked.chunk_rows_for(budget, n_classes, hidden, itemsize)


# ---- custom ops: under torch.compile each pass of a plan is one opaque node (no graph break, every row
# computed, one device). The options travel by name: LossOptions.op_kwargs(), LossScales.op_kwargs(). ----


def _or_empty(t, like):
    return t if t is not None else like.new_empty(0)


_PLAN = fields_schema(Plan)


@family_custom_op(
    "fuselm::linear_cross_entropy_fwd",
    tensors="Tensor x, Tensor w, Tensor? b, Tensor target",
    flags=f"{_PLAN}, bool compute_grad, {NEEDS_SCHEMA}, bool compute_predicted",
    returns="(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _fwd_op(x, w, b, target, weight, token_weights, weight_sum, grad_scale, **named):
    opts = options_of(named, weight, token_weights)
    plan = from_named(Plan, named)
    scales = LossScales(weight_sum, grad_scale)
    needs = (named["need_dx"], named["need_dw"], named["need_db"])
    backend = LocalRows(w.shape[0])
    compute_predicted = named["compute_predicted"]
    predicted = x.new_empty(x.shape[0] if compute_predicted else 0, dtype=torch.int64)
    loss, lse, dx, dw, db = PLANS[plan.kind].forward(
        plan,
        x,
        w,
        b,
        target,
        None,
        opts,
        scales,
        backend,
        named["compute_grad"],
        needs,
        predicted if compute_predicted else None,
    )
    return loss, lse, _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, loss), predicted


@family_fake(_fwd_op)
def _(x, w, b, target, weight, token_weights, weight_sum, grad_scale, **named):
    grad = named["compute_grad"]
    n, v = x.shape[0], w.shape[0]
    loss = x.new_empty(n, dtype=torch.float32)
    dx = x.new_empty(x.shape) if grad and named["need_dx"] else x.new_empty(0)
    dw = w.new_empty(w.shape) if grad and named["need_dw"] else w.new_empty(0)
    db = loss.new_empty(v) if grad and named["need_db"] else loss.new_empty(0)
    predicted = x.new_empty(n if named["compute_predicted"] else 0, dtype=torch.int64)
    return loss, x.new_empty(n, dtype=torch.float32), dx, dw, db, predicted


@family_custom_op(
    "fuselm::linear_cross_entropy_bwd",
    tensors="Tensor x, Tensor w, Tensor? b, Tensor target",
    after="Tensor dloss, Tensor? dlse, Tensor lse",
    flags=f"{_PLAN}, {NEEDS_SCHEMA}",
    returns="(Tensor, Tensor, Tensor)",
)
def _bwd_op(x, w, b, target, weight, token_weights, weight_sum, grad_scale, dloss, dlse, lse, **named):
    opts = options_of(named, weight, token_weights)
    plan = from_named(Plan, named)
    scales = LossScales(weight_sum, grad_scale)
    backend = LocalRows(w.shape[0])
    needs = (named["need_dx"], named["need_dw"], named["need_db"])
    dx, dw, db = PLANS[plan.kind].backward(
        plan, x, w, b, target, None, opts, scales, backend, dloss, dlse, lse, needs
    )
    return _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, lse)


@family_fake(_bwd_op)
def _(x, w, b, target, weight, token_weights, weight_sum, grad_scale, dloss, dlse, lse, **named):
    dx = x.new_empty(x.shape) if named["need_dx"] else x.new_empty(0)
    dw = w.new_empty(w.shape) if named["need_dw"] else w.new_empty(0)
    db = lse.new_empty(w.shape[0]) if named["need_db"] else lse.new_empty(0)
    return dx, dw, db


def run_forward(
    plan: Plan, x, w, b, target, rows, opts, scales, backend, compute_grad, needs, predicted=None
):
    """The plan's forward: the launchers in eager mode (may compact ignored rows), the custom op under
    torch.compile (one device). predicted: an int64 buffer (one per computed row) for the argmax, or None."""
    if torch.compiler.is_compiling():
        loss, lse, dx, dw, db, pred = _fwd_op(
            x,
            w,
            b,
            target,
            **opts.op_kwargs(),
            **scales.op_kwargs(),
            **plan._asdict(),
            compute_grad=compute_grad,
            need_dx=needs[0],
            need_dw=needs[1],
            need_db=needs[2],
            compute_predicted=predicted is not None,
        )
        if predicted is not None:
            predicted.copy_(pred)
        kept = [t if compute_grad and need else None for t, need in zip((dx, dw, db), needs, strict=True)]
        return (loss, lse, *kept)
    return PLANS[plan.kind].forward(
        plan, x, w, b, target, rows, opts, scales, backend, compute_grad, needs, predicted
    )


def run_backward(plan: Plan, x, w, b, target, rows, opts, scales, backend, dloss, dlse, lse, needs):
    """The plan's recompute backward, as run_forward."""
    if torch.compiler.is_compiling():
        grads = _bwd_op(
            x,
            w,
            b,
            target,
            **opts.op_kwargs(),
            **scales.op_kwargs(),
            dloss=dloss,
            dlse=dlse,
            lse=lse,
            **plan._asdict(),
            need_dx=needs[0],
            need_dw=needs[1],
            need_db=needs[2],
        )
        return tuple(t if need else None for t, need in zip(grads, needs, strict=True))
    return PLANS[plan.kind].backward(
        plan, x, w, b, target, rows, opts, scales, backend, dloss, dlse, lse, needs
    )
