"""fuselm.apply_rotary: launchers -> custom ops -> autograd Function -> public function."""

from __future__ import annotations

import functools

import torch

from .._common.dispatch import compiled_or_launcher, kernels_run, say_once
from .._common.dtensor import has_dtensor, run_local
from .._common.guard import check_choice
from .._common.launch import cdiv, launcher, next_pow2
from .kernels import rope_fwd_kernel, rope_fwd_kernel_dense
from .reference import LAYOUTS, apply_rotary_reference, broadcast_tables, check_qk


def _kernels_run(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, op: str) -> bool:
    """Do the Triton kernels run for input ``t``? Not for float64 or off the Triton path (the reference
    runs), nor when cos / sin require grad (the kernels give q and k their gradients only): then the
    differentiable reference runs and says so once."""
    if not kernels_run(t):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        say_once(
            f"fuselm.{op}: cos / sin require grad, so the differentiable PyTorch reference runs (slower; the "
            "kernels give q and k their gradients only): detach the tables if they are not trained"
        )
        return False
    return True


# Dense q and k (the usual case): the dense-rows kernel, about DENSE_BLOCK consecutive elements (whole
# rows) a program
# (benchmarks/experiments/rope_variants.py: 1024 / 4 warps and 2048 / 8 warps best on an H100).
DENSE_BLOCK = 1024
DENSE_NUM_WARPS = 4
# element indices past this need int64 math in the dense-rows kernel (int32 is cheaper per element)
INT32_INDEX_LIMIT = 2**31 - 1
# Other strides, the per-position kernel's launch config (to tune on the GPU). A program rotates all heads
# of one (b, t) position in tiles of [BLOCK_H, BLOCK_R] elements per rotary half, BLOCK_R = next_pow2(R /
# 2) and BLOCK_H the head count rounded up to a power of two, capped so that a tile holds at most MAX_TILE
# elements (the heads are then walked in several tiles). Pass-through columns (partial rotary) go in
# blocks of BLOCK_P_MAX.
MAX_TILE = 4096
NUM_WARPS = 4
NUM_WARPS_BIG_TILE = 8  # when the q tile holds more than BIG_TILE elements per half
BIG_TILE = 2048
BLOCK_P_MAX = 128

# cached launch bindings of the kernels (ops/_common/launch.py)
rope_fwd_dense_launch = launcher(rope_fwd_kernel_dense)
rope_fwd_launch = launcher(rope_fwd_kernel)


