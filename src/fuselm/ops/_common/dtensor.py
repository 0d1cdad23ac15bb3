"""DTensor inputs to the row-wise block ops (rms_norm, layer_norm, swiglu / geglu, apply_rotary).

These ops compute each row (or each head) on its own, so a DTensor whose shards split only the
dimensions the op does not reduce over is computed exactly by running the op on each rank's local
tensor and wrapping the result with the same mesh and placements: no communication. The operands that
every row reads (a norm's weight and bias, rotary tables) must be whole on every rank (a plain tensor
or a Replicate() DTensor). Anything else raises ValueError saying what to pass.

Gradients flow through ``DTensor.to_local`` / ``DTensor.from_local``: a row input's gradient has the
input's placements; a replicated DTensor operand's gradient is ``Partial()`` on the mesh dimensions
where the rows are sharded (each rank holds its rows' share of the sum) and ``Replicate()`` elsewhere.
A plain-tensor operand gets this rank's share only, as any plain tensor used by local code does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _find_dtensor_type():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - an old PyTorch
        return None
    return DTensor


_UNSET = object()
_DTENSOR = _UNSET  # found at the first call (importing torch.distributed.tensor takes time)


def _dtensor_type():
    """DTensor's class, or None. A module global rather than a cached function: torch.compile reads it
    while tracing (it would trace through a cache, with a warning at every compile)."""
    global _DTENSOR
    if _DTENSOR is _UNSET:
        _DTENSOR = _find_dtensor_type()
    return _DTENSOR


def has_dtensor(*tensors: object) -> bool:
    """Is any argument a DTensor? (cheap: a class test per argument, isinstance for subclasses)."""
    cls = _dtensor_type()
    if cls is None:
        return False
    for t in tensors:
        if t is not None and t.__class__ is not torch.Tensor and isinstance(t, cls):
            return True
    return False


def _global_stride(shape: tuple[int, ...], local: torch.Tensor) -> tuple[int, ...]:
    """Dense strides for shape, in the memory order of the local tensor (a transposed view stays so)."""
    order = sorted(range(len(shape)), key=lambda d: (-local.stride(d), d))
    stride, step = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = step
        step *= max(shape[d], 1)
    return tuple(stride)


def run_local(
    op: str,
    fn: Callable[..., object],
    rows: dict[str, object],
    whole: dict[str, object],
    *,
    shardable: Callable[[int, int], bool],
    hint: str,
    like: tuple[str, ...] | None = None,
):
    """Run ``fn(**local tensors)`` on this rank's shards and wrap its outputs as DTensors.

    rows: the row inputs (None entries are skipped); the first is the lead: every other one must be a
    DTensor on its mesh with its placements. ``shardable(dim, ndim)`` says whether a row input may be
    sharded on that (non-negative) dimension; ``hint`` ends the ValueError otherwise. whole: operands
    every row reads (None, plain tensors or Replicate() DTensors on the same mesh). like: for each
    output, the row input whose global shape it has on its sharded dimensions (default: the lead).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    present = {k: v for k, v in rows.items() if v is not None}
    lead_name = next((k for k, v in present.items() if isinstance(v, DTensor)), None)
    if lead_name is None:
        bad = next(k for k, v in whole.items() if isinstance(v, DTensor))
        raise ValueError(
            f"{op}: {bad} is a DTensor but {next(iter(present))} is not: pass {bad}.full_tensor() "
            f"(or {bad}.to_local() if it is replicated), or make the inputs DTensors"
        )
    lead = present[lead_name]
    mesh, placements = lead.device_mesh, tuple(lead.placements)
    for name, t in present.items():
        if not isinstance(t, DTensor) or t.device_mesh != mesh or tuple(t.placements) != placements:
            got = f"placements {tuple(t.placements)}" if isinstance(t, DTensor) else "a plain tensor"
            raise ValueError(
                f"{op}: {name} must be a DTensor on {lead_name}'s mesh with its placements {placements}, "
                f"got {got}; redistribute it, or pass .to_local() of every input"
            )
        for p in t.placements:
            if isinstance(p, Shard):
                dim = p.dim % t.ndim
                if not shardable(dim, t.ndim):
                    raise ValueError(f"{op}: {name} is sharded on dimension {dim} ({p}); {hint}")
            elif not isinstance(p, Replicate):
                raise ValueError(
                    f"{op}: {name} has placement {p}; redistribute it to Replicate() or Shard() "
                    f"(e.g. {name}.redistribute(placements=[Replicate()])), or pass {name}.to_local()"
                )
    sharded_mesh_dims = [isinstance(p, Shard) for p in placements]
    local: dict[str, object] = {k: (v.to_local() if v is not None else None) for k, v in rows.items()}
    for name, t in whole.items():
        if isinstance(t, DTensor):
            if t.device_mesh != mesh or not all(isinstance(p, Replicate) for p in t.placements):
                raise ValueError(
                    f"{op}: {name} must be whole on every rank: a plain tensor or a Replicate() DTensor "
                    f"on {lead_name}'s mesh, got placements {tuple(t.placements)}; pass "
                    f"{name}.full_tensor() or {name}.redistribute(placements=[Replicate()])"
                )
            grad = tuple(Partial() if s else Replicate() for s in sharded_mesh_dims)
            t = t.to_local(grad_placements=grad)
        local[name] = t
    out = fn(**local)
    outs = out if isinstance(out, tuple) else (out,)
    likes = like or (lead_name,) * len(outs)
    wrapped = []
    for o, name in zip(outs, likes, strict=True):
        ref = present[name]
        sharded = {p.dim % ref.ndim for p in placements if isinstance(p, Shard)}
        shape = tuple(ref.shape[d] if d in sharded else o.shape[d] for d in range(o.ndim))
        wrapped.append(
            DTensor.from_local(
                o, mesh, placements, run_check=False, shape=torch.Size(shape), stride=_global_stride(shape, o)
            )
        )
    return tuple(wrapped) if isinstance(out, tuple) else wrapped[0]


def leading_dims_only(dim: int, ndim: int) -> bool:
    """Row-wise over the last dimension: any dimension but the last may be sharded."""
    return dim != ndim - 1


ROWWISE_HINT = (
    "the op reduces over the last dimension, which must be whole on each rank: redistribute to "
    "Replicate() or Shard() of a leading dimension (e.g. t.redistribute(placements=[Shard(0)])), "
    "or pass .to_local() of every input"
)
