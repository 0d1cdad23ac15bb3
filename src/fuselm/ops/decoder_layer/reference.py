"""The PyTorch compositions the decoder-layer nodes replace: a pre-norm decoder layer (Llama's layout) cut
at the attention, written as Hugging Face's modules compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rms_norm import rms_norm_reference
from ..rope import apply_rotary_reference
from ..swiglu import gated_reference


def norm_qkv_rotary_reference(
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
    """``y = RMSNorm(x)``; q, k, v = the projections of y as ``[B, heads, T, D]``; q and k rotated.

    Example:
        >>> B, T, H, D = 1, 3, 16, 4
        >>> x = torch.randn(B, T, H)
        >>> emb = torch.randn(B, T, D)
        >>> q, k, v = norm_qkv_rotary_reference(x, torch.ones(H), torch.randn(2 * D, H), torch.randn(D, H),
        ...                                     torch.randn(D, H), emb.cos(), emb.sin(), head_dim=D, eps=1e-6)
        >>> q.shape, k.shape
        (torch.Size([1, 2, 3, 4]), torch.Size([1, 1, 3, 4]))
    """
    y = rms_norm_reference(x, norm_weight, eps, offset=norm_offset, casting=norm_casting)
    batch, seq_len, _ = x.shape
    q, k, v = (
        F.linear(y, w, b).view(batch, seq_len, -1, head_dim).transpose(1, 2)
        for w, b in ((q_weight, q_bias), (k_weight, k_bias), (v_weight, v_bias))
    )
    q, k = apply_rotary_reference(q, k, cos, sin, layout="bhtd")
    return q, k, v


def attention_output_mlp_reference(
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
    """``s = residual + o_proj(attn)``; ``s + down(act(gate(h)) * up(h))`` with ``h = RMSNorm(s)``.

    Example:
        >>> B, T, H, I = 1, 3, 16, 24
        >>> attn, residual = torch.randn(B, T, 8), torch.randn(B, T, H)
        >>> out = attention_output_mlp_reference(attn, residual, torch.randn(H, 8), torch.ones(H),
        ...                                      torch.randn(I, H), torch.randn(I, H), torch.randn(H, I),
        ...                                      eps=1e-6)
        >>> out.shape
        torch.Size([1, 3, 16])
    """
    attn = attn.reshape(*residual.shape[:-1], -1)
    summed = residual + F.linear(attn, o_weight, o_bias)
    h = rms_norm_reference(summed, norm_weight, eps, offset=norm_offset, casting=norm_casting)
    gated = gated_reference(F.linear(h, gate_weight, gate_bias), F.linear(h, up_weight, up_bias), activation)
    return summed + F.linear(gated, down_weight, down_bias)
