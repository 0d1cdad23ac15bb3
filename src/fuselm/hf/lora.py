"""The forwards that run PEFT LoRA layers fused (no patching here), with their fallback warnings.

- :func:`lora_linear_forward` is an instance forward for PEFT's LoRA ``Linear`` layers: the fused path
  (:func:`fuselm.lora.lora_linear` on hf/peft_operands.py's :func:`lora_operands`), else PEFT's own forward
  with one warning per module and reason (what reads as operands and what does not: hf/peft_operands.py).
- :func:`lora_gated_mlp_forward`: the same for a gated MLP's three projections and
  :func:`fuselm.lora.lora_gated_mlp`. A mixed-adapter batch (``adapter_names=``) runs PEFT's forward.
- Attention's ``q_proj``, ``k_proj`` and ``v_proj`` (:func:`group_qkv`): ``q_proj``'s forward runs the
  three in one node (:func:`fuselm.lora.lora_projections`) and leaves k and v for the two calls that
  follow on the same input; a model that does not call them so is said once and runs them one by one.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..lora import Bnb4bitWeight, lora_gated_mlp, lora_linear, lora_projections
from ._common import warn_fallback
from .peft_operands import gated_mlp_operands, is_lora_linear, lora_operands, with_mask_dtype

_QKV = "_fuselm_qkv"  # on a q_proj: (k_proj, v_proj), projected with it in one node
_LEFT = "_fuselm_left"  # on a k_proj / v_proj: (the input, its output, q_proj) left by q_proj's forward

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
        state = vars(self)
        left = state.pop(_LEFT, None)
        if left is not None:
            if left[0] is x:
                return left[1]
            _ungroup(left[2], "k_proj / v_proj called on another input than q_proj's")
        if _QKV in state:
            y = _qkv_forward(self, state[_QKV], x)
            if y is not None:
                return y
        ops = lora_operands(self)
    if isinstance(ops, str):
        warn_fallback(self, ops)
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's (fuselm only patches instances)
    return _output_dtype(lora_linear(x, *_fused_operands(self, ops, x)), ops[0], x)


def _fused_operands(layer: nn.Module, ops: tuple, x: torch.Tensor) -> tuple:
    """(base, adapter, bias) with the adapter's dropout mask drawn as PEFT draws it for ``x``."""
    base, adapter, bias = ops
    if adapter is not None and adapter.dropout:
        adapter = with_mask_dtype(layer, adapter, x.dtype)
    return base, adapter, bias


def _output_dtype(y: torch.Tensor, base: object, x: torch.Tensor) -> torch.Tensor:
    if isinstance(base, Bnb4bitWeight) and y.dtype != x.dtype:
        return y.to(x.dtype)  # bitsandbytes' Linear4bit returns its input's dtype
    return y


# ---- q, k and v in one node ----


def group_qkv(root: nn.Module) -> None:
    """Mark every attention module's ``q_proj`` under ``root`` whose ``q_proj``, ``k_proj`` and ``v_proj``
    are PEFT LoRA ``Linear`` layers running :func:`lora_linear_forward`: its forward projects the three
    (see the module docstring)."""
    for module in root.modules():
        trio = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(_runs_ours(m) for m in trio) and len(set(map(id, trio))) == 3:
            vars(trio[0])[_QKV] = (trio[1], trio[2])


def _runs_ours(module: object) -> bool:
    forward = vars(module).get("forward") if isinstance(module, nn.Module) else None
    inner = getattr(forward, "func", getattr(forward, "__func__", None))  # fuselm's, or a bound method
    return is_lora_linear(module) and inner is lora_linear_forward


def ungroup_qkv(root: nn.Module) -> None:
    """Undo :func:`group_qkv` under ``root``."""
    for module in root.modules():
        vars(module).pop(_QKV, None)
        vars(module).pop(_LEFT, None)


def _ungroup(q: nn.Module, reason: str) -> None:
    """Project ``q`` and its k and v one by one from now on, said once."""
    for m in vars(q).pop(_QKV, ()):
        vars(m).pop(_LEFT, None)
    warn_fallback(q, reason, "q_proj, k_proj and v_proj one by one")


def _qkv_forward(q: nn.Module, kv: tuple[nn.Module, nn.Module], x: torch.Tensor) -> torch.Tensor | None:
    """q's output, k's and v's left on them; None (q then runs alone) when a layer does not fuse or the
    previous call's k / v were never taken (the model does not call them on q's input)."""
    if any(_LEFT in vars(m) for m in kv):
        _ungroup(q, "k_proj / v_proj not called after q_proj on its input")
        return None
    members = (q, *kv)
    ops = [lora_operands(m) for m in members]
    if any(isinstance(o, str) for o in ops):
        return None  # each layer runs its own forward (and says why, if it cannot fuse)
    ops = [_fused_operands(m, o, x) for m, o in zip(members, ops, strict=True)]
    ys = [_output_dtype(y, o[0], x) for y, o in zip(lora_projections(x, ops), ops, strict=True)]
    for m, y in zip(kv, ys[1:], strict=True):
        vars(m)[_LEFT] = (x, y, q)
    return ys[0]


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
    computed (see :func:`fuselm.lora.lora_gated_mlp`).

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
