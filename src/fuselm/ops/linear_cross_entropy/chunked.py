"""The token-chunked plan: per chunk of C rows, cuBLAS writes the logits into one reused [C, V] buffer, the
row backend turns them in place into the chunk's gradient G (LocalRows: the family's row kernel; a
vocabulary shard: its slice, statistics exchanged with the other ranks), and cuBLAS accumulates
dX = G W, dW += G^T X (db += sum of G's rows). No [N, V] tensor ever exists. The math and the costs are in
README.md.
"""

from __future__ import annotations

import torch

from .._common.fp32_matmul import mm_fp32_into
from .._common.loss.options import LossOptions, LossScales

CHUNK_ROW_MULTIPLE = 16  # C is a multiple of this (GEMM tiles), and never below it


def chunk_rows_for(budget: int, n_cols: int, hidden: int, itemsize: int) -> int:
    """Rows C of a chunk whose temporaries fit `budget`: the [C, n_cols] logits buffer and two [C, hidden]
    ones (rows gathered when ignored rows are compacted, and their dX), of `itemsize` bytes. At least
    16, a multiple of 16; the launchers clamp it to the number of rows."""
    rows = budget // ((n_cols + 2 * hidden) * itemsize)
    return max(CHUNK_ROW_MULTIPLE, rows // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)


def _chunk(x, target, opts, rows, s, e):
    """Rows s:e of the work list (their x, target, options and row indices): a slice, or a gather when
    ignored rows were compacted out."""
    if rows is None:
        return x[s:e], target[s:e], opts.for_rows(slice(s, e)), None
    idx = rows[s:e]
    return x.index_select(0, idx), target.index_select(0, idx), opts.for_rows(idx), idx


def _logits_into(buf, xc, w, b):
    """buf [C, V] = xc @ w^T (+ b), by cuBLAS into the reused buffer."""
    if b is None:
        return torch.mm(xc, w.t(), out=buf)
    return torch.addmm(b, xc, w.t(), out=buf)


def _accumulate_grads(g, xc, w, idx, s, e, dx, dw, db_acc, first):
    """dX[rows] = G W, dW (+)= G^T X, db += sum_rows G (fp32)."""
    if dx is not None:
        if idx is None:
            torch.mm(g, w, out=dx[s:e])
        else:
            dx.index_copy_(0, idx, torch.mm(g, w))
    if dw is not None:
        if dw.dtype != g.dtype:  # an fp32 accumulator of 16-bit products: never rounded until the end
            mm_fp32_into(dw, g.t(), xc, accumulate=not first)
        elif first:
            torch.mm(g.t(), xc, out=dw)
        else:
            dw.addmm_(g.t(), xc)  # cuBLAS sums in fp32, rounds to dW's dtype once per chunk
    if db_acc is not None:
        db_acc += g.sum(0, dtype=torch.float32)


def weight_grad(dw, w):
    """dW in the weight's dtype: an fp32 accumulator rounded once (then freed), else dw itself."""
    return dw.to(w.dtype) if dw is not None and dw.dtype != w.dtype else dw


def new_grads(x, w, n, rows, needs, fp32_weight_grad=False):
    """(dx, dw, db) to be filled by a plan, None where not needed: dx [N, H] zeroed when only some rows are
    computed, dw [V, H] (fp32 with fp32_weight_grad: see finish_weight_grad) zeroed when none is, db [V] fp32
    zeros."""
    need_dx, need_dw, need_db = needs
    dx = dw = db = None
    if need_dx:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if rows is not None:
            dx.zero_()
    if need_dw:
        dtype = torch.float32 if fp32_weight_grad else w.dtype
        dw = torch.empty(w.shape, dtype=dtype, device=w.device)
        if n == 0:
            dw.zero_()
    if need_db:
        db = torch.zeros(w.shape[0], dtype=torch.float32, device=x.device)
    return dx, dw, db


def forward(
    plan,
    x,
    w,
    b,
    target,
    rows,
    opts: LossOptions,
    scales: LossScales,
    backend,
    compute_grad,
    needs,
    predicted=None,
):
    """x [N, H], w [V, H], b [V] or None, target [N]; rows: int64 indices of the rows to compute (ignored ones
    compacted out) or None for all. Returns per-row loss and lse (fp32, one per computed row), and with
    compute_grad the gradients of sum(loss_rows) * grad_scale: dx [N, H] (zero on rows not computed),
    dw [V, H] (dtype of w), db [V] (fp32); None where not needed. A vocabulary shard: w and b are its rows,
    dx is summed over the ranks. predicted: an int64 buffer, one per computed row, to fill with the argmax."""
    n = x.shape[0] if rows is None else rows.shape[0]
    c = max(1, min(plan.chunk_rows, n))
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    dx, dw, db = new_grads(x, w, n, rows, needs, plan.fp32_weight_grad) if compute_grad else (None,) * 3
    if n == 0:
        return loss, lse, dx, weight_grad(dw, w), db
    buf = torch.empty((c, w.shape[0]), dtype=x.dtype, device=x.device)  # the only [C, V] tensor
    for s in range(0, n, c):
        e = min(s + c, n)
        xc, tc, opts_c, idx = _chunk(x, target, opts, rows, s, e)
        logits = _logits_into(buf[: e - s], xc, w, b)
        # with the gradient, the backend overwrites the logits with G
        pred_c = predicted[s:e] if predicted is not None else None
        loss[s:e], lse[s:e], _ = backend.forward(
            logits, tc, opts_c, scales, "inplace" if compute_grad else None, pred_c
        )
        if compute_grad:
            _accumulate_grads(logits, xc, w, idx, s, e, dx, dw, db, s == 0)
    if dx is not None:
        backend.reduce_input_grad_(dx)
    return loss, lse, dx, weight_grad(dw, w), db


def backward(plan, x, w, b, target, rows, opts, scales, backend, dloss, dlse, lse, needs):
    """Recompute plan: per chunk, logits again, G from the saved lse (with dloss fp32 1-element or one per
    computed row, dlse [rows] or None) written over them, then the three GEMMs. Returns dx, dw, db (fp32)."""
    n = x.shape[0] if rows is None else rows.shape[0]
    c = max(1, min(plan.chunk_rows, n))
    dx, dw, db = new_grads(x, w, n, rows, needs, plan.fp32_weight_grad)
    if n == 0 or not any(needs):
        return dx, weight_grad(dw, w), db
    per_row = dloss.numel() != 1
    buf = torch.empty((c, w.shape[0]), dtype=x.dtype, device=x.device)
    for s in range(0, n, c):
        e = min(s + c, n)
        xc, tc, opts_c, idx = _chunk(x, target, opts, rows, s, e)
        logits = _logits_into(buf[: e - s], xc, w, b)
        dloss_c = dloss[s:e] if per_row else dloss
        dlse_c = dlse[s:e] if dlse is not None else None
        backend.backward(logits, tc, opts_c, scales, dloss_c, dlse_c, lse[s:e], True)
        _accumulate_grads(logits, xc, w, idx, s, e, dx, dw, db, s == 0)
    if dx is not None:
        backend.reduce_input_grad_(dx)
    return dx, weight_grad(dw, w), db
