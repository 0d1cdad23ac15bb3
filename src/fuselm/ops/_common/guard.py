"""Input guards: every bad argument raises ValueError naming it."""

from __future__ import annotations

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
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise ValueError if a target is outside [0, n_classes) and not ignore_index. It costs a host
    sync, so the ops call it only under FUSELM_VALIDATE=1."""
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        value = target[bad].reshape(-1)[0].item()
        raise ValueError(
            f"target holds {value}, outside [0, {n_classes}) and not ignore_index={ignore_index}"
        )
