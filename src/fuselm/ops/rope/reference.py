"""Pure-PyTorch rotary position embedding: the spec, the CPU fallback, the test oracle and the
benchmark baseline.

Hugging Face's convention (``rotate_half``, the one of Llama, Mistral, Qwen, Gemma...): with ``R`` the
rotary width (``cos.shape[-1]``, even, at most the head dim ``D``), every head ``x`` of q and k becomes

    x_rot, x_pass = x[..., :R], x[..., R:]
    rotate_half([x1, x2]) = [-x2, x1]                (x1, x2: the two halves of x_rot, R/2 each)
    out = cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass])

with ``cos``/``sin`` those of the token's position (the same for every head). ``R == D`` is the usual
full rotary; ``R < D`` is partial rotary (GPT-NeoX, Phi, StableLM): the last ``D - R`` columns pass
through unchanged.

Where cos/sin come from:

- ``position_ids=None``: ``cos``/``sin`` as Hugging Face's rotary embedding returns them, ``[B, T, R]``
  (or ``[1, T, R]`` / ``[T, R]``, broadcast over the batch; a 4-D ``[B, 1, T, R]`` already unsqueezed
  on the head axis is accepted too).
- ``position_ids`` ``[B, T]`` (or ``[1, T]`` / ``[T]``): ``cos``/``sin`` are tables ``[max_pos, R]``
  (or ``[1, max_pos, R]``) indexed by it. A position outside ``[0, max_pos)`` gives that token NaN in
  its rotary columns (no error, no host sync, never an out-of-bounds read); ``FUSELM_VALIDATE=1``
  raises ValueError instead.
"""

from __future__ import annotations

import torch

from .._common.dispatch import validate_enabled
from .._common.guard import FLOAT_DTYPES, check_choice, check_tensor

LAYOUTS = ("bhtd", "bthd")
TABLE_DTYPES = (*FLOAT_DTYPES, torch.float64)
POSITION_DTYPES = (torch.int64, torch.int32)


def head_axis(layout: str) -> int:
    """Axis of the heads in q/k: 1 for ``"bhtd"`` ([B, heads, T, D]), 2 for ``"bthd"``."""
    return 1 if layout == "bhtd" else 2


def check_qk(q: object, k: object, layout: object) -> tuple[int, int, int, int, int]:
    """Validate q, k and layout (ValueError naming the argument); return (B, T, Hq, Hk, D)."""
    check_choice("layout", layout, LAYOUTS)
    check_tensor("q", q, dtypes=TABLE_DTYPES, ndim=4)
    check_tensor("k", k, dtypes=TABLE_DTYPES, ndim=4, device=q.device)
    if k.dtype != q.dtype:
        raise ValueError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    h = head_axis(layout)
    t_axis = 3 - h
    b, t, d = q.shape[0], q.shape[t_axis], q.shape[3]
    if (k.shape[0], k.shape[t_axis], k.shape[3]) != (b, t, d):
        want = "[B, Hk, T, D]" if layout == "bhtd" else "[B, T, Hk, D]"
        raise ValueError(
            f"k must have shape {want} with q's B={b}, T={t}, D={d} (layout={layout!r}), got {tuple(k.shape)}"
        )
    return b, t, q.shape[h], k.shape[h], d


