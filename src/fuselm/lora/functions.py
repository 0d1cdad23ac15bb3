"""Fused LoRA autograd: ``lora_linear`` (one projection) and ``lora_gated_mlp`` (a gated MLP of three).

Forward of one projection (README.md has the derivation, the FLOPs and the saved tensors):

    low = drop(x) A^T                   [N, r]
    y   = s * low B^T + b               one rank-r GEMM, y written once (the bias in its epilogue)
    y  += x W^T                         y.addmm_(x, W^T): the base GEMM reads y in its epilogue

The LoRA GEMMs run in the compute dtype (x's, or the autocast dtype), the adapters cast once per
call; gradients of A and B are returned in their own dtype. Saved for backward: x, low (and the
dropout mask); never the (dequantized) base weight, which backward makes again.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..offload import call_memo, has_kept_output, keep_output, kept_output
from ..ops.swiglu import ChunkedMLP, ChunkSums, check_chunk_rows, gated_backward, gated_forward
from .frozen import FrozenWeight, dense

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One LoRA adapter of a projection ``[in] -> [out]``: ``y += scaling * drop(x) @ A.T @ B.T``.

    Attributes:
        A: ``[r, in]`` (PEFT's ``lora_A[name].weight``), any floating dtype (PEFT keeps fp32).
        B: ``[out, r]`` (PEFT's ``lora_B[name].weight``), A's dtype.
        scaling: the Python float ``s`` (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` for rsLoRA).
        dropout: the dropout probability ``p`` in ``[0, 1)`` applied to the input of ``A`` (0 in eval).
        mask_dtype: the dtype of the tensor PEFT's ``nn.Dropout`` sees (the RNG draw depends on it);
            None means A's dtype (PEFT casts the input to A's dtype before the dropout).

    Example:
        >>> LoraAdapter(torch.randn(8, 64), torch.zeros(32, 8), scaling=2.0).rank
        8
    """

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    dropout: float = 0.0
    mask_dtype: torch.dtype | None = None

    @property
    def rank(self) -> int:
        return self.A.shape[0]


# ---- checks (every bad argument raises ValueError naming it) ----


def _check_x(name: str, x: object, in_features: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got shape {tuple(x.shape)}")
    if in_features is not None and x.shape[-1] != in_features:
        raise ValueError(f"{name} must have {in_features} features (last dim), got shape {tuple(x.shape)}")
    return x


def _compute_dtype(x: torch.Tensor) -> tuple[torch.dtype, bool]:
    """(compute dtype, autocast on): x's dtype, or the autocast dtype inside an autocast region of x's
    device type (what F.linear would compute in; float64 is never autocast)."""
    if x.dtype != torch.float64 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type), True
    return x.dtype, False


def _check_base(name: str, base: object, x: torch.Tensor, cdt: torch.dtype, autocast: bool) -> None:
    if isinstance(base, torch.Tensor):
        if base.dim() != 2:
            raise ValueError(f"{name} must be a 2-D [out, in] weight, got shape {tuple(base.shape)}")
        if base.dtype != cdt and not autocast:
            raise ValueError(f"{name} must have the dtype of x ({cdt}), got {base.dtype}")
    elif not isinstance(base, FrozenWeight):
        raise ValueError(f"{name} must be a torch.Tensor or a FrozenWeight, got {type(base).__name__}")
    if base.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{name} must have shape [out, {x.shape[-1]}] (x's last dim), got {tuple(base.shape)}"
        )
    if base.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {base.device}")
    if base.requires_grad:
        raise ValueError(
            f"{name} requires grad: the fused LoRA path is for frozen base weights (train it elsewhere)"
        )


def _check_bias(name: str, bias: object, out_features: int, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        raise ValueError(f"{name} must be None or a floating torch.Tensor, got {type(bias).__name__}")
    if tuple(bias.shape) != (out_features,):
        raise ValueError(f"{name} must have shape [{out_features}], got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"{name} must be on x's device {device}, got {bias.device}")
    if bias.requires_grad:
        raise ValueError(f"{name} requires grad: the fused LoRA path takes a frozen bias")


def _check_adapter(name: str, adapter: object, in_features: int, out_features: int, device) -> None:
    if adapter is None:
        return
    if not isinstance(adapter, LoraAdapter):
        raise ValueError(f"{name} must be a LoraAdapter or None, got {type(adapter).__name__}")
    A, B = adapter.A, adapter.B
    for n, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}.{n} must be a 2-D floating tensor, got {got}")
        if t.device != device:
            raise ValueError(f"{name}.{n} must be on x's device {device}, got {t.device}")
    r = A.shape[0]
    if A.shape[1] != in_features or r < 1:
        raise ValueError(f"{name}.A must have shape [r, {in_features}], got {tuple(A.shape)}")
    if tuple(B.shape) != (out_features, r):
        raise ValueError(f"{name}.B must have shape [{out_features}, {r}] ([out, r]), got {tuple(B.shape)}")
    if B.dtype != A.dtype:
        raise ValueError(f"{name}.B must have the dtype of {name}.A ({A.dtype}), got {B.dtype}")
    s = adapter.scaling
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise ValueError(f"{name}.scaling must be a finite Python number, got {s!r}")
    p = adapter.dropout
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name}.dropout must be a number in [0, 1), got {p!r}")
    if adapter.mask_dtype is not None and not (
        isinstance(adapter.mask_dtype, torch.dtype) and adapter.mask_dtype.is_floating_point
    ):
        raise ValueError(
            f"{name}.mask_dtype must be None or a floating torch.dtype, got {adapter.mask_dtype!r}"
        )


