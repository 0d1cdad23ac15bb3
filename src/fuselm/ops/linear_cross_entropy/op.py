"""fuselm.linear_cross_entropy: launchers -> custom ops -> autograd Function -> public function.

Token-chunked plan: per chunk of C rows, cuBLAS writes the logits into one reused [C, V] buffer,
the cross-entropy Triton kernel turns them in place into the chunk's gradient G, and cuBLAS
accumulates dX = G W, dW += G^T X (db += sum of G's rows). No [N, V] tensor ever exists.
memory="min" selects the fused tile plan (fused.py, kernels.py): no [C, V] buffer at all.
The math and the costs are in README.md.
"""

from __future__ import annotations

import torch

from .._common.dispatch import capturing, compaction_allowed, use_triton
from .._common.guard import (
    FLOAT_DTYPES,
    bad_targets,
    check_loss_args,
    check_tensor,
    raise_target_range,
    resolve_loss_dtype,
    rows_view,
    validate_memory,
)
from ..cross_entropy.op import _run_scale_, cross_entropy_bwd, cross_entropy_fwd_into, loss_scales
from ..cross_entropy.reference import scale_keeping_zeros
from .fused import fused_bwd, fused_fwd
from .reference import linear_cross_entropy_reference

AUTO_BUDGET = 256 * 2**20  # bytes of the [C, V] chunk buffer under memory="auto" (also capped by free/4)
MIN_BUDGET = 8 * 2**20  # memory="min" on the PyTorch reference path (chunks of this many bytes)
FUSED_PLAN = 0  # the chunk_rows value that selects the fused tile plan (memory="min" on the Triton path)
CHUNK_ROW_MULTIPLE = 16  # C is a multiple of this (GEMM tiles), and never below it


# ---- plan ----


