"""fuselm.linear_log_probs: launchers -> custom ops -> autograd Function -> public function.

Both passes walk slabs of the vocabulary, each covering every kept token. Forward: per slab, cuBLAS
writes the fp32 logits into one reused [N, Vs] buffer and one Triton kernel folds them, read once, into
each row's running statistics. Backward: per slab, cuBLAS recomputes the logits into one reused [N, Vs]
buffer, one Triton kernel overwrites them with d/dlogits in place, and cuBLAS writes
d linear_weight[slab] = G^T X (one product over all N rows: summed in fp32, rounded once) while d input
is summed over the slabs in fp32 (half of the accumulator in the returned gradient's own storage).
The math and the costs are in README.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._common.dispatch import compaction_allowed, interpret_mode, kernels_run
from .._common.fp32_matmul import mm_fp32_into
from .._common.guard import (
    FLOAT_DTYPES,
    check_classes,
    linear_operands,
    refuse_double_backward,
    rows_view,
    validate_memory,
)
from .._common.launch import cdiv, launcher, row_launch
from .._common.loss.budget import memory_budget
from .._common.loss.compaction import kept_rows
from .._common.loss.options import (
    NEEDS_SCHEMA,
    LossOptions,
    family_custom_op,
    family_fake,
    fields_schema,
    from_named,
    options_of,
)
from .kernels import linear_log_probs_bwd_kernel, linear_log_probs_fwd_kernel
from .reference import DOUBLE_BACKWARD, OUTPUT_NAMES, LogProbs, linear_log_probs_reference

SLAB_MULTIPLE = 128  # backward slabs: a multiple of this many classes
AUTO_SLAB_FLOOR = 1024  # memory="auto": a slab keeps at least this many classes (GEMM shapes stay large)
MIN_SLAB_FLOOR = 128  # memory="min" or an int budget
STATE_ROWS = 8  # fp32 running statistics per row carried across the forward's slabs
FWD_BLOCK = 4096  # elements per step of the forward's row loop ([BLOCK_N, BLOCK_V] tiles)
BWD_BLOCK = 4096  # elements per program of the backward
INTERPRET_ROWS = 32  # rows per program under the interpreter (numpy: programs are costly, tiles are not)
# bits of the `stats` argument: which optional statistics the forward computes
ENTROPY, SUM_SQ, MEAN, TOP1 = 1, 2, 4, 8
# cached launch bindings of the kernels (ops/_common/launch.py)
linear_log_probs_fwd_launch = launcher(linear_log_probs_fwd_kernel)
linear_log_probs_bwd_launch = launcher(linear_log_probs_bwd_kernel)
STAT_BITS = {"entropy": ENTROPY, "log_sum_sq_probs": SUM_SQ, "mean_logits": MEAN, "is_top1": TOP1}


# ---- plan ----


class SlabPlan(NamedTuple):
    """How the vocabulary is cut into slabs: the bytes a slab's buffer (and, with fixed_in_budget, the
    per-row memory beside it) may take, and the fewest classes of a slab (GEMM shapes stay large; the
    budget is then exceeded: README.md). The custom ops take its fields by name (options.fields_schema),
    as linear_cross_entropy's Plan."""

    budget: int
    slab_floor: int
    fixed_in_budget: bool


def slab_cols(budget: int, fixed: int, n_rows: int, n_classes: int, itemsize: int, floor: int) -> int:
    """Classes Vs of a vocabulary slab: its [N, Vs] buffer (`itemsize` bytes: 4 for the forward's fp32
    logits, the input's for the backward) gets what `fixed` bytes (the gathered kept rows, per-row vectors,
    and in the backward the fp32 d input accumulator beyond what the returned d input holds) leave of
    `budget`: a multiple of 128 classes, at least `floor` (the budget is then exceeded: README.md), at
    most V."""
    cols = (budget - fixed) // max(n_rows * itemsize, 1) // SLAB_MULTIPLE * SLAB_MULTIPLE
    return max(min(floor, n_classes), min(cols, n_classes))


def hosted_rows(n_total: int, itemsize: int) -> int:
    """Rows of the fp32 [n, H] d input accumulator that fit in the storage of the returned d input
    [n_total, H] of `itemsize`-byte elements: n_total / 2 for 16-bit inputs, n_total for fp32."""
    return n_total * itemsize // 4


