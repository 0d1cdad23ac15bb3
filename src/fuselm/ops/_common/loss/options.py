"""The options of the cross-entropy family, as one object from a public function down to the launchers."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dispatch import validate_enabled
from ..guard import FLOAT_DTYPES, check_choice, check_number, check_target, check_target_range, check_tensor


class LossOptions(NamedTuple):
    """What a loss of the family computes per row, besides the logits and the targets.

    Per row with logits x, target t: ``z = transform(x)`` (``softcap * tanh(x * logit_scale / softcap) /
    temperature``; without softcap ``x * logit_scale / temperature``), then the cross-entropy of z with
    class weights, label smoothing and z-loss (ops/cross_entropy/README.md), times the token's weight.
    ``softcap`` 0 means none, ``weight`` (class weights [V]) and ``token_weights`` (one per row [N]) None
    mean ones. Launchers take the object whole; an autograd Function takes its tensors at the top level
    (:meth:`tensors`, :meth:`with_tensors`), a torch.library custom op takes every field by name
    (:meth:`op_kwargs`).

    Example:
        >>> opts = LossOptions.of(label_smoothing=0.1, softcap=None)
        >>> opts.softcap, opts.has_smoothing
        (0.0, True)
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0
    logit_scale: float = 1.0
    temperature: float = 1.0
    weight: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        weight=None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        token_weights=None,
        *,
        logit_scale: float = 1.0,
        temperature: float = 1.0,
    ) -> LossOptions:
        """The options, checked (each ValueError names its argument: every float a finite number in its
        range), with Python floats (softcap None -> 0.0) and a contiguous weight; weight and token_weights
        are checked against the input by :meth:`checked`. The first seven come in the order of the
        family's public signatures, so that a public function passes its own along in one line."""
        check_choice("reduction", reduction, ("mean", "sum", "none"))
        label_smoothing = check_number("label_smoothing", label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        z_loss = check_number("z_loss", z_loss)
        if z_loss < 0:
            raise ValueError(f"z_loss must be >= 0, got {z_loss}")
        if softcap is not None:
            softcap = check_number("softcap", softcap, positive=True)
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise ValueError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
        return cls(
            ignore_index,
            reduction,
            label_smoothing,
            z_loss,
            softcap or 0.0,
            check_number("logit_scale", logit_scale),
            check_number("temperature", temperature, positive=True),
            weight.contiguous() if isinstance(weight, torch.Tensor) else weight,
            token_weights,
        )

    def tensors(self) -> tuple:
        """(weight, token_weights)."""
        return self.weight, self.token_weights

    def with_tensors(self, weight, token_weights) -> LossOptions:
        """The same options with these tensors (self when they are already these). (Built from the fields:
        NamedTuple._replace does not survive a graph break under torch 2.11's dynamo.)"""
        if weight is self.weight and token_weights is self.token_weights:
            return self
        return LossOptions(*(getattr(self, name) for name in SCALAR_FIELDS), weight, token_weights)

    def for_rows(self, rows) -> LossOptions:
        """The options of some rows (a slice or int64 indices): token_weights follow the rows."""
        if self.token_weights is None:
            return self
        picked = (
            self.token_weights[rows] if isinstance(rows, slice) else self.token_weights.index_select(0, rows)
        )
        return self.with_tensors(self.weight, picked)

    def op_kwargs(self, tensors: bool = True) -> dict:
        """Every field by name (without weight and token_weights when not ``tensors``): the keyword
        arguments of the family's torch.library custom ops (:func:`family_custom_op`, whose schemas carry
        the fields' names; :func:`options_of` reads them back)."""
        names = LossOptions._fields if tensors else SCALAR_FIELDS
        return {name: getattr(self, name) for name in names}

    @property
    def has_smoothing(self) -> bool:
        return self.label_smoothing > 0

    def checked(self, input: torch.Tensor, target: object, n_classes: int) -> LossOptions:
        """The options after the checks of target, weight and token_weights against the input (each
        ValueError names its argument; under FUSELM_VALIDATE=1 also the target range, a host sync), with
        token_weights as one contiguous row [N]. ``input`` [..., C] gives the device and the target shape
        ``input.shape[:-1]``."""
        check_target(target, input)
        weight = self.weight
        if weight is not None:
            check_tensor("weight", weight, dtypes=(*FLOAT_DTYPES, torch.float64), ndim=1, device=input.device)
            if weight.shape[0] != n_classes:
                raise ValueError(
                    f"weight must have shape [{n_classes}] (one per class), got {tuple(weight.shape)}"
                )
        token_weights = self.token_weights
        if token_weights is not None:
            check_tensor(
                "token_weights", token_weights, dtypes=(*FLOAT_DTYPES, torch.float64), device=input.device
            )
            if tuple(token_weights.shape) != tuple(target.shape):
                raise ValueError(
                    f"token_weights must have the shape of target {tuple(target.shape)}, "
                    f"got {tuple(token_weights.shape)}"
                )
            if token_weights.requires_grad:
                raise ValueError("token_weights must not require grad (no gradient flows to them): detach it")
            token_weights = token_weights.reshape(-1).contiguous()
        if validate_enabled():
            check_target_range(target, n_classes, self.ignore_index)
        return self.with_tensors(weight, token_weights)


TENSOR_FIELDS = ("weight", "token_weights")
SCALAR_FIELDS = tuple(name for name in LossOptions._fields if name not in TENSOR_FIELDS)
# the flags of a family op that say which gradients of (input, weight, bias) are wanted
NEEDS_SCHEMA = "bool need_dx, bool need_dw, bool need_db"
# a torch.library schema type per annotation of a scalar field (a new scalar option needs one of these)
_SCHEMA_TYPES = {"int": "int", "str": "str", "float": "float", "bool": "bool"}


def scalar_options_schema() -> str:
    """The scalar fields of LossOptions as torch.library schema arguments, in field order.

    Example:
        >>> scalar_options_schema().split(", ")[:2]
        ['int ignore_index', 'str reduction']
    """
    return fields_schema(LossOptions, SCALAR_FIELDS)


def fields_schema(cls: type, fields: tuple[str, ...] | None = None) -> str:
    """Fields (default: all) of a NamedTuple of ints, floats, strs and bools as torch.library schema
    arguments, in field order: how the family's custom ops take LossOptions and the ops' plans (a plan is
    such a NamedTuple; the ops pass it as ``plan._asdict()`` and read it back with :func:`from_named`).

    Example:
        >>> class Slabs(NamedTuple):
        ...     budget: int
        ...     exact: bool
        >>> fields_schema(Slabs)
        'int budget, bool exact'
    """
    return ", ".join(f"{_SCHEMA_TYPES[_annotation(cls, n)]} {n}" for n in fields or cls._fields)


def from_named(cls: type, named: dict):
    """The NamedTuple ``cls`` of a custom op's keyword arguments (its fields by name; others ignored)."""
    return cls(*(named[name] for name in cls._fields))


def _annotation(cls: type, field: str) -> str:
    """A field's annotation as written ("int"): a string, a ForwardRef or a type, by Python version."""
    a = cls.__annotations__[field]
    return a if isinstance(a, str) else getattr(a, "__forward_arg__", None) or a.__name__


def family_custom_op(
    qualname: str,
    *,
    tensors: str,
    returns: str,
    after: str = "",
    flags: str = "",
    option_tensors: bool = True,
    scales: bool = True,
    mutates_args: tuple[str, ...] = (),
):
    """A decorator making a torch.library custom op of the family whose schema is derived from LossOptions:
    ``(<tensors>[, Tensor? weight, Tensor? token_weights][, Tensor? weight_sum, Tensor grad_scale][,
    <after>], <every scalar field>[, <flags>]) -> <returns>``. The function and its fake
    (:func:`family_fake`) get the tensors positionally and the scalars and flags as keyword arguments
    (``**named``), however the op was called (inductor passes every argument positionally): a new scalar
    option is a new LossOptions field, and every op of the family takes it (read it with
    :func:`options_of`). ``tensors``, ``after``, ``flags``: schema arguments (``"Tensor x, Tensor w"``;
    mutated ones marked ``Tensor(a!)`` and named in ``mutates_args``).

    Example:
        >>> @family_custom_op("fuselm_doc::rows", tensors="Tensor logits", returns="Tensor")
        ... def rows(logits, weight, token_weights, weight_sum, grad_scale, **named):
        ...     return logits * options_of(named, weight, token_weights).label_smoothing
        >>> rows(torch.ones(2), None, None, None, torch.ones(1), **LossOptions().op_kwargs(tensors=False))
        tensor([0., 0.])
    """
    parts = [tensors]
    if option_tensors:
        parts.append("Tensor? weight, Tensor? token_weights")
    if scales:
        parts.append("Tensor? weight_sum, Tensor grad_scale")
    if after:
        parts.append(after)
    parts += [p for p in (scalar_options_schema(), flags) if p]
    arguments = ", ".join(parts)
    names = [a.strip().rsplit(" ", 1)[1] for a in arguments.split(",")]
    n_tensors = sum(1 for a in arguments.split(",") if a.strip().startswith("Tensor"))

    def decorate(fn):
        op = torch.library.custom_op(
            qualname, mutates_args=mutates_args, schema=f"({arguments}) -> {returns}"
        )(_by_name(fn, names, n_tensors))
        op.fuselm_signature = (names, n_tensors)  # for family_fake
        return op

    return decorate


def family_fake(op):
    """Register the fake of a :func:`family_custom_op` (called as the op's function is)."""
    names, n_tensors = op.fuselm_signature

    def register(fn):
        op.register_fake(_by_name(fn, names, n_tensors))
        return fn

    return register


def _by_name(fn, names: list[str], n_tensors: int):
    """fn(*tensors, **scalars) from a call with the schema's arguments, positional or by name."""

    def call(*args, **kwargs):
        bound = dict(zip(names, args, strict=False))  # the leading ones positional
        bound.update(kwargs)
        values = [bound.pop(name) for name in names[:n_tensors]]
        return fn(*values, **bound)

    return call


def options_of(named: dict, weight=None, token_weights=None) -> LossOptions:
    """The LossOptions of a family custom op's keyword arguments (its scalars by field name) and its
    option tensors."""
    return from_named(LossOptions, {**named, "weight": weight, "token_weights": token_weights})


class LossScales(NamedTuple):
    """Device scalars the row kernels read (fp32 [1] each): the sum of the class weights (label smoothing
    with class weights only, else None) and the gradient scale (1 / the mean's denominator, else 1)."""

    weight_sum: torch.Tensor | None
    grad_scale: torch.Tensor

    def op_kwargs(self) -> dict:
        """Both scalars by name, as the family's custom ops take them."""
        return {"weight_sum": self.weight_sum, "grad_scale": self.grad_scale}


def loss_scales(target: torch.Tensor, opts: LossOptions, n_classes: int) -> LossScales:
    """The LossScales of target [N] (global class ids), computed without a host sync: "mean" divides by
    the number of non-ignored targets, or by the sum of their class weights."""
    valid = target != opts.ignore_index
    weight = opts.weight
    weight_sum = None
    if weight is not None:
        t_safe = torch.where(valid & (target >= 0) & (target < n_classes), target, 0)
        w_t = torch.where(valid, weight.float()[t_safe], 0.0)
        weight_sum = weight.float().sum().reshape(1) if opts.has_smoothing else None
    if opts.reduction == "mean":
        denom = w_t.sum() if weight is not None else valid.sum(dtype=torch.float32)
        return LossScales(weight_sum, denom.reciprocal().reshape(1))
    return LossScales(weight_sum, torch.ones(1, dtype=torch.float32, device=target.device))


class Extras(NamedTuple):
    """Which extra outputs a public loss returns, after the loss, in this order."""

    lse: bool = False
    z_loss: bool = False
    token_accuracy: bool = False
    predicted_tokens: bool = False

    @property
    def argmax(self) -> bool:
        """Are the predicted tokens (each row's argmax) needed?"""
        return self.token_accuracy or self.predicted_tokens


def loss_outputs(
    loss, lse, target, opts: LossOptions, loss_dtype, extras: Extras, z_loss=None, predicted=None
):
    """What the public losses return: ``loss`` in loss_dtype (per token in the target's shape for
    reduction "none"), then as ``extras`` asks: ``lse`` (fp32, target's shape), the z-loss value (given,
    reduced as the loss, in loss_dtype, detached), the token accuracy (token_accuracy, from ``predicted``)
    and the predicted tokens (``predicted``: int64 [N], each row's argmax, -1 on ignored tokens). One
    tensor alone, else a tuple in that order."""
    target_shape = target.shape
    if loss.dtype != loss_dtype:
        loss = loss.to(loss_dtype)
    if opts.reduction == "none":
        loss = loss.reshape(target_shape)
    per_token = opts.reduction == "none"
    out = [loss]
    if extras.lse:
        out.append(lse.reshape(target_shape))
    if extras.z_loss:
        z_loss = z_loss.to(loss_dtype)
        out.append(z_loss.reshape(target_shape) if per_token else z_loss)
    if extras.token_accuracy:
        accuracy = token_accuracy(predicted, target.reshape(-1), opts)
        out.append(accuracy.reshape(target_shape) if per_token else accuracy)
    if extras.predicted_tokens:
        out.append(predicted.reshape(target_shape))
    return out[0] if len(out) == 1 else tuple(out)


def token_accuracy(predicted, target, opts: LossOptions):
    """Whether each non-ignored token's argmax is its target, reduced as the loss but without class or
    token weights: "mean" the fraction of non-ignored tokens predicted right (NaN when there are none),
    "sum" their number, "none" 1.0 / 0.0 per token (0 for ignored ones). fp32, no gradient."""
    valid = target != opts.ignore_index
    right = ((predicted == target) & valid).float()
    if opts.reduction == "none":
        return right
    if opts.reduction == "sum":
        return right.sum()
    return right.sum() / valid.sum()


def reduce_rows(loss: torch.Tensor, opts: LossOptions, scales: LossScales) -> torch.Tensor:
    """Per-row losses (fp32) reduced as opts.reduction asks ("none": unchanged)."""
    if opts.reduction == "sum":
        return loss.sum()
    if opts.reduction == "mean":
        return loss.sum() * scales.grad_scale[0]
    return loss