def memory_budget(memory, device: torch.device) -> int:
    """Bytes allowed for the [C, V] chunk buffer. "auto": min(256 MiB, a quarter of the free device
    memory; the query is skipped under torch.compile and CUDA graph capture); "min": 8 MiB; int: itself."""
    if memory == "min":
        return MIN_BUDGET
    if memory != "auto":
        return int(memory)
    budget = AUTO_BUDGET
    if device.type == "cuda" and not torch.compiler.is_compiling() and not capturing(device):
        free, _ = torch.cuda.mem_get_info(device)  # asked every call: nothing cached across devices
        budget = min(budget, free // 4)
    return budget


def chunk_rows_for(budget: int, n_cols: int, hidden: int, itemsize: int) -> int:
    """Rows C of a chunk whose temporaries fit `budget`: the [C, n_cols] logits buffer and two [C, hidden]
    ones (rows gathered when ignored rows are compacted, and their dX), of `itemsize` bytes. At least
    16, a multiple of 16; the launchers clamp it to the number of rows."""
    rows = budget // ((n_cols + 2 * hidden) * itemsize)
    return max(CHUNK_ROW_MULTIPLE, rows // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)


# ---- launchers ----


def _chunk(x, target, rows, s, e):
    """Rows s:e of the work list: a slice, or a gather when ignored rows were compacted out."""
    if rows is None:
        return x[s:e], target[s:e], None
    idx = rows[s:e]
    return x.index_select(0, idx), target.index_select(0, idx), idx


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
        if first:
            torch.mm(g.t(), xc, out=dw)
        else:
            dw.addmm_(g.t(), xc)  # cuBLAS sums in fp32, rounds to dW's dtype once per chunk
    if db_acc is not None:
        db_acc += g.sum(0, dtype=torch.float32)


def _n_work(x, rows):
    return x.shape[0] if rows is None else rows.shape[0]


def linear_cross_entropy_fwd(
    x,
    w,
    b,
    target,
    weight,
    weight_sum,
    grad_scale,
    rows,
    chunk_rows,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    compute_grad,
    need_dx,
    need_dw,
    need_db,
    shard=None,
):
    """Chunked forward. x [N, H], w [V, H], b [V] or None, target [N]; rows: int64 indices of the rows
    to compute (ignored ones compacted out) or None for all. Returns per-row loss and lse (fp32, one per
    computed row), and with compute_grad the gradients of sum(loss_rows) * grad_scale: dx [N, H] (zero on
    rows not computed), dw [V, H] (dtype of w), db [V] (fp32); None where not needed.
    chunk_rows == FUSED_PLAN runs the fused tile plan instead (fused.py).
    shard (fuselm.distributed): w and b are one rank's vocabulary shard; the shard's fwd_into stands in
    for the cross-entropy kernel and dx is summed over the ranks."""
    if chunk_rows == FUSED_PLAN:
        assert shard is None, "the fused tile plan does not run on a vocabulary shard"
        return fused_fwd(
            x,
            w,
            b,
            target,
            weight,
            weight_sum,
            grad_scale,
            rows,
            ignore_index,
            label_smoothing,
            z_loss,
            softcap,
            compute_grad,
            need_dx,
            need_dw,
            need_db,
        )
    n_total, h = x.shape
    v = w.shape[0]
    assert w.shape[1] == h and target.is_contiguous()
    n = _n_work(x, rows)
    c = max(1, min(chunk_rows, n))
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    dx = dw = db_acc = None
    if compute_grad:
        if need_dx:
            dx = torch.empty((n_total, h), dtype=x.dtype, device=x.device)
            if rows is not None:
                dx.zero_()
        if need_dw:
            dw = torch.empty_like(w, memory_format=torch.contiguous_format)
            if n == 0:
                dw.zero_()
        if need_db:
            db_acc = torch.zeros(v, dtype=torch.float32, device=x.device)
    if n == 0:
        return loss, lse, dx, dw, db_acc
    buf = torch.empty((c, v), dtype=x.dtype, device=x.device)  # the only [C, V] tensor
    args = (ignore_index, label_smoothing, z_loss, softcap)
    ce_fwd_into = cross_entropy_fwd_into if shard is None else shard.fwd_into
    for s in range(0, n, c):
        e = min(s + c, n)
        xc, tc, idx = _chunk(x, target, rows, s, e)
        logits = _logits_into(buf[: e - s], xc, w, b)
        grad = logits if compute_grad else None  # the kernel overwrites the logits with G
        loss_c, lse_c = ce_fwd_into(logits, tc, weight, weight_sum, grad_scale, grad, *args)
        loss[s:e] = loss_c
        lse[s:e] = lse_c
        if compute_grad:
            _accumulate_grads(logits, xc, w, idx, s, e, dx, dw, db_acc, s == 0)
    if shard is not None and dx is not None:
        shard.all_reduce_(dx)
    return loss, lse, dx, dw, db_acc


def linear_cross_entropy_bwd(
    x,
    w,
    b,
    target,
    weight,
    weight_sum,
    grad_scale,
    dloss,
    dlse,
    lse,
    rows,
    chunk_rows,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    need_dx,
    need_dw,
    need_db,
    shard=None,
):
    """Recompute plan: per chunk, logits again, G from the saved lse (with dloss fp32 1-element or one per
    computed row, dlse [rows] or None) written over them, then the three GEMMs. Returns dx, dw, db (fp32).
    chunk_rows == FUSED_PLAN runs the fused tile plan instead (fused.py). shard: as in the forward."""
    if chunk_rows == FUSED_PLAN:
        assert shard is None, "the fused tile plan does not run on a vocabulary shard"
        return fused_bwd(
            x,
            w,
            b,
            target,
            weight,
            weight_sum,
            grad_scale,
            dloss,
            dlse,
            lse,
            rows,
            ignore_index,
            label_smoothing,
            z_loss,
            softcap,
            need_dx,
            need_dw,
            need_db,
        )
    n_total, h = x.shape
    v = w.shape[0]
    n = _n_work(x, rows)
    c = max(1, min(chunk_rows, n))
    dx = dw = db_acc = None
    if need_dx:
        dx = torch.empty((n_total, h), dtype=x.dtype, device=x.device)
        if rows is not None:
            dx.zero_()
    if need_dw:
        dw = torch.empty_like(w, memory_format=torch.contiguous_format)
        if n == 0:
            dw.zero_()
    if need_db:
        db_acc = torch.zeros(v, dtype=torch.float32, device=x.device)
    if n == 0 or not (need_dx or need_dw or need_db):
        return dx, dw, db_acc
    per_row = dloss.numel() != 1
    buf = torch.empty((c, v), dtype=x.dtype, device=x.device)
    args = (ignore_index, label_smoothing, z_loss, softcap)
    ce_bwd = cross_entropy_bwd if shard is None else shard.bwd
    for s in range(0, n, c):
        e = min(s + c, n)
        xc, tc, idx = _chunk(x, target, rows, s, e)
        logits = _logits_into(buf[: e - s], xc, w, b)
        dloss_c = dloss[s:e] if per_row else dloss
        dlse_c = dlse[s:e] if dlse is not None else None
        inputs = (logits, tc, weight, weight_sum, grad_scale, dloss_c, dlse_c, lse[s:e])
        ce_bwd(*inputs, logits, *args)
        _accumulate_grads(logits, xc, w, idx, s, e, dx, dw, db_acc, s == 0)
    if shard is not None and dx is not None:
        shard.all_reduce_(dx)
    return dx, dw, db_acc


# ---- custom ops: under torch.compile each chunked pass is one opaque node (no graph break) ----


def _or_empty(t, like):
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("fuselm::linear_cross_entropy_fwd", mutates_args=())
def _lce_fwd_op(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor,
    chunk_rows: int,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    compute_grad: bool,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, lse, dx, dw, db = linear_cross_entropy_fwd(
        x,
        w,
        b,
        target,
        weight,
        weight_sum,
        grad_scale,
        None,
        chunk_rows,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        compute_grad,
        need_dx,
        need_dw,
        need_db,
    )
    return loss, lse, _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, loss)


@_lce_fwd_op.register_fake
def _(
    x,
    w,
    b,
    target,
    weight,
    weight_sum,
    grad_scale,
    chunk_rows,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    compute_grad,
    need_dx,
    need_dw,
    need_db,
):
    n, v = x.shape[0], w.shape[0]
    loss = x.new_empty(n, dtype=torch.float32)
    dx = x.new_empty(x.shape) if compute_grad and need_dx else x.new_empty(0)
    dw = w.new_empty(w.shape) if compute_grad and need_dw else w.new_empty(0)
    db = loss.new_empty(v) if compute_grad and need_db else loss.new_empty(0)
    return loss, x.new_empty(n, dtype=torch.float32), dx, dw, db


@torch.library.custom_op("fuselm::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd_op(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    grad_scale: torch.Tensor,
    dloss: torch.Tensor,
    dlse: torch.Tensor | None,
    lse: torch.Tensor,
    chunk_rows: int,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = linear_cross_entropy_bwd(
        x,
        w,
        b,
        target,
        weight,
        weight_sum,
        grad_scale,
        dloss,
        dlse,
        lse,
        None,
        chunk_rows,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        need_dx,
        need_dw,
        need_db,
    )
    return _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, lse)


@_lce_bwd_op.register_fake
def _(
    x,
    w,
    b,
    target,
    weight,
    weight_sum,
    grad_scale,
    dloss,
    dlse,
    lse,
    chunk_rows,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    need_dx,
    need_dw,
    need_db,
):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = w.new_empty(w.shape) if need_dw else w.new_empty(0)
    db = lse.new_empty(w.shape[0]) if need_db else lse.new_empty(0)
    return dx, dw, db


# Eager calls run the launchers directly (and may compact ignored rows); under torch.compile the
# custom ops above stand in, on all rows (no data-dependent shapes, no host sync).


def _run_fwd(
    x, w, b, target, weight, weight_sum, grad_scale, rows, chunk_rows, args, compute_grad, needs, shard
):
    if torch.compiler.is_compiling() and shard is None:
        loss, lse, dx, dw, db = _lce_fwd_op(
            x, w, b, target, weight, weight_sum, grad_scale, chunk_rows, *args, compute_grad, *needs
        )
        kept = [t if compute_grad and need else None for t, need in zip((dx, dw, db), needs, strict=True)]
        return (loss, lse, *kept)
    return linear_cross_entropy_fwd(
        x, w, b, target, weight, weight_sum, grad_scale, rows, chunk_rows, *args, compute_grad, *needs, shard
    )


def _run_bwd(
    x, w, b, target, weight, weight_sum, grad_scale, dloss, dlse, lse, rows, chunk_rows, args, needs, shard
):
    inputs = (x, w, b, target, weight, weight_sum, grad_scale, dloss, dlse, lse)
    if torch.compiler.is_compiling() and shard is None:
        grads = _lce_bwd_op(*inputs, chunk_rows, *args, *needs)
        return tuple(t if need else None for t, need in zip(grads, needs, strict=True))
    return linear_cross_entropy_bwd(*inputs, rows, chunk_rows, *args, *needs, shard)


# ---- autograd ----


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for x [N, H], w [V, H], b [V] or None, target [N]. Two plans:

    - gradient in forward (reduction mean/sum, no lse output, some gradient needed): the forward
      computes dX, dW, db of the loss; the backward multiplies them by grad_output in place (the
      device skips it when grad_output == 1). 6NHV FLOPs.
    - recompute (reduction none, or return_lse): the forward keeps lse; the backward recomputes
      each chunk's logits and writes the gradient over them. 8NHV FLOPs.

    `rows` (eager only): indices of the non-ignored rows, or None to compute every row.
    `shard` (fuselm.distributed, eager only): w, b are one rank's vocabulary shard (see the launchers).
    """

    @staticmethod
    def forward(
        ctx,
        x,
        w,
        b,
        target,
        weight,
        rows,
        chunk_rows,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
        return_lse,
        needs,
        shard=None,
    ):
        n = x.shape[0]
        v = shard.n_classes if shard is not None else w.shape[0]
        weight_sum, grad_scale = loss_scales(target, weight, ignore_index, reduction, label_smoothing, v)
        compute_grad = any(needs)
        grad_in_forward = compute_grad and reduction != "none" and not return_lse
        args = (ignore_index, label_smoothing, z_loss, softcap)
        loss, lse, dx, dw, db = _run_fwd(
            x,
            w,
            b,
            target,
            weight,
            weight_sum,
            grad_scale,
            rows,
            chunk_rows,
            args,
            grad_in_forward,
            needs,
            shard,
        )
        ctx.shard = shard
        ctx.grad_in_forward = grad_in_forward
        ctx.needs = needs
        ctx.args = args
        ctx.chunk_rows = chunk_rows
        ctx.bias_dtype = b.dtype if b is not None else None
        ctx.consumed = False
        if grad_in_forward:
            ctx.save_for_backward(dx, dw, db)
        else:
            ctx.save_for_backward(x, w, b, target, weight, weight_sum, grad_scale, lse, rows)
        if not return_lse:
            ctx.mark_non_differentiable(lse)
        if reduction == "sum":
            out = loss.sum()
        elif reduction == "mean":
            out = loss.sum() * grad_scale[0]
        elif rows is not None:
            out = loss.new_zeros(n).index_copy_(0, rows, loss)  # ignored rows: loss 0
        else:
            out = loss
        return out, lse  # fp32; the caller casts to loss_dtype

    @staticmethod
    def backward(ctx, dloss, dlse):
        if ctx.consumed:
            raise RuntimeError(
                "fuselm.linear_cross_entropy: backward ran twice through a graph whose gradients were "
                "computed in the forward and already handed out; recompute the loss instead of "
                "retain_graph=True"
            )
        if ctx.grad_in_forward:
            ctx.consumed = True
            dx, dw, db = ctx.saved_tensors
            dl = dloss.float().reshape(1)
            if dx is not None:
                _run_scale_(dx, dl)
            if dw is not None:
                _run_scale_(dw, dl)
            if db is not None:
                db = scale_keeping_zeros(db, dl).to(ctx.bias_dtype)  # [V], kept in fp32 until here
        else:
            x, w, b, target, weight, weight_sum, grad_scale, lse, rows = ctx.saved_tensors
            dloss = dloss.float().reshape(-1)
            if dloss.numel() != 1 and rows is not None:
                dloss = dloss.index_select(0, rows)
            dloss = dloss.contiguous()
            dlse = dlse.float().reshape(-1).contiguous() if dlse is not None else None
            dx, dw, db = _run_bwd(
                x,
                w,
                b,
                target,
                weight,
                weight_sum,
                grad_scale,
                dloss,
                dlse,
                lse,
                rows,
                ctx.chunk_rows,
                ctx.args,
                ctx.needs,
                ctx.shard,
            )
            if db is not None:
                db = db.to(ctx.bias_dtype)
        return dx, dw, db, *([None] * 12)


def eager_rows(target: torch.Tensor, ignore_index: int, n_classes: int) -> torch.Tensor | None:
    """Eager mode's one host sync, for two answers: the indices of the rows to compute (target !=
    ignore_index; None when that is every row), and whether a target is outside [0, n_classes) (then
    ValueError naming it).

    One ``nonzero`` over N + 1 flags: the valid rows and a last one, False; a bad target sets every flag, so
    the count is N + 1 exactly when some target is bad (a count of valid rows is at most N)."""
    n = target.shape[0]
    bad = bad_targets(target, n_classes, ignore_index)
    any_bad = bad.any().reshape(1)
    flags = torch.cat([target != ignore_index, any_bad]) | any_bad
    idx = flags.nonzero().reshape(-1)  # the host sync: its length
    if idx.shape[0] > n:
        raise_target_range(target, bad, n_classes, ignore_index)
    return idx if idx.shape[0] < n else None


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
    return_lse: bool = False,
    memory: str | int = "auto",
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
        return_lse: also return the log-sum-exp of each token's logits (float32, shape
            ``input.shape[:-1]``), differentiable.
        memory: how much memory the chunk buffer may take.

            - ``"auto"`` (default): ``min(256 MiB, a quarter of the free device memory)``.
            - an int: that many bytes.
            - ``"min"``: the fused tile plan, O(N) extra memory: Triton kernels compute logit tiles on
              chip (lse first, then every tile again for the gradient, 8NHV FLOPs) and add dX, dW into
              the gradients with atomics (dX of 16-bit inputs accumulated in fp16 with per-row scales;
              see README.md). On the CPU reference path: chunks of an 8 MiB budget.

            The chunk has ``C = budget // (V * itemsize)`` rows (at least 16, a multiple of 16, at most
            N). Its buffer is the only tensor of V columns, in the input dtype; with gathered ignored
            rows (below) two ``[C, H]`` temporaries come with it.
        loss_dtype: the dtype of the returned loss: by default the input's (as PyTorch); the loss is
            accumulated in fp32 (fp64 for fp64 input), so ``torch.float32`` returns it unrounded, as
            Hugging Face's loss (computed on ``logits.float()``) is.

    Autocast: under ``torch.autocast``, ``input``, ``linear_weight`` and ``linear_bias`` are cast to the
    autocast dtype first, as ``F.linear`` would (the gradients flow back to their own dtypes).

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

    Returns:
        ``loss`` in the dtype of ``input`` (a scalar, or ``input.shape[:-1]`` for ``"none"``), and ``lse``
        when ``return_lse``.

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
    device = input.device
    loss_dtype = resolve_loss_dtype(loss_dtype, input)
    h = input.shape[-1]
    v = linear_weight.shape[0]
    if v == 0:
        raise ValueError("linear_weight must have at least one row (one class)")
    if ignore_index is None:  # torch.nn.functional.linear_cross_entropy's default, which means -100
        ignore_index = -100
    check_loss_args(
        input,
        target,
        v,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
    )
    validate_memory(memory)

    budget = memory_budget(memory, device)
    if input.dtype == torch.float64 or not use_triton(input):
        if not return_lse and compaction_allowed(device):  # eager: the range check, as on the Triton path
            eager_rows(target.reshape(-1), ignore_index, v)
        compute_itemsize = 8 if input.dtype == torch.float64 else 4
        return linear_cross_entropy_reference(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            weight=weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            return_lse=return_lse,
            chunk_rows=chunk_rows_for(budget, v, h, compute_itemsize),
            loss_dtype=loss_dtype,
        )

    return apply_linear_cross_entropy(
        input,
        linear_weight,
        linear_bias,
        target,
        weight,
        FUSED_PLAN if memory == "min" else chunk_rows_for(budget, v, h, input.element_size()),
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
        return_lse,
        loss_dtype,
    )


def linear_operands(input, linear_weight, linear_bias, dtypes):
    """(input, linear_weight, linear_bias) after autocast (cast to the autocast dtype, as F.linear would),
    checked: input of one of `dtypes`, linear_weight [V, H] and linear_bias [V] of its dtype and device."""
    check_tensor("input", input, dtypes=dtypes, min_ndim=1)
    device = input.device
    if torch.is_autocast_enabled(device.type) and input.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device.type)
        input, linear_weight = input.to(dtype), linear_weight.to(dtype)
        linear_bias = linear_bias.to(dtype) if linear_bias is not None else None
    check_tensor("linear_weight", linear_weight, ndim=2, device=device)
    if linear_weight.dtype != input.dtype:
        raise ValueError(
            f"linear_weight must have the dtype of input ({input.dtype}), got {linear_weight.dtype}"
        )
    h = input.shape[-1]
    v = linear_weight.shape[0]
    if linear_weight.shape[1] != h:
        raise ValueError(
            f"linear_weight must have shape [V, {h}] (input's last dim), got {tuple(linear_weight.shape)}"
        )
    if linear_bias is not None:
        check_tensor("linear_bias", linear_bias, ndim=1, device=device)
        if linear_bias.dtype != input.dtype:
            raise ValueError(
                f"linear_bias must have the dtype of input ({input.dtype}), got {linear_bias.dtype}"
            )
        if linear_bias.shape[0] != v:
            raise ValueError(f"linear_bias must have shape [{v}], got {tuple(linear_bias.shape)}")
    return input, linear_weight, linear_bias


def apply_linear_cross_entropy(
    input,
    linear_weight,
    linear_bias,
    target,
    weight,
    chunk_rows,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
    return_lse,
    loss_dtype,
    shard=None,
):
    """The Triton path of the public functions (arguments checked): rows view, compaction of ignored rows
    (eager), LinearCrossEntropyFunction, output shapes and dtype."""
    t1 = target.reshape(-1).contiguous()
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and input.requires_grad,
        grad_on and linear_weight.requires_grad,
        grad_on and linear_bias is not None and linear_bias.requires_grad,
    )
    rows = None
    if not return_lse and compaction_allowed(input.device):
        n_classes = shard.n_classes if shard is not None else linear_weight.shape[0]
        rows = eager_rows(t1, ignore_index, n_classes)  # the one host sync (and the target range check)
    loss, lse = LinearCrossEntropyFunction.apply(
        rows_view(input),
        linear_weight,
        linear_bias,
        t1,
        weight.contiguous() if weight is not None else None,
        rows,
        chunk_rows,
        ignore_index,
        reduction,
        float(label_smoothing),
        float(z_loss),
        float(softcap or 0.0),
        return_lse,
        needs,
        shard,
    )
    loss = loss.to(loss_dtype)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    if return_lse:
        return loss, lse.reshape(target.shape)
    return loss
