"""Activation offloading for gradient checkpointing: a checkpointed function's inputs kept in host memory.

Under gradient checkpointing a layer keeps only its input (a decoder layer's hidden states, [B, T, H]) until
the backward recomputes the layer from it: ``layers x B x T x H`` elements on the device (Llama-3-8B, B4 x
2048, bf16: 32 x 64 MiB = 2 GiB). :func:`offloaded_checkpoint` keeps them in pinned host memory instead.
Forward: the function runs under ``no_grad`` while its positional tensors are copied to pinned host buffers
on a side CUDA stream (one per device); the device memory goes back to the caching allocator once the copy
is done (``record_stream``), except the newest call's, which stay until the next call starts
(:data:`NEWEST_ON_DEVICE`: the backward of a forward's last call comes first and takes them there).
Backward: the inputs come back on the side stream, and the copy of the inputs of the call made just before
(in the forward) starts at once, so it overlaps this call's recompute; the recompute runs under the
forward's CPU and device RNG states (the same dropout masks) and autocast state. Host buffers come from a
pool, reused across steps and shorter sequences; large ones are sized to within 1/8 of the request and
page-locked by ``cudaHostRegister`` (PyTorch's pinned allocator would round each up to a power of two: up to
twice the host memory); :func:`host_memory_stats` reports them. CPU tensors take the same path with plain
host copies, so the semantics are tested without a GPU. :func:`recompute_checkpoint` is the same checkpoint
with the inputs left on their device. In either recompute, a call whose output nothing saved reads may skip
computing it (:func:`output_may_go_unread`: the fused LoRA MLP's down projection at the end of a decoder
layer), and the recompute of an offloaded call may take outputs its forward kept in host memory beside the
inputs (:func:`keep_output`, :func:`kept_output`: the fused LoRA projections, attention's and the MLP's gate
and up). Inside a CUDA graph capture (:class:`fuselm.CapturedStep`) the copies are captured too: the host
buffers become the graphs' (:func:`captured_host_buffers`; every replay copies out and back), and instead of
``record_stream`` (under which the caching allocator would hold every offloaded input until the capture
ends) a checkpointed call makes the compute stream wait for the copies out of the calls before the previous
one (:data:`CAPTURED_COPIES_BEHIND`), and the capture of a forward for all (:func:`join_captured_copies`).
:func:`selective_checkpoint` recomputes nothing but the outputs marked :func:`remakeable` (a norm's output:
cheap to make again from a tensor the backward holds anyway). This module imports torch only
(:mod:`fuselm.hf.offload` installs it in Hugging Face models).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "offloaded_checkpoint",
    "recompute_checkpoint",
    "selective_checkpoint",
    "remakeable",
    "output_may_go_unread",
    "note_unread_output",
    "call_memo",
    "keep_output",
    "kept_output",
    "has_kept_output",
    "count_kept_outputs",
    "set_kept_output_room",
    "checkpoint_fn",
    "host_memory_stats",
    "reset_peak_host_memory_stats",
    "empty_host_cache",
]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# ---- host buffers ----


def _held(device_index: int | None) -> str:
    return "pageable_bytes" if device_index is None else "pinned_bytes"  # CPU tensors: pageable


# Buffers up to SMALL_BUFFER bytes are powers of two; larger ones are rounded up to 1/16 of the power of two
# above them (less than 1/8 more than asked: a Llama-3-8B layer input at 342,784 tokens, 2.62 GiB, takes
# 2.75 GiB, not the 4 GiB of a power of two).
SMALL_BUFFER = 1 << 20
STEPS_PER_OCTAVE = 16


def buffer_bytes(nbytes: int) -> int:
    """The size of the host buffer that holds ``nbytes``: the power of two above it up to
    :data:`SMALL_BUFFER`, else rounded up to a multiple of 1/:data:`STEPS_PER_OCTAVE` of that power.

    Example:
        >>> buffer_bytes(1000), buffer_bytes(3 << 20) == 3 << 20, buffer_bytes((3 << 20) + 1) / 2**20
        (1024, True, 3.25)
    """
    power = 1 << max(nbytes - 1, 0).bit_length()
    if power <= SMALL_BUFFER:
        return power
    step = power // STEPS_PER_OCTAVE
    return -(-nbytes // step) * step


def _pinned_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(a host buffer of exactly ``nbytes`` page-locked by ``cudaHostRegister``, True); PyTorch's pinned
    allocator would round it up to a power of two (up to 2x the memory). Where registering fails (said
    once): (a buffer from that allocator, False)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    code = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(code) == 0:
        return buf, True
    _warn_once(
        "register",
        f"fuselm.offload: cudaHostRegister failed ({code}); offloaded inputs go to PyTorch's pinned "
        "allocator, which rounds each buffer up to a power of two",
    )
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False


class _HostPool:
    """Flat uint8 host buffers (pinned for CUDA tensors), the free ones per device (index, None for CPU
    tensors) sorted by size, and the figures of :func:`host_memory_stats`. A request takes the smallest
    free buffer that holds it, if at most twice its :func:`buffer_bytes`; else the free buffers smaller
    than the request are dropped (the sequences grew: they would only pile up) and one of
    :func:`buffer_bytes` is made. A buffer serves one
    device: its copies are ordered on that device's side stream, so one released with a copy still queued
    is reused behind it, and dropping one waits for that stream."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: a stash's finalizer (release) may run in a GC in acquire
        self.free: dict[int | None, list[tuple[int, int, torch.Tensor, bool]]] = {}  # (size, id, buf, reg)
        self.scopes: list[_Captured] = []  # the capture scopes open (captured_host_buffers)
        self.captured: list[tuple[int | None, tuple]] = []  # buffers captured outside a scope: never reused
        names = "pinned_bytes peak_pinned_bytes pageable_bytes in_use_bytes peak_in_use_bytes offloads"
        self.stats = dict.fromkeys((*names.split(), "fetches", "prefetched"), 0)

    def add(self, name: str, n: int) -> None:
        self.stats[name] += n
        if "peak_" + name in self.stats:
            self.stats["peak_" + name] = max(self.stats["peak_" + name], self.stats[name])

    @staticmethod
    def _take(bucket: list, nbytes: int) -> tuple | None:
        """The smallest entry of ``bucket`` (sorted by size) that holds ``nbytes``, if at most twice its
        :func:`buffer_bytes` (popped), else None."""
        at = bisect.bisect_left(bucket, (nbytes,))
        if at < len(bucket) and bucket[at][0] <= 2 * buffer_bytes(nbytes):
            return bucket.pop(at)
        return None

    def acquire(self, nbytes: int, device: torch.device, captured: bool = False) -> tuple:
        """A buffer of >= ``nbytes`` for a tensor on ``device``: (buffer, its entry, nbytes). ``captured``:
        for copies a CUDA graph captures, which every replay repeats: the buffer is the graphs' of the open
        capture scope (one its graphs copied back from already, else one more), never the pool's again
        while they live; no smaller free buffer is dropped then (that waits for the side stream)."""
        index = device.index if device.type == "cuda" else None
        if device.type == "cuda" and index is None:
            index = torch.cuda.current_device()
        with self.lock:
            scope = self.scopes[-1] if captured and self.scopes else None
            entry = self._take(scope.spare.setdefault(index, []), nbytes) if scope is not None else None
            if entry is None:
                bucket = self.free.setdefault(index, [])
                entry = self._take(bucket, nbytes)
                if entry is None:
                    at = 0 if captured else bisect.bisect_left(bucket, (nbytes,))
                    self._drop(index, bucket[:at])
                    del bucket[:at]
                    size = buffer_bytes(nbytes)
                    if index is None:
                        buf, registered = torch.empty(size, dtype=torch.uint8), False
                    else:
                        buf, registered = _pinned_buffer(size)
                    entry = (size, id(buf), buf, registered)
                    self.add(_held(index), size)
                if captured:
                    (scope.owned if scope is not None else self.captured).append((index, entry))
            self.add("in_use_bytes", nbytes)
            self.add("offloads", 1)
        return entry[2], (index, entry), nbytes

    def release(self, held: list, fetched: bool = False, prefetched: bool = False, captured: bool = False):
        """Return the (buffer, (device index, entry), nbytes) of ``held`` to the pool and empty the list;
        count them as copied back (by a prefetch). ``captured``: they stay their graphs' (those copied back
        may serve another graph of the open capture scope)."""
        with self.lock:
            self.add("fetches", len(held) if fetched else 0)
            self.add("prefetched", len(held) if prefetched else 0)
            scope = self.scopes[-1] if captured and fetched and self.scopes else None
            while held:
                _, (index, entry), nbytes = held.pop()
                if not captured:
                    bisect.insort(self.free.setdefault(index, []), entry)
                elif scope is not None:
                    bisect.insort(scope.spare.setdefault(index, []), entry)
                self.add("in_use_bytes", -nbytes)

    def give_back(self, owned: list) -> None:
        """The buffers of graphs that will not replay again (``owned``: (device index, entry)) back to the
        free ones; empties the list."""
        with self.lock:
            while owned:
                index, entry = owned.pop()
                bisect.insort(self.free.setdefault(index, []), entry)

    def _drop(self, index: int | None, entries: list) -> None:
        """Free ``entries`` (free buffers of device ``index``) once the copies queued on its side stream
        are done."""
        if not entries:
            return
        if index is not None and index in _SIDE_STREAMS:
            _SIDE_STREAMS[index].synchronize()
        for size, _, buf, registered in entries:
            if registered:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            self.add(_held(index), -size)

    def empty(self) -> None:
        with self.lock:
            for index, bucket in self.free.items():
                self._drop(index, bucket)
            self.free.clear()


