"""Plain PyTorch LoRA: the definition the fused functions are tested against (autograd does backward).

With a dense weight W [out, in], bias b, adapter A [r, in], B [out, r], scaling s, dropout p and its
bool keep-mask m (drawn by :func:`fuselm.lora.dropout_mask`, PEFT's draw):

    drop(x) = x * m / (1 - p)                      (x when p == 0)
    y       = x W^T + b + s * (drop(x) A^T) B^T
    mlp(x)  = down(act(gate(x)) * up(x))           act in {"silu", "gelu_tanh", "gelu"}

Everything runs in x's dtype (adapters cast to it), so float64 inputs give the float64 oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.swiglu import gated_reference
from .functions import LoraAdapter


def dropout_reference(x: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    """x * mask / (1 - p) (x itself when mask is None).

    Example:
        >>> dropout_reference(torch.ones(3), torch.tensor([True, False, True]), 0.5)
        tensor([2., 0., 2.])
    """
    if mask is None:
        return x
    return x * mask / (1.0 - p)


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    adapter: LoraAdapter | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, W, b) + s * F.linear(F.linear(drop(x), A), B)`` in x's dtype; ``mask`` is the bool
    keep-mask of x's shape (None: no dropout).

    Example:
        >>> x, W = torch.randn(4, 8), torch.randn(6, 8)
        >>> ad = LoraAdapter(torch.randn(2, 8), torch.randn(6, 2), scaling=0.5)
        >>> lora_linear_reference(x, W, ad).shape
        torch.Size([4, 6])
    """
    dt = x.dtype
    y = F.linear(x, weight.to(dt), bias.to(dt) if bias is not None else None)
    if adapter is None:
        return y
    xd = dropout_reference(x, mask, adapter.dropout)
    low = F.linear(xd, adapter.A.to(dt))
    return y + adapter.scaling * F.linear(low, adapter.B.to(dt))


def lora_gated_mlp_reference(
    x: torch.Tensor,
    gate: tuple,
    up: tuple,
    down: tuple,
    activation: str = "silu",
    masks: tuple = (None, None, None),
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with each projection ``(weight, adapter[, bias])`` as in
    :func:`lora_linear_reference` and ``masks`` the keep-masks of gate, up (x's shape) and down (h's).

    Example:
        >>> x = torch.randn(3, 8)
        >>> W1, W2, W3 = torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)
        >>> lora_gated_mlp_reference(x, (W1, None), (W2, None), (W3, None)).shape
        torch.Size([3, 8])
    """

    def proj(inp, op, mask):
        w, adapter = op[0], op[1]
        bias = op[2] if len(op) == 3 else None
        return lora_linear_reference(inp, w, adapter, bias, mask)

    g = proj(x, gate, masks[0])
    u = proj(x, up, masks[1])
    h = gated_reference(g, u, activation)
    return proj(h, down, masks[2])
