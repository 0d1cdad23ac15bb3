"""Input guards: every bad argument raises ValueError naming it."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .dispatch import validate_enabled

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
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
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


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [rows, C] with unit column stride; copies only when no strided view exists."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: C may be 0 (an empty vocabulary shard)
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


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


def check_loss_args(
    input: torch.Tensor,
    target: object,
    n_classes: int,
    *,
    weight: object,
    ignore_index: object,
    reduction: object,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> None:
    """The checks every cross-entropy-like op shares (each ValueError names its argument); under
    FUSELM_VALIDATE=1 also the target range (a host sync)."""
    check_tensor("target", target, dtypes=(torch.int64, torch.int32), device=input.device)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target must have shape input.shape[:-1] = {tuple(input.shape[:-1])}, got {tuple(target.shape)}"
        )
    if weight is not None:
        check_tensor("weight", weight, dtypes=(*FLOAT_DTYPES, torch.float64), ndim=1, device=input.device)
        if weight.shape[0] != n_classes:
            raise ValueError(
                f"weight must have shape [{n_classes}] (one per class), got {tuple(weight.shape)}"
            )
    check_choice("reduction", reduction, ("mean", "sum", "none"))
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if validate_enabled():
        check_target_range(target, n_classes, ignore_index)


def resolve_loss_dtype(loss_dtype, input: torch.Tensor) -> torch.dtype:
    """The dtype a loss is returned in: ``loss_dtype`` (a floating dtype) or, when None, the input's."""
    if loss_dtype is None:
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