def _operands(name: str, op: object) -> tuple:
    """(base, adapter, bias) from a (base, adapter) pair or a (base, adapter, bias) triple."""
    if not isinstance(op, (tuple, list)) or len(op) not in (2, 3):
        raise ValueError(f"{name} must be a (base, adapter) or (base, adapter, bias) tuple, got {op!r:.80}")
    return (op[0], op[1], op[2] if len(op) == 3 else None)


# ---- dropout: PEFT's masks ----


def dropout_mask(x: torch.Tensor, p: float, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The bool keep-mask PEFT's ``nn.Dropout(p)`` would draw for ``x`` (cast to ``dtype``), or None when
    ``p == 0``.

    The RNG use of dropout depends on the tensor's shape, strides, dtype and device, not on its
    values: the mask is drawn by ``F.dropout`` on a tensor of ones like ``x`` (same shape and strides)
    in ``dtype`` (default x's), so with the same RNG state it equals PEFT's, and it advances the RNG
    exactly as PEFT's dropout does. Kept elements are True; PEFT's output is ``x * mask / (1 - p)``.

    Args:
        x: the input of the LoRA branch, as PEFT's dropout would see it (before the cast).
        p: the dropout probability in ``[0, 1)``.
        dtype: the dtype PEFT's dropout sees (``lora_A``'s weight dtype by default in PEFT).

    Example:
        >>> x = torch.randn(4, 16)
        >>> _ = torch.manual_seed(0); m = dropout_mask(x, 0.5)
        >>> _ = torch.manual_seed(0); torch.equal(m, torch.nn.Dropout(0.5)(x) != 0)
        True
    """
    if p == 0:
        return None
    ones = torch.ones_like(x, dtype=dtype or x.dtype)
    return F.dropout(ones, p, training=True) != 0


# ---- the projection math, shared by both functions ----


class _Proj:
    """The non-tensor operands of one projection inside the autograd functions."""

    __slots__ = ("base", "bias", "scaling", "keep_scale", "versions")

    def __init__(self, base, bias, adapter: LoraAdapter | None):
        self.base = base
        self.bias = bias
        self.scaling = float(adapter.scaling) if adapter is not None else 0.0
        self.keep_scale = 1.0 / (1.0 - adapter.dropout) if adapter is not None and adapter.dropout else 1.0
        self.versions = []
        if torch.is_grad_enabled():  # a backward may follow (no version counters in inference mode)
            tensors = (base, adapter and adapter.A, adapter and adapter.B)
            self.versions = [
                (t, t._version) for t in tensors if isinstance(t, torch.Tensor) and not t.is_inference()
            ]

    def check_versions(self) -> None:
        for t, v in self.versions:
            if t._version != v:
                raise RuntimeError(
                    "fuselm.lora: a weight of a LoRA projection was modified in place between forward and "
                    "backward (merge, optimizer step): the gradient would be wrong"
                )


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
# which fp32-output GEMMs of 16-bit operands run here (CUDA builds; tried once each)
_OUT_DTYPE_GEMMS = {"addmm": True, "mm": True}


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-dim zero: the ignored ``input`` of ``addmm(..., beta=0)``."""
    key = (dtype, device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros((), dtype=dtype, device=device)
    return z


def _mm_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``scale * (a @ b)`` in ``dtype``, the scale applied inside the GEMM (``addmm``, beta = 0: one launch,
    one rounding). A 16-bit product for an fp32 adapter gradient on CUDA comes out of the GEMM in fp32
    (fp32 accumulation, one rounding); elsewhere it is rounded to the operands' dtype, then cast."""
    if a.dtype == dtype:
        if scale == 1.0:
            return torch.mm(a, b)
        return torch.addmm(_zero(dtype, a.device), a, b, beta=0, alpha=scale)
    if dtype == torch.float32 and a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        if _OUT_DTYPE_GEMMS["addmm"]:
            try:
                z = _zero(dtype, a.device)
                return torch.addmm(z, a, b, beta=0, alpha=scale, out_dtype=dtype)
            except (RuntimeError, NotImplementedError, TypeError):  # not in this build
                _OUT_DTYPE_GEMMS["addmm"] = False
        if _OUT_DTYPE_GEMMS["mm"]:
            try:
                out = torch.mm(a, b, out_dtype=dtype)
                return out.mul_(scale) if scale != 1.0 else out
            except (RuntimeError, NotImplementedError, TypeError):
                _OUT_DTYPE_GEMMS["mm"] = False
    if scale == 1.0:
        return torch.mm(a, b).to(dtype)
    return torch.addmm(_zero(a.dtype, a.device), a, b, beta=0, alpha=scale).to(dtype)


def _cast_adapter(a: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype):
    """(A, B) in ``dtype``; inside a checkpointed call, made once for its forward and its recompute
    (:func:`fuselm.offload.call_memo`: two launches fewer per projection in the backward)."""
    if a is None:
        return None, None
    if a.dtype == dtype:  # (a no-op .to still costs host time)
        return a, b
    memo = call_memo()
    if memo is None:
        return a.to(dtype), b.to(dtype)
    key = ("lora_cast", id(a), id(b), dtype)
    kept = memo.get(key)
    if kept is None or kept[0] is not a or kept[1] is not b:
        kept = memo[key] = (a, b, (a.to(dtype), b.to(dtype)))
    return kept[2]


def _backward_cast(cast: tuple, a: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype):
    """The adapters in ``dtype`` for backward: the casts forward made (kept on the context: two launches
    fewer per projection; the version check guards A and B), or new ones for another dtype."""
    if a is None or cast[0].dtype == dtype:
        return cast
    return _cast_adapter(a, b, dtype)


def _proj_forward(x, a, cast, mask, proj: _Proj, output: bool = True, low=None):
    """(y [N, out], low [N, r] or None) for x [N, in] in the compute dtype, ``cast`` = (A, B) in that
    dtype (:func:`_cast_adapter`); ``low`` when made already; ``output=False``: low only, y allocated
    without values (no base GEMM, no dequantization)."""
    a_c, b_c = cast
    if not output:
        return x.new_empty(x.shape[0], proj.base.shape[0]), _low(x, a, a_c, mask, proj)
    bias = proj.bias
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if a is None:
        return F.linear(x, dense(proj.base, x.dtype), bias), None  # addmm: the bias in the GEMM epilogue
    if low is None:
        low = _low(x, a, a_c, mask, proj)
    bt = b_c.t()
    # the rank-r product first, written once (with the bias), then the base GEMM adds itself to it: the
    # read of y hides in the epilogue of a compute-bound GEMM, where adding the update after the base
    # GEMM would read and write y once more
    if bias is None:
        y = torch.addmm(_zero(x.dtype, x.device), low, bt, beta=0, alpha=proj.scaling)
    else:
        y = torch.addmm(bias, low, bt, alpha=proj.scaling)
    y.addmm_(x, dense(proj.base, x.dtype).t())  # a quantized weight's scratch is free when this returns
    return y, low


def _low(x, a, a_c, mask, proj: _Proj):
    """drop(x) A^T [N, r] (None without an adapter); a_c is A in x's dtype."""
    if a is None:
        return None
    if mask is None:
        return F.linear(x, a_c)
    # drop(x) A^T = (x * mask) (A / (1 - p))^T: the 1 / (1 - p) folded into the small operand
    return F.linear(x * mask, (a * proj.keep_scale).to(x.dtype))


def _grad_input(dy, dyb, a_c, mask, proj: _Proj, acc=None):
    """dX = dY W (+ s * ((dY B) A) masked), into ``acc`` when given (dX += ...). The rank-r part first, so
    the base GEMM adds itself to it in its epilogue (as in forward)."""
    dx = acc
    if a_c is not None:
        if mask is None:
            if dx is None:
                dx = torch.addmm(_zero(dy.dtype, dy.device), dyb, a_c, beta=0, alpha=proj.scaling)
            else:
                dx.addmm_(dyb, a_c, alpha=proj.scaling)
        else:
            t = torch.mm(dyb, a_c).mul_(mask)
            scale = proj.scaling * proj.keep_scale
            dx = t.mul_(scale) if dx is None else dx.add_(t, alpha=scale)
    w = dense(proj.base, dy.dtype)
    return torch.mm(dy, w) if dx is None else dx.addmm_(dy, w)


def _grad_adapter(dy, dyb, inp, low, mask, a, b, proj: _Proj, need_a: bool, need_b: bool):
    """(dA [r, in] in A's dtype, dB [out, r] in B's dtype): dA = s (dY B)^T drop(x), dB = s dY^T low."""
    da = db = None
    if need_a:
        xm = inp if mask is None else inp * mask
        da = _mm_to(dyb.t(), xm, a.dtype, proj.scaling * proj.keep_scale)
    if need_b:
        db = _mm_to(dy.t(), low, b.dtype, proj.scaling)
    return da, db


def _no_autocast(device_type: str):
    """Autocast off for the explicit-dtype GEMMs of backward (a no-op context when it is off already)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _mlp_backward_casts(ctx, dtype: torch.dtype) -> list[tuple]:
    """:func:`_backward_cast` of the gated MLP's three adapters (gate, up, down)."""
    ag, bg, au, bu, ad, bd = ctx.adapters
    pairs = ((ag, bg), (au, bu), (ad, bd))
    return [_backward_cast(c, a, b, dtype) for c, (a, b) in zip(ctx.casts, pairs, strict=True)]


# ---- autograd ----


class LoraLinearFunction(torch.autograd.Function):
    """y = x W^T + b + s * (drop(x) A^T) B^T for x [N, in] in the compute dtype. Saves x and low [N, r]
    (with an adapter) and the bool dropout mask (p > 0); the base weight and the adapters are
    referenced, not saved."""

    @staticmethod
    def forward(ctx, x, a, b, mask, proj):
        cast = _cast_adapter(a, b, x.dtype)
        y, low = _kept_or_made(x, a, cast, mask, proj)
        ctx.proj, ctx.a, ctx.b, ctx.cast = proj, a, b, cast  # references and [r, *] casts: no activations
        ctx.save_for_backward(x if a is not None else None, low, mask)  # no adapter: dX = dY W only
        return y

    @staticmethod
    def backward(ctx, dy):
        x, low, mask = ctx.saved_tensors
        proj, a, b = ctx.proj, ctx.a, ctx.b
        proj.check_versions()
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        with _no_autocast(dy.device.type):
            a_c, b_c = _backward_cast(ctx.cast, a, b, dy.dtype)
            dyb = torch.mm(dy, b_c) if a is not None and (need_x or need_a) else None  # [N, r]
            dx = _grad_input(dy, dyb, a_c, mask, proj) if need_x else None
            da, db = (None, None)
            if a is not None:
                da, db = _grad_adapter(dy, dyb, x, low, mask, a, b, proj, need_a, need_b)
        return dx, da, db, None, None


class LoraProjectionsFunction(torch.autograd.Function):
    """``lora_linear`` of several projections of one input x [N, in] (attention's q, k and v), one node:
    with every adapter present and no dropout, x A^T is one GEMM against the adapters' A stacked
    ``[sum r, in]``, dX one buffer (the rank-r parts in one GEMM, then each base GEMM adding itself in its
    epilogue: no sum of separate dX tensors) and dA one GEMM. Saves x, the lows and the masks."""

    @staticmethod
    def forward(ctx, x, projs, masks, *adapters):
        pairs = list(zip(adapters[0::2], adapters[1::2], strict=True))
        each = masks or (None,) * len(pairs)  # () when no projection has dropout
        casts = [_cast_adapter(a, b, x.dtype) for a, b in pairs]
        stacked = _stacked(pairs, masks)
        a_cat = torch.cat([c[0] for c in casts]) if stacked else None
        if stacked:
            low_cat = F.linear(x, a_cat)
            lows = list(low_cat.split([a.shape[0] for a, _ in pairs], dim=1))
        else:
            lows = [_low(x, a, c[0], m, p) for (a, _), c, m, p in zip(pairs, casts, each, projs, strict=True)]
        ys = [_kept(a) for a, _ in pairs]
        for i, ((a, _), c, m, p, low) in enumerate(zip(pairs, casts, each, projs, lows, strict=True)):
            if ys[i] is None:
                ys[i] = _proj_forward(x, a, c, m, p, low=low)[0]
                _keep(a, ys[i])
        ctx.projs, ctx.pairs, ctx.casts, ctx.a_cat = projs, pairs, casts, a_cat
        ctx.save_for_backward(x, *lows, *masks)
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, *rest = ctx.saved_tensors
        n = len(ctx.pairs)
        lows, masks = rest[:n], rest[n:]
        projs, pairs = ctx.projs, ctx.pairs
        for p in projs:
            p.check_versions()
        need_x = ctx.needs_input_grad[0]
        needs = ctx.needs_input_grad[3:]
        grads: list = [None] * (2 * n)
        with _no_autocast(x.device.type):
            casts = [_backward_cast(c, a, b, x.dtype) for c, (a, b) in zip(ctx.casts, pairs, strict=True)]
            dybs = [
                torch.mm(dy, c[1]) if dy is not None and a is not None and (need_x or needs[2 * i]) else None
                for i, (dy, (a, _), c) in enumerate(zip(dys, pairs, casts, strict=True))
            ]
            live = [i for i in range(n) if dys[i] is not None]
            stacked = ctx.a_cat is not None and len(live) == n and len({p.scaling for p in projs}) == 1
            dyb_cat = torch.cat(dybs, 1) if stacked and (need_x or all(needs[0::2])) else None
            dx = None
            if need_x:
                if stacked:  # s (dYB_cat) A_cat: one GEMM writes dX
                    dx = torch.addmm(
                        _zero(x.dtype, x.device),
                        dyb_cat,
                        ctx.a_cat,
                        beta=0,
                        alpha=projs[0].scaling,
                    )
                    for i in live:
                        dx.addmm_(dys[i], dense(projs[i].base, x.dtype))
                else:
                    for i in live:
                        dx = _grad_input(
                            dys[i], dybs[i], casts[i][0], masks[i] if masks else None, projs[i], dx
                        )
                if dx is None:
                    dx = torch.zeros_like(x)
            if stacked and all(needs[0::2]):  # dA of every adapter: one GEMM over x
                a = pairs[0][0]
                da_cat = _mm_to(dyb_cat.t(), x, a.dtype, projs[0].scaling)
                grads[0::2] = da_cat.split([a.shape[0] for a, _ in pairs])
            for i in live:
                a, b = pairs[i]
                if a is None:
                    continue
                need_a = needs[2 * i] and grads[2 * i] is None
                mask = masks[i] if masks else None
                da, db = _grad_adapter(
                    dys[i], dybs[i], x, lows[i], mask, a, b, projs[i], need_a, needs[2 * i + 1]
                )
                if need_a:
                    grads[2 * i] = da
                grads[2 * i + 1] = db
        return (dx, None, None, *grads)


def _kept_or_made(x, a, cast, mask, proj: _Proj):
    """:func:`_proj_forward` of a projection whose output an offloaded call keeps for its recompute: there
    the forward's y comes back from host memory (no base GEMM; low made again), else y is made and kept."""
    y = _kept(a)
    if y is None:
        y, low = _proj_forward(x, a, cast, mask, proj)
        _keep(a, y)
        return y, low
    return y, _low(x, a, cast[0], mask, proj)


def _keep(a: torch.Tensor | None, y: torch.Tensor) -> None:
    """Keep a projection's output for the recompute of the offloaded call running
    (:func:`fuselm.offload.keep_output`: the recompute then skips the base GEMM), keyed by its adapter."""
    if a is not None:
        keep_output(("lora", id(a)), y)


def _kept(a: torch.Tensor | None) -> torch.Tensor | None:
    """The output :func:`_keep` kept for this recompute, or None."""
    return None if a is None else kept_output(("lora", id(a)))


# A recompute's fused MLP (output=False) leaves its work to its backward, which runs over this many chunks
# of rows unless chunk_rows asks for smaller ones: more divide its [N, I] buffers (g, u and dh, the
# recompute's peak), for more launches and, with 4-bit bases, more dequantizations (gate's and up's twice a
# chunk, down's once).
RECOMPUTE_MLP_CHUNKS = 1


def _is_kept(a: torch.Tensor | None) -> bool:
    """Does this recompute hold an output :func:`_keep` kept (not taken)?"""
    return a is not None and has_kept_output(("lora", id(a)))


def _stacked(pairs: list, masks: tuple) -> bool:
    """Can the projections' x A^T be one GEMM? Every adapter present, of one dtype, no dropout."""
    return not masks and all(a is not None for a, _ in pairs) and len({a.dtype for a, _ in pairs}) == 1


class LoraGatedMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) of three LoRA projections for x [N, H]. Saves x, the gate and up
    pre-activations g, u [N, I] and the three lows [N, r] (and the bool dropout masks, p > 0); the
    product h = act(g) * u is recomputed in backward by the kernel that writes dg and du. In an offloaded
    call g and u may be kept for its recompute (:func:`_kept_or_made`)."""

    @staticmethod
    def forward(ctx, x, ag, bg, au, bu, ad, bd, mg, mu, projs, activation, down_p, down_mask_dtype, output):
        pg, pu, pd = projs
        casts = [_cast_adapter(a, b, x.dtype) for a, b in ((ag, bg), (au, bu), (ad, bd))]
        g, low_g = _kept_or_made(x, ag, casts[0], mg, pg)  # [N, I]
        u, low_u = _kept_or_made(x, au, casts[1], mu, pu)  # [N, I]
        h = gated_forward(g, u, activation)  # [N, I]
        # PEFT's down_proj draws its mask here, after gate's and up's, on h cast to A's dtype
        md = dropout_mask(h, down_p, down_mask_dtype) if ad is not None else None
        y, low_d = _proj_forward(h, ad, casts[2], md, pd, output)  # [N, H]
        ctx.projs, ctx.activation, ctx.casts = projs, activation, casts
        ctx.adapters = (ag, bg, au, bu, ad, bd)
        ctx.consumed = False
        x_saved = x if ag is not None or au is not None else None  # only dA of gate / up reads x
        ctx.save_for_backward(x_saved, g, u, low_g, low_u, low_d, mg, mu, md)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, u, low_g, low_u, low_d, mg, mu, md = ctx.saved_tensors
        ag, bg, au, bu, ad, bd = ctx.adapters
        pg, pu, pd = ctx.projs
        for p in ctx.projs:
            p.check_versions()
        nx, nag, nbg, nau, nbu, nad, nbd = ctx.needs_input_grad[:7]
        need_gu = nx or nag or nbg or nau or nbu  # anything upstream of h
        cdt = dy.dtype
        dx = dag = dbg = dau = dbu = dad = dbd = None
        with _no_autocast(dy.device.type):
            # down: dh = dY Wd (+ LoRA), then one kernel: dg (into dh's storage), du and h
            (ag_c, bg_c), (au_c, bu_c), (ad_c, bd_c) = _mlp_backward_casts(ctx, cdt)
            dyb = torch.mm(dy, bd_c) if ad is not None and (need_gu or nad) else None
            if need_gu:
                if ctx.consumed:
                    raise RuntimeError(
                        "fuselm.lora.lora_gated_mlp: backward through the same graph twice (retain_graph): "
                        "the first backward overwrote the saved gate and up projections"
                    )
                ctx.consumed = True
                dh = _grad_input(dy, dyb, ad_c, md, pd)  # [N, I], fresh
                # one kernel writes dg over dh, du over u and h over g: g and u are this node's alone, so
                # the backward's peak is three [N, I] buffers (dh, g, u), not five
                res = gated_backward(dh, g, u, ctx.activation, want_out=nad, overwrite_inputs=True)
                dg, du, h = res if nad else (*res, None)
                del dh, g, u
            else:
                dg = du = None
                h = gated_forward(g, u, ctx.activation) if nad else None
            if ad is not None:
                dad, dbd = _grad_adapter(dy, dyb, h, low_d, md, ad, bd, pd, nad, nbd)
            del h, dyb
            if need_gu:
                # gate, then up, dX accumulated in one buffer
                dgb = torch.mm(dg, bg_c) if ag is not None and (nx or nag) else None
                if nx:
                    dx = _grad_input(dg, dgb, ag_c, mg, pg)
                if ag is not None:
                    dag, dbg = _grad_adapter(dg, dgb, x, low_g, mg, ag, bg, pg, nag, nbg)
                del dg, dgb
                dub = torch.mm(du, bu_c) if au is not None and (nx or nau) else None
                if nx:
                    dx = _grad_input(du, dub, au_c, mu, pu, acc=dx)
                if au is not None:
                    dau, dbu = _grad_adapter(du, dub, x, low_u, mu, au, bu, pu, nau, nbu)
        return dx, dag, dbg, dau, dbu, dad, dbd, None, None, None, None, None, None, None


class _LoraChunks(ChunkedMLP):
    """ChunkedLoraGatedMLPFunction's projections on one chunk of rows (fuselm.ops.swiglu's ChunkedMLP runs the
    chunks): gate's and up's with their rank-r products (the lows kept for the adapters' gradients), then
    down's, whose dropout is 0 here. The adapters' gradients are summed over the chunks in fp32 (at least)."""

    def __init__(self, adapters, casts, masks, projs, needs=(False,) * 7):
        self.adapters, self.casts, self.masks, self.projs = adapters, casts, masks, projs
        self.needs = needs
        self.sums = ChunkSums()

    def gate_up(self, xc, s, e):
        ag, _, au, _, _, _ = self.adapters
        (mg, mu), (cg, cu, _), (pg, pu, _) = self.masks, self.casts, self.projs
        self.mgc, self.muc = _rows_of(mg, s, e), _rows_of(mu, s, e)
        g, self.low_g = _proj_forward(xc, ag, cg, self.mgc, pg)
        u, self.low_u = _proj_forward(xc, au, cu, self.muc, pu)
        return g, u

    def down(self, h):
        return _proj_forward(h, self.adapters[4], self.casts[2], None, self.projs[2])[0]

    def grad_h(self, dyc):
        (ad_c, bd_c), pd = self.casts[2], self.projs[2]
        self.dyb = torch.mm(dyc, bd_c) if self.adapters[4] is not None else None
        return _grad_input(dyc, self.dyb, ad_c, None, pd)  # [chunk, I], fresh

    def grads(self, s, e, xc, dyc, dg, du, h):
        ag, bg, au, bu, ad, bd = self.adapters
        (ag_c, bg_c), (au_c, bu_c), (ad_c, _) = self.casts
        pg, pu, pd = self.projs
        nx, nag, nbg, nau, nbu, nad, nbd = self.needs
        dyb, self.dyb = self.dyb, None
        if h is not None:  # down's adapter wants gradients
            low_d = F.linear(h, ad_c)
            dad, dbd = _grad_adapter(dyc, dyb, h, low_d, None, ad, bd, pd, nad, nbd)
            self.sums.add("ad", dad)
            self.sums.add("bd", dbd)
        del h, dyb
        if not (nx or nag or nbg or nau or nbu):
            return
        dgb = torch.mm(dg, bg_c) if ag is not None and (nx or nag) else None
        dxc = _grad_input(dg, dgb, ag_c, self.mgc, pg) if nx else None
        if ag is not None:
            dag, dbg = _grad_adapter(dg, dgb, xc, self.low_g, self.mgc, ag, bg, pg, nag, nbg)
            self.sums.add("ag", dag)
            self.sums.add("bg", dbg)
        del dg, dgb
        dub = torch.mm(du, bu_c) if au is not None and (nx or nau) else None
        if nx:
            self.put_dx(s, e, _grad_input(du, dub, au_c, self.muc, pu, acc=dxc))
        if au is not None:
            dau, dbu = _grad_adapter(du, dub, xc, self.low_u, self.muc, au, bu, pu, nau, nbu)
            self.sums.add("au", dau)
            self.sums.add("bu", dbu)


class ChunkedLoraGatedMLPFunction(torch.autograd.Function):
    """LoraGatedMLPFunction's math over chunks of ``chunk_rows`` rows, for sequences whose [N, I] tensors
    would not fit: only [chunk, I] ones are ever held. Saves x and the gate / up dropout masks alone; the
    backward recomputes each chunk's gate and up projections (with their rank-r products) and the down
    projection's low product, and sums the adapters' gradients over the chunks in fp32 (at least). down_proj's
    dropout must be 0 (its mask would be an [N, I] tensor; the public function checks). Without ``output``
    the forward computes nothing: a recompute that reads no output (one chunk of every row, or more)."""

    @staticmethod
    def forward(ctx, x, ag, bg, au, bu, ad, bd, mg, mu, projs, activation, chunk_rows, output):
        adapters = (ag, bg, au, bu, ad, bd)
        casts = [_cast_adapter(a, b, x.dtype) for a, b in ((ag, bg), (au, bu), (ad, bd))]
        if output:
            y = _LoraChunks(adapters, casts, (mg, mu), projs).forward(x, chunk_rows, activation)
        else:  # nothing computed: the backward makes all it needs
            y = x.new_empty(x.shape)
        ctx.projs, ctx.activation, ctx.chunk_rows, ctx.casts = projs, activation, chunk_rows, casts
        ctx.adapters = adapters
        ctx.save_for_backward(x, mg, mu)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mg, mu = ctx.saved_tensors
        for p in ctx.projs:
            p.check_versions()
        needs = ctx.needs_input_grad[:7]
        nad, nbd = needs[5:7]
        want_h = ctx.adapters[4] is not None and (nad or nbd)
        with _no_autocast(dy.device.type):
            casts = _mlp_backward_casts(ctx, dy.dtype)
            mlp = _LoraChunks(ctx.adapters, casts, (mg, mu), ctx.projs, needs)
            mlp.backward(x, dy, ctx.chunk_rows, ctx.activation, want_h)
        like = dict(zip(("ag", "bg", "au", "bu", "ad", "bd"), ctx.adapters, strict=True))
        return mlp.dx, *mlp.sums.rounded(like), None, None, None, None, None, None


def _rows_of(t: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if t is None else t[start:end]


# ---- public functions ----


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [N, C] with unit column stride (a view when one exists)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def _prepare(name: str, x, base, adapter, bias, cdt, autocast):
    _check_base(f"{name}base" if name else "base", base, x, cdt, autocast)
    out_features, in_features = base.shape
    _check_adapter(f"{name}adapter" if name else "adapter", adapter, in_features, out_features, x.device)
    _check_bias(f"{name}bias" if name else "bias", bias, out_features, x.device)
    a = adapter.A if adapter is not None else None
    b = adapter.B if adapter is not None else None
    return a, b, _Proj(base, bias, adapter)


def lora_linear(
    x: torch.Tensor,
    base: torch.Tensor | FrozenWeight,
    adapter: LoraAdapter | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b + s * (drop(x) A^T) B^T`` with a frozen base weight ``W`` and one LoRA adapter.

    The rank-r GEMM writes ``y = s * low B^T + b`` with ``low = drop(x) A^T`` ``[N, r]``, then the base
    GEMM adds ``x W^T`` to it in place (``y.addmm_``, beta = 1): y is written once and read once, inside
    the base GEMM's epilogue; no ``[N, out]`` temporary. The LoRA
    GEMMs run in the compute dtype (x's dtype, or the autocast dtype in an autocast region), the
    adapters cast once per call; A's and B's gradients come back in their own dtype (fp32 adapters on
    a bf16 model get fp32 gradients, accumulated in fp32 on CUDA). Saved for backward: x, low, and the
    bool dropout mask when ``p > 0``; a quantized base is dequantized again in backward.
    ``adapter=None`` is the frozen linear layer alone (it saves nothing: dX = dY W).

    Dropout (``adapter.dropout > 0``): the mask is drawn as PEFT's LoRA ``Linear`` draws it
    (:func:`dropout_mask` on x in ``adapter.mask_dtype``), so under the same torch seed the output and
    gradients equal PEFT's.

    Args:
        x: ``[..., in]`` float16 / bfloat16 / float32 / float64.
        base: the frozen weight ``[out, in]``: a tensor of x's dtype (any dtype in an autocast region)
            that does not require grad, or a :class:`~fuselm.lora.FrozenWeight` (bitsandbytes 4/8-bit).
        adapter: a :class:`LoraAdapter` (A ``[r, in]``, B ``[out, r]``, scaling, dropout) or None.
        bias: the frozen base bias ``[out]`` (cast to the compute dtype) or None.

    Returns:
        ``[..., out]`` in the compute dtype.

    Example:
        >>> x = torch.randn(2, 5, 64, requires_grad=True)
        >>> W = torch.randn(32, 64)
        >>> A = torch.randn(8, 64, requires_grad=True)
        >>> B = torch.randn(32, 8, requires_grad=True)
        >>> y = lora_linear(x, W, LoraAdapter(A, B, scaling=2.0))
        >>> torch.allclose(y, x @ W.T + 2.0 * (x @ A.T) @ B.T, atol=1e-3)
        True
        >>> y.sum().backward(); A.grad.shape, B.grad.shape
        (torch.Size([8, 64]), torch.Size([32, 8]))
    """
    _check_x("x", x)
    cdt, autocast = _compute_dtype(x)
    a, b, proj = _prepare("", x, base, adapter, bias, cdt, autocast)
    mask = None
    if adapter is not None and adapter.dropout:
        # PEFT: x.to(A.dtype) then the dropout, on x's full shape: the same draw
        mask = _rows(dropout_mask(x, adapter.dropout, adapter.mask_dtype or adapter.A.dtype))
    x2 = _rows(x if x.dtype == cdt else x.to(cdt))
    if autocast:
        with _no_autocast(x.device.type):
            y = LoraLinearFunction.apply(x2, a, b, mask, proj)
    else:
        y = LoraLinearFunction.apply(x2, a, b, mask, proj)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], base.shape[0])


