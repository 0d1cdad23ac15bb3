"""fuselm.ops.decoder_layer: a pre-norm decoder layer (Llama's layout) as two autograd nodes around the
attention: ``norm_qkv_rotary`` (input RMSNorm, q / k / v projections, RoPE) and ``attention_output_mlp``
(output projection, residual add, post-attention RMSNorm, gated MLP, residual add).

No kernels of its own: the nodes launch rms_norm's, rope's and swiglu's kernels and eager PyTorch's GEMMs
directly (their launchers; no custom-op dispatch). Where a node does not run (no Triton for the tensors,
float64, autocast to another dtype, torch.compile, mixed dtypes, cos / sin requiring grad) the same math
runs through the
separate public ops (``fuselm.rms_norm``, ``qkv_rotary``, ``swiglu_mlp``), which have their own reference
and compile paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._common.dispatch import kernels_run
from .._common.guard import check_choice, check_tensor, rows_view
from ..rms_norm import CASTINGS, rms_norm, rms_norm_bwd, rms_norm_fwd
from ..rope import broadcast_tables, qkv_rotary, qkv_rotary_bwd, qkv_rotary_fwd
from ..swiglu import ACTIVATIONS, gated_backward, gated_forward, swiglu_mlp

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _nodes_run(x: torch.Tensor, tensors, cos=None, sin=None) -> bool:
    """Do the fused nodes run for these operands (else the separate ops do)?"""
    if not kernels_run(x) or torch.compiler.is_compiling():
        return False
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != x.dtype:
        return False  # autocast to x's own dtype casts nothing: the nodes run
    if any(t is not None and t.dtype != x.dtype for t in tensors):
        return False
    return not (torch.is_grad_enabled() and cos is not None and (cos.requires_grad or sin.requires_grad))


# ---- autograd ----


class NormQKVRotaryFunction(torch.autograd.Function):
    """x [B, T, H] -> y = RMSNorm(x) -> q, k, v = y W^T + b -> RoPE of q and k; returned as [B, heads, T, D]
    views of [B, T, heads, D] tensors. Saves x, y, rstd (fp32 [N]) and the tables; the backward rotates
    dq, dk back into [B, T, heads, D] buffers, accumulates dy = dq Wq + dk Wk + dv Wv in one buffer, and
    the norm's backward writes dx over it."""

    @staticmethod
    def forward(ctx, x, norm_w, wq, wk, wv, bq, bk, bv, cos, sin, eps, offset, casting, head_dim):
        batch, seq_len, _ = x.shape
        x = rows_view(x)  # [N, H]: views made inside the node put no view nodes in the graph
        y, _, rstd = rms_norm_fwd(x, None, norm_w, eps, offset, casting)
        ctx.save_for_backward(x, y, rstd, norm_w, wq, wk, wv, cos, sin)
        ctx.norm = (eps, offset)
        ctx.x_shape = (batch, seq_len, x.shape[1])
        return qkv_rotary_fwd(y, (wq, wk, wv), (bq, bk, bv), cos, sin, batch, seq_len, head_dim)

    @staticmethod
    def backward(ctx, dq_embed, dk_embed, dv):
        x, y, rstd, norm_w, wq, wk, wv, cos, sin = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_y = need[0] or need[1]
        douts = (dq_embed, dk_embed, dv)
        dy, dw, db = qkv_rotary_bwd(y, (wq, wk, wv), douts, cos, sin, need_y, need[2:5], need[5:8])
        dx = dnorm_w = None
        if need_y:
            eps, offset = ctx.norm
            dx, dnorm_w = rms_norm_bwd(x, dy, None, norm_w, rstd, eps, offset, need[1], in_place=True)
            dx = dx.view(ctx.x_shape)
        return dx, dnorm_w, *dw, *db, None, None, None, None, None, None


