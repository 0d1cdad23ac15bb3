"""PEFT LoRA layers read as :mod:`fuselm.lora` operands (no forward, no patching here).

- :func:`lora_operands` reads one layer: a PEFT LoRA ``Linear`` (``peft.tuners.lora.Linear`` and its
  bitsandbytes variants ``peft.tuners.lora.bnb.Linear4bit`` / ``Linear8bitLt``), or a plain
  ``nn.Linear`` / ``bitsandbytes.nn.Linear4bit`` / ``Linear8bitLt``, into ``(base, adapter, bias)`` for
  :func:`fuselm.lora.lora_linear`, or returns the one-line reason it cannot.
- :func:`gated_mlp_operands`: the same for a gated MLP's three projections and
  :func:`fuselm.lora.lora_gated_mlp`.
- :func:`keep_quant_states`: where a 4-bit layer's quantization state survives FSDP2's sharding.

What reads as operands (and so runs fused, hf/lora.py): one active vanilla LoRA adapter (any rank,
``lora_alpha / r`` or rsLoRA's ``lora_alpha / sqrt(r)`` scaling: the value PEFT stores in
``layer.scaling``), dropout 0 or not, a base layer with or without a bias, over a dense, bitsandbytes 4-bit
(NF4/FP4, double quantization or not) or 8-bit base; merged adapters and disabled adapters (the base
layer alone). What does not, each with its reason: LoRA variants (DoRA, aLoRA, ...), LoRA bias
(``lora_bias=True``), several active adapters, ``fan_in_fan_out`` weights, a trainable base weight or bias,
other base layers (fp8, GPTQ, HQQ, ... quantization), disabled adapters that are still merged (PEFT
unmerges them then).

peft and bitsandbytes are looked up in ``sys.modules``: a layer of a package that was never imported
cannot be in the model, and this module imports neither itself.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.nn as nn

from ..lora import Bnb4bitWeight, Bnb8bitWeight, LoraAdapter

# ---- the classes, looked up without importing anything ----


_TYPES_CACHE: dict[tuple[bool, bool], dict[type, str]] = {}


def peft_lora_kinds() -> dict[type, str]:
    """PEFT's LoRA Linear classes fuselm runs fused -> "dense" / "4bit" / "8bit"."""
    key = ("peft.tuners.lora" in sys.modules, "peft.tuners.lora.bnb" in sys.modules)
    types = _TYPES_CACHE.get(key)
    if types is not None:
        return types
    types = {}
    if key[0]:
        types[sys.modules["peft.tuners.lora"].Linear] = "dense"
    if key[1]:
        peft_bnb = sys.modules["peft.tuners.lora.bnb"]
        for name, kind in (("Linear4bit", "4bit"), ("Linear8bitLt", "8bit")):
            cls = getattr(peft_bnb, name, None)
            if cls is not None:
                types[cls] = kind
    _TYPES_CACHE[key] = types
    return types


def is_lora_linear(module: nn.Module) -> bool:
    """Whether ``module`` is one of PEFT's LoRA ``Linear`` layers (dense, bitsandbytes 4-bit or 8-bit
    base): the layers :func:`lora_linear_forward` is made for (subclasses, e.g. other tuners, are not)."""
    return type(module) in peft_lora_kinds()


def _is_peft_layer(module: nn.Module) -> bool:
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _bnb_nn():
    bnb = sys.modules.get("bitsandbytes")
    return getattr(bnb, "nn", None) if bnb is not None else None


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


# ---- operands ----


_DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _frozen(name: str, t: torch.Tensor | None) -> str | None:
    if t is not None and t.requires_grad:
        return f"the base layer's {name} requires grad (trained with the adapter)"
    return None