_POOL = _HostPool()
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_copy(dst: torch.Tensor, src: torch.Tensor, device: torch.device, captured: bool = False):
    """``dst.copy_(src)`` between ``device`` and pinned memory on the device's side stream, after what its
    current stream queued (the source is written, the destination's memory free); the device tensor's
    memory is not reused before the copy is done. Returns the copy's event.

    ``captured`` (inside a CUDA graph capture, where the caching allocator keeps a block another stream
    used until the capture ends, so ``record_stream`` would hold every offloaded input): a device source
    waits in :data:`_UNJOINED` until :func:`join_captured_copies` (at the next checkpointed call, or the
    end of the captured forward: a capture ends with every stream's work joined) makes the current stream
    wait for its copy and lets it go; a device destination is read only after :meth:`_Stash.take` made
    the current stream wait for it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _POOL.lock:
        if index not in _SIDE_STREAMS:
            _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
        side = _SIDE_STREAMS[index]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    if not captured:
        (src if src.is_cuda else dst).record_stream(side)
    elif src.is_cuda:
        if not _UNJOINED:
            _UNJOINED.append([])
        _UNJOINED[-1].append((done, src))
    return done


# the captured copies out not yet waited for, one list per offloaded call (the oldest first)
_UNJOINED: list[list[tuple[torch.cuda.Event, torch.Tensor]]] = []
# How many calls' copies out a captured offloaded call leaves running when it starts: its compute does not
# wait for the copies of the call just before (the two overlap; their sources' memory is held one call
# longer), only for those of the calls before that. 0 would make each call wait for the previous one's:
# where a call's copies out take longer than its compute (a Llama-3.2-1B layer at 4 x 2048 copies 80 MiB
# over the host link in ~1.7 ms and computes in ~1.6), every call would wait for the link.
CAPTURED_COPIES_BEHIND = 1
# Whether the newest offloaded call's tensors also stay on the device until the next call starts (_Stash):
# the last call of a forward (a model's last decoder layer) then needs no copy back when its backward, the
# first, starts (at 4 x 2048 a Llama-3.2-1B layer's 80 MiB take ~1.7 ms over the host link), for its
# tensors' device memory through the rest of the forward (the head).
NEWEST_ON_DEVICE = True


def join_captured_copies(behind: int = 0) -> None:
    """Make each device's current stream wait for the captured copies out (:func:`_side_copy`) of every
    offloaded call but the newest ``behind``: their sources' memory may be reused after that, and the side
    stream's work rejoins the capture. A capture of a forward with offloaded calls calls it (behind=0)
    before it ends (:mod:`fuselm.graph_step` does)."""
    while len(_UNJOINED) > behind:
        for done, src in _UNJOINED.pop(0):
            torch.cuda.current_stream(src.device).wait_event(done)


@contextlib.contextmanager
def captured_host_buffers():
    """Collect the host buffers that the offloaded calls captured inside this scope copy into and out of
    (every replay of their graphs does): yields the list that holds them, which the caller keeps as long as
    the graphs may replay and then passes to :func:`give_back_host_buffers`. Buffers captured outside such
    a scope stay out of the pool for good (their graph's lifetime is not known here)."""
    scope = _Captured()
    with _POOL.lock:
        _POOL.scopes.append(scope)
    try:
        yield scope.owned
    finally:
        with _POOL.lock:
            _POOL.scopes.remove(scope)
        _UNJOINED.clear()  # none after a whole step's capture; a failed one leaves its copies behind


class _Captured:
    """The host buffers of one capture scope: all it took (``owned``: (device index, entry)) and, per device,
    those its graphs' backward copied back from already (``spare``), which a later graph of the scope
    reuses: the graphs of one scope never replay at once (graph_step's passes of one signature)."""

    def __init__(self) -> None:
        self.owned: list[tuple[int | None, tuple]] = []
        self.spare: dict[int | None, list] = {}


def give_back_host_buffers(owned: list) -> None:
    """Return the buffers :func:`captured_host_buffers` collected to the pool (their graphs are gone)."""
    _POOL.give_back(owned)


def host_memory_stats() -> dict[str, int]:
    """Host memory of activation offloading, in bytes, and copy counts since the last reset.

    Returns a dict:

    - ``pinned_bytes``: pinned host memory the pool holds now (buffers in use and free; each of
      :func:`buffer_bytes`), ``peak_pinned_bytes`` its maximum;
    - ``pageable_bytes``: pageable host memory the pool holds (inputs that were CPU tensors);
    - ``in_use_bytes``: bytes of checkpointed inputs in host buffers now (between their forward and
      their backward), ``peak_in_use_bytes`` its maximum;
    - ``offloads``: tensors copied to host buffers, ``fetches``: copied back in a backward,
      ``prefetched``: of those, the ones whose copy the backward of the next call had started.

    Example:
        >>> from fuselm.offload import host_memory_stats
        >>> sorted(host_memory_stats())  # doctest: +NORMALIZE_WHITESPACE
        ['fetches', 'in_use_bytes', 'offloads', 'pageable_bytes', 'peak_in_use_bytes', 'peak_pinned_bytes',
         'pinned_bytes', 'prefetched']
    """
    with _POOL.lock:
        return dict(_POOL.stats)


def reset_peak_host_memory_stats() -> None:
    """Set the peaks of :func:`host_memory_stats` to the current values and its counts to 0.

    Example:
        >>> from fuselm.offload import host_memory_stats, reset_peak_host_memory_stats
        >>> reset_peak_host_memory_stats()
        >>> host_memory_stats()["offloads"]
        0
    """
    with _POOL.lock:
        stats = _POOL.stats
        stats.update(peak_pinned_bytes=stats["pinned_bytes"], peak_in_use_bytes=stats["in_use_bytes"])
        stats.update(offloads=0, fetches=0, prefetched=0)


def empty_host_cache() -> None:
    """Free the pool's unused host buffers (those in use stay until their backward).

    Example:
        >>> from fuselm.offload import empty_host_cache, host_memory_stats
        >>> empty_host_cache()
        >>> host_memory_stats()["pinned_bytes"] == 0 or host_memory_stats()["in_use_bytes"] > 0
        True
    """
    _POOL.empty()


# ---- the inputs of one call, between its forward and its backward ----


class _Stash:
    """The positional tensors of one call: in host buffers after the forward (``saved``), on their
    device once fetched (``fetched``: by this call's backward, or early by the backward of the call made
    after it), gone once taken (both None). The newest call's stash also holds its tensors on the device
    (``on_device``) until the next call starts: the backward of the last call of a forward, which comes
    first, takes them from there instead of waiting for a copy back."""

    _last: weakref.ref | None = None  # the stash made last (class-wide): the previous of the next one

    def __init__(
        self,
        tensors: list[torch.Tensor],
        offload: bool = True,
        share: float = 0.0,
        prefetch: int = 1,
        captured: bool = False,
    ) -> None:
        self.prefetch = prefetch  # how many stashes made before this one its take fetches
        self.captured = captured  # inside a CUDA graph capture: its buffers are the graph's (_side_copy)
        with _POOL.lock:
            newest = _Stash._last and _Stash._last()
        if newest is not None:
            newest.on_device = None  # no longer the newest call: its device tensors go (once copied out)
        if captured:
            join_captured_copies(CAPTURED_COPIES_BEHIND)
            if offload:
                _UNJOINED.append([])  # this call's copies out (a recompute call makes none)
        self.held: list = []  # pool buffers: back to the pool once fetched, or when the stash dies unused
        self.kept_bytes = [0]  # of them, the bytes of kept outputs (see keep)
        weakref.finalize(self, _release, self.held, self.kept_bytes, False, False, captured)
        # saved's tensors on their device, with their versions, while this is the newest call's stash
        self.on_device = _versioned(tensors) if offload and NEWEST_ON_DEVICE else None
        # (device, host copy or the tensor itself, whether it stays where it is)
        self.saved: list | None = [self._offload(t) if offload else (t.device, t, True) for t in tensors]
        self.fetched: list | None = None  # (tensor on its device, event of its copy or None)
        # outputs of the call kept for its recompute (keep): their keys, in the order of saved's tail
        self.keys: list = []
        self.room = share * sum(h[2] for h in self.held) if offload else 0
        with _POOL.lock:
            self.previous, _Stash._last = _Stash._last, weakref.ref(self)

    def _offload(self, t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        kind = t.device.type
        if kind not in ("cuda", "cpu"):
            message = f"inputs on {kind} tensors stay on the device (only CUDA and CPU tensors are copied)"
            _warn_once(f"device:{kind}", f"fuselm.offload: checkpointed {message}")
            return t.device, t, True
        nbytes = t.numel() * t.element_size()
        self.held.append(_POOL.acquire(nbytes, t.device, self.captured))
        host = self.held[-1][0][:nbytes].view(t.dtype).view(t.shape)
        if kind == "cuda":
            _side_copy(host, t, t.device, self.captured)
        else:
            host.copy_(t)
        return t.device, host, False

    def keep(self, key: Any, tensors: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """Keep ``tensors`` (outputs of the call's forward, CUDA or CPU tensors: all or none) in host
        memory with the inputs, if this call and the host have room for them (see :func:`keep_output`)."""
        group = tensors if isinstance(tensors, tuple) else (tensors,)
        nbytes = _nbytes(group)
        devices = {t.device.type for t in group}
        if self.saved is None or not devices <= {"cuda", "cpu"} or nbytes > self.room:
            return
        with _POOL.lock:
            if _KEPT.in_use + nbytes > _KEPT.limit():
                return
            _KEPT.in_use += nbytes
        self.kept_bytes[0] += nbytes
        self.room -= nbytes
        self.saved.extend(self._offload(t) for t in group)
        if self.on_device is not None:
            more = _versioned(group)
            self.on_device = None if more is None else self.on_device + more
        self.keys.append((key, len(group) if isinstance(tensors, tuple) else None))

    def fetch(self, prefetch: bool = False) -> None:
        """Start the copies back to the device (on the side stream); the host buffers go back to the
        pool (copies into them are queued on the same stream, after these)."""
        if self.saved is None:
            return
        fetched = []
        if self.on_device is not None and all(t._version == v for t, v in self.on_device):
            fetched = [(t, None) for t, _ in self.on_device]  # the newest call's, unwritten: no copy back
        else:
            for device, t, kept in self.saved:
                if kept:
                    fetched.append((t, None))
                elif device.type == "cuda":
                    out = torch.empty(t.shape, dtype=t.dtype, device=device)  # on the compute stream
                    fetched.append((out, _side_copy(out, t, device, self.captured)))
                else:  # a host copy of a CPU tensor
                    fetched.append((t.clone(), None))
        _release(self.held, self.kept_bytes, True, prefetch, self.captured)
        self.saved, self.fetched, self.on_device = None, fetched, None

    def take(self) -> tuple[list[torch.Tensor], dict]:
        """(the inputs on their device, the kept outputs by key), usable on the compute stream; start
        fetching the ``prefetch`` stashes made before this one."""
        if self.saved is None and self.fetched is None:
            raise RuntimeError(
                "fuselm.offload: this checkpointed call was already backpropagated (its inputs were "
                "freed); a second backward through it (retain_graph=True) is not supported"
            )
        if self.captured:
            join_captured_copies()  # the forward's copies out, where one capture holds both passes
        self.fetch()
        for t, done in self.fetched:
            if done is not None:
                torch.cuda.current_stream(t.device).wait_event(done)
        tensors, self.fetched = [t for t, _ in self.fetched], None
        stash = self
        for _ in range(self.prefetch):
            stash = stash.previous and stash.previous()
            if stash is None:
                break
            stash.fetch(prefetch=True)
        kept, end = {}, len(tensors)
        for key, n in reversed(self.keys):  # the tail of saved, in keep's order
            start = end - (n or 1)
            kept[key] = tuple(tensors[start:end]) if n is not None else tensors[start]
            end = start
        return tensors[:end], kept


def _versioned(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int]] | None:
    """(tensor, its version) of each, or None if one is an inference tensor (no version counter)."""
    tensors = list(tensors)
    return None if any(t.is_inference() for t in tensors) else [(t, t._version) for t in tensors]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _release(
    held: list, kept_bytes: list, fetched: bool = False, prefetched: bool = False, captured: bool = False
) -> None:
    """A stash's buffers back to the pool (``captured``: kept by their graph), its kept outputs' bytes off
    :data:`_KEPT`."""
    with _POOL.lock:
        _KEPT.in_use -= kept_bytes[0]
        kept_bytes[0] = 0
        _POOL.release(held, fetched, prefetched, captured)


# ---- outputs kept for the recompute ----
# The recompute of an offloaded call computes again what its backward needs. Some of that is cheap to keep
# instead: a projection's output costs a GEMM to remake (2 x in FLOPs per element) and 2 host copies of its
# bytes to keep, copies that overlap the compute. keep_output() puts such an output in host memory with
# the call's inputs (it comes back with them, prefetched with them); the recompute takes it with
# kept_output() and skips the GEMM. A call keeps at most kept_per_input bytes of outputs per byte of its
# offloaded inputs (an option of offloaded_checkpoint, KEPT_PER_INPUT by default; outputs offered in the
# forward's order, each kept if it fits what is left), and all calls together at most the kept-output room
# (set_kept_output_room; by default KEPT_FRACTION of the host's available memory when first needed). 1.5
# inputs are a Llama-3-8B layer's q, k and v (its o would be 2.5): what comes back costs device memory in the
# backward (the previous layer's, prefetched), and at 1.5 the 8B step at 4 x 2048 peaks no higher than
# without (measured: 2.5 cost 0.3 GiB). A memory budget with room to spare keeps more (fuselm.hf's planner).

KEPT_PER_INPUT = 1.5
KEPT_FRACTION = 0.25


def _kept_share(kept_per_input: float | None) -> float:
    """A call's ``kept_per_input``: :data:`KEPT_PER_INPUT` (read now) for None."""
    return KEPT_PER_INPUT if kept_per_input is None else kept_per_input


class _KeptRoom:
    def __init__(self) -> None:
        self.room: int | None = None  # bytes; None: KEPT_FRACTION of the available memory, read when needed
        self.in_use = 0

    def limit(self) -> int:
        if self.room is None:
            available = host_available()
            self.room = 0 if available is None else int(KEPT_FRACTION * available)
        return self.room


_KEPT = _KeptRoom()


def set_kept_output_room(nbytes: int | None) -> None:
    """The host memory (bytes) the outputs kept for recomputes (:func:`keep_output`) may take together;
    None: :data:`KEPT_FRACTION` of the host's available memory (:func:`host_available`) when first needed.
    It holds for the whole process: ``checkpointing="auto"`` sets it with each plan it makes (what the
    offloaded inputs leave of the host's room, or 0 where its budget has no room for kept outputs).

    Example:
        >>> set_kept_output_room(0)      # keep none: every recompute computes everything again
        >>> set_kept_output_room(None)   # the default
    """
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise ValueError(f"nbytes must be None or an int >= 0, got {nbytes!r}")
    with _POOL.lock:
        _KEPT.room = nbytes


def keep_output(key: Any, tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
    """In the forward of an :func:`offloaded_checkpoint` call: keep ``tensor`` for the recompute (in pinned
    host memory, copied on the side stream, back with the call's inputs), where :func:`kept_output` with the
    same ``key`` returns it; a tuple of tensors is kept whole or not at all, and comes back a tuple. For the
    forward of a ``torch.autograd.Function`` whose backward needs not the output's history (the recompute
    gets a tensor without one): ``tensor`` must be what the recompute would compute again, bit for bit
    (an output of the call's inputs and of parameters the backward checks are unchanged), not modified
    afterwards. A no-op elsewhere (outside such a forward, or no room left).
    CPU tensors take the same path with plain host copies.

    Example:
        >>> import torch
        >>> keep_output("q", torch.ones(2))   # outside a checkpointed call: nothing kept
        >>> kept_output("q") is None
        True
    """
    stash = _MEMO.stash
    if stash is not None:
        stash.keep(key, tensor)


class _KeptProbe:
    """Stands in for a stash while a planner measures a call's forward: records the bytes of each output
    offered to :func:`keep_output`, in order, copies nothing."""

    def __init__(self, input_bytes: int) -> None:
        self.input_bytes, self.offered = input_bytes, []

    def keep(self, key: Any, tensors: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        self.offered.append(_nbytes(tensors if isinstance(tensors, tuple) else (tensors,)))

    def kept(self, kept_per_input: float | None = None) -> int:
        """The bytes a call with this ``kept_per_input`` (None: :data:`KEPT_PER_INPUT`) keeps of them (each
        kept if it fits what is left)."""
        room, kept = _kept_share(kept_per_input) * self.input_bytes, 0
        for nbytes in self.offered:
            if nbytes <= room - kept:
                kept += nbytes
        return kept


@contextlib.contextmanager
def count_kept_outputs(input_bytes: int):
    """Inside: a forward's :func:`keep_output` calls keep nothing but are recorded; yields the probe, whose
    ``kept(kept_per_input)`` is what a call offloading ``input_bytes`` of inputs would keep of them (bytes),
    and ``offered`` all they offered. For planners.

    Example:
        >>> with count_kept_outputs(8) as probe:
        ...     keep_output("q", torch.ones(2))   # 8 bytes: within 1.5 x 8
        ...     keep_output("g", torch.ones(4))   # 16 more: beyond it
        >>> probe.kept(), probe.kept(3.0), probe.offered
        (8, 24, [8, 16])
    """
    probe = _KeptProbe(input_bytes)
    state = _MEMO
    outer, state.stash = state.stash, probe
    try:
        yield probe
    finally:
        state.stash = outer


def kept_output(key: Any) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """In the recompute of an :func:`offloaded_checkpoint` call: the tensor its forward kept under ``key``
    (:func:`keep_output`), on its device, once (None the second time); None elsewhere."""
    memo = _MEMO.current
    return None if memo is None else memo.pop((_KEPT_KEY, key), None)


def has_kept_output(key: Any) -> bool:
    """Does the recompute running now hold a tensor kept under ``key`` that :func:`kept_output` has not
    returned yet? (False elsewhere.)"""
    memo = _MEMO.current
    return memo is not None and (_KEPT_KEY, key) in memo


_KEPT_KEY = "fuselm.offload.kept"


def host_available() -> int | None:
    """The host memory available to new allocations (``MemAvailable`` of ``/proc/meminfo``), or None
    where there is no such file.

    Example:
        >>> n = host_available(); n is None or n > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- the autograd function ----


def _check_options(
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
) -> None:
    for name, value, allowed, what in (
        ("use_reentrant", use_reentrant, (None, True, False), "a bool or None"),
        ("preserve_rng_state", preserve_rng_state, (True, False), "a bool"),
        ("determinism_check", determinism_check, ("default", "none"), "'default' or 'none'"),
        ("debug", debug, (True, False), "a bool"),
        ("early_stop", early_stop, (True, False), "a bool"),
    ):
        if value not in allowed:
            raise ValueError(f"offloaded_checkpoint: {name} must be {what}, got {value!r}")
    if context_fn is not torch_checkpoint.noop_context_fn:
        raise ValueError(
            "offloaded_checkpoint: context_fn (selective activation checkpointing) is not supported: the "
            "whole function is recomputed from its offloaded inputs"
        )
    if debug:
        _warn_once("debug", "fuselm.offload: debug=True is ignored (no operator trace is recorded)")


_OPTIONS = frozenset(inspect.signature(_check_options).parameters)


def _split(tree: Any, select: Callable[[Any], bool]) -> tuple[list, Callable[[list], Any]]:
    """The leaves of ``tree`` that ``select`` picks, and a function that puts others in their places
    (it holds the other leaves only; with none picked, it returns ``tree`` itself)."""
    leaves, spec = tree_flatten(tree)
    slots = [i for i, x in enumerate(leaves) if select(x)]
    if not slots:
        return [], lambda values: tree
    picked = [leaves[i] for i in slots]
    for i in slots:
        leaves[i] = None

    def join(values: list) -> Any:
        filled = list(leaves)
        for i, v in zip(slots, values, strict=True):
            filled[i] = v
        return tree_unflatten(filled, spec)

    return picked, join


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _device_type(tensors: list[torch.Tensor]) -> str:
    kinds = [t.device.type for t in tensors if t.device.type not in ("cpu", "meta")]
    if "cuda" in kinds:
        return "cuda"
    return kinds[0] if kinds else torch_checkpoint.DefaultDeviceType.get_device_type()


# ---- outputs a recompute does not read ----
# A recompute runs the function again for the tensors it saves for backward; the values of its outputs are
# never read (the backward needs the graph, not them). A call whose output only feeds the function's
# outputs (a decoder layer's MLP before the residual add) may skip computing it: it asks
# output_may_go_unread(), returns a tensor without values, and says so with note_unread_output(). If the
# recompute then saves any tensor for backward (something downstream might read the unread values), the
# function is recomputed once more with no output unread, and never again for that function's kind.


class _Recompute(threading.local):
    def __init__(self) -> None:
        self.hooks: tuple | None = None  # (pack, unpack) of the recompute in progress, on this thread
        self.unread = False  # a call in it returned an output without values
        self.saved_after = False  # and a tensor was saved for backward after that
        self.saved: set[int] = set()  # the storages of the tensors it saved for backward (data_ptr)


_RECOMPUTE = _Recompute()
_OUTPUTS_READ: set[Any] = set()  # kinds of functions whose recompute saved a tensor after an unread output


class _Memo(threading.local):
    def __init__(self) -> None:
        self.current: dict | None = None  # the memo of the checkpointed call running on this thread
        self.stash: _Stash | _KeptProbe | None = (
            None  # of the offloaded call whose forward runs (keep_output)
        )


_MEMO = _Memo()


def call_memo() -> dict | None:
    """A dict private to the checkpointed call running now (:func:`offloaded_checkpoint`,
    :func:`recompute_checkpoint`), shared by its forward and its recompute; None outside one. What the
    forward stores there the recompute finds again: for values that depend on parameters only, never on
    the call's inputs (a LoRA adapter cast to the compute dtype: made once, not again in the backward). It
    is freed with the call's backward.

    Example:
        >>> call_memo() is None
        True
    """
    return _MEMO.current


@contextlib.contextmanager
def _memo_scope(memo: dict | None, stash: _Stash | None = None):
    state = _MEMO
    outer, state.current, outer_stash, state.stash = state.current, memo, state.stash, stash
    try:
        yield
    finally:
        state.current, state.stash = outer, outer_stash


def output_may_go_unread() -> bool:
    """Whether the call running now may return an output without values: True only inside a recompute
    of :func:`offloaded_checkpoint` / :func:`recompute_checkpoint`, with grad mode on and no other
    saved-tensor hooks pushed since it began. The caller that returns such an output must call
    :func:`note_unread_output` right after making it (before anything else saves a tensor)."""
    if torch.compiler.is_compiling():  # a traced forward is no recompute of these (they run eagerly)
        return False
    state = _RECOMPUTE
    return (
        state.hooks is not None
        and torch.is_grad_enabled()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) == state.hooks
    )


def note_unread_output() -> None:
    """Say that the call that just ran returned an output without values (see
    :func:`output_may_go_unread`); from now on, a tensor saved for backward in this recompute makes it
    run again with every output computed."""
    if _RECOMPUTE.hooks is None:
        raise RuntimeError("fuselm.offload.note_unread_output: called outside a recompute")
    _RECOMPUTE.unread = True


@contextlib.contextmanager
def _recompute_scope(allow_unread: bool):
    """The recompute of one call: with ``allow_unread``, outputs may go unread (and saves after one are
    noted); nested recomputes and forwards of checkpointed calls inside it see their own state."""
    state = _RECOMPUTE
    outer = (state.hooks, state.unread, state.saved_after, state.saved)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if state.unread:
            state.saved_after = True
        state.saved.add(t.untyped_storage().data_ptr())
        return t

    hooks = (pack, _identity)
    state.hooks, state.unread, state.saved_after = (hooks if allow_unread else None), False, False
    state.saved = set()
    try:
        if allow_unread:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                yield state
        else:
            yield state
    finally:
        state.hooks, state.unread, state.saved_after, state.saved = outer


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _kind(function: Callable) -> Any:
    """What the memories of a checkpointed function (outputs read, random numbers drawn) are kept by: the
    class of a bound method's object (a layer's ``__call__``) or of a module; for a function, its code and
    name (the same for every closure made from it; a decorator's wrappers share their code, not their
    name); else the callable."""
    owner = getattr(function, "__self__", None)
    if owner is not None or isinstance(function, torch.nn.Module):
        return type(owner if owner is not None else function)
    code = getattr(function, "__code__", None)
    if code is None:
        return function
    return code, getattr(function, "__module__", None), getattr(function, "__qualname__", None)


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return str(kind[2] or kind[0].co_qualname)
    return getattr(kind, "__qualname__", None) or repr(kind)


@dataclass
class _Call:
    run: Callable  # (offloaded, lifted) -> what the function returns
    n_offloaded: int  # the Function's tensors: the offloaded ones, then the lifted ones
    preserve_rng_state: bool
    offload: bool = True  # the positional tensors wait in host memory (else on their device)
    kept_per_input: float = 0.0  # outputs kept for the recompute, bytes per byte of offloaded inputs
    prefetch: int = 1  # calls made before this one whose inputs its backward starts bringing back
    backward_context: Callable | None = None  # entered around the recompute and the backward
    kind: Any = None  # see _kind
    join_outputs: Callable | None = None  # set by the forward


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, dummy: torch.Tensor, *tensors: torch.Tensor):
        offloaded, lifted = list(tensors[: call.n_offloaded]), tensors[call.n_offloaded :]
        ctx.call, ctx.device_type = call, _device_type(offloaded)
        ctx.set_materialize_grads(False)
        ctx.autocast = {  # the forward's autocast state, for the recompute
            kind: {
                "enabled": torch.is_autocast_enabled(kind),
                "dtype": torch.get_autocast_dtype(kind),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }
            for kind in dict.fromkeys((ctx.device_type, "cpu"))
            if torch.amp.is_autocast_available(kind)
        }
        # (cpu state, device ids, device states): devices of the offloaded tensors only, none initialized
        ctx.rng = None
        captured = _capturing(ctx.device_type)
        if captured:
            _check_capturable(call)
        elif call.preserve_rng_state:
            ctx.rng = _rng_states(offloaded)
        # copies queued before the function runs (it reads them)
        ctx.stash = _Stash(offloaded, call.offload, call.kept_per_input, call.prefetch, captured)
        ctx.save_for_backward(*lifted)
        ctx.memo = {}
        # (a forward inside a recompute reads its outputs: none goes unread)
        with _recompute_scope(allow_unread=False), _memo_scope(ctx.memo, ctx.stash):
            outputs, call.join_outputs = _split(call.run(offloaded, lifted), _is_tensor)
        if ctx.rng is not None:
            after = _flat(_rng_states(offloaded))
            _DRAWS[call.kind] = not all(torch.equal(a, b) for a, b in zip(_flat(ctx.rng), after, strict=True))
        ctx.mark_non_differentiable(*[t for t in outputs if not (t.is_floating_point() or t.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "fuselm.offload: offloaded_checkpoint is incompatible with torch.autograd.grad() and with "
                "backward(inputs=...): the recompute accumulates into .grad (use .backward())"
            )
        call = ctx.call
        with call.backward_context() if call.backward_context else contextlib.nullcontext():
            tensors, kept = ctx.stash.take()
            tensors += ctx.saved_tensors
            ctx.memo.update({(_KEPT_KEY, key): t for key, t in kept.items()})
            del kept  # (the memo holds them through the recompute only: what it does not save goes then)
            allow = call.kind not in _OUTPUTS_READ
            inputs, outputs, saved_after, spare = _recompute(ctx, tensors, allow)
            if allow and saved_after:
                _OUTPUTS_READ.add(call.kind)
                _warn_once(
                    f"unread:{call.kind!r}",
                    f"fuselm.offload: the recompute of {_kind_name(call.kind)} saves a "
                    "tensor after an output it skipped: recomputed in full (from now on every time)",
                )
                inputs, outputs, _, spare = _recompute(ctx, tensors, False)
            for o in spare:  # (a decoder layer's output when its MLP skipped the down projection)
                o.untyped_storage().resize_(0)
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
            ctx.memo = None  # the recompute is done
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        needs = ctx.needs_input_grad[2:]
        return (None, None, *[x.grad if need else None for x, need in zip(inputs, needs, strict=True)])


# ---- inside a CUDA graph capture ----
# A graph's random numbers come from an offset its replays advance on the device: a generator state read
# on the host during the capture would make the recompute draw the same numbers at every replay while the
# forward draws new ones. So a call may be captured only if the last eager run of its kind (the capture's
# warm-up) drew none (no dropout) - then the recompute is exact without restoring any state. Offloaded
# inputs are captured with their copies: the host buffers become the graph's (every replay copies into and
# out of them), and the copies out are waited for by the next call instead of record_stream (_side_copy).
_DRAWS: dict[Any, bool] = {}  # kind of checkpointed function: did its last eager forward draw random numbers


def _capturing(device_type: str) -> bool:
    """Is a CUDA graph being captured on the current stream (for work on ``device_type``)?"""
    return device_type == "cuda" and torch.cuda.is_current_stream_capturing()


def _rng_states(tensors: list[torch.Tensor]) -> tuple:
    """(the CPU RNG state, device ids, their RNG states): those of the devices of ``tensors``."""
    return (torch.get_rng_state(), *torch_checkpoint.get_device_states(*tensors))


def _flat(states: tuple) -> list[torch.Tensor]:
    cpu, _, devices = states
    return [cpu, *devices]


def _check_capturable(call: _Call) -> None:
    """RuntimeError where ``call``, run inside a CUDA graph capture, would not recompute exactly."""
    name = _kind_name(call.kind)
    drew = _DRAWS.get(call.kind)
    if call.preserve_rng_state and drew:
        raise RuntimeError(
            f"fuselm.offload: {name} draws random numbers (dropout) and is checkpointed inside a CUDA graph "
            "capture, whose recompute cannot restore them: set its dropout to 0, or capture without "
            "checkpointing"
        )
    if call.preserve_rng_state and drew is None:
        raise RuntimeError(
            f"fuselm.offload: {name} is checkpointed inside a CUDA graph capture without an eager run "
            "before it (which tells whether it draws random numbers): run a step eagerly first"
        )


def _recompute(ctx: Any, tensors: list[torch.Tensor], allow_unread: bool) -> tuple[list, list, bool, list]:
    """Run the call again on ``tensors`` under the forward's RNG and autocast states: (its inputs, which
    gather the gradients, its tensor outputs, whether it saved a tensor after an unread output, the outputs
    whose memory may go before the backward: with an output left unread and nothing saved after it, the
    outputs' values are never made right nor read, and those that no node saved and that hold no input's
    memory are needed for their graph only)."""
    needs, n = ctx.needs_input_grad[2:], ctx.call.n_offloaded
    cpu_state, devices, device_states = ctx.rng or (None, [], [])
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            torch.random.fork_rng(devices, enabled=ctx.rng is not None, device_type=ctx.device_type)
        )
        if ctx.rng is not None:
            torch.set_rng_state(cpu_state)
            torch_checkpoint.set_device_states(devices, device_states, device_type=ctx.device_type)
        inputs = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs, strict=True)]
        stack.enter_context(torch.enable_grad())
        for kind, state in ctx.autocast.items():
            stack.enter_context(torch.amp.autocast(kind, **state))
        state = stack.enter_context(_recompute_scope(allow_unread))
        stack.enter_context(_memo_scope(ctx.memo))
        outputs, _ = _split(ctx.call.run(inputs[:n], inputs[n:]), _is_tensor)
        saved_after, spare = state.saved_after, []
        if state.unread and not saved_after:
            kept = state.saved | {t.untyped_storage().data_ptr() for t in tensors}
            spare = [
                o for o in outputs if o.grad_fn is not None and o.untyped_storage().data_ptr() not in kept
            ]
    return inputs, outputs, saved_after, spare


# An input of every call: outputs require grad (so the function's parameters get gradients) even when no
# input does (frozen embeddings under PEFT).
_DUMMY = torch.zeros(0, device="cpu", requires_grad=True)


@torch.compiler.disable  # host copies, pinned buffers and finalizers: runs eagerly, a graph break around it
def offloaded_checkpoint(
    function: Callable,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    kept_per_input: float | None = None,
    prefetch: int = 1,
    backward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` checkpointed, its tensor ``args`` kept in host memory until the backward.

    A drop-in for :func:`torch.utils.checkpoint.checkpoint` (same signature), e.g. as HF's
    ``_gradient_checkpointing_func``. The tensors among ``args`` (a decoder layer's hidden states,
    [B, T, H]) go to pinned host memory (CPU tensors: a host buffer) and come back for the recompute
    (the module docstring tells the schedule); the recompute sees the forward's RNG states (the same
    dropout masks) and autocast state. The parameters used by ``function`` get their gradients even
    when no input requires grad. Under ``torch.compile`` it runs eagerly (``torch.compiler.disable``: a graph
    break around each checkpointed call; the function inside runs eagerly too).

    Args:
        function: the callable to checkpoint; it must not modify its inputs in place. Tensors it closes
            over (a ``functools.partial``'s bound arguments and keywords, ``kwargs``) stay on their
            device; those that require grad get their gradients.
        *args: its positional arguments, tensors (any shape and dtype) or not; tensors nested in
            tuples, lists or dicts count.
        use_reentrant: accepted for compatibility (``None``, ``True`` or ``False``); all behave as the
            non-reentrant variant (parameters get gradients when no input requires grad).
        preserve_rng_state: restore the CPU and device RNG states for the recompute (default True).
        context_fn: only the default (selective checkpointing is not supported: ValueError).
        determinism_check: ``"default"`` or ``"none"`` (no check is made either way).
        debug, early_stop: accepted; ``debug=True`` warns once that it is ignored.
        kept_per_input: how many bytes of the outputs ``function`` offers to :func:`keep_output` stay in host
            memory for the recompute (which then skips making them), per byte of the offloaded inputs: a
            finite number >= 0, or None: :data:`KEPT_PER_INPUT`, read when called (a Llama layer's q, k
            and v projections; 0: none). What comes back costs device memory in the backward (one call's,
            prefetched).
        prefetch: how many of the offloaded calls made before this one its backward starts bringing back
            (each waits on the device for its own backward): an int >= 1 (default 1). More gives each
            copy back more time when the host link is busy, for one more call's inputs and kept outputs
            of device memory each.
        backward_context: None, or a callable that returns a context manager entered around the call's
            recompute and backward (e.g. :func:`fuselm.lora.holding_dense`: the backward reuses the dense
            base weights the recompute made).
        **kwargs: keyword arguments of ``function``.

    Returns:
        What ``function`` returns (a tensor, or a tuple / list / dict with tensors and other values);
        floating tensors require grad. Without grad mode, ``function(*args, **kwargs)`` runs as is.

    Raises:
        ValueError: an unsupported option (named).
        RuntimeError: at backward, under ``torch.autograd.grad`` / ``backward(inputs=...)``, or a second
            backward through the same call (its inputs are freed after the first).

    Example:
        >>> import torch
        >>> from fuselm.offload import host_memory_stats, offloaded_checkpoint
        >>> layers = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.1)) for _ in "ab"]
        >>> x = torch.randn(2, 16, 32)                  # [B, T, H], no grad needed
        >>> before = host_memory_stats()["in_use_bytes"]
        >>> y = offloaded_checkpoint(layers[1], offloaded_checkpoint(layers[0], x, use_reentrant=False))
        >>> y.requires_grad, host_memory_stats()["in_use_bytes"] - before   # 2 inputs, fp32, on the host
        (True, 8192)
        >>> y.sum().backward()                          # recomputes each layer from its host copy
        >>> layers[0][0].weight.grad.shape, host_memory_stats()["in_use_bytes"] - before
        (torch.Size([32, 32]), 0)
    """
    _check_options(use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop)
    kept_per_input = _kept_share(kept_per_input)
    _check_offload_options(
        kept_per_input=kept_per_input, prefetch=prefetch, backward_context=backward_context
    )
    return _checkpoint(
        function, args, kwargs, preserve_rng_state, True, kept_per_input, prefetch, backward_context
    )


def _check_offload_options(**options: Any) -> None:
    """ValueError naming ``kept_per_input`` (neither None nor a finite number >= 0), ``prefetch`` (not an
    int >= 1) or ``backward_context`` (neither None nor callable)."""
    x = options.get("kept_per_input")
    if x is not None and not (
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
    ):
        raise ValueError(
            f"offloaded_checkpoint: kept_per_input must be None or a finite number >= 0, got {x!r}"
        )
    n = options.get("prefetch", 1)
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"offloaded_checkpoint: prefetch must be an int >= 1, got {n!r}")
    context = options.get("backward_context")
    if context is not None and not callable(context):
        raise ValueError(f"offloaded_checkpoint: backward_context must be None or callable, got {context!r}")


@torch.compiler.disable  # see offloaded_checkpoint
def recompute_checkpoint(
    function: Callable,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    backward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    **kwargs: Any,
) -> Any:
    """:func:`offloaded_checkpoint` with the tensor ``args`` kept on their device: plain gradient
    checkpointing (same arguments, same recompute, the same ``backward_context``), where the recompute may
    leave an output of the function unread (:func:`output_may_go_unread`: a decoder layer's MLP skips its
    down projection).

    Example:
        >>> import torch
        >>> from fuselm.offload import recompute_checkpoint
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> recompute_checkpoint(layer, x).sum().backward()
        >>> torch.allclose(x.grad, torch.autograd.grad(layer(x).sum(), x)[0])
        True
    """
    _check_options(use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop)
    _check_offload_options(backward_context=backward_context)
    return _checkpoint(function, args, kwargs, preserve_rng_state, False, backward_context=backward_context)


def _checkpoint(
    function: Callable,
    args: tuple,
    kwargs: dict,
    preserve_rng_state: bool,
    offload: bool,
    share: float = 0.0,
    prefetch: int = 1,
    backward_context: Callable | None = None,
):
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    base, bound, keywords = function, (), kwargs
    if isinstance(function, functools.partial):
        base, bound, keywords = function.func, function.args, {**function.keywords, **kwargs}
    offloaded, join_args = _split(args, _is_tensor)
    # tensors that require grad among a partial's bound arguments and the keywords: inputs of the Function
    lifted, join_keywords = _split((bound, keywords), lambda x: _is_tensor(x) and x.requires_grad)
    if offload and not offloaded:
        name = getattr(function, "__qualname__", type(function).__name__)
        _warn_once(
            f"no-positional:{name}",
            f"fuselm.offload: {name} got no positional tensor: nothing is offloaded (keyword tensors stay "
            "on their device)",
        )

    def run(offloaded: list, lifted: list) -> Any:
        bound, keywords = join_keywords(lifted)
        return base(*bound, *join_args(offloaded), **keywords)

    call = _Call(
        run, len(offloaded), preserve_rng_state, offload, share, prefetch, backward_context, _kind(base)
    )
    outputs = _OffloadedCheckpoint.apply(call, _DUMMY, *offloaded, *lifted)
    return call.join_outputs(outputs)  # (set by the forward)


# ---- selective: only the outputs marked remakeable are recomputed ----


class _Selective(threading.local):
    def __init__(self) -> None:
        self.hooks: tuple | None = None  # (pack, unpack) of the selective call running on this thread
        # storage address: (output, its version when marked, recipe)
        self.marked: dict[int, tuple[torch.Tensor, int, _Recipe]] = {}


_SELECTIVE = _Selective()


class _Recipe:
    """How to make a marked output again; the value made is shared by the saves of it (q, k and v
    projections save one norm output) until each was unpacked once."""

    __slots__ = ("remake", "shape", "nbytes", "saves", "unpacks", "value")

    def __init__(self, remake: Callable[[], torch.Tensor], output: torch.Tensor) -> None:
        self.remake, self.shape, self.nbytes = remake, output.shape, output.numel() * output.element_size()
        self.saves = self.unpacks = 0
        self.value: torch.Tensor | None = None

    def made(self) -> torch.Tensor:
        value = self.value
        if value is None:
            with torch.no_grad():
                value = self.remake()
            if value.shape != self.shape or not value.is_contiguous():
                raise RuntimeError("fuselm.offload: a remakeable output was made again with another layout")
        self.unpacks += 1
        self.value = None if self.unpacks % self.saves == 0 else value
        return value


@dataclass(frozen=True)
class _Remade:
    """A saved tensor left as its recipe: a view (size, stride, offset) of the marked output."""

    recipe: _Recipe
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def remakeable(
    output: torch.Tensor, remake: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
) -> torch.Tensor:
    """Mark ``output`` as made again, bit for bit, by ``remake(*args, **kwargs)`` (run under ``no_grad`` in
    the backward; the call is bound only when the mark is taken, so a call outside costs no allocation):
    inside :func:`selective_checkpoint`, a tensor saved for backward that is ``output`` or a view of it is
    saved as the recipe. ``remake`` should only read what the backward keeps anyway (a norm's input,
    which the norm saves). Elsewhere, or for an output that is not a contiguous tensor of its own, a
    no-op. Returns ``output``.

    Example:
        >>> import torch
        >>> from fuselm.offload import remakeable
        >>> x = torch.randn(3)
        >>> remakeable(x * 2, lambda: x * 2).shape        # outside selective_checkpoint: as it was
        torch.Size([3])
    """
    state = _SELECTIVE
    if (
        state.hooks is not None
        and torch._C._autograd._top_saved_tensors_default_hooks(False) == state.hooks
        and output.is_contiguous()
        and output.storage_offset() == 0
        and output.untyped_storage().nbytes() == output.numel() * output.element_size()
    ):
        if args or kwargs:
            remake = functools.partial(remake, *args, **kwargs)
        state.marked[output.untyped_storage().data_ptr()] = (output, output._version, _Recipe(remake, output))
    return output


def _selective_pack(t: torch.Tensor) -> tuple[torch.Tensor, int] | _Remade:
    entry = _SELECTIVE.marked.get(t.untyped_storage().data_ptr())
    if (
        entry is None
        or entry[0].dtype != t.dtype
        or entry[0].device != t.device
        or entry[0]._version != entry[1]
    ):
        # (a marked output changed in place since is no longer what its recipe makes: saved as it is)
        # with hooks autograd checks no version counter: the unpack does (an in-place change raises)
        return t, (t._version if not t.is_inference() else -1)
    recipe = entry[2]
    recipe.saves += 1
    return _Remade(recipe, t.size(), t.stride(), t.storage_offset())


def _selective_unpack(packed: tuple[torch.Tensor, int] | _Remade) -> torch.Tensor:
    if isinstance(packed, _Remade):
        return packed.recipe.made().as_strided(packed.size, packed.stride, packed.offset)
    t, version = packed
    if version >= 0 and t._version != version:
        raise RuntimeError(
            "fuselm.offload.selective_checkpoint: a tensor saved for backward was modified by an in-place "
            f"operation (shape {tuple(t.shape)}, version {t._version}, saved at version {version})"
        )
    return t


@contextlib.contextmanager
def _selective_scope(then: Callable[[Any], Any] | None = None):
    """Saved tensors that are marked outputs (or views of them) become recipes inside; ``then`` sees what
    each save packed to and returns it: ``(tensor, version)``, or a :class:`_Remade` (the activation
    planner counts the bytes of each)."""
    state = _SELECTIVE
    outer = (state.hooks, state.marked)

    def pack(t: torch.Tensor) -> Any:
        packed = _selective_pack(t)
        return packed if then is None else then(packed)

    hooks = (pack, _selective_unpack)
    state.hooks, state.marked = hooks, {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            yield
    finally:
        state.hooks, state.marked = outer  # the marked outputs are no longer held: their memory is free


@torch.compiler.disable  # saved-tensor hooks with Python state: eager, as the other checkpoints
def selective_checkpoint(
    function: Callable,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` keeping what it saves for backward on the device, except the outputs
    marked :func:`remakeable` inside it, which the backward makes again (bit for bit): a decoder layer's
    norm outputs (2 of its ~14 hidden-sized tensors) cost an elementwise pass instead of their memory.
    Options as :func:`offloaded_checkpoint` (checked, otherwise unused: nothing else is recomputed).
    Under grad mode off, or inside other saved-tensor hooks (a checkpoint around it), it is the plain call.

    Example:
        >>> import torch
        >>> from fuselm.offload import remakeable, selective_checkpoint
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> def f(x):
        ...     n = remakeable(torch.tanh(x), lambda: torch.tanh(x))   # saved by the matmul: remade
        ...     return n @ w
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> selective_checkpoint(f, x).sum().backward()
        >>> torch.allclose(w.grad, torch.tanh(x).T @ torch.ones(2, 4))
        True
    """
    _check_options(use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop)
    if not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return function(*args, **kwargs)
    with _selective_scope():
        return function(*args, **kwargs)


def checkpoint_fn(offload: bool = True, **options: Any) -> functools.partial:
    """``functools.partial(offloaded_checkpoint, **options)`` (``offload=False``:
    :func:`recompute_checkpoint`), the options checked now (ValueError naming one that is unknown or
    unsupported): for frameworks that take a checkpointing function and its options apart (HF's
    ``gradient_checkpointing_kwargs``). ``options`` are the keyword options of
    :func:`offloaded_checkpoint` (those of :func:`torch.utils.checkpoint.checkpoint`, and
    ``kept_per_input`` and ``prefetch`` when ``offload``, ``backward_context`` either way).

    Example:
        >>> from fuselm.offload import checkpoint_fn
        >>> checkpoint_fn(use_reentrant=True).keywords
        {'use_reentrant': True}
        >>> checkpoint_fn(offload=False).func.__name__
        'recompute_checkpoint'
    """
    offloading = {"kept_per_input", "prefetch"}
    known = _OPTIONS | {"backward_context"} | (offloading if offload is True else set())
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"offloaded_checkpoint: options {unknown} not supported (known: {sorted(known)})")
    if not isinstance(offload, bool):
        raise ValueError(f"checkpoint_fn: offload must be a bool, got {offload!r}")
    _check_options(**{k: v for k, v in options.items() if k in _OPTIONS})
    _check_offload_options(**{k: v for k, v in options.items() if k in offloading | {"backward_context"}})
    return functools.partial(offloaded_checkpoint if offload else recompute_checkpoint, **options)