def lora_projections(x: torch.Tensor, projections: Sequence[tuple]) -> tuple[torch.Tensor, ...]:
    """:func:`lora_linear` of several projections of one input, in one autograd node: attention's q, k and
    v. Each of ``projections`` is ``(base, adapter)`` or ``(base, adapter, bias)`` as the arguments of
    :func:`lora_linear`; the outputs are theirs, and so are the gradients under the numerics rule (dropout
    masks drawn in the order given, as PEFT draws them calling the layers one after another). With every
    adapter present and no dropout, ``x A^T`` is one GEMM against the stacked ``A``s, dX is made in one
    buffer (no sum of separate dX tensors) and the ``A`` gradients come from one GEMM.

    Args:
        x: ``[..., in]`` float16 / bfloat16 / float32 / float64.
        projections: at least one ``(base, adapter[, bias])`` with ``base`` ``[out_i, in]``.

    Returns:
        one ``[..., out_i]`` tensor per projection, in the compute dtype.

    Example:
        >>> x = torch.randn(5, 16, requires_grad=True)
        >>> Wq, Wk = torch.randn(16, 16), torch.randn(4, 16)
        >>> aq = LoraAdapter(torch.randn(2, 16), torch.randn(16, 2), scaling=2.0)
        >>> ak = LoraAdapter(torch.randn(2, 16), torch.randn(4, 2), scaling=2.0)
        >>> q, k = lora_projections(x, [(Wq, aq), (Wk, ak)])
        >>> torch.allclose(k, lora_linear(x, Wk, ak), atol=1e-5), q.shape
        (True, torch.Size([5, 16]))
    """
    _check_x("x", x)
    if not isinstance(projections, (list, tuple)) or not projections:
        raise ValueError(
            f"projections must be a non-empty list of (base, adapter[, bias]), got {projections!r:.80}"
        )
    cdt, autocast = _compute_dtype(x)
    adapters, projs, masks = [], [], []
    for i, op in enumerate(projections):
        base, adapter, bias = _operands(f"projections[{i}]", op)
        a, b, proj = _prepare(f"projections[{i}] ", x, base, adapter, bias, cdt, autocast)
        adapters += [a, b]
        projs.append(proj)
        p = adapter.dropout if adapter is not None else 0.0
        masks.append(_rows(dropout_mask(x, p, adapter.mask_dtype or adapter.A.dtype)) if p else None)
    masks = tuple(masks) if any(m is not None for m in masks) else ()
    x2 = _rows(x if x.dtype == cdt else x.to(cdt))
    with _no_autocast(x.device.type) if autocast else contextlib.nullcontext():
        ys = LoraProjectionsFunction.apply(x2, tuple(projs), masks, *adapters)
    if x.dim() == 2:
        return tuple(ys)
    return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)


