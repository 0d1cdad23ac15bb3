"""The forwards fuselm puts in place of Hugging Face's: RMSNorm, gated MLP, rotary function, decoder
layer (the residual add fused into the post-attention RMSNorm), CausalLM.

Each factory takes a :class:`~fuselm.hf.registry.FamilySpec` (and, for what can fall back, the
original) and returns a plain function with the original's signature, usable as a class attribute
(class patching) or bound to one instance (instance patching). Factories are cached so one family
always gets the same function object: patching twice is idempotent and unpatching can check identity.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.mlp import ACTIVATIONS, gated_mlp, gated_packed, is_plain_linear
from ..ops._common.guard import TargetRangeError
from ..ops.cross_entropy import cross_entropy
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.rms_norm import rms_norm
from ..ops.rope import apply_rotary
from .registry import NORM_STYLES, FamilySpec


@functools.cache
def rms_norm_forward(spec: FamilySpec) -> Callable:
    """``forward(self, hidden_states)`` of the family's RMSNorm through :func:`fuselm.rms_norm`."""
    style = NORM_STYLES[spec.norm_style]
    eps_attr, offset, casting = style["eps_attr"], style["offset"], style["casting"]
    scale_flag = style.get("scale_flag")  # a bool attribute: False means no weight (Gemma 4's with_scale)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight if scale_flag is None or getattr(self, scale_flag) else None
        return rms_norm(hidden_states, weight, getattr(self, eps_attr), offset=offset, casting=casting)

    forward.__qualname__ = f"fuselm_{spec.rms_norm}.forward"
    return forward