def _heads_block(n_heads: int, block_r: int) -> int:
    return max(1, min(next_pow2(n_heads), MAX_TILE // block_r))


def launch_config(n_q_heads: int, n_k_heads: int, rotary_dim: int, head_dim: int) -> dict[str, int]:
    """Block sizes and warps of rope_fwd_kernel for these head counts and dims."""
    return dict(_launch_config(n_q_heads, n_k_heads, rotary_dim, head_dim))


@functools.lru_cache(maxsize=64)
def _launch_config(n_q_heads, n_k_heads, rotary_dim, head_dim):
    block_r = next_pow2(rotary_dim // 2)
    block_hq = _heads_block(n_q_heads, block_r)
    block_hk = _heads_block(n_k_heads, block_r)
    n_pass = head_dim - rotary_dim
    return (
        ("BLOCK_HQ", block_hq),
        ("BLOCK_HK", block_hk),
        ("BLOCK_R", block_r),
        ("BLOCK_P", min(next_pow2(n_pass), BLOCK_P_MAX)),
        ("num_warps", NUM_WARPS_BIG_TILE if block_hq * block_r > BIG_TILE else NUM_WARPS),
    )


def _alloc_out(x: torch.Tensor) -> torch.Tensor:
    """An output like x: x's strides when x is dense (a transposed view stays in that memory order, the
    kernel writes as it reads), else contiguous; always with unit stride on the last dimension."""
    out = torch.empty_like(x)
    if out.stride(-1) != 1:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension has stride 1 (any other strides are fine), else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _dense_order(x: torch.Tensor) -> bool | None:
    """Memory order of a [B, T, H, D] view: True if dense as [B, H, T, D] (head-major, Hugging Face's
    transposed projections), False if dense as [B, T, H, D], None if not dense (e.g. a qkv slice)."""
    if x.is_contiguous():
        return False
    b, t, h, d = x.shape
    sb, st, sh, sd = x.stride()
    # contiguous as [B, H, T, D] (a size-1 dimension's stride means nothing), read from the strides
    if (
        (d <= 1 or sd == 1)
        and (t <= 1 or st == d)
        and (h <= 1 or sh == t * d)
        and (b <= 1 or sb == h * t * d)
    ):
        return True
    return None


def _dense_orders(q, k, q_out, k_out) -> tuple[bool, bool] | None:
    """(q head-major?, k head-major?) when each input and its output are dense in the same order (the
    dense-rows kernel's case), else None."""
    q_order, k_order = _dense_order(q), _dense_order(k)
    if q_order is None or k_order is None:
        return None
    if _dense_order(q_out) is not q_order or _dense_order(k_out) is not k_order:
        return None
    return q_order, k_order


def _launch(q, k, q_out, k_out, cos, sin, position_ids, is_bwd):
    """q, k, q_out, k_out [B, T, H, D] (any strides); cos/sin [B, T, R] or, with position_ids [B, T],
    tables [P, R]. Writes the rotation (is_bwd: its transpose) of q, k into q_out, k_out."""
    batch, seq_len, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[2]
    if batch * seq_len == 0 or n_q_heads + n_k_heads == 0:
        return
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = _unit_last(cos), _unit_last(sin)
    assert q_out.stride(-1) == 1 and k_out.stride(-1) == 1
    rotary_dim = cos.shape[-1]
    has_pos = position_ids is not None
    if has_pos:
        n_pos = cos.shape[0]
        cos_strides, sin_strides = (0, cos.stride(0)), (0, sin.stride(0))
        pos, pos_strides = position_ids, position_ids.stride()
    else:
        n_pos = 0
        cos_strides, sin_strides = cos.stride()[:2], sin.stride()[:2]
        pos, pos_strides = cos, (0, 0)
    tables = dict(
        cos_ptr=cos,
        cos_stride_b=cos_strides[0],
        cos_stride_t=cos_strides[1],
        sin_ptr=sin,
        sin_stride_b=sin_strides[0],
        sin_stride_t=sin_strides[1],
        pos_ptr=pos,
        pos_stride_b=pos_strides[0],
        pos_stride_t=pos_strides[1],
        n_pos=n_pos,
        ROT_HALF=rotary_dim // 2,
        HEAD_DIM=head_dim,
        HAS_POS=has_pos,
        IS_BWD=is_bwd,
        # no FMA contraction: fp32 results equal eager PyTorch's (and Hugging Face's) bit for bit
        enable_fp_fusion=False,
    )
    orders = _dense_orders(q, k, q_out, k_out)
    if orders is not None:
        block_d = next_pow2(head_dim)
        block_rows = max(1, DENSE_BLOCK // block_d)
        q_rows, k_rows = q.numel() // head_dim, k.numel() // head_dim
        q_blocks = cdiv(q_rows, block_rows)
        rope_fwd_dense_launch(
            (q_blocks + cdiv(k_rows, block_rows),),
            q_ptr=q,
            k_ptr=k,
            q_out_ptr=q_out,
            k_out_ptr=k_out,
            q_rows=q_rows,
            k_rows=k_rows,
            q_blocks=q_blocks,
            seq_len=seq_len,
            N_QH=n_q_heads,
            N_KH=n_k_heads,
            Q_HEAD_MAJOR=orders[0],
            K_HEAD_MAJOR=orders[1],
            INDEX_64=max(q.numel(), k.numel()) + block_rows * block_d > INT32_INDEX_LIMIT,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            num_warps=DENSE_NUM_WARPS,
            **tables,
        )
        return
    qs, ks, qos, kos = q.stride(), k.stride(), q_out.stride(), k_out.stride()  # one call each (host time)
    rope_fwd_launch(
        (batch * seq_len,),
        q_ptr=q,
        q_stride_b=qs[0],
        q_stride_t=qs[1],
        q_stride_h=qs[2],
        k_ptr=k,
        k_stride_b=ks[0],
        k_stride_t=ks[1],
        k_stride_h=ks[2],
        q_out_ptr=q_out,
        q_out_stride_b=qos[0],
        q_out_stride_t=qos[1],
        q_out_stride_h=qos[2],
        k_out_ptr=k_out,
        k_out_stride_b=kos[0],
        k_out_stride_t=kos[1],
        k_out_stride_h=kos[2],
        seq_len=seq_len,
        N_QH=n_q_heads,
        N_KH=n_k_heads,
        **tables,
        **launch_config(n_q_heads, n_k_heads, rotary_dim, head_dim),
    )


def rope_fwd(q, k, cos, sin, position_ids):
    """(q_embed, k_embed) for q [B, T, Hq, D], k [B, T, Hk, D] (any strides), in their memory order."""
    q_out, k_out = _alloc_out(q), _alloc_out(k)
    _launch(q, k, q_out, k_out, cos, sin, position_ids, is_bwd=False)
    return q_out, k_out


def rope_bwd(dq_embed, dk_embed, cos, sin, position_ids):
    """(dq, dk) from the output gradients: the same kernel, rotation by -theta."""
    dq, dk = _alloc_out(dq_embed), _alloc_out(dk_embed)
    _launch(dq_embed, dk_embed, dq, dk, cos, sin, position_ids, is_bwd=True)
    return dq, dk


# ---- custom ops: torch.compile sees one opaque node per launch, no graph break ----


@torch.library.custom_op("fuselm::rope_fwd", mutates_args=())
def _rope_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_fwd(q, k, cos, sin, position_ids)


@_rope_fwd_op.register_fake
def _(q, k, cos, sin, position_ids):
    return _alloc_out(q), _alloc_out(k)


@torch.library.custom_op("fuselm::rope_bwd", mutates_args=())
def _rope_bwd_op(
    dq_embed: torch.Tensor,
    dk_embed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_bwd(dq_embed, dk_embed, cos, sin, position_ids)


@_rope_bwd_op.register_fake
def _(dq_embed, dk_embed, cos, sin, position_ids):
    return _alloc_out(dq_embed), _alloc_out(dk_embed)


# Eager calls launch directly (a custom op costs tens of microseconds of host time per call);
# under torch.compile the custom ops above stand in, so the graph has no break.


_run_fwd = compiled_or_launcher(_rope_fwd_op, rope_fwd)
_run_bwd = compiled_or_launcher(_rope_bwd_op, rope_bwd)


# ---- autograd ----


class RotaryFunction(torch.autograd.Function):
    """Autograd for q [B, T, Hq, D], k [B, T, Hk, D] (any strides; with bhtd, q [B, Hq, T, D] and k
    [B, Hk, T, D], transposed inside the Function: no view nodes in the graph). Saves only cos, sin and
    position_ids (small); the backward reads dq_embed, dk_embed once and writes dq, dk once. cos and
    sin get no gradient (the public function sends them to the reference when they require one)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, bhtd=False):
        if bhtd:  # the kernel indexes [b, t, h, d]: a view, no copy
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q_out, k_out = _run_fwd(_unit_last(q), _unit_last(k), cos, sin, position_ids)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.bhtd = bhtd
        if bhtd:
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        cos, sin, position_ids = ctx.saved_tensors
        if ctx.bhtd:
            dq_embed, dk_embed = dq_embed.transpose(1, 2), dk_embed.transpose(1, 2)
        dq, dk = _run_bwd(dq_embed, dk_embed, cos, sin, position_ids)
        if ctx.bhtd:
            dq, dk = dq.transpose(1, 2), dk.transpose(1, 2)
        return dq, dk, None, None, None, None


_HEADS_HINT = (
    "apply_rotary runs per head: shard q and k on the head dimension (tensor parallel) or replicate "
    "them; for a sharded batch or sequence, pass q.to_local() and k.to_local() with the matching local "
    "rows of cos and sin (or of position_ids)"
)


def _apply_rotary_dtensor(q, k, cos, sin, position_ids, layout):
    check_choice("layout", layout, LAYOUTS)
    head_dim = 1 if layout == "bhtd" else 2
    return run_local(
        "apply_rotary",
        lambda q, k, cos, sin, position_ids: apply_rotary(
            q, k, cos, sin, position_ids=position_ids, layout=layout
        ),
        {"q": q, "k": k},
        {"cos": cos, "sin": sin, "position_ids": position_ids},
        shardable=lambda dim, ndim: ndim == 4 and dim == head_dim,
        hint=_HEADS_HINT,
        like=("q", "k"),
    )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    layout: str = "bhtd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, Hugging Face's ``apply_rotary_pos_emb`` in one kernel.

    Every head ``x`` of q and k becomes ``x * cos + rotate_half(x) * sin`` on its first ``R`` columns
    (``R = cos.shape[-1]``, the rotary width; ``rotate_half([x1, x2]) = [-x2, x1]``), and keeps its
    other ``D - R`` columns unchanged (partial rotary, as Hugging Face's GPT-NeoX / Phi / StableLM do).
    q and k may have different head counts (GQA): one launch handles both. The math is in
    ops/rope/README.md.

    Args:
        q: queries, ``[B, Hq, T, D]`` (``layout="bhtd"``, Hugging Face's) or ``[B, T, Hq, D]``
            (``layout="bthd"``), float32 / float16 / bfloat16 (float64 runs the PyTorch reference).
            Any strides: a transposed view of a ``[B, T, H, D]`` projection (what Hugging Face
            attention passes) or a slice of a fused qkv tensor is read in place, not copied (only a
            last dimension with stride != 1 is copied first).
        k: keys, the same layout, batch, T, D and dtype as q; its head count ``Hk`` may differ.
        cos: cosines as Hugging Face's rotary embedding returns them, ``[B, T, R]``, ``[1, T, R]`` or
            ``[T, R]`` (also ``[B, 1, T, R]`` / ``[B, T, 1, R]``, already unsqueezed on the head axis);
            with ``position_ids``, a table ``[max_pos, R]`` instead. ``R`` even, ``2 <= R <= D``. Any
            float dtype (read and upcast to fp32). Both halves of the table are read, so tables whose
            halves differ follow the formula above exactly too.
        sin: sines, the shape of ``cos``.
        position_ids: optional ``[B, T]`` (or ``[1, T]`` / ``[T]``) int32 / int64 rows of the cos/sin
            tables to use per token (as older Hugging Face code did with ``cos[position_ids]``). A
            position outside ``[0, max_pos)`` makes that token's rotary columns NaN (never an
            out-of-bounds read, no host sync); ``FUSELM_VALIDATE=1`` raises ValueError instead.
        layout: ``"bhtd"`` (default, Hugging Face's ``unsqueeze_dim=1``) or ``"bthd"`` (the layout of
            the projections before the transpose; Hugging Face's ``unsqueeze_dim=2``). Explicit, never
            inferred from shapes (``H == T`` would be ambiguous).

    Returns:
        ``(q_embed, k_embed)``: the shapes and dtype of q and k (computed in fp32, rounded once). When
        an input is dense (e.g. a transposed view), its output has the same strides (the same memory
        order); otherwise it is contiguous.

    DTensor: q and k may be DTensors (the same mesh and placements) sharded on the head dimension
    (tensor parallel) or replicated, with cos, sin and position_ids plain tensors or ``Replicate()``
    DTensors: each rank rotates its heads, the outputs have q's and k's placements. A sharded batch or
    sequence dimension raises ValueError saying what to pass (the local rows of the tables).

    Gradients: q and k get exact gradients (the rotation by ``-theta``, from the same kernel). cos and
    sin are treated as constants (Hugging Face makes them from non-learned buffers); if either requires
    grad while grad mode is on, the call runs the differentiable PyTorch reference instead (slower, but
    no gradient is silently dropped).

    Example:
        >>> import torch
        >>> from fuselm.ops.rope import apply_rotary
        >>> B, T, Hq, Hk, D = 2, 5, 4, 2, 8
        >>> q = torch.randn(B, Hq, T, D, requires_grad=True)
        >>> k = torch.randn(B, Hk, T, D, requires_grad=True)
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
        >>> freqs = torch.arange(T).float()[:, None] * inv_freq  # [T, D/2]
        >>> emb = torch.cat((freqs, freqs), dim=-1)[None].expand(B, T, D)
        >>> q_embed, k_embed = apply_rotary(q, k, emb.cos(), emb.sin())
        >>> (q_embed.sum() + k_embed.sum()).backward()
        >>> q_embed.shape, k.grad.shape
        (torch.Size([2, 4, 5, 8]), torch.Size([2, 2, 5, 8]))
    """
    if has_dtensor(q, k, cos, sin, position_ids):
        return _apply_rotary_dtensor(q, k, cos, sin, position_ids, layout)
    batch, seq_len, _, _, head_dim = check_qk(q, k, layout)
    cos_b, sin_b, pos_b = broadcast_tables(cos, sin, position_ids, batch, seq_len, head_dim, layout, q.device)
    if not _kernels_run(q, cos, sin, "apply_rotary"):
        return apply_rotary_reference(q, k, cos, sin, position_ids=position_ids, layout=layout)

    bhtd = layout == "bhtd"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return RotaryFunction.apply(q, k, cos_b.detach(), sin_b.detach(), pos_b, bhtd)
    if bhtd:  # the kernel indexes [b, t, h, d]: a view, no copy
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q_out, k_out = _run_fwd(_unit_last(q), _unit_last(k), cos_b, sin_b, pos_b)
    if bhtd:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out