class AttentionOutputMLPFunction(torch.autograd.Function):
    """attn [B, T, A] or [B, T, heads, D], residual [B, T, H] -> s = residual + attn Wo^T (+ bo) -> h =
    RMSNorm(s) -> out = s + down(act(gate(h)) * up(h)), the last add inside the down projection's GEMM
    (``addmm``: one rounding).
    Saves attn, s, rstd, h and the pre-activations g, u [N, I]; the product is recomputed in backward by
    the kernel that writes dg and du over the saved g and u, so a second backward raises. The backward
    gives the residual stream's gradient ds (the norm's backward with the output's gradient added, one
    kernel), then attn's and Wo's from it."""

    @staticmethod
    def forward(
        ctx, attn, residual, wo, bo, norm_w, wg, wu, wd, bg, bu, bd, eps, offset, casting, activation
    ):
        shapes = (attn.shape, residual.shape)
        attn = rows_view(attn.reshape(residual.shape[0] * residual.shape[1], -1))  # [N, A]
        residual = rows_view(residual)  # [N, H]
        o = F.linear(attn, wo, bo)
        h, s, rstd = rms_norm_fwd(o, residual, norm_w, eps, offset, casting)
        g = F.linear(h, wg, bg)
        u = F.linear(h, wu, bu)
        out = torch.addmm(s, gated_forward(g, u, activation), wd.t())
        if bd is not None:
            out += bd
        ctx.save_for_backward(attn, s, rstd, h, g, u, wo, norm_w, wg, wu, wd)
        ctx.config = (eps, offset, activation)
        ctx.consumed = False
        ctx.shapes = shapes
        return out.view(shapes[1])

    @staticmethod
    def backward(ctx, dout):
        attn, s, rstd, h, g, u, wo, norm_w, wg, wu, wd = ctx.saved_tensors
        if ctx.consumed:
            raise RuntimeError(
                "fuselm attention_output_mlp: backward through the same graph twice (retain_graph): the "
                "first backward overwrote the saved gate and up projections; run the forward again"
            )
        ctx.consumed = True
        eps, offset, activation = ctx.config
        n_attn, n_res, n_wo, n_bo, n_norm, n_wg, n_wu, n_wd, n_bg, n_bu, n_bd = ctx.needs_input_grad[:11]
        dout = rows_view(dout)
        dmid = torch.mm(dout, wd)  # [N, I], owned here: dgate is written over it
        dg, du, gated = gated_backward(dmid, g, u, activation, want_out=True, overwrite_inputs=True)
        del dmid, g, u
        dwd = torch.mm(dout.t(), gated) if n_wd else None
        del gated
        dbd = dout.sum(0) if n_bd else None
        dwg = torch.mm(dg.t(), h) if n_wg else None
        dwu = torch.mm(du.t(), h) if n_wu else None
        dbg = dg.sum(0) if n_bg else None
        dbu = du.sum(0) if n_bu else None
        dh = torch.mm(dg, wg).addmm_(du, wu)  # one buffer: the norm's backward writes ds over it
        del dg, du
        ds, dnorm_w = rms_norm_bwd(s, dh, dout, norm_w, rstd, eps, offset, n_norm, in_place=True)
        dwo = torch.mm(ds.t(), attn) if n_wo else None
        dbo = ds.sum(0) if n_bo else None
        dattn = torch.mm(ds, wo).view(ctx.shapes[0]) if n_attn else None
        return (
            dattn,
            ds.view(ctx.shapes[1]),
            dwo,
            dbo,
            dnorm_w,
            dwg,
            dwu,
            dwd,
            dbg,
            dbu,
            dbd,
            None,
            None,
            None,
            None,
        )


# ---- public functions ----


def _check_norm(norm_weight, hidden: int, x: torch.Tensor, eps, casting) -> None:
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=_DTYPES, ndim=1, device=x.device)
        if norm_weight.shape[0] != hidden:
            raise ValueError(f"norm_weight must have shape [{hidden}], got {list(norm_weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    check_choice("norm_casting", casting, CASTINGS)


def _check_linear(
    name: str, w, b, in_features: int, x: torch.Tensor, out_features: int | None = None
) -> None:
    check_tensor(name, w, dtypes=_DTYPES, ndim=2, device=x.device)
    if w.shape[1] != in_features or (out_features is not None and w.shape[0] != out_features):
        want = f"[{out_features if out_features is not None else 'out'}, {in_features}]"
        raise ValueError(f"{name} must have shape {want}, got {list(w.shape)}")
    if b is not None:
        bias = name.replace("weight", "bias")
        check_tensor(bias, b, dtypes=_DTYPES, ndim=1, device=x.device)
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"{bias} must have shape [{w.shape[0]}], got {list(b.shape)}")