def _base_operands(layer: nn.Module) -> tuple | str:
    """(base, bias) of a frozen base layer, or the reason it is not one fuselm computes."""
    if type(layer) is nn.Linear:  # the common case, read straight from the parameter dict (host time)
        params = layer._parameters
        weight, bias = params["weight"], params.get("bias")
        if (
            not weight.requires_grad
            and (bias is None or not bias.requires_grad)
            and weight.dtype in _DENSE_DTYPES
            and type(weight) in (nn.Parameter, torch.Tensor)
        ):
            return weight, bias
    bnb_nn = _bnb_nn()
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward:
        if not weight.dtype.is_floating_point or weight.dtype.itemsize < 2:
            return f"base weight of dtype {weight.dtype} (a quantization fuselm does not dequantize)"
        if _is_dtensor(weight):
            return "DTensor base weight"
        reason = _frozen("weight", weight) or _frozen("bias", bias)
        return reason or (weight, bias)
    if bnb_nn is not None and isinstance(layer, bnb_nn.Linear4bit):
        if type(layer).forward is not bnb_nn.Linear4bit.forward:
            return f"base layer {type(layer).__qualname__} (a Linear4bit with its own forward)"
        qs = getattr(weight, "quant_state", None) or getattr(layer, "quant_state", None)
        if qs is None and (_is_dtensor(weight) or type(weight) is not bnb_nn.Params4bit):
            return (
                "4-bit base layer whose quantization state was lost (sharded by fully_shard before "
                "fuselm.hf.patch? patch first: it keeps the state on the layer)"
            )
        if qs is None:
            return "4-bit base layer not quantized yet (move it to its device first)"
        if getattr(qs, "packing_format_for_cpu", False):
            return "4-bit base weight repacked for bitsandbytes' CPU inference kernel"
        return _frozen("bias", bias) or (Bnb4bitWeight(weight, qs), bias)
    if bnb_nn is not None and isinstance(layer, bnb_nn.Linear8bitLt):
        if type(layer).forward is not bnb_nn.Linear8bitLt.forward:
            return f"base layer {type(layer).__qualname__} (a Linear8bitLt with its own forward)"
        state = layer.state
        if getattr(state, "has_fp16_weights", False) or weight.dtype != torch.int8:
            return "8-bit base layer with has_fp16_weights=True (bitsandbytes requantizes it every call)"
        scb = weight.SCB if getattr(weight, "SCB", None) is not None else getattr(state, "SCB", None)
        if scb is None:
            return "8-bit base layer without row scales (SCB): not quantized yet"
        return _frozen("bias", bias) or (Bnb8bitWeight(weight.data, scb), bias)
    return f"base layer {type(layer).__qualname__} (not nn.Linear or bitsandbytes Linear4bit / Linear8bitLt)"


def lora_operands(module: nn.Module) -> tuple | str:
    """``(base, adapter, bias)`` for :func:`fuselm.lora.lora_linear`, or the one-line reason PEFT's
    forward must run.

    ``module`` is a PEFT LoRA ``Linear`` (dense or bitsandbytes 4-bit / 8-bit base) or a plain
    ``nn.Linear`` / ``bitsandbytes.nn.Linear4bit`` / ``Linear8bitLt``. ``base`` is the frozen weight (a
    tensor or a :class:`fuselm.lora.FrozenWeight`), ``adapter`` a :class:`fuselm.lora.LoraAdapter` of the
    one active adapter (None: merged, disabled or no adapter, the base layer alone), ``bias`` the base
    layer's bias or None. The dropout probability is the module's ``p`` in training mode and 0 in eval,
    as ``nn.Dropout``.

    Example:
        >>> from peft.tuners.lora import Linear as LoraLinear
        >>> from peft import LoraConfig
        >>> base = nn.Linear(16, 8).requires_grad_(False)
        >>> layer = LoraLinear(base, "default", config=LoraConfig(r=4, lora_alpha=8), r=4, lora_alpha=8)
        >>> weight, adapter, bias = lora_operands(layer)
        >>> weight is base.weight, adapter.rank, adapter.scaling, bias is base.bias
        (True, 4, 2.0, True)
        >>> lora_operands(nn.Linear(16, 8))
        "the base layer's weight requires grad (trained with the adapter)"
    """
    kind = peft_lora_kinds().get(type(module))
    if kind is None:
        if _is_peft_layer(module):
            return f"PEFT layer {type(module).__qualname__} (fuselm runs LoRA Linear layers)"
        base = _base_operands(module)
        return base if isinstance(base, str) else (base[0], None, base[1])
    # PEFT's state read from the instance dict where it lives (its properties wrap these; host time)
    d = module.__dict__
    mods = d["_modules"]
    if d.get("fan_in_fan_out"):
        return "fan_in_fan_out (Conv1D-layout) base weight"
    base_layer = mods["base_layer"]
    if _is_peft_layer(base_layer):
        return "nested PEFT layers"
    base = _base_operands(base_layer)
    if isinstance(base, str):
        return base
    weight, bias = base
    disabled = d["_disable_adapters"] if "_disable_adapters" in d else module.disable_adapters
    merged = bool(d["merged_adapters"]) if "merged_adapters" in d else module.merged
    if disabled:
        if merged:
            return "adapters disabled while merged (PEFT unmerges them on this call)"
        return weight, None, bias
    if merged:
        return weight, None, bias
    names = d["_active_adapter"] if "_active_adapter" in d else module.active_adapters
    lora_a_layers = mods["lora_A"]._modules
    if isinstance(names, str):
        active = [names] if names in lora_a_layers else []
    else:
        active = [name for name in names if name in lora_a_layers]
    if not active:
        return weight, None, bias
    if len(active) > 1:
        return f"{len(active)} active adapters ({', '.join(active)})"
    name = active[0]
    variant = d.get("lora_variant", {}).get(name)
    if variant is not None:
        label = "DoRA" if d.get("use_dora", {}).get(name) else "a LoRA variant"
        return f"{label} ({type(variant).__name__})"
    lora_a, lora_b = lora_a_layers[name], mods["lora_B"]._modules[name]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
        return f"adapter layers {type(lora_a).__qualname__} / {type(lora_b).__qualname__}"
    if d["lora_bias"].get(name) or lora_b._parameters.get("bias") is not None:
        return "LoRA bias (lora_bias=True)"
    scaling = d["scaling"][name]
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        return f"scaling of type {type(scaling).__name__} (a tensor: per-call scales)"
    drop = mods["lora_dropout"]._modules[name]
    if type(drop) is nn.Identity:
        p = 0.0
    elif type(drop) is nn.Dropout:
        p = drop.p if drop.training else 0.0
    else:
        return f"dropout module {type(drop).__qualname__}"
    if p >= 1.0:
        return "dropout p = 1"
    return weight, LoraAdapter(lora_a._parameters["weight"], lora_b._parameters["weight"], scaling, p), bias


