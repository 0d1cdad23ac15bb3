"""Activation offloading for gradient checkpointing: decoder-layer inputs kept in pinned host memory.

Under gradient checkpointing a decoder layer keeps only its input (the hidden states, [B, T, H]) from
the forward to the backward, where it recomputes the layer from it. Those inputs are what is left of
the activations: ``layers x B x T x H`` elements on the device (Llama-3-8B, B4 x 2048, bf16: 32 x 64 MiB
= 2 GiB). :func:`offloaded_checkpoint` keeps them in pinned host memory instead:

- forward: the layer runs under ``no_grad``; its tensor arguments are copied to pinned host buffers
  with non-blocking copies on a side CUDA stream (one per device), overlapping the layer's compute;
  the device tensor's memory is handed back to the caching allocator only once the copy is done
  (``record_stream``);
- backward: the input comes back on the side stream; when layer ``i``'s backward starts, the copy of
  the input of the layer called just before it in the forward (``i - 1``) is started, so that it
  overlaps layer ``i``'s recompute and backward; the layer is recomputed with the CPU and device RNG
  states (dropout masks) and autocast state of the forward, and backpropagated.

Host buffers come from a pool (power-of-two byte classes, which is what PyTorch's pinned allocator
reserves anyway, so buffers are reused across steps and across sequence lengths within a class);
:func:`host_memory_stats` reports what is pinned and in use. CPU tensors take the same path with
plain host copies (no streams), so the semantics are tested without a GPU.

:func:`enable` installs it as the checkpointing function of every ``GradientCheckpointingLayer`` of a
transformers model (PEFT-wrapped too), turning HF's gradient checkpointing on if it is off, and keeps
it installed when ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` is called
again (by the user, PEFT or Trainer); :func:`disable` restores HF's function.

    >>> import torch, transformers
    >>> from fuselm.hf import offload
    >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    >>> model = offload.enable(transformers.LlamaForCausalLM(config).train())
    >>> offload.is_enabled(model)
    True
    >>> ids = torch.randint(0, 100, (2, 16))
    >>> loss = model(input_ids=ids, labels=ids).loss   # the 2 layer inputs [2, 16, 32] now on the host
    >>> offload.host_memory_stats()["in_use_bytes"] >= 2 * 2 * 16 * 32 * 4
    True
    >>> loss.backward()
    >>> _ = offload.disable(model)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "offloaded_checkpoint",
    "enable",
    "disable",
    "is_enabled",
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


def _size_class(nbytes: int) -> int:
    """The power of two >= nbytes (PyTorch's pinned allocator rounds every allocation up to one)."""
    return 1 << max(nbytes - 1, 0).bit_length()


class _HostPool:
    """Flat uint8 host buffers keyed by (pinned, device index, power-of-two byte class); byte counts."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.free: dict[tuple[bool, int | None, int], list[torch.Tensor]] = {}
        self.held = {True: 0, False: 0}  # bytes the pool holds (in use + free), pinned / pageable
        self.peak_pinned = 0
        self.in_use = 0  # bytes of activations in host buffers now
        self.peak_in_use = 0
        self.offloads = 0  # tensors copied to the host
        self.fetches = 0  # tensors copied back
        self.prefetched = 0  # of which the copy was started by the backward of the layer after

    def acquire(self, nbytes: int, pinned: bool, device_index: int | None) -> tuple[torch.Tensor, tuple]:
        key = (pinned, device_index, _size_class(nbytes))
        with self.lock:
            bucket = self.free.get(key)
            buf = bucket.pop() if bucket else None
            if buf is None:
                buf = torch.empty(key[2], dtype=torch.uint8, pin_memory=pinned)
                self.held[pinned] += key[2]
                if pinned:
                    self.peak_pinned = max(self.peak_pinned, self.held[True])
            self.in_use += nbytes
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            self.offloads += 1
        return buf, key

    def release(self, held: list) -> None:
        """Return the (buffer, key, nbytes) of ``held`` to the pool and empty the list."""
        with self.lock:
            while held:
                buf, key, nbytes = held.pop()
                self.free.setdefault(key, []).append(buf)
                self.in_use -= nbytes

    def empty(self) -> None:
        with self.lock:
            for (pinned, _, size), bucket in self.free.items():
                self.held[pinned] -= size * len(bucket)
            self.free.clear()


_POOL = _HostPool()
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _POOL.lock:
        stream = _SIDE_STREAMS.get(index)
        if stream is None:
            stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def host_memory_stats() -> dict[str, int]:
    """Host memory of activation offloading, in bytes, and copy counts since the last reset.

    Returns a dict:

    - ``pinned_bytes``: pinned host memory the pool holds now (buffers in use and free; each buffer
      is a power of two, as PyTorch's pinned allocator reserves), ``peak_pinned_bytes`` its maximum;
    - ``pageable_bytes``: pageable host memory the pool holds (inputs that were CPU tensors);
    - ``in_use_bytes``: bytes of checkpointed inputs in host buffers now (between their forward and
      their backward), ``peak_in_use_bytes`` its maximum;
    - ``offloads``: tensors copied to host buffers, ``fetches``: copied back in a backward,
      ``prefetched``: of those, the ones whose copy the backward of the next layer had started.

    Example:
        >>> from fuselm.hf.offload import host_memory_stats
        >>> sorted(host_memory_stats())  # doctest: +NORMALIZE_WHITESPACE
        ['fetches', 'in_use_bytes', 'offloads', 'pageable_bytes', 'peak_in_use_bytes', 'peak_pinned_bytes',
         'pinned_bytes', 'prefetched']
    """
    with _POOL.lock:
        return {
            "pinned_bytes": _POOL.held[True],
            "peak_pinned_bytes": _POOL.peak_pinned,
            "pageable_bytes": _POOL.held[False],
            "in_use_bytes": _POOL.in_use,
            "peak_in_use_bytes": _POOL.peak_in_use,
            "offloads": _POOL.offloads,
            "fetches": _POOL.fetches,
            "prefetched": _POOL.prefetched,
        }


def reset_peak_host_memory_stats() -> None:
    """Set the peaks of :func:`host_memory_stats` to the current values and its counts to 0.

    Example:
        >>> from fuselm.hf.offload import host_memory_stats, reset_peak_host_memory_stats
        >>> reset_peak_host_memory_stats()
        >>> host_memory_stats()["offloads"]
        0
    """
    with _POOL.lock:
        _POOL.peak_pinned = _POOL.held[True]
        _POOL.peak_in_use = _POOL.in_use
        _POOL.offloads = _POOL.fetches = _POOL.prefetched = 0


def empty_host_cache() -> None:
    """Free the pool's unused host buffers (those in use stay until their backward).

    Example:
        >>> from fuselm.hf.offload import empty_host_cache, host_memory_stats
        >>> empty_host_cache()
        >>> host_memory_stats()["pinned_bytes"] == 0 or host_memory_stats()["in_use_bytes"] > 0
        True
    """
    _POOL.empty()


# ---- the inputs of one checkpointed call, between its forward and its backward ----


@dataclass
class _Entry:
    device: torch.device
    shape: torch.Size
    dtype: torch.dtype
    host: torch.Tensor | None  # a view of a pool buffer (None: kept as is, below)
    kept: torch.Tensor | None = None  # a tensor on a device without an offload path


class _Stash:
    """The positional tensor inputs of one call: copied to host buffers in the forward, copied back
    (maybe early, by the backward of the call after it) in the backward."""

    _last: weakref.ref | None = None  # the stash made last (class-wide): the previous of the next one

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.entries: list[_Entry] = []
        self.held: list = []  # (buffer, pool key, nbytes): back to the pool once copied back or dropped
        self.fetched: list[tuple[torch.Tensor, Any]] | None = None
        self.by_prefetch = False
        self.consumed = False
        for t in tensors:
            self.entries.append(self._offload(t))
        weakref.finalize(self, _POOL.release, self.held)  # a graph freed without a backward
        with _POOL.lock:
            self.previous = _Stash._last
            _Stash._last = weakref.ref(self)

    def _offload(self, t: torch.Tensor) -> _Entry:
        kind = t.device.type
        if kind not in ("cuda", "cpu"):
            _warn_once(
                f"device:{kind}",
                f"fuselm.hf.offload: checkpointed inputs on {kind} tensors stay on the device (only CUDA "
                "tensors are offloaded to pinned host memory, CPU tensors copied)",
            )
            return _Entry(t.device, t.shape, t.dtype, None, kept=t)
        nbytes = t.numel() * t.element_size()
        buf, key = _POOL.acquire(nbytes, pinned=kind == "cuda", device_index=t.device.index)
        self.held.append((buf, key, nbytes))
        host = buf[:nbytes].view(t.dtype).view(t.shape)
        if kind == "cuda":
            compute, side = torch.cuda.current_stream(t.device), _side_stream(t.device)
            side.wait_stream(compute)  # t is written
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # its memory is not reused before the copy is done
        else:
            host.copy_(t)
        return _Entry(t.device, t.shape, t.dtype, host)

    def fetch(self, prefetch: bool = False) -> None:
        """Start the copies back to the device (on the side stream); the host buffers go back to the
        pool (copies into them are queued on the same stream, after these)."""
        if self.fetched is not None or self.consumed:
            return
        fetched = []
        for e in self.entries:
            if e.kept is not None:
                fetched.append((e.kept, None))
            elif e.device.type == "cuda":
                compute, side = torch.cuda.current_stream(e.device), _side_stream(e.device)
                t = torch.empty(e.shape, dtype=e.dtype, device=e.device)  # on the compute stream
                side.wait_stream(compute)
                with torch.cuda.stream(side):
                    t.copy_(e.host, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(side)
                t.record_stream(side)  # freed unconsumed (graph dropped): not reused before the copy
                fetched.append((t, done))
            else:
                fetched.append((e.host.clone(), None))
        _POOL.release(self.held)
        copied = sum(e.kept is None for e in self.entries)
        with _POOL.lock:
            _POOL.fetches += copied
            if prefetch:
                _POOL.prefetched += copied
        self.fetched = fetched
        self.by_prefetch = prefetch

    def take(self) -> list[torch.Tensor]:
        """The inputs on their device, usable on the compute stream; start fetching the previous stash."""
        if self.consumed:
            raise RuntimeError(
                "fuselm.hf.offload: this checkpointed call was already backpropagated (its inputs were "
                "freed); a second backward through it (retain_graph=True) is not supported"
            )
        self.fetch()
        tensors = []
        for t, done in self.fetched:
            if done is not None:
                torch.cuda.current_stream(t.device).wait_event(done)
            tensors.append(t)
        self.fetched, self.consumed = None, True
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.fetch(prefetch=True)
        return tensors


# ---- the autograd function ----

_CHECKPOINT_OPTIONS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug")


def _check_options(
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
) -> None:
    if use_reentrant not in (None, True, False):
        raise ValueError(f"offloaded_checkpoint: use_reentrant must be a bool or None, got {use_reentrant!r}")
    if preserve_rng_state not in (True, False):
        raise ValueError(
            f"offloaded_checkpoint: preserve_rng_state must be a bool, got {preserve_rng_state!r}"
        )
    if context_fn is not torch_checkpoint.noop_context_fn:
        raise ValueError(
            "offloaded_checkpoint: context_fn (selective activation checkpointing) is not supported: the "
            "whole function is recomputed from its offloaded inputs"
        )
    if determinism_check not in ("default", "none"):
        raise ValueError(
            f"offloaded_checkpoint: determinism_check must be 'default' or 'none', got {determinism_check!r}"
        )
    if debug not in (True, False) or early_stop not in (True, False):
        raise ValueError("offloaded_checkpoint: debug and early_stop must be bools")
    if debug:
        _warn_once(
            "debug", "fuselm.hf.offload: debug=True is ignored (no operator trace is recorded on recompute)"
        )


def _device_type(tensors: list[torch.Tensor]) -> str:
    kinds = [t.device.type for t in tensors if t.device.type not in ("cpu", "meta")]
    if "cuda" in kinds:
        return "cuda"
    return kinds[0] if kinds else torch_checkpoint.DefaultDeviceType.get_device_type()


def _autocast_state(device_type: str) -> tuple[dict | None, dict]:
    def state(kind: str) -> dict:
        return {
            "enabled": torch.is_autocast_enabled(kind),
            "dtype": torch.get_autocast_dtype(kind),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }

    return (state(device_type) if torch.amp.is_autocast_available(device_type) else None), state("cpu")


class _Call:
    """One call ``fn(*args, **kwargs)`` with its tensors taken out: the positional tensor leaves (the
    offloaded ones) and the keyword / bound-argument tensor leaves that require grad (kept on the device:
    their gradients are returned). Holds no reference to the offloaded tensors nor to the outputs."""

    def __init__(self, function: Callable, args: tuple, kwargs: dict, preserve_rng_state: bool) -> None:
        self.preserve_rng_state = preserve_rng_state
        leaves, self.args_spec = tree_flatten(args)
        self.arg_slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.offloaded = [leaves[i] for i in self.arg_slots]  # handed to the Function, then dropped
        for i in self.arg_slots:
            leaves[i] = None
        self.arg_leaves = leaves
        # tensors that require grad among the bound arguments of a partial and the keywords: lifted
        base, bound, keywords = function, (), dict(kwargs)
        if isinstance(function, functools.partial):
            base, bound, keywords = function.func, function.args, {**function.keywords, **kwargs}
        kw_leaves, kw_spec = tree_flatten((bound, keywords))
        lift = [i for i, x in enumerate(kw_leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        self.lifted = [kw_leaves[i] for i in lift]
        if lift:
            for i in lift:
                kw_leaves[i] = None
            self.function, self.kw_leaves, self.kw_spec, self.kw_slots = base, kw_leaves, kw_spec, lift
        else:  # nothing lifted: call the function as given
            self.function, self.kwargs, self.kw_slots = function, kwargs, []
        self.out_spec = None
        self.out_leaves: list = []
        self.out_slots: list[int] = []

    def run(self, offloaded, lifted):
        leaves = list(self.arg_leaves)
        for i, t in zip(self.arg_slots, offloaded, strict=True):
            leaves[i] = t
        args = tree_unflatten(leaves, self.args_spec)
        if not self.kw_slots:
            return self.function(*args, **self.kwargs)
        kw_leaves = list(self.kw_leaves)
        for i, t in zip(self.kw_slots, lifted, strict=True):
            kw_leaves[i] = t
        bound, keywords = tree_unflatten(kw_leaves, self.kw_spec)
        return self.function(*bound, *args, **keywords)

    def split_outputs(self, outputs) -> list[torch.Tensor]:
        leaves, self.out_spec = tree_flatten(outputs)
        self.out_slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in self.out_slots]
        for i in self.out_slots:
            leaves[i] = None
        self.out_leaves = leaves
        return tensors

    def join_outputs(self, tensors):
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_slots, tensors, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, self.out_spec)


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, dummy: torch.Tensor, *tensors: torch.Tensor):
        n = len(call.arg_slots)
        offloaded, lifted = list(tensors[:n]), list(tensors[n:])
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.device_type = _device_type(offloaded)
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.devices, ctx.device_states = [], []
        if call.preserve_rng_state:
            ctx.cpu_state = torch.get_rng_state()
            module = getattr(torch, ctx.device_type, None)
            is_initialized = getattr(module, "is_initialized", None)
            if is_initialized is not None and is_initialized():
                ctx.devices, ctx.device_states = torch_checkpoint.get_device_states(*offloaded)
        ctx.stash = _Stash(offloaded)  # copies queued before the function runs (it reads them only)
        ctx.save_for_backward(*lifted)
        outputs = call.split_outputs(call.run(offloaded, lifted))
        ctx.mark_non_differentiable(*[t for t in outputs if not (t.is_floating_point() or t.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "fuselm.hf.offload: offloaded_checkpoint is incompatible with torch.autograd.grad() and with "
                "backward(inputs=...): the recompute accumulates into .grad (use .backward())"
            )
        call = ctx.call
        offloaded = ctx.stash.take()
        lifted = list(ctx.saved_tensors)
        needs = ctx.needs_input_grad[2:]
        with torch.random.fork_rng(
            devices=ctx.devices, enabled=call.preserve_rng_state, device_type=ctx.device_type
        ):
            if call.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_state)
                if ctx.devices:
                    torch_checkpoint.set_device_states(
                        ctx.devices, ctx.device_states, device_type=ctx.device_type
                    )
            inputs = [
                t.detach().requires_grad_(need) for t, need in zip(offloaded + lifted, needs, strict=True)
            ]
            device_autocast, cpu_autocast = ctx.autocast
            device_ctx = (
                torch.amp.autocast(ctx.device_type, **device_autocast)
                if device_autocast is not None
                else contextlib.nullcontext()
            )
            with torch.enable_grad(), device_ctx, torch.amp.autocast("cpu", **cpu_autocast):
                outputs = call.split_outputs(call.run(inputs[: len(offloaded)], inputs[len(offloaded) :]))
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if need else None for x, need in zip(inputs, needs, strict=True)])


_DUMMY: torch.Tensor | None = None


def _dummy() -> torch.Tensor:
    """An empty leaf that requires grad, an input of every call: outputs require grad (so the layer's
    parameters get gradients) even when no input does (frozen embeddings under PEFT)."""
    global _DUMMY
    if _DUMMY is None:
        _DUMMY = torch.zeros(0, requires_grad=True)
    return _DUMMY


def offloaded_checkpoint(
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
    """``function(*args, **kwargs)`` checkpointed, its tensor ``args`` kept in host memory until the backward.

    A drop-in for :func:`torch.utils.checkpoint.checkpoint` (same signature) as HF's
    ``_gradient_checkpointing_func``. The forward runs ``function`` under ``no_grad`` and copies the
    tensors among ``args`` (a decoder layer's hidden states, [B, T, H]) to pinned host memory on a side
    CUDA stream (CPU tensors: to a host buffer); the backward copies them back (the copy of the previous
    call's inputs is started when this call's backward starts, so it overlaps), recomputes ``function``
    with grad enabled under the forward's RNG states (the same dropout masks) and autocast state,
    backpropagates and returns the inputs' gradients. The parameters used by ``function`` get their
    gradients even when no input requires grad.

    Args:
        function: the callable to checkpoint; it must not modify its inputs in place. Tensors it closes
            over (a ``functools.partial``'s bound arguments and keywords, ``kwargs``) stay on their
            device; those that require grad get their gradients.
        *args: its positional arguments, tensors (any shape and dtype) or not; tensors nested in
            tuples, lists or dicts count.
        use_reentrant: accepted for compatibility (``None``, ``True`` or ``False``); both behave the
            same way here (a custom autograd function, which still gives the parameters their gradients
            when no input requires grad, as the non-reentrant variant).
        preserve_rng_state: restore the CPU and device RNG states for the recompute (default True).
        context_fn: only the default (selective checkpointing is not supported: ValueError).
        determinism_check: ``"default"`` or ``"none"`` (no check is made either way).
        debug, early_stop: accepted; ``debug=True`` warns once that it is ignored.
        **kwargs: keyword arguments of ``function``.

    Returns:
        What ``function`` returns (a tensor, or a tuple / list / dict with tensors and other values);
        floating tensors require grad when grad mode is on.

    Raises:
        ValueError: an unsupported option (named).
        RuntimeError: at backward, under ``torch.autograd.grad`` / ``backward(inputs=...)``, or a second
            backward through the same call (its inputs are freed after the first).

    Without grad mode, ``function(*args, **kwargs)`` runs as is (nothing to recompute).

    Example:
        >>> import torch
        >>> from fuselm.hf.offload import offloaded_checkpoint
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
        >>> x = torch.randn(2, 5, 8)                    # [B, T, H], no grad needed
        >>> y = offloaded_checkpoint(layer, x, use_reentrant=False)
        >>> y.requires_grad
        True
        >>> y.sum().backward()                          # recomputes layer(x) from the host copy
        >>> layer[0].weight.grad.shape
        torch.Size([8, 8])
    """
    _check_options(use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    call = _Call(function, args, kwargs, preserve_rng_state)
    if not call.arg_slots:
        name = getattr(function, "__qualname__", type(function).__name__)
        _warn_once(
            f"no-positional:{name}",
            f"fuselm.hf.offload: {name} got no positional tensor: nothing is offloaded (only positional "
            "tensor arguments are; keyword tensors stay on their device)",
        )
    tensors = [*call.offloaded, *call.lifted]
    call.offloaded = call.lifted = None  # the Function holds them (and drops the offloaded ones)
    outputs = _OffloadedCheckpoint.apply(call, _dummy(), *tensors)
    return call.join_outputs(outputs)


# ---- transformers models ----

_STATE = "_fuselm_offload"  # on each wrapped PreTrainedModel: the _State shared by them
_HF_FUNC = "_fuselm_hf_checkpointing_func"  # on each layer: the function HF set (restored by disable)


class _Missing:
    """No function was set (a sentinel that survives copy.deepcopy and pickling as itself)."""

    def __repr__(self) -> str:
        return "<missing>"

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


@dataclass
class _State:
    turned_on: bool = False  # enable() switched HF's checkpointing on; disable() switches it off again
    enabling: bool = False  # inside enable()'s own call of HF's enable


def _is_offloaded(func: Any) -> bool:
    return func is offloaded_checkpoint or (
        isinstance(func, functools.partial) and func.func is offloaded_checkpoint
    )


def _offloaded_from(hf_func: Any, layer: torch.nn.Module) -> Callable:
    """offloaded_checkpoint with the options of HF's function (``partial(checkpoint, **kwargs)``)."""
    inner, keywords = hf_func, {}
    if isinstance(hf_func, functools.partial):
        inner, keywords = hf_func.func, dict(hf_func.keywords)
    if hf_func is not _MISSING and not (
        inner is torch_checkpoint.checkpoint or getattr(inner, "__module__", "").startswith("transformers.")
    ):
        name = getattr(inner, "__qualname__", type(inner).__name__)
        _warn_once(
            f"replaced:{name}",
            f"fuselm.hf.offload: {type(layer).__name__}'s checkpointing function {name} is replaced by "
            "offloaded_checkpoint (disable() restores it)",
        )
    unknown = sorted(set(keywords) - {*_CHECKPOINT_OPTIONS, "early_stop"})
    if unknown:
        raise ValueError(f"gradient_checkpointing_kwargs: {unknown} not supported by offloaded_checkpoint")
    _check_options(**keywords)
    return functools.partial(offloaded_checkpoint, **keywords)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _install(model: torch.nn.Module) -> None:
    """offloaded_checkpoint as the checkpointing function of every layer of ``model`` (HF's kept aside)."""
    for layer in _layers(model):
        current = layer.__dict__.get("_gradient_checkpointing_func", _MISSING)
        if _is_offloaded(current):
            continue
        setattr(layer, _HF_FUNC, current)
        layer._gradient_checkpointing_func = _offloaded_from(current, layer)


class _SetGradientCheckpointing:
    """The instance-level ``_set_gradient_checkpointing`` of a model under offloading: HF's (every
    ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` / ``..._disable`` of
    transformers 5.x ends there), then offloaded_checkpoint installed over the function it set."""

    def __init__(self, model: torch.nn.Module, previous: Any) -> None:
        self.model = model
        self.previous = previous  # an instance-level function found there, or _MISSING

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if self.previous is not _MISSING:
            result = self.previous(*args, **kwargs)
        else:
            result = type(model)._set_gradient_checkpointing(model, *args, **kwargs)
        state = model.__dict__[_STATE]
        if not state.enabling:
            state.turned_on = False  # the user (or Trainer, PEFT) set checkpointing: theirs to keep
        _install(model)
        return result


def _pretrained(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers import PreTrainedModel

    found = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not found:
        raise TypeError(
            f"model: {type(model).__name__} holds no transformers PreTrainedModel (activation offloading "
            "installs itself through HF's gradient checkpointing)"
        )
    return found


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Gradient checkpointing with the layer inputs offloaded to pinned host memory, on ``model``.

    ``model`` is a transformers model or a module holding one (a PEFT ``PeftModel``: the first
    ``PreTrainedModel`` among its modules is the one switched). Every ``GradientCheckpointingLayer`` gets
    :func:`offloaded_checkpoint` as its ``_gradient_checkpointing_func``, with the options of the
    function HF had set (``use_reentrant``, ``preserve_rng_state``...). If HF's gradient checkpointing
    is off, it is switched on first (``activation_checkpointing_enable`` or, before transformers 5.24,
    ``gradient_checkpointing_enable``, with ``use_reentrant=False``); ``every_n_layers`` set earlier is
    kept. Later calls of those (by the user, PEFT's ``prepare_model_for_kbit_training``, Trainer's
    ``gradient_checkpointing=True``, with any kwargs) keep offloading installed: the model's
    ``_set_gradient_checkpointing``, where all of them end, is wrapped on the instance. Calling
    ``enable`` again is a no-op. Memory: ``layers x B x T x H`` activation elements leave the device for
    host memory (see :func:`host_memory_stats`).

    Args:
        model: the model (trained in ``model.train()`` mode, as HF checkpoints only in training).

    Returns:
        ``model``.

    Raises:
        TypeError: no ``PreTrainedModel`` in ``model``.
        ValueError: the model does not support gradient checkpointing, has no
            ``GradientCheckpointingLayer``, or was set with checkpointing options offloading does not
            support (``context_fn``).

    Example:
        >>> import transformers
        >>> from fuselm.hf import offload
        >>> config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100)
        >>> model = offload.enable(transformers.Qwen3ForCausalLM(config))
        >>> model.model.layers[0]._gradient_checkpointing_func.func.__name__
        'offloaded_checkpoint'
        >>> offload.is_enabled(model), model.model.layers[1].gradient_checkpointing
        (True, True)
    """
    found = _pretrained(model)
    top = found[0]
    if not getattr(top, "supports_gradient_checkpointing", False):
        raise ValueError(f"model: {type(top).__name__} does not support gradient checkpointing")
    if "value" in inspect.signature(top._set_gradient_checkpointing).parameters:
        raise ValueError(
            f"model: {type(top).__name__} uses the pre-4.35 checkpointing format "
            "(_set_gradient_checkpointing with a 'value' argument); offloading needs the current one"
        )
    layers = _layers(top)
    if not layers:
        raise ValueError(f"model: {type(top).__name__} has no GradientCheckpointingLayer to checkpoint")
    state = top.__dict__.get(_STATE)
    if state is None:
        state = _State()
        for m in found:
            if _STATE in m.__dict__:  # a sub-model enabled on its own before: take it over
                _unwrap(m)
            m.__dict__[_STATE] = state
            previous = m.__dict__.get("_set_gradient_checkpointing", _MISSING)
            m.__dict__["_set_gradient_checkpointing"] = _SetGradientCheckpointing(m, previous)
    if any(layer.gradient_checkpointing for layer in layers):
        _install(top)
        return model
    state.enabling = True
    try:
        hf_enable = getattr(top, "activation_checkpointing_enable", None)
        if hf_enable is not None:
            hf_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            top.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    finally:
        state.enabling = False
    state.turned_on = True
    return model


def _unwrap(m: torch.nn.Module) -> None:
    wrapper = m.__dict__.pop("_set_gradient_checkpointing", None)
    if isinstance(wrapper, _SetGradientCheckpointing) and wrapper.previous is not _MISSING:
        m.__dict__["_set_gradient_checkpointing"] = wrapper.previous
    m.__dict__.pop(_STATE, None)


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable`: HF's checkpointing function back on every layer that has offloading.

    The function restored is the one HF set last (at :func:`enable`, or by a later
    ``gradient_checkpointing_enable``); checkpointing is switched off only if :func:`enable` switched it
    on and nobody set it since. A model without offloading is returned unchanged.

    Args:
        model: the model given to :func:`enable`.

    Returns:
        ``model``.

    Example:
        >>> import transformers
        >>> from fuselm.hf import offload
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
        >>> model = offload.disable(offload.enable(transformers.LlamaForCausalLM(config)))
        >>> offload.is_enabled(model), model.model.layers[0].gradient_checkpointing
        (False, False)
    """
    found = _pretrained(model)
    state = found[0].__dict__.get(_STATE)
    if state is None:
        return model
    for m in found:
        if m.__dict__.get(_STATE) is state:
            _unwrap(m)
    for layer in _layers(found[0]):
        hf_func = layer.__dict__.pop(_HF_FUNC, _MISSING)
        if _is_offloaded(layer.__dict__.get("_gradient_checkpointing_func")):
            if hf_func is _MISSING:
                del layer._gradient_checkpointing_func
            else:
                layer._gradient_checkpointing_func = hf_func
    if state.turned_on:
        top = found[0]
        hf_disable = getattr(top, "activation_checkpointing_disable", None)
        if hf_disable is not None:
            hf_disable()
        else:
            top.gradient_checkpointing_disable()
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Does ``model``'s training forward offload: :func:`enable` applied (not undone) and at least one
    layer checkpointing with :func:`offloaded_checkpoint`?

    Example:
        >>> import torch
        >>> from fuselm.hf import offload
        >>> offload.is_enabled(torch.nn.Linear(2, 2))
        False
    """
    try:
        found = _pretrained(model)
    except TypeError:
        return False
    if _STATE not in found[0].__dict__:
        return False
    return any(
        layer.gradient_checkpointing and _is_offloaded(layer.__dict__.get("_gradient_checkpointing_func"))
        for layer in _layers(found[0])
    )