def broadcast_tables(
    cos: object,
    sin: object,
    position_ids: object,
    batch: int,
    seq_len: int,
    head_dim: int,
    layout: str,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate cos/sin/position_ids (ValueError naming the argument) and bring them to one form, views
    only (no copy):

    - ``position_ids is None``: ``(cos [B, T, R], sin [B, T, R], None)``, broadcast dims with stride 0;
    - else: ``(cos [P, R], sin [P, R], position_ids [B, T])``, the last possibly with stride 0.
    """
    check_tensor("cos", cos, dtypes=TABLE_DTYPES, device=device)
    check_tensor("sin", sin, dtypes=TABLE_DTYPES, device=device)
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    shape = tuple(cos.shape)
    if position_ids is None:
        if cos.dim() == 4:
            axis = head_axis(layout)
            if cos.shape[axis] != 1:
                raise ValueError(
                    f"cos of 4 dimensions must have size 1 on the head axis {axis} (layout={layout!r}), "
                    f"got {shape}"
                )
            cos, sin = cos.squeeze(axis), sin.squeeze(axis)
        elif cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
            raise ValueError(
                f"cos must have shape [B, T, R], [1, T, R] or [T, R] with B={batch}, T={seq_len} "
                f"(or pass position_ids to index a [max_pos, R] table), got {shape}"
            )
        rot = cos.shape[-1]
        cos, sin = cos.expand(batch, seq_len, rot), sin.expand(batch, seq_len, rot)
    else:
        check_tensor("position_ids", position_ids, dtypes=POSITION_DTYPES, device=device)
        if cos.dim() == 3 and cos.shape[0] == 1:
            cos, sin = cos[0], sin[0]
        if cos.dim() != 2:
            raise ValueError(
                f"cos must be a table [max_pos, R] (or [1, max_pos, R]) with position_ids, got {shape}"
            )
        pos = position_ids
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.dim() != 2 or pos.shape[0] not in (1, batch) or pos.shape[1] != seq_len:
            raise ValueError(
                f"position_ids must have shape [B, T], [1, T] or [T] with B={batch}, T={seq_len}, "
                f"got {tuple(position_ids.shape)}"
            )
        position_ids = pos.expand(batch, seq_len)
        rot = cos.shape[-1]
        if validate_enabled():
            check_position_range(position_ids, cos.shape[0])
    if rot % 2 != 0 or not 2 <= rot <= head_dim:
        raise ValueError(
            f"cos must have an even last dimension R (the rotary width) in [2, head_dim={head_dim}], "
            f"got {shape}"
        )
    return cos, sin, position_ids


def check_position_range(position_ids: torch.Tensor, n_pos: int) -> None:
    """Raise ValueError if a position is outside [0, n_pos). Costs a host sync (FUSELM_VALIDATE=1 only)."""
    bad = (position_ids < 0) | (position_ids >= n_pos)
    if bool(bad.any()):
        value = position_ids[bad].reshape(-1)[0].item()
        raise ValueError(f"position_ids holds {value}, outside [0, {n_pos}) (the rows of cos/sin)")


def gather_tables(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [P, R] at position_ids [B, T] -> [B, T, R]; NaN rows at out-of-range positions."""
    n_pos = cos.shape[0]
    ok = (position_ids >= 0) & (position_ids < n_pos)
    idx = torch.where(ok, position_ids, torch.zeros_like(position_ids)).long()
    nan = torch.tensor(float("nan"), dtype=cos.dtype, device=cos.device)
    return torch.where(ok[..., None], cos[idx], nan), torch.where(ok[..., None], sin[idx], nan)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension (Hugging Face's rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    layout: str = "bhtd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in fp32 (fp64 for fp64 q), outputs in q's dtype; differentiable in q, k, cos and sin.

    Arguments as :func:`fuselm.apply_rotary`. In fp32 this is Hugging Face's ``apply_rotary_pos_emb``
    operation for operation (so bit-for-bit equal to it with fp32 cos/sin).
    """
    batch, seq_len, _, _, head_dim = check_qk(q, k, layout)
    cos, sin, position_ids = broadcast_tables(
        cos, sin, position_ids, batch, seq_len, head_dim, layout, q.device
    )
    if position_ids is not None:
        cos, sin = gather_tables(cos, sin, position_ids)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    axis = head_axis(layout)
    cos = cos.to(compute).unsqueeze(axis)  # [B, 1, T, R] or [B, T, 1, R]
    sin = sin.to(compute).unsqueeze(axis)
    rot = cos.shape[-1]

    def embed(x: torch.Tensor) -> torch.Tensor:
        x = x.to(compute)
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        out = (x_rot * cos) + (rotate_half(x_rot) * sin)
        if x_pass.shape[-1]:
            out = torch.cat((out, x_pass), dim=-1)
        return out

    return embed(q).to(q.dtype), embed(k).to(k.dtype)