def with_mask_dtype(module: nn.Module, adapter: LoraAdapter, input_dtype: torch.dtype | None):
    """The dtype PEFT's dropout sees: A's (PEFT casts the input first), or the input's when it does not
    cast (``cast_input_dtype_enabled`` off; its bitsandbytes layers under CUDA autocast)."""
    casts = getattr(module, "cast_input_dtype_enabled", True)
    if casts and peft_lora_kinds().get(type(module)) in ("4bit", "8bit"):
        casts = not torch.is_autocast_enabled()  # PEFT's own test (CUDA autocast)
    if casts or input_dtype is None:
        return adapter
    return replace(adapter, mask_dtype=input_dtype)


def keep_quant_states(model: nn.Module) -> None:
    """Keep each bitsandbytes 4-bit layer's quantization state on the layer too (``layer.quant_state``,
    bitsandbytes' own place for a state its weight lost), where :func:`lora_operands` finds it when the
    weight no longer carries it: FSDP2's ``fully_shard`` replaces the ``Params4bit`` by a DTensor of the
    packed bytes, and what its forward all-gathers is those bytes alone. ``fuselm.hf.patch`` calls it, so
    patch before sharding; the state (absmax, code: 1/16 to 1/32 of the packed weight) stays whole on
    every rank, the packed weight is sharded.

    Example:
        >>> keep_quant_states(nn.Linear(2, 2))  # no bitsandbytes layer: nothing to keep
    """
    bnb_nn = _bnb_nn()
    if bnb_nn is None:
        return
    for module in model.modules():
        if isinstance(module, bnb_nn.Linear4bit) and getattr(module, "quant_state", None) is None:
            qs = getattr(module.weight, "quant_state", None)
            if qs is not None:
                module.quant_state = qs


_PROJECTIONS = ("gate", "up", "down")


def gated_mlp_operands(
    gate_proj: nn.Module,
    up_proj: nn.Module,
    down_proj: nn.Module,
    *,
    input_dtype: torch.dtype | None = None,
) -> tuple | str:
    """``(gate, up, down)``, each ``(base, adapter, bias)``, for :func:`fuselm.lora.lora_gated_mlp`, or the
    reason (naming the projection) the fused MLP cannot run.

    Each projection is what :func:`lora_operands` accepts. ``input_dtype`` (the MLP input's dtype) is
    the dtype given to dropout masks where PEFT draws them on the uncast input (its bitsandbytes layers
    under CUDA autocast; ``cast_input_dtype_enabled`` off); None keeps A's dtype.

    Example:
        >>> g, u = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
        >>> d = nn.Linear(12, 8, bias=False)
        >>> for m in (g, u, d): _ = m.requires_grad_(False)
        >>> ops = gated_mlp_operands(g, u, d)
        >>> [op[0].shape for op in ops]
        [torch.Size([12, 8]), torch.Size([12, 8]), torch.Size([8, 12])]
        >>> gated_mlp_operands(g, u, nn.Linear(12, 8))
        "down_proj: the base layer's weight requires grad (trained with the adapter)"
    """
    ops = []
    for label, module in zip(_PROJECTIONS, (gate_proj, up_proj, down_proj), strict=True):
        op = lora_operands(module)
        if isinstance(op, str):
            return f"{label}_proj: {op}"
        base, adapter, bias = op
        if adapter is not None and adapter.dropout:
            adapter = with_mask_dtype(module, adapter, input_dtype)
        ops.append((base, adapter, bias))
    (g, _, _), (u, _, _), (d, _, _) = ops
    if tuple(u.shape) != tuple(g.shape) or tuple(d.shape) != (g.shape[1], g.shape[0]):
        shapes = ", ".join(
            f"{label}_proj {tuple(op[0].shape)}" for label, op in zip(_PROJECTIONS, ops, strict=True)
        )
        return f"projection shapes do not chain ({shapes})"
    return tuple(ops)