def lora_gated_mlp(
    x: torch.Tensor,
    gate: tuple,
    up: tuple,
    down: tuple,
    activation: str = "silu",
    *,
    chunk_rows: int | None = None,
    output: bool = True,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))``, each projection a frozen base with an optional LoRA adapter.

    Each of ``gate``, ``up``, ``down`` is ``(base, adapter)`` or ``(base, adapter, bias)`` as the
    arguments of :func:`lora_linear`. Saved for backward: x, the gate and up pre-activations ``g``,
    ``u`` ``[N, I]`` and the three ``low`` ``[N, r]`` (plus bool dropout masks when ``p > 0``); the
    product ``h = act(g) * u`` is recomputed in backward by the kernel that writes ``dg`` (into ``dh``'s
    buffer) and ``du`` (``fuselm.ops.swiglu.gated_backward``). Dropout masks are drawn in PEFT's order:
    gate's, up's, then down's (on ``h``).

    Args:
        x: ``[..., H]`` float16 / bfloat16 / float32 / float64.
        gate: operands of ``gate_proj`` (base ``[I, H]``).
        up: operands of ``up_proj`` (base ``[I, H]``).
        down: operands of ``down_proj`` (base ``[H, I]``).
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU).
        chunk_rows: None, or run the MLP over chunks of this many rows (tokens) when x has more: only
            ``[chunk_rows, I]`` tensors are ever held and only x (and the gate / up dropout masks) is
            saved; the backward recomputes each chunk's projections (the base GEMMs twice: for the
            longest sequences, where the ``[N, I]`` tensors decide what fits). down's adapter must have
            no dropout then (its mask would be an ``[N, I]`` tensor): ValueError otherwise.
        output: False: the result's values are not computed (the tensor is allocated only): for a
            recompute that never reads the result (:func:`fuselm.offload.output_may_go_unread`). With
            down's dropout 0 and neither gate's nor up's output kept for the recompute
            (:func:`fuselm.offload.keep_output`), the forward then computes nothing and saves x alone
            (and the gate / up masks): the backward makes g and u (and h) as the chunked backward does,
            over ``chunk_rows`` or :data:`RECOMPUTE_MLP_CHUNKS` chunks; otherwise it saves what
            ``output=True`` saves, skipping down's base GEMM.

    Returns:
        ``[..., H]`` in the compute dtype.

    Example:
        >>> H, I, r = 64, 96, 8
        >>> x = torch.randn(3, H, requires_grad=True)
        >>> Wg, Wu, Wd = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)
        >>> A, B = torch.randn(r, I, requires_grad=True), torch.randn(H, r, requires_grad=True)
        >>> ad = LoraAdapter(A, B, scaling=2.0)
        >>> y = lora_gated_mlp(x, (Wg, None), (Wu, None), (Wd, ad), "silu")
        >>> h = F.silu(x @ Wg.T) * (x @ Wu.T)
        >>> torch.allclose(y, h @ Wd.T + 2.0 * (h @ ad.A.T) @ ad.B.T, rtol=1e-4, atol=1e-2)
        True
    """
    _check_x("x", x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_chunk_rows("chunk_rows", chunk_rows)
    if not isinstance(output, bool):
        raise ValueError(f"output must be a bool, got {output!r}")
    cdt, autocast = _compute_dtype(x)
    gb, gadapter, gbias = _operands("gate", gate)
    ub, uadapter, ubias = _operands("up", up)
    db, dadapter, dbias = _operands("down", down)
    ag, bg, pg = _prepare("gate ", x, gb, gadapter, gbias, cdt, autocast)
    au, bu, pu = _prepare("up ", x, ub, uadapter, ubias, cdt, autocast)
    inter = gb.shape[0]
    if ub.shape[0] != inter:
        raise ValueError(
            f"up base must have shape [{inter}, {x.shape[-1]}] like gate's, got {tuple(ub.shape)}"
        )
    if tuple(db.shape) != (x.shape[-1], inter):
        raise ValueError(
            f"down base must have shape [{x.shape[-1]}, {inter}] ([H, I]), got {tuple(db.shape)}"
        )
    h_probe = x.new_empty((0, inter), dtype=cdt)  # down's checks see a [.., I] input of the compute dtype
    ad, bd, pd = _prepare("down ", h_probe, db, dadapter, dbias, cdt, autocast)
    # PEFT's order: gate's mask, then up's (on x as the layers see it); down's is drawn in forward
    mg = mu = None
    if gadapter is not None and gadapter.dropout:
        mg = _rows(dropout_mask(x, gadapter.dropout, gadapter.mask_dtype or gadapter.A.dtype))
    if uadapter is not None and uadapter.dropout:
        mu = _rows(dropout_mask(x, uadapter.dropout, uadapter.mask_dtype or uadapter.A.dtype))
    down_p = dadapter.dropout if dadapter is not None else 0.0
    if chunk_rows is not None and down_p:
        raise ValueError(
            f"chunk_rows={chunk_rows} needs down's adapter without dropout (p={down_p}: its mask would be an "
            "[N, I] tensor); set lora_dropout=0 for down_proj, or chunk_rows=None"
        )
    down_mask_dtype = (dadapter.mask_dtype or dadapter.A.dtype) if dadapter is not None else None
    x2 = _rows(x if x.dtype == cdt else x.to(cdt))
    projs = (pg, pu, pd)
    chunked = chunk_rows is not None and x2.shape[0] > chunk_rows
    if chunked or (not output and not down_p and not (_is_kept(ag) or _is_kept(au))):
        rows = chunk_rows if chunked else -(-x2.shape[0] // RECOMPUTE_MLP_CHUNKS)
        fn = ChunkedLoraGatedMLPFunction
        args = (x2, ag, bg, au, bu, ad, bd, mg, mu, projs, activation, rows, output)
    else:
        fn = LoraGatedMLPFunction
        args = (x2, ag, bg, au, bu, ad, bd, mg, mu, projs, activation, down_p, down_mask_dtype, output)
    if autocast:
        with _no_autocast(x.device.type):
            y = fn.apply(*args)
    else:
        y = fn.apply(*args)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], x.shape[-1])