# ---- launchers ----


def _tile(n_cols: int, max_block: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_V, num_warps): rows of up to max_block classes are walked one per program in
    BLOCK_V-column steps; shorter rows are packed several per program (always under the interpreter)."""
    block_v, _ = row_launch(n_cols, max_block=max_block)
    block_n = INTERPRET_ROWS if interpret_mode() else max(1, min(16, max_block // block_v))
    return block_n, block_v, min(32, max(4, block_n * block_v // 1024))


def _rows(x, target, rows):
    if rows is None:
        return x, target
    return x.index_select(0, rows), target.index_select(0, rows)


def _kernel_options(opts: LossOptions) -> dict:
    return dict(
        ignore_index=opts.ignore_index,
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        inv_temp=1.0 / opts.temperature,
        HAS_SOFTCAP=opts.softcap > 0,
    )


def linear_log_probs_fwd(x, w, b, target, rows, plan: SlabPlan, opts: LossOptions, stats):
    """Vocabulary-slab forward. x [N, H], w [V, H], b [V] or None, target [N]; rows: int64 indices of the
    rows to compute (ignored ones compacted out) or None for all; opts: ignore_index, logit_scale,
    softcap, temperature; stats: bits of the optional statistics. Per slab of Vs classes: cuBLAS writes
    its fp32 logits for all n rows into one reused [n, Vs] buffer, one kernel folds them into the rows'
    running statistics. Returns (log_probs, entropy, lse, log_sum_sq_probs, mean_logits, is_top1), one
    per computed row (fp32; bool), None where not asked."""
    h = x.shape[1]
    v = w.shape[0]
    assert w.shape[1] == h and target.is_contiguous() and (b is None or b.is_contiguous())
    xk, tk = _rows(x, target, rows)  # [n, H]: a gathered copy when rows were compacted
    n = xk.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    log_probs, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n, **f32) if stats & ENTROPY else None
    log_sum_sq = torch.empty(n, **f32) if stats & SUM_SQ else None
    mean = torch.empty(n, **f32) if stats & MEAN else None
    top1 = torch.empty(n, dtype=torch.bool, device=x.device) if stats & TOP1 else None
    outs = (log_probs, entropy, lse, log_sum_sq, mean, top1)
    if n == 0:
        return outs
    fixed = n * (STATE_ROWS * 4 + 64) + (xk.numel() * x.element_size() if rows is not None else 0)
    vs = slab_cols(plan.budget, fixed if plan.fixed_in_budget else 0, n, v, 4, plan.slab_floor)
    state = torch.empty((STATE_ROWS, n), **f32) if vs < v else log_probs  # running statistics
    flat = torch.empty(n * vs, **f32)  # the only tensor of many classes
    block_n, block_v, num_warps = _tile(vs, FWD_BLOCK)
    for v0 in range(0, v, vs):
        v1 = min(v0 + vs, v)
        logits = mm_fp32_into(flat[: n * (v1 - v0)].view(n, v1 - v0), xk, w[v0:v1].t())
        linear_log_probs_fwd_launch(
            (cdiv(n, block_n),),
            logits_ptr=logits,
            logits_row_stride=logits.stride(0),
            bias_ptr=b if b is not None else logits,
            target_ptr=tk,
            state_ptr=state,
            log_probs_ptr=log_probs,
            entropy_ptr=entropy if entropy is not None else log_probs,
            lse_ptr=lse,
            log_sum_sq_ptr=log_sum_sq if log_sum_sq is not None else log_probs,
            mean_ptr=mean if mean is not None else log_probs,
            top1_ptr=top1 if top1 is not None else log_probs,
            n_rows=n,
            n_cols=v1 - v0,
            col_offset=v0,
            n_classes=v,
            HAS_BIAS=b is not None,
            HAS_ENTROPY=entropy is not None,
            HAS_SUM_SQ=log_sum_sq is not None,
            HAS_MEAN=mean is not None,
            HAS_TOP1=top1 is not None,
            IS_FIRST=v0 == 0,
            IS_LAST=v1 == v,
            BLOCK_N=block_n,
            BLOCK_V=block_v,
            num_warps=num_warps,
            **_kernel_options(opts),
        )
    return outs


def _dx_accumulator(n_total, n, h, dtype, device):
    """(dx, top, bottom): dx [n_total, H] in `dtype` is the gradient that will be returned; the fp32
    accumulator of the n computed rows is `top` (its first rows, a view of dx's own storage) and `bottom`
    (the rest, a separate fp32 tensor: n - n_total / 2 rows for 16-bit inputs, none for fp32)."""
    dx = torch.empty((n_total, h), dtype=dtype, device=device)
    m = min(n, hosted_rows(n_total, dx.element_size()))
    top = dx.view(-1)[: m * h * 4 // dx.element_size()].view(torch.float32).view(m, h).zero_()
    bottom = torch.zeros((n - m, h), dtype=torch.float32, device=device)
    return dx, top, bottom


def _dx_finish(dx, top, bottom, rows, chunk_rows):
    """Turn the accumulator into the returned d input, in dx's own storage: the fp32 rows of `top` rounded
    in place to the compact rows 0.. of dx (ascending chunks through a [chunk_rows, H] temporary: a chunk's
    destination never reaches a row not yet read), then `bottom` after them; with compacted rows, the
    compact rows moved to their places (descending chunks: a row never moves up) and the others zeroed."""
    n_total, h = dx.shape
    m = top.shape[0]
    n = m + bottom.shape[0]
    flat = dx.view(-1)
    if dx.dtype != torch.float32:
        for a in range(0, m, chunk_rows):
            e = min(a + chunk_rows, m)
            flat[a * h : e * h].copy_(top[a:e].to(dx.dtype).view(-1))
    if bottom.shape[0]:
        flat[m * h : n * h].view(n - m, h).copy_(bottom)
    if rows is not None:
        for e in range(n, 0, -chunk_rows):
            a = max(e - chunk_rows, 0)
            dx.index_copy_(0, rows[a:e], dx[a:e].clone())
        ignored = torch.ones(n_total, dtype=torch.bool, device=dx.device).index_fill_(0, rows, False)
        dx.masked_fill_(ignored[:, None], 0)
    return dx


def linear_log_probs_bwd(x, w, b, target, lse, entropy, grads, rows, plan: SlabPlan, opts, needs):
    """Vocabulary-slab backward. lse, entropy (or None): [n] per computed row, from the forward; grads =
    (dlog_probs, dentropy, dlse), each fp32 [n] or None. Per slab of Vs classes: its logits for all n
    rows into one reused [n, Vs] buffer (input dtype), d/dlogits written over them in place, then
    dW[slab] = G^T X (one cuBLAS product over all rows, rounded once), db[slab] = sum_rows G (fp32) and
    acc += G W[slab] (fp32; half of it, or all of it for fp32 inputs, lives in the storage of the returned
    dx). `fixed` memory (the accumulator part beyond dx, gathered rows) counts against `budget` when
    fixed_in_budget. Returns dx [N, H] (zero on rows not computed), dw [V, H], db [V] fp32."""
    need_dx, need_dw, need_db = needs
    n_total, h = x.shape
    v = w.shape[0]
    dlog_probs, dentropy, dlse = grads
    xk, tk = _rows(x, target, rows)  # [n, H]: a gathered copy when rows were compacted
    n = xk.shape[0]
    itemsize = x.element_size()
    dx = top = bottom = None
    if need_dx:
        dx, top, bottom = _dx_accumulator(n_total, n, h, x.dtype, x.device)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format) if need_dw else None
    db = torch.empty(v, dtype=torch.float32, device=x.device) if need_db else None
    for t in (dw, db):
        if t is not None and n == 0:
            t.zero_()
    if n == 0 and dx is not None:
        dx.zero_()
        return dx, dw, db
    fixed = n * 64 + (n * h * itemsize if rows is not None else 0)  # per-row vectors, gathered rows
    if bottom is not None:
        fixed += bottom.numel() * 4
    fixed = fixed if plan.fixed_in_budget else 0
    vs = slab_cols(plan.budget, fixed, n, v, itemsize, plan.slab_floor)
    flat = torch.empty(n * vs, dtype=x.dtype, device=x.device)  # the only tensor of many classes
    block_n, block_v, num_warps = _tile(vs, BWD_BLOCK)
    m = top.shape[0] if top is not None else 0
    for v0 in range(0, v, vs):
        v1 = min(v0 + vs, v)
        g = flat[: n * (v1 - v0)].view(n, v1 - v0)
        w_slab = w[v0:v1]
        torch.mm(xk, w_slab.t(), out=g)
        linear_log_probs_bwd_launch(
            (cdiv(n, block_n), cdiv(v1 - v0, block_v)),
            logits_ptr=g,
            logits_row_stride=g.stride(0),
            bias_ptr=b if b is not None else g,
            target_ptr=tk,
            lse_ptr=lse,
            entropy_ptr=entropy if entropy is not None else lse,
            dlog_probs_ptr=dlog_probs if dlog_probs is not None else lse,
            dentropy_ptr=dentropy if dentropy is not None else lse,
            dlse_ptr=dlse if dlse is not None else lse,
            n_rows=n,
            n_cols=v1 - v0,
            col_offset=v0,
            n_classes=v,
            HAS_BIAS=b is not None,
            HAS_DLOG_PROBS=dlog_probs is not None,
            HAS_DENTROPY=dentropy is not None,
            HAS_DLSE=dlse is not None,
            BLOCK_N=block_n,
            BLOCK_V=block_v,
            num_warps=num_warps,
            **_kernel_options(opts),
        )
        if dx is not None:
            mm_fp32_into(top, g[:m], w_slab, accumulate=True)
            if m < n:
                mm_fp32_into(bottom, g[m:], w_slab, accumulate=True)
        if dw is not None:
            torch.mm(g.t(), xk, out=dw[v0:v1])  # fp32 inside cuBLAS, rounded once
        if db is not None:
            torch.sum(g, dim=0, dtype=torch.float32, out=db[v0:v1])
    chunk_rows = max(1, flat.numel() * itemsize // (h * 4))
    del xk, flat, g, w_slab  # the slab buffer is free before d input is rounded into place
    if dx is not None:
        _dx_finish(dx, top, bottom, rows, chunk_rows)
    return dx, dw, db


# ---- custom ops: under torch.compile each pass is one opaque node (no graph break, every row computed) ----


def _or_empty(t, like, dtype=None):
    return t if t is not None else like.new_empty(0, dtype=dtype or like.dtype)


_PLAN = fields_schema(SlabPlan)


@family_custom_op(
    "fuselm::linear_log_probs_fwd",
    tensors="Tensor x, Tensor w, Tensor? b, Tensor target",
    flags=f"{_PLAN}, int stats",
    returns="(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    option_tensors=False,
    scales=False,
)
def _fwd_op(x, w, b, target, **named):
    plan = from_named(SlabPlan, named)
    outs = linear_log_probs_fwd(x, w, b, target, None, plan, options_of(named), named["stats"])
    log_probs = outs[0]
    return tuple(_or_empty(o, log_probs) for o in outs[:5]) + (_or_empty(outs[5], log_probs, torch.bool),)


@family_fake(_fwd_op)
def _(x, w, b, target, **named):
    stats = named["stats"]
    n = x.shape[0]

    def out(bit, dtype=torch.float32):
        return x.new_empty(n if bit is None or stats & bit else 0, dtype=dtype)

    return out(None), out(ENTROPY), out(None), out(SUM_SQ), out(MEAN), out(TOP1, torch.bool)


@family_custom_op(
    "fuselm::linear_log_probs_bwd",
    tensors="Tensor x, Tensor w, Tensor? b, Tensor target",
    after="Tensor lse, Tensor? entropy, Tensor? dlog_probs, Tensor? dentropy, Tensor? dlse",
    flags=f"{_PLAN}, {NEEDS_SCHEMA}",
    returns="(Tensor, Tensor, Tensor)",
    option_tensors=False,
    scales=False,
)
def _bwd_op(x, w, b, target, lse, entropy, dlog_probs, dentropy, dlse, **named):
    dx, dw, db = linear_log_probs_bwd(
        x,
        w,
        b,
        target,
        lse,
        entropy,
        (dlog_probs, dentropy, dlse),
        None,
        from_named(SlabPlan, named),
        options_of(named),
        (named["need_dx"], named["need_dw"], named["need_db"]),
    )
    return _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, lse)


@family_fake(_bwd_op)
def _(x, w, b, target, lse, entropy, dlog_probs, dentropy, dlse, **named):
    dx = x.new_empty(x.shape if named["need_dx"] else (0,))
    dw = w.new_empty(w.shape if named["need_dw"] else (0,))
    db = lse.new_empty(w.shape[0] if named["need_db"] else 0)
    return dx, dw, db


# Eager calls run the launchers directly (and may compact ignored rows); under torch.compile the custom
# ops above stand in, on all rows (no data-dependent shapes, no host sync).


def _run_fwd(x, w, b, target, rows, plan, opts, stats):
    if torch.compiler.is_compiling():
        outs = _fwd_op(x, w, b, target, **plan._asdict(), **opts.op_kwargs(tensors=False), stats=stats)
        keep = (True, stats & ENTROPY, True, stats & SUM_SQ, stats & MEAN, stats & TOP1)
        return tuple(o if k else None for o, k in zip(outs, keep, strict=True))
    return linear_log_probs_fwd(x, w, b, target, rows, plan, opts, stats)


def _run_bwd(x, w, b, target, lse, entropy, grads, rows, plan, opts, needs):
    if torch.compiler.is_compiling():
        dlog_probs, dentropy, dlse = grads
        need_dx, need_dw, need_db = needs
        out = _bwd_op(
            x,
            w,
            b,
            target,
            lse=lse,
            entropy=entropy,
            dlog_probs=dlog_probs,
            dentropy=dentropy,
            dlse=dlse,
            **plan._asdict(),
            **opts.op_kwargs(tensors=False),
            need_dx=need_dx,
            need_dw=need_dw,
            need_db=need_db,
        )
        return tuple(t if need else None for t, need in zip(out, needs, strict=True))
    return linear_log_probs_bwd(x, w, b, target, lse, entropy, grads, rows, plan, opts, needs)


# ---- autograd ----


class LinearLogProbsFunction(torch.autograd.Function):
    """Autograd for x [N, H], w [V, H], b [V] or None, target [N]: the six statistics [N] (None where not
    asked), log_probs, entropy and lse differentiable. The forward keeps lse and entropy per computed row;
    the backward recomputes the logits slab by slab (8NHV FLOPs in all). `rows` (eager only): indices of
    the non-ignored rows, or None to compute every row."""

    @staticmethod
    def forward(ctx, x, w, b, target, rows, plan, opts, stats):
        ctx.set_materialize_grads(False)
        outs = _run_fwd(x, w, b, target, rows, plan, opts, stats)
        _, entropy, lse, *_ = outs
        ctx.save_for_backward(x, w, b, target, rows, lse, entropy)
        ctx.plan, ctx.opts = plan, opts
        if rows is not None:  # back to one value per token: 0 (False) on ignored ones
            n = x.shape[0]
            outs = tuple(o.new_zeros(n).index_copy_(0, rows, o) if o is not None else None for o in outs)
        ctx.mark_non_differentiable(*(o for o in outs[3:] if o is not None))
        return outs

    @staticmethod
    def backward(ctx, dlog_probs, dentropy, dlse, *_):
        refuse_double_backward(*DOUBLE_BACKWARD)
        x, w, b, target, rows, lse, entropy = ctx.saved_tensors
        needs = tuple(bool(k) for k in ctx.needs_input_grad[:3])
        grads = []
        for g in (dlog_probs, dentropy, dlse):
            if g is not None:
                g = g.float().reshape(-1)
                g = (g.index_select(0, rows) if rows is not None else g).contiguous()
            grads.append(g)
        if all(g is None for g in grads) or not any(needs):
            return (None,) * 8
        dx, dw, db = _run_bwd(x, w, b, target, lse, entropy, tuple(grads), rows, ctx.plan, ctx.opts, needs)
        if db is not None:
            db = db.to(b.dtype)
        return dx, dw, db, *([None] * 5)


# ---- public function ----


def check_outputs(outputs) -> tuple[str, ...]:
    """The names of `outputs` (a sequence of names among OUTPUT_NAMES, or one name), else ValueError."""
    names = (outputs,) if isinstance(outputs, str) else outputs
    try:
        names = tuple(names)
    except TypeError:
        raise ValueError(
            f"outputs must be a sequence of names among {OUTPUT_NAMES}, got {outputs!r}"
        ) from None
    for name in names:
        if name not in OUTPUT_NAMES:
            raise ValueError(f"outputs: unknown name {name!r}; the names are {OUTPUT_NAMES}")
    return names


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs=("log_probs",),
    memory: str | int = "auto",
) -> LogProbs:
    """Per-token log-probabilities of ``target`` (and, on request, entropy and other statistics) under the
    logits of a linear layer, without ever materializing the ``[N, V]`` logits.

    The logits of a token are ``z = (input @ linear_weight.T + linear_bias) * logit_scale``, then
    ``softcap * tanh(z / softcap)`` if ``softcap`` is set, then ``z / temperature`` (the order of TRL's
    fused head). With ``p = softmax(z)`` over the V classes, per token:

    - ``log_probs = z[target] - lse`` (always computed)
    - ``entropy = lse - sum_j p_j z_j``
    - ``lse = logsumexp(z)``
    - ``log_sum_sq_probs = log(sum_j p_j**2)``
    - ``mean_logits = mean_j z_j``
    - ``is_top1 = argmax_j z_j == target`` (the first of tied maxima counts, as ``torch.argmax``)

    ``log_probs``, ``entropy`` and ``lse`` are differentiable with respect to ``input``, ``linear_weight``
    and ``linear_bias`` under any per-token upstream gradients, on one, two or all three of them (e.g. a
    policy-gradient loss on log_probs with per-token advantages plus an entropy bonus); the other
    statistics are not differentiable. The backward recomputes the logits (8NHV FLOPs in all: the forward
    GEMM, and the logits GEMM and the two gradient GEMMs of the backward).

    Args:
        input: hidden states ``[..., H]`` (e.g. ``[B, T, H]``), float32 / float16 / bfloat16 (float64 runs
            the PyTorch reference).
        linear_weight: ``[V, H]``, same dtype and device as ``input`` (e.g. the lm_head weight).
        target: class indices of shape ``input.shape[:-1]``, int32 or int64.
        linear_bias: optional ``[V]``, same dtype as ``input``.
        ignore_index: target value of tokens to skip (any int): every output is 0 (False for ``is_top1``)
            there and they get no gradient; in eager mode they also cost no FLOPs (see below). A target
            outside ``[0, V)`` that is not ``ignore_index`` raises ValueError in eager mode (found during
            the same host sync); under ``torch.compile`` and CUDA graph capture, where nothing syncs, such a
            token gets a NaN ``log_probs``, 0 elsewhere and no gradient.
        temperature: the logits are divided by it (``> 0``).
        softcap: if set (``> 0``), ``softcap * tanh(z / softcap)`` is applied before the temperature
            (Gemma 2's final logit softcapping).
        logit_scale: the raw logits are multiplied by it first (a finite float; Cohere's ``logit_scale``,
            Granite's ``1 / logits_scaling``).
        outputs: names of the statistics to compute among ``"log_probs"``, ``"entropy"``, ``"lse"``,
            ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"`` (a sequence, or one name);
            ``log_probs`` is computed in any case. Each costs a little in the forward's pass over the
            logits; the others are returned as None.
        memory: how much memory the plan may take.

            - ``"auto"`` (default): a budget of ``min(256 MiB, a quarter of the free device memory)``.
              Both passes walk slabs of the vocabulary: the forward's fp32 ``[N, Vs]`` logits buffer, and
              in the backward the ``[N, Vs]`` buffer together with the part of the fp32 ``[N, H]``
              accumulator of the input gradient that the returned gradient's own storage does not hold
              (half of it for 16-bit inputs, none for fp32), fit the budget; the slab keeps at least 1024
              classes (the budget is then exceeded; README.md counts it).
            - an int: that many bytes, the same way (slabs of at least 128 classes).
            - ``"min"``: 8 MiB slab buffers (at least 128 classes), plus that accumulator part: O(N)
              memory besides what the gradient of ``input`` itself takes; narrow slabs, so slower.

    Ignored tokens: in eager mode (not under ``torch.compile``, not while capturing a CUDA graph) the kept
    rows are found first, at the cost of one host synchronization, and only they go through the GEMMs.
    Under ``torch.compile`` and CUDA graph capture every row is computed (no sync) and the ignored ones are
    zeroed.

    Autocast: under ``torch.autocast``, ``input``, ``linear_weight`` and ``linear_bias`` are cast to the
    autocast dtype first, as ``F.linear`` would (the gradients flow back to their own dtypes).

    Precision: the forward's logits are cuBLAS products accumulated and kept in fp32 (never rounded to
    16 bits), and every statistic is computed in fp32. In the backward, the recomputed logits and the
    gradient written over them are in the input dtype (as eager PyTorch's), ``d linear_weight`` of each
    slab is one cuBLAS product over all tokens (fp32 inside, rounded once to its dtype, never summed in
    16 bits), ``d input`` is summed over the slabs in fp32 and ``d linear_bias`` in fp32. No host sync
    besides the one of ignored-row compaction (eager only).

    Double backward: not supported on any path: a backward with ``create_graph=True`` (higher-order
    gradients) raises RuntimeError naming it (the backward recomputes the logits without a graph); use
    eager PyTorch for those (``torch.log_softmax(F.linear(input, linear_weight, linear_bias), -1)``).

    Returns:
        :class:`fuselm.LogProbs` ``(log_probs, entropy, lse, log_sum_sq_probs, mean_logits, is_top1)``: each
        of ``target``'s shape, float32 (float64 for float64 input; bool for ``is_top1``), or None when not
        asked for (``log_probs`` always there).

    Example:
        >>> import torch
        >>> from fuselm.ops.linear_log_probs import linear_log_probs
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> lm_head = torch.randn(100, 16, requires_grad=True)
        >>> target = torch.randint(0, 100, (2, 5))
        >>> target[:, :2] = -100  # prompt tokens
        >>> out = linear_log_probs(hidden, lm_head, target, temperature=0.7, outputs=("entropy",))
        >>> advantages = torch.randn(2, 5)
        >>> loss = -(advantages * out.log_probs).sum() - 0.01 * out.entropy.sum()
        >>> loss.backward()
        >>> out.log_probs.shape, out.lse is None, hidden.grad.shape
        (torch.Size([2, 5]), True, torch.Size([2, 5, 16]))
    """
    input, linear_weight, linear_bias = linear_operands(
        input, linear_weight, linear_bias, dtypes=(*FLOAT_DTYPES, torch.float64)
    )
    device = input.device
    v = linear_weight.shape[0]
    check_classes("linear_weight", v)
    # the family's options and checks: per-token statistics, so no reduction, smoothing or z-loss
    opts = LossOptions.of(
        ignore_index=ignore_index,
        reduction="none",
        softcap=softcap,
        logit_scale=logit_scale,
        temperature=temperature,
    ).checked(input, target, v)
    names = check_outputs(outputs)
    validate_memory(memory)

    t1 = target.reshape(-1)
    rows = kept_rows(t1, v, ignore_index) if compaction_allowed(device) else None
    budget = memory_budget(memory, device)
    if not kernels_run(input):
        stats = linear_log_probs_reference(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            ignore_index=opts.ignore_index,
            temperature=opts.temperature,
            softcap=opts.softcap or None,
            logit_scale=opts.logit_scale,
            budget=budget,
            rows=rows,
        )
    else:
        plan = SlabPlan(
            budget=budget,
            slab_floor=AUTO_SLAB_FLOOR if memory == "auto" else MIN_SLAB_FLOOR,
            fixed_in_budget=memory != "min",  # does the fp32 d input accumulator count against the bytes?
        )
        stat_bits = sum(bit for name, bit in STAT_BITS.items() if name in names)
        stats = LinearLogProbsFunction.apply(
            rows_view(input),
            linear_weight,
            linear_bias.contiguous() if linear_bias is not None else None,
            t1.contiguous(),
            rows,
            plan,
            opts,
            stat_bits,
        )
        stats = tuple(s.reshape(target.shape) if s is not None else None for s in stats)
    wanted = {"log_probs", *names}
    return LogProbs(*(s if name in wanted else None for name, s in zip(OUTPUT_NAMES, stats, strict=True)))
