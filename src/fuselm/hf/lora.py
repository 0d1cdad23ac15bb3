"""The forwards that run PEFT LoRA layers fused (no patching here), with their fallback warnings.

- :func:`lora_linear_forward` is an instance forward for PEFT's LoRA ``Linear`` layers: the fused path
  (:func:`fuselm.lora.lora_linear` on hf/peft_operands.py's :func:`lora_operands`), else PEFT's own forward
  with one warning per module and reason (what reads as operands and what does not: hf/peft_operands.py).
- :func:`lora_gated_mlp_forward`: the same for a gated MLP's three projections and
  :func:`fuselm.lora.lora_gated_mlp`. A mixed-adapter batch (``adapter_names=``) runs PEFT's forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..lora import Bnb4bitWeight, lora_gated_mlp, lora_linear
from ._common import warn_fallback
from .peft_operands import gated_mlp_operands, lora_operands, with_mask_dtype

# ---- forwards ----


def lora_linear_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """An instance forward for PEFT's LoRA ``Linear`` layers (dense, bitsandbytes 4-bit and 8-bit
    bases): :func:`fuselm.lora.lora_linear` on :func:`lora_operands`, or PEFT's own forward with one
    warning per module and reason when the fused path does not cover the layer's state.

    The output dtype is PEFT's: the compute dtype (x's, or the autocast dtype), x's for a 4-bit base
    (bitsandbytes returns its input's dtype). Install it with
    ``layer.forward = types.MethodType(lora_linear_forward, layer)``.

    Example:
        >>> import types
        >>> from peft.tuners.lora import Linear as LoraLinear
        >>> from peft import LoraConfig
        >>> layer = LoraLinear(nn.Linear(16, 8).requires_grad_(False), "default",
        ...                    config=LoraConfig(r=4, lora_alpha=8), r=4, lora_alpha=8)
        >>> x = torch.randn(3, 16)
        >>> peft_y = layer(x)
        >>> layer.forward = types.MethodType(lora_linear_forward, layer)
        >>> torch.allclose(layer(x), peft_y, atol=1e-6)
        True
    """
    if args or any(v is not None for v in kwargs.values()):
        if kwargs.get("adapter_names") is not None:
            reason = "adapter_names= (a mixed-adapter batch)"
        else:
            reason = "extra arguments to the base layer"
        ops = reason
    else:
        ops = lora_operands(self)
    if isinstance(ops, str):
        warn_fallback(self, ops)
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's (fuselm only patches instances)
    base, adapter, bias = ops
    if adapter is not None and adapter.dropout:
        adapter = with_mask_dtype(self, adapter, x.dtype)
    y = lora_linear(x, base, adapter, bias)
    if isinstance(base, Bnb4bitWeight) and y.dtype != x.dtype:
        y = y.to(x.dtype)  # bitsandbytes' Linear4bit returns its input's dtype
    return y


def lora_gated_mlp_forward(
    mlp: nn.Module,
    x: torch.Tensor,
    activation: str,
    *,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    chunk_rows: int | None = None,
    output: bool = True,
) -> torch.Tensor | None:
    """``down(act(gate(x)) * up(x))`` of ``mlp``'s three projections through
    :func:`fuselm.lora.lora_gated_mlp`, or None (after one warning naming ``mlp`` and the reason) when
    the fused MLP cannot run: the caller then runs HF's MLP forward (whose PEFT layers may still run
    :func:`lora_linear_forward`). ``chunk_rows``: over chunks of that many tokens (refused, once, with
    LoRA dropout on down_proj: the MLP then runs whole). ``output=False``: the result's values are not
    computed (see :func:`fuselm.lora.lora_gated_mlp`; not with ``chunk_rows``).

    Example:
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate_proj, self.up_proj = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
        ...         self.down_proj = nn.Linear(12, 8, bias=False)
        >>> import torch.nn.functional as F
        >>> mlp = MLP().requires_grad_(False)
        >>> x = torch.randn(2, 3, 8)
        >>> y = lora_gated_mlp_forward(mlp, x, "silu")
        >>> torch.allclose(y, mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)), atol=1e-6)
        True
    """
    projs = [getattr(mlp, n) for n in names]
    ops = gated_mlp_operands(*projs, input_dtype=x.dtype)
    if isinstance(ops, str):
        warn_fallback(mlp, ops, "HF's MLP forward")
        return None
    down_adapter = ops[2][1]
    if chunk_rows is not None and down_adapter is not None and down_adapter.dropout:
        warn_fallback(
            mlp, "mlp_chunk_tokens with LoRA dropout on down_proj (its mask is [tokens, I])", "the whole MLP"
        )
        chunk_rows = None
    y = lora_gated_mlp(x, *ops, activation, chunk_rows=chunk_rows, output=output)
    if any(isinstance(op[0], Bnb4bitWeight) for op in ops) and y.dtype != x.dtype:
        y = y.to(x.dtype)  # bitsandbytes' Linear4bit returns its input's dtype
    return y
