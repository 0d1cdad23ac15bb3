"""Pure-PyTorch per-token log-probabilities of a linear layer: the spec, the CPU fallback, the basis of
the test oracle.

    u = input @ linear_weight.T + linear_bias                    # [N, V], never held whole
    z = transform(u) = softcap * tanh(u * logit_scale / softcap) / temperature   (no softcap: u * s / T)
    p = softmax(z)
    log_probs = z[target] - lse,  entropy = lse - sum_j p_j z_j,  lse = logsumexp(z),
    log_sum_sq_probs = log sum_j p_j^2,  mean_logits = mean_j z_j,  is_top1 = argmax_j z_j == target

The per-row math is written once here (`row_statistics`, `row_logit_grad`, on the family's
`transform_logits` and `softmax_grad`); the Triton kernels implement the same functions (kernels.py).
The plan has the shape of the Triton path (README.md): the forward walks chunks of tokens, the backward
walks slabs of the vocabulary,
recomputing each slab's logits for every kept token, so that d linear_weight[slab] is one product over
all tokens (summed in the compute dtype, rounded once) and d input is summed in the compute dtype.
Math in fp32 (fp64 for fp64 input).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._common.guard import refuse_double_backward
from .._common.loss.reference import softmax_grad, transform_logits

# refuse_double_backward's arguments, for the reference's Function and the op's
DOUBLE_BACKWARD = (
    "linear_log_probs",
    "fused kernels, or chunks recomputed without a graph",
    "eager PyTorch: torch.log_softmax(F.linear(input, linear_weight, linear_bias), -1)"
    ".gather(-1, target[..., None])",
)

OUTPUT_NAMES = ("log_probs", "entropy", "lse", "log_sum_sq_probs", "mean_logits", "is_top1")
DIFFERENTIABLE = ("log_probs", "entropy", "lse")
# Working-set budget of the reference when none is given: a chunk's (or slab's) fp32 logits and their
# few temporaries take at most this many bytes.
DEFAULT_BUDGET = 256 * 2**20
TEMPORARIES = 4  # [rows, cols] tensors alive at once in a chunk or slab step (logits, exp, products)


class LogProbs(NamedTuple):
    """Per-token results of :func:`fuselm.linear_log_probs`, each of the target's shape (float32; bool for
    ``is_top1``); a field that was not asked for is None. ``log_probs`` is always there.

    Example:
        >>> import torch
        >>> out = LogProbs(log_probs=torch.tensor([-0.5, -2.0]))
        >>> out.log_probs.exp(), out.entropy
        (tensor([0.6065, 0.1353]), None)
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- the per-row math (one definition) ----


