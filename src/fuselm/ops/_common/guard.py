"""Input guards: every bad argument raises ValueError naming it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    min_ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        if t.dtype not in dtypes:
            dtypes = tuple(dtypes)
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            got = str(t.dtype).replace("torch.", "")
            raise ValueError(f"{name} must have dtype in ({allowed}), got {got}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the input, got {t.device}")
    return t


def cast_for_autocast(device_type: str, *tensors) -> tuple[tuple, bool]:
    """(the operands as ``nn.Linear`` sees them under autocast on ``device_type``: floating tensors in the
    autocast dtype, anything else as it is for the argument checks to name; whether autocast is on). The
    operands come back unchanged when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return tensors, False
    dtype = torch.get_autocast_dtype(device_type)
    cast = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)
    return cast, True


def check_number(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a Python float: a finite real number (> 0 with ``positive``), else ValueError naming
    ``name``.

    Example:
        >>> check_number("temperature", 2, positive=True)
        2.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars too
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (value == value and abs(value) != float("inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_classes(name: str, n_classes: int) -> None:
    """ValueError naming ``name`` (what holds the classes: the logits, the lm_head rows, their shards)
    unless there is at least one class."""
    if n_classes == 0:
        raise ValueError(f"{name} holds no class (at least one is needed)")


def check_target(target: object, input: torch.Tensor) -> None:
    """ValueError naming target unless it holds int32 / int64 class indices of shape ``input.shape[:-1]``
    on input's device."""
    check_tensor("target", target, dtypes=(torch.int64, torch.int32), device=input.device)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        expected = tuple(input.shape[:-1])
        raise ValueError(f"target must have shape input.shape[:-1] = {expected}, got {tuple(target.shape)}")


def check_bool(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is a bool (a flag: no truthy stand-ins)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_chunk_rows(name: str, value: object) -> None:
    """A chunk size of rows (tokens): None or an int >= 1, else ValueError naming ``name``.

    Example:
        >>> check_chunk_rows("chunk_rows", 0)
        Traceback (most recent call last):
        ...
        ValueError: chunk_rows must be None or an int >= 1, got 0
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [rows, C] with unit column stride; copies only when no strided view exists (a 2-D
    tensor with unit column stride is returned as it is)."""
    t2 = t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # C may be 0: not -1
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def launch_rows(t: torch.Tensor) -> torch.Tensor:
    """t as a row launcher takes it: itself when it is [N, C] with unit column stride (rows may be
    strided) or contiguous of any shape (rows of its last dimension, no view made: host time), else its
    rows_view."""
    if t.is_contiguous() or (t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1)):
        return t
    return rows_view(t)


def rows_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, C) of a tensor taken by launch_rows."""
    n_cols = t.shape[-1]
    return (t.numel() // n_cols if n_cols else 0), n_cols


def row_stride(t: torch.Tensor) -> int:
    """The row stride of a tensor taken by launch_rows: its own in 2-D, C when contiguous of another
    rank."""
    return t.stride(0) if t.dim() == 2 else t.shape[-1]


class TargetRangeError(ValueError):
    """A target outside ``[0, n_classes)`` that is not ``ignore_index`` (``value``: the first such one)."""

    def __init__(self, value: int, n_classes: int, ignore_index: int):
        self.value, self.n_classes, self.ignore_index = value, n_classes, ignore_index
        super().__init__(
            f"target holds {value}, outside [0, {n_classes}) and not ignore_index={ignore_index}"
        )


def bad_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    """Bool mask of the targets outside [0, n_classes) that are not ignore_index (no sync)."""
    return (target != ignore_index) & ((target < 0) | (target >= n_classes))


def raise_target_range(target: torch.Tensor, bad: torch.Tensor, n_classes: int, ignore_index: int):
    """Raise TargetRangeError for the first bad target (syncs: for the error path only)."""
    value = int(target[bad].reshape(-1)[0].item())
    raise TargetRangeError(value, n_classes, ignore_index)


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise TargetRangeError (a ValueError) if a target is outside [0, n_classes) and not ignore_index.
    It costs a host sync, so the ops call it only under FUSELM_VALIDATE=1."""
    bad = bad_targets(target, n_classes, ignore_index)
    if bool(bad.any()):
        raise_target_range(target, bad, n_classes, ignore_index)


def resolve_loss_dtype(loss_dtype, input: torch.Tensor) -> torch.dtype:
    """The dtype a loss is returned in: ``loss_dtype`` (a floating dtype) or, when None, the input's, or
    float32 when autocast is on for the input's device (as torch's cross-entropy losses, on autocast's
    float32 list, return; float64 stays)."""
    if loss_dtype is None:
        if input.dtype != torch.float64 and torch.is_autocast_enabled(input.device.type):
            return torch.float32
        return input.dtype
    if not (isinstance(loss_dtype, torch.dtype) and loss_dtype.is_floating_point):
        raise ValueError(f"loss_dtype must be a floating torch.dtype or None, got {loss_dtype!r}")
    return loss_dtype


def validate_memory(memory) -> None:
    """The ``memory=`` argument of the fused linear ops: "auto", "min" or a positive int (bytes)."""
    if memory in ("auto", "min"):
        return
    if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0:
        return
    raise ValueError(f"memory must be 'auto', 'min' or a positive int (bytes), got {memory!r}")


def linear_operands(input, linear_weight, linear_bias, dtypes):
    """(input, linear_weight, linear_bias) after autocast (cast to the autocast dtype, as F.linear would),
    checked: input of one of `dtypes`, linear_weight [V, H] and linear_bias [V] of its dtype and device."""
    check_tensor("input", input, dtypes=dtypes, min_ndim=1)
    device = input.device
    if torch.is_autocast_enabled(device.type) and input.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device.type)
        input, linear_weight = input.to(dtype), linear_weight.to(dtype)
        linear_bias = linear_bias.to(dtype) if linear_bias is not None else None
    check_tensor("linear_weight", linear_weight, ndim=2, device=device)
    if linear_weight.dtype != input.dtype:
        raise ValueError(
            f"linear_weight must have the dtype of input ({input.dtype}), got {linear_weight.dtype}"
        )
    h = input.shape[-1]
    v = linear_weight.shape[0]
    if linear_weight.shape[1] != h:
        raise ValueError(
            f"linear_weight must have shape [V, {h}] (input's last dim), got {tuple(linear_weight.shape)}"
        )
    if linear_bias is not None:
        check_tensor("linear_bias", linear_bias, ndim=1, device=device)
        if linear_bias.dtype != input.dtype:
            raise ValueError(
                f"linear_bias must have the dtype of input ({input.dtype}), got {linear_bias.dtype}"
            )
        if linear_bias.shape[0] != v:
            raise ValueError(f"linear_bias must have shape [{v}], got {tuple(linear_bias.shape)}")
    return input, linear_weight, linear_bias


def refuse_double_backward(op: str, why: str, instead: str) -> None:
    """Call at the top of an autograd backward whose gradients autograd cannot differentiate again (fused
    kernels, chunks recomputed without a graph): grad mode is on there exactly when the backward runs with
    ``create_graph=True``, and the second-order terms would be silently missing. RuntimeError naming the op,
    ``why`` its backward is not differentiable, and what to use ``instead``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"fuselm.{op}: double backward (create_graph=True) is not supported: its backward ({why}) is not "
            f"differentiable; for higher-order gradients use {instead}"
        )