@functools.cache
def mlp_forward(spec: FamilySpec, original: Callable) -> Callable:
    """``forward(self, x)`` of the family's gated MLP with the fused activation (and, for split
    gate/up projections, the down projection's input recomputed in backward). An activation fuselm has
    no kernel for (``config.<act_attr>`` not in ``fuselm.nn.mlp.ACTIVATIONS``) runs the original.
    ``spec.mlp_multipliers`` names the module attributes read at each call (as HF's forward reads them)
    for the gate and down multipliers of :func:`fuselm.nn.mlp.gated_mlp` (Falcon-H1)."""
    gate_attr, down_attr = spec.mlp_multipliers or (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS.get(getattr(self.config, spec.act_attr, None))
        if act is None:
            return original(self, x)
        if spec.packed_mlp:
            return self.down_proj(gated_packed(self.gate_up_proj(x), act))
        multipliers = {}
        if gate_attr is not None:
            multipliers = dict(
                gate_multiplier=getattr(self, gate_attr), down_multiplier=getattr(self, down_attr)
            )
        return gated_mlp(
            x,
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            getattr(self.config, spec.act_attr),
            **multipliers,
        )

    forward.__qualname__ = f"fuselm_{spec.mlp}.forward"
    return forward


@functools.cache
def rope_function(spec: FamilySpec, original: Callable) -> Callable:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through :func:`fuselm.apply_rotary`
    (both layouts HF uses: ``unsqueeze_dim=1`` is ``[B, heads, T, D]``, ``2`` is ``[B, T, heads, D]``);
    any other call (extra arguments, another ``unsqueeze_dim``) runs the original."""
    layouts = {1: "bhtd", 2: "bthd"}
    if spec.rope_one_tensor:
        return _one_tensor_rope_function(spec, original, layouts)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or unsqueeze_dim not in layouts or cos.dim() != 3:
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return apply_rotary(q, k, cos, sin, layout=layouts[unsqueeze_dim])

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb


def _one_tensor_rope_function(spec: FamilySpec, original: Callable, layouts: dict[int, str]) -> Callable:
    """``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (Gemma 4: q and k rotated by separate calls,
    also each axis part of the vision tower's 2-D RoPE) through :func:`fuselm.apply_rotary`, with a
    zero-head key beside ``x`` (the kernel skips it: one launch per call, nothing computed twice)."""

    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or unsqueeze_dim not in layouts or cos.dim() != 3 or x.dim() != 4:
            return original(x, cos, sin, unsqueeze_dim, *args, **kwargs)
        layout = layouts[unsqueeze_dim]
        no_heads = x.narrow(1 if layout == "bhtd" else 2, 0, 0)
        return apply_rotary(x, no_heads, cos, sin, layout=layout)[0]

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.__qualname__ = f"fuselm_{spec.model_type}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb


# ---- the decoder layer: the add after the attention runs inside the post-attention RMSNorm ----

# Llama's decoder layer forward, statement by statement (transformers 5.x, comments and docstring aside).
# The self_attn call (statement _ATTN_CALL) passes hidden_states and, by name, some of the forward's own
# parameters (which ones varies by family: Mixtral's passes no use_cache) and **kwargs.
_LLAMA_LAYER = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""
_ATTN_CALL = 2


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """How a decoder layer forward of Llama's layout (:func:`llama_layer_layout`) takes its arguments
    and what it passes on to ``self_attn``.

    Attributes:
        params: its parameters after ``self``, positional or keyword (``hidden_states`` first).
        defaults: the defaults of those that have one.
        var_kw: the name of its ``**kwargs``, or None.
        attn_args: the parameters it passes on to ``self_attn`` by name, besides ``hidden_states``.
        attn_var_kw: it passes its ``**kwargs`` on to ``self_attn`` too.
    """

    params: tuple[str, ...]
    defaults: dict
    var_kw: str | None
    attn_args: tuple[str, ...]
    attn_var_kw: bool

    def bind(self, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        """(each parameter -> its value, the other keyword arguments) of a call ``forward(self, *args,
        **kwargs)``, as Python binds them (``kwargs`` is consumed); TypeError as the forward raises."""
        if len(args) > len(self.params):
            raise TypeError(f"forward() takes {len(self.params)} arguments after self, {len(args)} given")
        named = dict(zip(self.params[: len(args)], args, strict=True))
        for name in self.params[len(args) :]:
            if name in kwargs:
                named[name] = kwargs.pop(name)
            elif name in self.defaults:
                named[name] = self.defaults[name]
            else:
                raise TypeError(f"forward() missing required argument: {name!r}")
        twice = [name for name in self.params[: len(args)] if name in kwargs]
        if twice:
            raise TypeError(f"forward() got multiple values for argument {twice[0]!r}")
        if kwargs and self.var_kw is None:
            raise TypeError(f"forward() got an unexpected keyword argument {next(iter(kwargs))!r}")
        return named, kwargs


def _attention_call(stmt: ast.stmt, params: list[str], var_kw: str | None):
    """The self_attn statement with its keywords other than hidden_states taken out, and (the
    parameters passed by name, whether **kwargs is passed); None when a keyword is anything but a
    parameter passed under its own name (``attention_mask=attention_mask``) or the forward's **kwargs."""
    if not isinstance(stmt, ast.Assign) or not isinstance(stmt.value, ast.Call):
        return None
    stmt = copy.deepcopy(stmt)
    kept, attn_args, attn_var_kw = [], [], False
    for kw in stmt.value.keywords:
        value = kw.value.id if isinstance(kw.value, ast.Name) else None
        if kw.arg == "hidden_states":
            kept.append(kw)
        elif kw.arg is None and value is not None and value == var_kw:
            attn_var_kw = True
        elif kw.arg in params[2:] and value == kw.arg:
            attn_args.append(kw.arg)
        else:
            return None
    stmt.value.keywords = kept
    return stmt, (tuple(attn_args), attn_var_kw)


def _renames_kwargs(decorator: ast.expr) -> bool:
    """Is this decorator ``deprecate_kwarg(...)`` (transformers 5.24 puts it on the layers' forward to rename
    ``past_key_values``; fuselm keeps it around its own forward: :func:`split_checkpointing`)?"""
    func = decorator.func if isinstance(decorator, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name == "deprecate_kwarg"


def llama_layer_layout(forward: Callable) -> LayerLayout | str:
    """The :class:`LayerLayout` of a decoder layer ``forward`` (HF's own function, not a checkpointing
    wrapper) whose body is Llama's pre-norm layout statement for statement, or why it is not.

    Llama's layout: ``residual = hidden_states``; ``input_layernorm``; ``hidden_states, _ =
    self.self_attn(hidden_states=hidden_states, <its parameters by name>, **kwargs)``; ``residual +
    hidden_states``; ``post_attention_layernorm``; ``mlp``; ``residual + hidden_states``; return. The
    forward's signature: ``self, hidden_states``, then parameters (positional or keyword) and optionally
    ``**kwargs``; no decorator but ``deprecate_kwarg``. Compared on the syntax tree of the installed source,
    so a transformers version that changes the layer is seen when patching, not at the first wrong result.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"its source cannot be read ({type(e).__name__})"
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef) or not all(map(_renames_kwargs, fn.decorator_list)):
        return "its forward is not a plain function"
    sig = fn.args
    params = [a.arg for a in sig.args]
    if sig.posonlyargs or sig.vararg or sig.kwonlyargs or params[:2] != ["self", "hidden_states"]:
        return "its forward's signature is not (self, hidden_states, <parameters>, **kwargs)"
    var_kw = sig.kwarg.arg if sig.kwarg else None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    template = ast.parse(_LLAMA_LAYER).body
    if len(body) != len(template):
        return "its forward is not Llama's pre-norm layout"
    attn = None
    for i, (got, want) in enumerate(zip(body, template, strict=True)):
        if i == _ATTN_CALL:
            found = _attention_call(got, params, var_kw)
            if found is None:
                return "its self_attn call is not Llama's"
            got, attn = found
        if ast.dump(got) != ast.dump(want):
            return "its forward is not Llama's pre-norm layout"
    defaults = {
        name: p.default
        for name, p in inspect.signature(forward).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return LayerLayout(tuple(params[1:]), defaults, var_kw, *attn)


def split_checkpointing(forward: Callable) -> tuple[Callable, bool, Callable] | str:
    """(HF's own forward, whether the class's forward checkpoints, ``rewrap``) of a decoder layer class's
    ``forward``; ``rewrap(fn)`` puts around ``fn`` the argument-renaming wrappers HF's forward had.

    transformers 5.23's ``GradientCheckpointingLayer`` wraps every subclass's forward in
    ``forward_with_checkpointing`` (so module hooks stay outside the checkpoint), 5.17's checkpoints in
    ``__call__`` around an unwrapped forward. 5.24 also decorates the forward with ``deprecate_kwarg``
    (``past_key_values`` renamed ``cache``): such wrappers are kept, around fuselm's forward too. Any other
    wrapper: a reason (the layer stays HF's)."""
    checkpoints = False
    code = getattr(forward, "__code__", None)
    if code is not None and code.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        forward, checkpoints = forward.__wrapped__, True
    renaming = []
    while getattr(forward, "__wrapped__", None) is not None:
        if not _is_kwarg_deprecation(forward):
            if getattr(getattr(forward, "__code__", None), "co_name", None) == "forward_with_checkpointing":
                return "its forward is wrapped twice"
            return f"its forward is wrapped ({getattr(forward, '__qualname__', forward)!r})"
        renaming.append(forward)
        forward = forward.__wrapped__

    def rewrap(fn: Callable) -> Callable:
        for wrapper in reversed(renaming):
            fn = _with_wrapped(wrapper, fn)
        return fn

    return forward, checkpoints, rewrap


def _is_kwarg_deprecation(fn: Callable) -> bool:
    """Is ``fn`` the wrapper transformers' ``deprecate_kwarg`` makes (it renames or warns about keyword
    arguments, then calls the function it wraps, held in its closure as ``func``)?"""
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and code.co_name == "wrapped_func"
        and code.co_filename.replace("\\", "/").endswith("transformers/utils/deprecation.py")
        and "func" in code.co_freevars
        and fn.__closure__ is not None
    )


def _with_wrapped(wrapper: Callable, fn: Callable) -> Callable:
    """A copy of a ``deprecate_kwarg`` wrapper that calls ``fn`` instead of the function it wrapped (the
    same code and settings, its ``func`` cell replaced)."""
    cells = list(wrapper.__closure__)
    cells[wrapper.__code__.co_freevars.index("func")] = types.CellType(fn)
    copy_ = types.FunctionType(
        wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, tuple(cells)
    )
    copy_.__kwdefaults__ = wrapper.__kwdefaults__
    return functools.update_wrapper(copy_, fn)


def hf_class(module: nn.Module) -> type:
    """The module's Hugging Face class: FSDP2's fully_shard (and replicate) swap a module's class for a
    subclass (FSDPModule, cls) defined in torch; look through that one, not through user subclasses."""
    return unsharded_class(type(module))


def unsharded_class(cls: type) -> type:
    """``cls``, or the class FSDP2 made it from when it is FSDP2's subclass (FSDPModule, that class)."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ in ("FSDPModule", "ReplicateModule"):
        return bases[1]
    return cls


def sharded_classes(cls: type) -> list[type]:
    """The classes FSDP2 made from ``cls`` (torch caches one per class) that hold a ``forward`` of their
    own: transformers 5.23's ``GradientCheckpointingLayer`` wraps a subclass's forward when the subclass is
    made, so such a class keeps the forward ``cls`` had then (a later class patch would not reach it)."""
    return [s for s in cls.__subclasses__() if unsharded_class(s) is cls and "forward" in vars(s)]


_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _hooked(module: nn.Module) -> bool:
    """Would calling the module run hooks (its own or global ones) that a fused path skips?"""
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return True
    if module._backward_pre_hooks:
        return True
    return any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS)


def _is_plain(t) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def _same_function(fn, other: Callable) -> bool:
    """fn (a function, or a method bound to it) is other; by qualified name and module too, which
    torch.compile resolves while tracing (torch 2.11's dynamo answers the identity False for the same one)."""
    if getattr(fn, "__func__", fn) is other:
        return True
    return getattr(fn, "__qualname__", None) == other.__qualname__ and getattr(fn, "__module__", None) == (
        other.__module__
    )


def fused_norm_args(spec: FamilySpec, norm, norm_forward: Callable) -> tuple | None:
    """(weight, eps, offset, casting) with which :func:`fuselm.rms_norm` computes what ``norm(x)`` would,
    or None: ``norm`` is not the family's RMSNorm class (FSDP2's subclass of it aside) running fuselm's
    forward (``norm_forward``: :func:`rms_norm_forward` of the family, class- or instance-patched), it
    has hooks, or its weight is not a plain tensor (a DTensor, absent)."""
    if not isinstance(norm, nn.Module):
        return None
    cls = hf_class(norm)
    if cls.__name__ != spec.rms_norm or cls.__module__ != spec.module:
        return None
    own = norm.__dict__.get("forward")  # an instance patch: a bound method
    if not _same_function(own if own is not None else type(norm).forward, norm_forward) or _hooked(norm):
        return None
    style = NORM_STYLES[spec.norm_style]
    scale_flag = style.get("scale_flag")
    weight = None
    if scale_flag is None or getattr(norm, scale_flag):
        weight = getattr(norm, "weight", None)
        if not _is_plain(weight):
            return None
    return weight, getattr(norm, style["eps_attr"]), style["offset"], style["casting"]


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(residual + x), residual + x)`` by one :func:`fuselm.rms_norm` call with ``residual=``,
    in the dtype HF's ``residual + x`` has (both cast to their promoted dtype first: under autocast an
    fp32 residual stream and a bf16 attention output add in fp32, as in HF).

    Shapes: x, residual ``[..., H]`` (the same); weight ``[H]``; returns two ``[..., H]`` tensors."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return rms_norm(x.to(dtype), weight, eps, residual=residual.to(dtype), offset=offset, casting=casting)


def _outermost(module: nn.Module, forward: Callable) -> bool:
    """Is ``forward`` what ``module(...)`` calls first (its instance forward, or its class's): then it
    checkpoints, as HF's wrapper does when it is the outermost one."""
    own = module.__dict__.get("forward")
    if own is not None:
        return getattr(own, "__func__", None) is forward
    return type(module).forward is forward


def _checkpoint(module: nn.Module, inner: Callable, args: tuple, kwargs: dict):
    """``inner(module, *args, **kwargs)`` under the layer's gradient checkpointing function, with the
    cache arguments transformers' ``GradientCheckpointingLayer`` turns off (and its warning)."""
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("`use_cache=False`")
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in ("past_key_values", "cache", "layer_past"):  # the cache's names (5.24: cache)
            if kwargs.get(name) is not None:
                kwargs[name] = None
                changed.append(f"`{name}=None`")
    if changed:
        from transformers.utils import logging

        logging.get_logger("transformers.modeling_layers").warning_once(
            f"Caching is incompatible with gradient checkpointing in {type(module).__name__}. Setting "
            + ", ".join(changed)
            + "."
        )
    return module._gradient_checkpointing_func(functools.partial(inner, module, **kwargs), *args)


@functools.cache
def decoder_layer_forward(spec: FamilySpec, original: Callable) -> Callable | None:
    """The forward of a decoder layer of Llama's layout with the add after the attention fused into the
    post-attention RMSNorm, or None (with a one-time warning) when ``original`` (the class's forward) is
    not that layout in the installed transformers (:func:`llama_layer_layout`).

    It runs HF's forward with one change: ``hidden_states = residual + attn_out; residual =
    hidden_states; hidden_states = post_attention_layernorm(hidden_states)`` is ``hidden_states,
    residual = fuselm.rms_norm(attn_out, weight, eps, residual=residual, ...)`` (one kernel: the sum is
    rounded to the activations' dtype as HF's add rounds it, and the backward gives the gradient of both
    operands, the residual stream's gradient added in fp32 before its one rounding). Everything else is
    HF's: the arguments are bound to HF's signature and passed on to ``self_attn`` as HF's forward passes
    them, ``input_layernorm``, ``self_attn`` and ``mlp`` are called as modules (PEFT's LoRA layers, hooks
    and patches on them run), a tensor is returned. Under gradient checkpointing (transformers 5.23
    checkpoints in the layer's forward, which this replaces) it checkpoints itself, with HF's rules.

    HF's forward runs instead when the post-attention norm is not the family's RMSNorm running fuselm's
    forward, has hooks, or has no plain weight (:func:`fused_norm_args`); HF's add and norm run when the
    attention output and the residual are not plain tensors of one shape and device (DTensors).

    Shapes: ``hidden_states`` ``[B, T, H]`` in, ``[B, T, H]`` out (HF's other arguments as HF takes them).
    """
    layer = spec.decoder_layer
    split = split_checkpointing(original)
    layout = split if isinstance(split, str) else llama_layer_layout(split[0])
    if isinstance(layout, str):
        warn_once(
            f"layer:{spec.module}.{layer}",
            f"fuselm.hf: {layer} in this transformers version: {layout}, so its residual add stays "
            "Hugging Face's (the norms, RoPE and MLP inside still run fuselm's)",
        )
        return None
    raw, checkpoints, rewrap = split
    attn_args, attn_var_kw = layout.attn_args, layout.attn_var_kw
    norm_forward = rms_norm_forward(spec)  # here, not in the forward: torch.compile traces through caches

    def inner(self, *args, **kwargs):
        norm_args = fused_norm_args(spec, getattr(self, "post_attention_layernorm", None), norm_forward)
        if norm_args is None:
            return raw(self, *args, **kwargs)
        named, kwargs = layout.bind(args, kwargs)
        hidden_states = named["hidden_states"]
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        passed = {name: named[name] for name in attn_args}
        if attn_var_kw:
            passed.update(kwargs)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **passed)
        if (
            _is_plain(hidden_states)
            and _is_plain(residual)
            and hidden_states.shape == residual.shape
            and hidden_states.device == residual.device
        ):
            hidden_states, residual = residual_rms_norm(hidden_states, residual, *norm_args)
        else:  # HF's add and norm
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states

    inner.__name__ = inner.__qualname__ = "forward"  # HF's rename warnings name the layer's forward
    inner = rewrap(inner)  # HF's keyword renames (5.24: past_key_values -> cache) before fuselm's code

    @functools.wraps(raw)
    def forward(self, *args, **kwargs):
        if checkpoints and self.gradient_checkpointing and self.training and _outermost(self, forward):
            return _checkpoint(self, inner, args, kwargs)
        return inner(self, *args, **kwargs)

    forward.__qualname__ = f"fuselm_{layer}.forward"
    return forward


def shifted_targets(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int, n_tokens: int, device
) -> torch.Tensor:
    """``[n_tokens]`` targets of HF's causal-LM loss: token ``t`` predicts ``labels[..., t + 1]`` (the last
    position predicts nothing), or ``shift_labels[..., t]`` when given (already shifted, as HF's
    sequence-parallel path passes them)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device)
    if target.shape[0] != n_tokens:
        got = target.shape[0]
        raise ValueError(f"labels must give one target per token: {n_tokens} tokens, {got} targets")
    return target


def _per_item(loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """HF's normalization: the summed loss divided by ``num_items_in_batch`` (when given)."""
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _labels_error(e: TargetRangeError) -> ValueError:
    return ValueError(
        f"labels hold {e.value}, outside [0, {e.n_classes}) (the rows of lm_head) and not "
        f"ignore_index={e.ignore_index}"
    )


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    memory: str | int = "auto",
    accum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` of the logits ``hidden_states @ weight.T + bias``, computed by
    :func:`fuselm.linear_cross_entropy` without building them.

    Targets as :func:`shifted_targets`. With ``num_items_in_batch`` the loss is the sum over predicted
    tokens divided by it (HF's gradient-accumulation-correct normalization; a batch without targets and
    ``num_items_in_batch = 0`` gives 0 / 0 = NaN as HF's, with zero gradients); otherwise the mean.
    ``softcap``: Gemma 2/3's final logit softcapping; ``label_smoothing``: PyTorch's (what Trainer's
    ``label_smoothing_factor`` computes); ``memory``, ``accum_dtype``: those of
    :func:`fuselm.linear_cross_entropy`. The loss
    is fp32, as HF's (computed on ``logits.float()``). A label outside ``[0, V)`` that is not
    ``ignore_index`` raises ValueError in eager mode (see :func:`fuselm.linear_cross_entropy`).

    Shapes: hidden_states ``[B, T, H]``, weight ``[V, H]``, bias ``[V]``, labels ``[B, T]`` (int,
    ``ignore_index`` for no target); returns a scalar.
    """
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shifted_targets(labels, shift_labels, ignore_index, hidden.shape[0], hidden.device)
    try:
        loss = linear_cross_entropy(
            hidden,
            weight,
            target,
            linear_bias=bias,
            ignore_index=ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
            softcap=softcap,
            label_smoothing=label_smoothing,
            memory=memory,
            accum_dtype=accum_dtype,
            loss_dtype=torch.float32,
        )
    except TargetRangeError as e:
        raise _labels_error(e) from e
    return _per_item(loss, num_items_in_batch)


def causal_lm_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` on materialized logits ``[B, T, V]`` through :func:`fuselm.cross_entropy`:
    one pass per row, fp32 math and an fp32 loss without HF's fp32 copy of the logits. A label outside
    ``[0, V)`` gives a NaN loss and a zero gradient (no host sync, see :func:`fuselm.cross_entropy`)."""
    v = logits.shape[-1]
    target = shifted_targets(labels, shift_labels, ignore_index, logits.numel() // v, logits.device)
    loss = cross_entropy(
        logits.reshape(-1, v),
        target,
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        label_smoothing=label_smoothing,
        loss_dtype=torch.float32,
    )
    return _per_item(loss, num_items_in_batch)


@dataclass(frozen=True)
class LossOptions:
    """How the patched ``*ForCausalLM.forward`` computes its loss (hashable: factories are cached on it).

    Attributes:
        from_logits: HF's logits are made and returned, the loss on them by :func:`fuselm.cross_entropy`
            (``patch(..., cross_entropy=True)``); otherwise the fused loss from the hidden states.
        label_smoothing: PyTorch's label smoothing, applied inside the fused loss.
        memory: the ``memory=`` plan of :func:`fuselm.linear_cross_entropy`.
        accum_dtype: its ``accum_dtype=`` (None, or torch.float32 for an fp32 lm_head gradient accumulator).
    """

    from_logits: bool = False
    label_smoothing: float = 0.0
    memory: str | int = "auto"
    accum_dtype: torch.dtype | None = None


# ---- the lm_head: which weight the fused loss reads ----

# (x [N, H], weight [V, H'], bias [V] or None) -> the operands of the fused loss, x widened to H' columns
HeadOperands = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _peft_class(name: str):
    """A PEFT class when PEFT is imported (a head cannot be one otherwise), else None."""
    if "peft" not in sys.modules:
        return None
    if name == "ModulesToSaveWrapper":
        from peft.utils.other import ModulesToSaveWrapper

        return ModulesToSaveWrapper
    from peft.tuners.lora import Linear

    return Linear


def head_operands(head: nn.Module) -> HeadOperands | str:
    """How the fused loss computes the logits of ``head``, or why it cannot (a one-line reason).

    - a plain ``nn.Linear``: its weight and bias;
    - PEFT's ``modules_to_save`` wrapper: the active copy (the original when adapters are disabled);
    - a PEFT LoRA ``Linear`` (vanilla LoRA, any dropout, any number of active adapters): the base
      weight and each adapter's ``B`` side by side, ``[W, B_1, ...]`` of shape ``[V, H + r_1 + ...]``,
      and the input ``[x, s_1 A_1(dropout(x)), ...]``: the logits ``x W^T + sum_k s_k B_k A_k dropout(x)``
      exactly as PEFT computes them. The widened weight is a temporary copy of W, and its gradient is
      computed in full even when W is frozen (2NHV more FLOPs than needed); a merged or disabled adapter
      reads the base weight alone.
    """
    if is_plain_linear(head):
        return lambda x: (x, head.weight, head.bias)
    if head._forward_hooks or head._forward_pre_hooks:
        return f"lm_head ({type(head).__name__}) has hooks"
    wrapper = _peft_class("ModulesToSaveWrapper")
    if wrapper is not None and isinstance(head, wrapper):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return head_operands(head.original_module)
        return head_operands(head.modules_to_save[active[0]])
    lora = _peft_class("Linear")
    if lora is not None and isinstance(head, lora):
        return _lora_operands(head)
    return f"lm_head is a {type(head).__name__}"


def _lora_operands(head: nn.Module) -> HeadOperands | str:
    base = head.base_layer
    if not is_plain_linear(base):
        return f"lm_head is LoRA on a {type(base).__name__}"
    if head.disable_adapters or head.merged:
        return head_operands(base)
    adapters = [a for a in head.active_adapters if a in head.lora_A]
    if any(a in head.lora_variant for a in adapters):
        return "lm_head is a LoRA variant (DoRA, ...)"

    def operands(x):
        xs, ws, b = [x], [base.weight], base.bias
        for a in adapters:
            lora_a, lora_b, s = head.lora_A[a], head.lora_B[a], head.scaling[a]
            low = lora_a(head.lora_dropout[a](x.to(lora_a.weight.dtype))) * s  # [N, r]
            xs.append(low.to(x.dtype))
            ws.append(lora_b.weight.to(base.weight.dtype))
            if lora_b.bias is not None:  # lora_bias=True: B's bias is scaled with its output
                b_lora = (lora_b.bias * s).to(base.weight.dtype)
                b = b_lora if b is None else b + b_lora
        if len(xs) == 1:
            return x, base.weight, b
        return torch.cat(xs, dim=-1), torch.cat(ws, dim=1), b

    return operands


# ---- what HF's forward does with its logits ----

# Config attributes HF's CausalLM forwards apply to the logits: scale them by (multiplied or divided),
# or softcap them with (Gemma 2/3).
MULTIPLIERS = ("logit_scale", "lm_head_multiplier")  # Cohere 1/2, Falcon-H1
DIVISORS = ("logits_scaling",)  # Granite, Granite MoE
SOFTCAP = "final_logit_softcapping"  # Gemma 2 / 3


@dataclass(frozen=True)
class HeadFacts:
    """What HF's forward does after its backbone, read from its source.

    Attributes:
        transforms: the config attributes among :data:`MULTIPLIERS`, :data:`DIVISORS` and :data:`SOFTCAP`
            it applies to the logits: those its source names (Gemma 3's multimodal wrapper, for one, does
            not softcap although its text config has the attribute).
        calls_loss_function: its loss comes from ``self.loss_function`` (HF's template), which fuselm
            stands in for.
    """

    transforms: frozenset[str]
    calls_loss_function: bool


@functools.cache
def head_facts(forward: Callable) -> HeadFacts:
    """:class:`HeadFacts` of an HF forward (every transform, and a loss function, if the source is
    unavailable)."""
    names = (*MULTIPLIERS, *DIVISORS, SOFTCAP)
    try:
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):
        return HeadFacts(frozenset(names), True)
    named = frozenset(n for n in names if re.search(rf"\b{n}\b", source))
    return HeadFacts(named, "self.loss_function(" in source)


def _logit_scale_and_softcap(config, transforms: frozenset[str]) -> tuple[float, float | None]:
    """(scale, softcap): HF's logits are softcap(scale * (x W^T + b)); from the (text) config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    for name in transforms:
        value = getattr(text, name, None)
        if value is None or name == SOFTCAP:
            continue
        scale = scale * value if name in MULTIPLIERS else scale / value
    softcap = getattr(text, SOFTCAP, None) if SOFTCAP in transforms else None
    return scale, softcap


# ---- the patched CausalLM forward ----

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class _HiddenCapture(nn.Module):
    """Stands in for the lm_head during one call of HF's forward: keeps the hidden states it is given and
    returns an empty ``[..., 0]`` tensor for the logits (HF's scaling or softcap of it costs nothing)."""

    def __init__(self):
        super().__init__()
        self.hidden = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden_states
        return hidden_states[..., :0]


def _head_name(model: nn.Module) -> str | None:
    """The attribute name of the model's output embedding (``lm_head``) among its direct children."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else model._modules.get("lm_head")
    return next((n for n, m in model._modules.items() if m is head and head is not None), None)


@functools.cache
def _signature(forward: Callable) -> inspect.Signature:
    return inspect.signature(forward)


def _call_args(forward: Callable, self, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call by name (positional ones bound to the forward's signature)."""
    if not args:
        return kwargs
    return {**_signature(forward).bind_partial(self, *args).arguments, **kwargs}


def _fallback_reason(model: nn.Module, facts: HeadFacts) -> str | None:
    if "_loss_function" in vars(model):
        return "the model has its own loss_function"
    if not facts.calls_loss_function:
        return "its forward computes the loss without self.loss_function"
    return None


@functools.cache
def causal_lm_forward(spec: FamilySpec, original: Callable, options: LossOptions = LossOptions()) -> Callable:
    """A ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward whose training loss is fuselm's.

    When the model is training (``model.train()``, gradients enabled) and gets ``labels`` (or
    ``shift_labels``), HF's own forward runs (backbone, multimodal inputs, MoE router auxiliary loss, the
    output class HF returns) with two of its members standing in, for that call only:

    - ``lm_head`` (``from_logits=False``): keeps the last hidden states and gives HF an empty tensor for
      the logits, so the returned ``logits`` is None: no ``[B, T, V]`` tensor is made;
    - ``loss_function``: keeps HF's arguments (labels, ``num_items_in_batch``, ...) and returns 0, to
      which HF's MoE forwards add ``router_aux_loss_coef * aux_loss`` as they do to their loss.

    Then the loss is added: :func:`causal_lm_loss` on the kept hidden states, with the logit transforms
    of HF's forward (:func:`head_facts`: ``logit_scale``, ``lm_head_multiplier``, ``logits_scaling``
    folded into the hidden states as ``x * scale``, which in bf16 rounds x once;
    ``final_logit_softcapping`` as ``softcap``) and the lm_head's weight (PEFT heads:
    :func:`head_operands`); or, ``from_logits=True``, :func:`causal_lm_loss_from_logits` on HF's logits
    (returned). The sum equals HF's ``loss + coef * aux_loss`` bit for bit in its order of terms.

    Otherwise (eval, ``torch.no_grad``, no labels, ``logits_to_keep`` set) HF's forward runs unchanged:
    evaluation and prediction get HF's logits and loss. So does a model whose loss fuselm cannot take
    over (another lm_head, a ``loss_function`` of the user's), with a one-time warning saying why.
    Training without labels (Trainer's label smoother pops them) warns once: the full logits are made for
    a loss computed outside the model.
    """
    facts = head_facts(original)
    from_logits, smoothing, memory = options.from_logits, options.label_smoothing, options.memory
    accum_dtype = options.accum_dtype

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        call = _call_args(original, self, args, kwargs)
        labels, shift_labels = call.get("labels"), call.get("shift_labels")
        training = self.training and torch.is_grad_enabled()
        if training and labels is None and shift_labels is None:
            warn_once(
                "no-labels",
                f"fuselm.hf: {type(self).__name__} is training without labels, so its full logits are "
                "made for a loss computed outside the model (e.g. Trainer's label_smoothing_factor): pass "
                "the labels instead, with fuselm.hf.patch(model, label_smoothing=...) for label smoothing",
            )
        if (
            not training
            or (labels is None and shift_labels is None)
            or not _keeps_all(call.get("logits_to_keep", 0))
        ):
            return original(self, *args, **kwargs)
        name = operands = None
        reason = _fallback_reason(self, facts)
        if reason is None and not from_logits:
            name = _head_name(self)
            operands = head_operands(self._modules[name]) if name else "no lm_head among the model's children"
            reason = operands if isinstance(operands, str) else None
        if reason is not None:
            warn_once(
                f"fallback:{reason}",
                f"fuselm.hf: {reason}, so {type(self).__name__}'s loss is HF's, on the full logits "
                "(fuselm fuses it for an nn.Linear lm_head, PEFT's modules_to_save and LoRA)",
            )
            return original(self, *args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        if labels is None:  # shift_labels alone: HF computes a loss only when it sees labels
            kwargs["labels"] = shift_labels
        seen = {}

        def loss_function(logits, labels=None, vocab_size=None, **loss_kwargs):
            seen.update(loss_kwargs, labels=labels)
            return torch.zeros((), dtype=torch.float32, device=logits.device)

        head = self._modules[name] if name else None
        capture = _HiddenCapture() if name else None
        if name:
            self._modules[name] = capture
        self.__dict__["_loss_function"] = loss_function
        try:
            out = original(self, *args, return_dict=True, **kwargs)
        finally:
            del self.__dict__["_loss_function"]
            if name:
                self._modules[name] = head
        loss_kwargs = dict(
            shift_labels=seen.get("shift_labels"),
            num_items_in_batch=seen.get("num_items_in_batch"),
            ignore_index=seen.get("ignore_index", -100),
            label_smoothing=smoothing,
        )
        if from_logits:
            loss = causal_lm_loss_from_logits(out.logits, seen["labels"], **loss_kwargs)
            return _finish(out, out.loss + loss, out.logits, return_dict)
        x, weight, bias = operands(capture.hidden)
        scale, softcap = _logit_scale_and_softcap(self.config, facts.transforms)
        if scale != 1.0:
            x = x * scale
            bias = bias * scale if bias is not None else None
        loss = causal_lm_loss(
            x,
            weight,
            seen["labels"],
            bias=bias,
            softcap=softcap,
            memory=memory,
            accum_dtype=accum_dtype,
            **loss_kwargs,
        )
        return _finish(out, out.loss + loss, None, return_dict)

    owner = original.__qualname__.split(".")[0]
    forward.__qualname__ = f"fuselm_{owner}.forward" + ("[logits]" if from_logits else "")
    return forward


def _finish(out, loss, logits, return_dict: bool):
    """HF's output with fuselm's loss (HF's ``loss + coef * aux_loss`` order: ``aux + loss``) and logits."""
    out = dataclasses.replace(out, loss=loss, logits=logits)
    return out if return_dict else out.to_tuple()


def _keeps_all(logits_to_keep) -> bool:
    """HF's ``logits_to_keep`` default (0 = every position)."""
    return isinstance(logits_to_keep, int) and logits_to_keep == 0