def norm_qkv_rotary(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    head_dim: int,
    eps: float,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    v_bias: torch.Tensor | None = None,
    norm_offset: float = 0.0,
    norm_casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of a pre-norm decoder layer as one autograd node: the input RMSNorm, the q, k, v
    projections and the RoPE of q and k (Hugging Face's ``input_layernorm`` then the attention's first
    five statements).

    Saved for backward: x, the normalized y, the fp32 rstd [N] and the tables (what the separate ops
    save); never q, k or v (the attention saves its own inputs). Backward: one launch rotates dq and dk
    back, three GEMMs accumulate dy in one buffer, one launch writes dx over it (and the norm weight's
    gradient). The node runs for CUDA tensors of one dtype (fp32 / fp16 / bf16), outside autocast or
    under autocast to that dtype (which casts nothing; Trainer's ``bf16=True`` on a bf16 model), outside
    torch.compile; otherwise the same math runs through ``fuselm.rms_norm`` and :func:`qkv_rotary`.

    Args:
        x: ``[B, T, H]``.
        norm_weight: ``[H]`` or None; norm_offset, norm_casting, eps: as :func:`fuselm.rms_norm`'s
            ``offset``, ``casting``, ``eps``.
        q_weight: ``[Hq * D, H]``; k_weight, v_weight: ``[Hk * D, H]``; optional biases of their rows.
        cos, sin: ``[B, T, R]``, ``[1, T, R]`` or ``[T, R]`` (R even, ``R <= D``).
        head_dim: D.

    Returns:
        ``(q, k, v)``: ``[B, Hq, T, D]``, ``[B, Hk, T, D]``, ``[B, Hk, T, D]``, views of ``[B, T, heads,
        D]`` tensors.

    Example:
        >>> import torch
        >>> from fuselm.ops.decoder_layer import norm_qkv_rotary
        >>> B, T, H, D = 2, 5, 32, 8
        >>> x = torch.randn(B, T, H, requires_grad=True)
        >>> emb = torch.randn(B, T, D)
        >>> q, k, v = norm_qkv_rotary(x, torch.ones(H), torch.randn(4 * D, H), torch.randn(2 * D, H),
        ...                           torch.randn(2 * D, H), emb.cos(), emb.sin(), head_dim=D, eps=1e-6)
        >>> q.shape, k.shape, v.shape
        (torch.Size([2, 4, 5, 8]), torch.Size([2, 2, 5, 8]), torch.Size([2, 2, 5, 8]))
    """
    check_tensor("x", x, dtypes=_DTYPES, ndim=3)
    batch, seq_len, hidden = x.shape
    _check_norm(norm_weight, hidden, x, eps, norm_casting)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2:
        raise ValueError(f"head_dim must be an int >= 2, got {head_dim!r}")
    weights = (q_weight, k_weight, v_weight)
    biases = (q_bias, k_bias, v_bias)
    for name, w, b in zip(("q_weight", "k_weight", "v_weight"), weights, biases, strict=True):
        _check_linear(name, w, b, hidden, x)
        if w.shape[0] % head_dim:
            raise ValueError(f"{name} must have heads * {head_dim} rows, got {w.shape[0]}")
    if v_weight.shape[0] != k_weight.shape[0]:
        raise ValueError(f"v_weight must have k_weight's {k_weight.shape[0]} rows, got {v_weight.shape[0]}")
    cos_b, sin_b, _ = broadcast_tables(cos, sin, None, batch, seq_len, head_dim, "bthd", x.device)
    if not _nodes_run(x, (norm_weight, *weights, *biases), cos, sin):
        y = rms_norm(x, norm_weight, eps, offset=norm_offset, casting=norm_casting)
        return qkv_rotary(
            y, *weights, cos, sin, head_dim=head_dim, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias
        )
    return NormQKVRotaryFunction.apply(
        x,
        norm_weight,
        *weights,
        *biases,
        cos_b.detach(),
        sin_b.detach(),
        float(eps),
        float(norm_offset),
        norm_casting,
        head_dim,
    )


def attention_output_mlp(
    attn: torch.Tensor,
    residual: torch.Tensor,
    o_weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    eps: float,
    activation: str = "silu",
    o_bias: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    norm_offset: float = 0.0,
    norm_casting: str = "llama",
) -> torch.Tensor:
    """The second half of a pre-norm decoder layer as one autograd node: ``s = residual +
    o_proj(attn)``, ``h = RMSNorm(s)``, ``s + down(act(gate(h)) * up(h))`` (Hugging Face's ``o_proj``,
    the add, ``post_attention_layernorm``, the MLP and the last add).

    The add after the attention runs in the norm's kernel (the sum rounded to the activations' dtype, as
    HF's add); the last add runs in the down projection's GEMM (``addmm``: the sum rounded once, where HF
    rounds the MLP's output first). Saved for backward: attn, s, h, the fp32 rstd and the gate and up
    pre-activations (what the separate ops save); the product ``act(g) * u`` is recomputed in backward,
    written over the saved g, so a second backward through the same graph raises. The node runs where
    :func:`norm_qkv_rotary`'s does; otherwise the same math runs through ``F.linear``,
    ``fuselm.rms_norm(..., residual=)`` and :func:`fuselm.ops.swiglu.swiglu_mlp`.

    Args:
        attn: the attention's output, ``[B, T, A]`` or ``[B, T, heads, D]`` (A = heads * D).
        residual: ``[B, T, H]``, the layer's input.
        o_weight: ``[H, A]``; norm_weight: ``[H]`` or None; gate_weight, up_weight: ``[I, H]``;
            down_weight: ``[H, I]``; optional biases of their rows.
        eps, norm_offset, norm_casting: the post-attention norm's (as :func:`fuselm.rms_norm`).
        activation: ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``.

    Returns:
        ``[B, T, H]`` in residual's dtype: the layer's output.

    Example:
        >>> import torch
        >>> from fuselm.ops.decoder_layer import attention_output_mlp
        >>> B, T, H, A, I = 2, 5, 32, 16, 48
        >>> attn, x = torch.randn(B, T, A, requires_grad=True), torch.randn(B, T, H, requires_grad=True)
        >>> out = attention_output_mlp(attn, x, torch.randn(H, A), torch.ones(H), torch.randn(I, H),
        ...                            torch.randn(I, H), torch.randn(H, I), eps=1e-6)
        >>> out.shape
        torch.Size([2, 5, 32])
        >>> out.sum().backward(); attn.grad.shape, x.grad.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 32]))
    """
    check_tensor("residual", residual, dtypes=_DTYPES, ndim=3)
    check_tensor("attn", attn, dtypes=_DTYPES, device=residual.device)
    batch, seq_len, hidden = residual.shape
    if attn.dim() not in (3, 4) or tuple(attn.shape[:2]) != (batch, seq_len):
        raise ValueError(
            f"attn must be [{batch}, {seq_len}, A] or [{batch}, {seq_len}, heads, D] like residual, got "
            f"{list(attn.shape)}"
        )
    _check_norm(norm_weight, hidden, residual, eps, norm_casting)
    check_choice("activation", activation, ACTIVATIONS)
    _check_linear("o_weight", o_weight, o_bias, attn[0, 0].numel(), residual, hidden)
    _check_linear("gate_weight", gate_weight, gate_bias, hidden, residual)
    inter = gate_weight.shape[0]
    _check_linear("up_weight", up_weight, up_bias, hidden, residual, inter)
    _check_linear("down_weight", down_weight, down_bias, inter, residual, hidden)
    tensors = (attn, norm_weight, o_weight, o_bias, gate_weight, up_weight, down_weight)
    if not _nodes_run(residual, (*tensors, gate_bias, up_bias, down_bias)):
        out, summed = rms_norm(
            F.linear(attn.reshape(batch, seq_len, -1), o_weight, o_bias),
            norm_weight,
            eps,
            residual=residual,
            offset=norm_offset,
            casting=norm_casting,
        )
        mlp = swiglu_mlp(
            out, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation=activation
        )
        return summed + mlp
    return AttentionOutputMLPFunction.apply(
        attn,
        residual,
        o_weight,
        o_bias,
        norm_weight,
        gate_weight,
        up_weight,
        down_weight,
        gate_bias,
        up_bias,
        down_bias,
        float(eps),
        float(norm_offset),
        norm_casting,
        activation,
    )