def row_statistics(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every per-row statistic of z [R, V] (compute dtype) for targets [R] in [0, V) (callers clamp others):
    (log_probs, entropy, lse, log_sum_sq_probs, mean_logits, is_top1). Sums are taken around the row max m
    (entropy = log s - sum_j e_j (z_j - m) / s with e_j = exp(z_j - m), s = sum_j e_j), so that the entropy
    of a peaked row does not come from the difference of two large numbers."""
    m = z.amax(dim=1, keepdim=True)
    d = z - m
    e = torch.exp(d)
    s = e.sum(dim=1)
    log_s = torch.log(s)
    lse = m.squeeze(1) + log_s
    z_t = z.gather(1, target.reshape(-1, 1)).squeeze(1)
    entropy = log_s - (e * d).sum(dim=1) / s
    log_sum_sq = torch.log((e * e).sum(dim=1)) - 2.0 * log_s
    is_top1 = z.argmax(dim=1) == target  # argmax: the first of tied maxima, as torch.argmax
    return z_t - lse, entropy, lse, log_sum_sq, z.mean(dim=1), is_top1


def row_logit_grad(z, target, lse, entropy, dlog_probs, dentropy, dlse):
    """d(sum_i a_i log_probs_i + e_i entropy_i + l_i lse_i) / dz for a block of columns z [R, Vb] (compute
    dtype) whose column 0 is class `target`'s offset: `target` [R] holds each row's target class minus the
    block's first class (outside [0, Vb) when the block does not hold it). lse, entropy [R] are the row's
    statistics over all V classes; dlog_probs (a), dentropy (e), dlse (l) are [R] or None (zero).

        dz_j = a (1[j = t] - p_j) + l p_j - e p_j (log p_j + entropy),   p_j = exp(z_j - lse)
    """
    log_p = z - lse[:, None]
    p = torch.exp(log_p)
    a = dlog_probs if dlog_probs is not None else torch.zeros_like(lse)
    p_coef = dlse - a if dlse is not None else -a
    cols = torch.arange(z.shape[1], device=z.device)
    g = softmax_grad(p, cols[None, :] == target[:, None], p_coef[:, None], -a[:, None])
    if dentropy is not None:
        g = g - (dentropy[:, None] * p) * (log_p + entropy[:, None])
    return g


# ---- the chunked plan ----


def reference_chunk_rows(budget: int, n_cols: int, itemsize: int) -> int:
    """Rows of a forward chunk (or columns of a backward slab, with n_cols the number of rows) whose
    TEMPORARIES fp32 tensors fit `budget` bytes; at least 1."""
    return max(1, budget // (TEMPORARIES * max(n_cols, 1) * itemsize))


def _linear(xc, w, b):
    return xc @ w.T if b is None else torch.addmm(b, xc, w.T)


class _LinearLogProbsReference(torch.autograd.Function):
    """x [N, H], w [V, H], b [V] or None, target [N]; rows: indices of the tokens to compute (ignored ones
    compacted out, eager only) or None for all. Returns the six statistics [N] (compute dtype; bool for
    is_top1), 0 (False) on tokens not computed, on ignored ones and on out-of-range targets, whose
    log_probs is NaN instead."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def forward(
        ctx, x, w, b, target, rows, chunk_rows, budget, ignore_index, logit_scale, softcap, temperature
    ):
        ctx.set_materialize_grads(False)
        cd = compute_dtype(x.dtype)
        n_total, v = x.shape[0], w.shape[0]
        xk = x if rows is None else x.index_select(0, rows)
        tk = target if rows is None else target.index_select(0, rows)
        n = xk.shape[0]
        wc = w.to(cd)
        bc = b.to(cd) if b is not None else None
        stats = [torch.zeros(n, dtype=cd, device=x.device) for _ in range(5)]
        top1 = torch.zeros(n, dtype=torch.bool, device=x.device)
        in_range = (tk >= 0) & (tk < v)
        t_safe = torch.where(in_range, tk, 0)
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            z, _ = transform_logits(_linear(xk[s:e].to(cd), wc, bc), logit_scale, softcap, temperature)
            *values, is_top1 = row_statistics(z, t_safe[s:e])
            for out, val in zip(stats, values, strict=True):
                out[s:e] = val
            top1[s:e] = is_top1
        lse_raw, ent_raw = stats[2].clone(), stats[1].clone()  # unmasked: the backward's p and entropy
        valid = (tk != ignore_index) & in_range
        outs = [torch.where(valid, val, 0.0) for val in stats]
        outs[0] = torch.where((tk != ignore_index) & ~in_range, float("nan"), outs[0])
        outs.append(top1 & valid)
        if rows is not None:
            outs = [o.new_zeros(n_total).index_copy_(0, rows, o) for o in outs]
        ctx.save_for_backward(x, w, b, target, rows, lse_raw, ent_raw)
        ctx.options = (budget, ignore_index, logit_scale, softcap, temperature)
        ctx.mark_non_differentiable(*outs[3:])
        return tuple(outs)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, dlog_probs, dentropy, dlse, *_):
        refuse_double_backward(*DOUBLE_BACKWARD)
        x, w, b, target, rows, lse, entropy = ctx.saved_tensors
        budget, ignore_index, logit_scale, softcap, temperature = ctx.options
        cd = compute_dtype(x.dtype)
        v = w.shape[0]
        needs = ctx.needs_input_grad[:3]
        grads = [dlog_probs, dentropy, dlse]
        if rows is not None:
            grads = [g.index_select(0, rows) if g is not None else None for g in grads]
        xk = x if rows is None else x.index_select(0, rows)
        tk = target if rows is None else target.index_select(0, rows)
        n = xk.shape[0]
        valid = (tk != ignore_index) & (tk >= 0) & (tk < v)
        grads = [torch.where(valid, g.to(cd), 0.0) if g is not None else None for g in grads]
        xc = xk.to(cd)  # [n, H]
        dx = torch.zeros_like(xc) if needs[0] else None  # d input summed over slabs in the compute dtype
        # zeros, not empty: a torch.empty traced inside this Function stopped torch.compile in CI (the test
        # harness swaps torch.empty & co. for NaN-filling wrappers, and one ordering of tests left dynamo
        # unable to trace through them); each slab writes its rows anyway
        dw = torch.zeros_like(w) if needs[1] else None
        db = torch.zeros(v, dtype=cd, device=x.device) if needs[2] and b is not None else None
        slab = reference_chunk_rows(budget, n, torch.finfo(cd).bits // 8)
        for s in range(0, v, slab):
            e = min(s + slab, v)
            ws = w[s:e].to(cd)
            u = _linear(xc, ws, b[s:e].to(cd) if b is not None else None)  # [n, slab]
            z, dz_du = transform_logits(u, logit_scale, softcap, temperature)
            g = row_logit_grad(z, tk - s, lse, entropy, *grads) * dz_du
            g = torch.where(valid[:, None], g, 0.0)  # ignored and out-of-range rows: no gradient
            if dx is not None:
                dx += g @ ws
            if dw is not None:
                dw[s:e] = (g.T @ xc).to(w.dtype)  # one product over all tokens, rounded once
            if db is not None:
                db[s:e] = g.sum(dim=0)
        if dx is not None:
            dx = dx.to(x.dtype)
            if rows is not None:
                dx = x.new_zeros(x.shape).index_copy_(0, rows, dx)
        if db is not None:
            db = db.to(b.dtype)
        return dx, dw, db, *([None] * 8)


def linear_log_probs_reference(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    budget: int = DEFAULT_BUDGET,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The six per-token statistics of ``input @ linear_weight.T + linear_bias`` (see the module docstring),
    in PyTorch, in chunks of tokens (forward) and slabs of the vocabulary (backward).

    input [..., H], linear_weight [V, H], linear_bias [V] or None, target input.shape[:-1] (int). Returns
    (log_probs, entropy, lse, log_sum_sq_probs, mean_logits, is_top1), each of target's shape, float32
    (float64 for float64 input; bool for is_top1); log_probs, entropy and lse are differentiable. Tokens
    whose target is ``ignore_index`` get 0 (False) everywhere and no gradient; a target outside [0, V)
    gets a NaN log_probs, 0 elsewhere and no gradient (the public function raises on it in eager mode).
    ``budget`` bytes bound each step's compute-dtype temporaries (chunks of rows, slabs of classes);
    ``rows``: int64 indices of the flattened tokens to compute (others count as ignored), or None.
    Memory besides the gradients: the temporaries, compute-dtype copies of linear_weight (forward) and of
    the kept rows of input and their gradient (backward), O(VH + NH), never O(NV).

    Example:
        >>> import torch
        >>> x, w = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8)
        >>> out = linear_log_probs_reference(x, w, torch.randint(0, 20, (6,)), temperature=0.7)
        >>> out[0].sum().backward()
        >>> x.grad.shape
        torch.Size([6, 8])
    """
    h = input.shape[-1]
    v = linear_weight.shape[0]
    itemsize = torch.finfo(compute_dtype(input.dtype)).bits // 8
    outs = _LinearLogProbsReference.apply(
        input.reshape(-1, h),
        linear_weight,
        linear_bias,
        target.reshape(-1),
        rows,
        reference_chunk_rows(budget, v, itemsize),
        int(budget),
        int(ignore_index),
        float(logit_scale),
        float(softcap) if softcap else None,
        float(temperature),
    )
    return tuple(o.reshape(target.shape) for o in outs)
