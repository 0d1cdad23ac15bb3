"""CUDA graphs emulated on the CPU, so that what fuselm.graph_step builds around its graphs (static inputs and
outputs, the gradient buffers, the autograd node, the signatures, the eager fallbacks) runs in CI.

A capture records every aten operation (``TorchDispatchMode``) with the very tensors it read and wrote; a
replay runs them again in order on those tensors and copies each result into the tensor the capture wrote,
so a replay reads the static inputs, the parameters and the gradient buffers as they are then, and writes
the same tensors, like a CUDA graph (random operations draw new numbers, as dropout does in a graph). A
host synchronization inside a capture (``.item()``, ``nonzero``) raises, as a real capture fails.
:func:`emulate` installs it (``monkeypatch``) and lets graph_step capture CPU tensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item")


class _State:
    capturing = False


class FakeGraph:
    """torch.cuda.CUDAGraph's replay and pool, over recorded operations."""

    def __init__(self):
        self.ops: list[tuple] = []

    def pool(self):
        return None

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                _write(out, func(*args, **kwargs))


def _write(recorded, result) -> None:
    if isinstance(recorded, torch.Tensor) and recorded.untyped_storage().nbytes() == 0:
        return  # memory given back during the capture (nothing reads it later: a graph reuses it)
    if isinstance(recorded, torch.Tensor) and isinstance(result, torch.Tensor):
        same = recorded.data_ptr() == result.data_ptr() and recorded.stride() == result.stride()
        if not same or recorded.shape != result.shape:  # views and in-place results are the recorded ones
            recorded.copy_(result)
    elif isinstance(recorded, (tuple, list)):
        for r, x in zip(recorded, result, strict=True):
            _write(r, x)


class _Recorder(TorchDispatchMode):
    """Records the operations run inside; tensors made before the capture that they write are given their
    values back at its end (a capture runs nothing)."""

    def __init__(self, graph: FakeGraph):
        super().__init__()
        self.graph = graph
        self.made: set[int] = set()  # storages the recorded operations made
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name() in _SYNCS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func.name()})")
        for t in _written(func, args, kwargs):
            storage = t.untyped_storage().data_ptr()
            if storage not in self.made and id(t) not in self.saved:
                self.saved[id(t)] = (t, t.detach().clone())
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        self.graph.ops.append((func, args, kwargs, out))
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for t, value in self.saved.values():
                t.copy_(value)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


@contextlib.contextmanager
def fake_graph(graph: FakeGraph, pool=None, stream=None, capture_error_mode: str = "global"):
    """torch.cuda.graph: record what runs inside into ``graph``."""
    _State.capturing = True
    recorder = _Recorder(graph)
    try:
        with recorder:
            yield
    finally:
        _State.capturing = False
        recorder.restore()


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other) -> None:
        pass


def emulate(monkeypatch) -> None:
    """Replace torch.cuda's graph and stream API by the emulation and let fuselm.graph_step capture CPU
    tensors (undone with ``monkeypatch``)."""
    from fuselm import graph_step, offload
    from fuselm.ops._common import dispatch
    from fuselm.ops._common.loss import budget

    monkeypatch.setattr(graph_step, "CAPTURE_DEVICES", ("cuda", "cpu"))
    for module in (dispatch, budget):  # fuselm's ops skip their host syncs while capturing
        monkeypatch.setattr(module, "capturing", lambda device: _State.capturing)
    monkeypatch.setattr(offload, "_capturing", lambda device_type: _State.capturing)  # and its checkpoints
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("fake pool",))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: _State.capturing)
