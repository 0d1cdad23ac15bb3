"""A training step's forward and backward captured in CUDA graphs once per input shape, then replayed.

At small batches a step is bound by the host (Python, the autograd engine and ~15-25 us of launch cost per
kernel, see the README's "Small batches"); replaying a CUDA graph launches a whole forward or backward with
one call. :class:`GraphCache` keeps, per input signature (the shapes, dtypes and devices of the tensor
arguments, the values of the others), the forward of a callable and its backward as two CUDA graphs:

- a call copies its tensors into the captured ones and replays the forward graph; its outputs come back in
  their structure (a ``ModelOutput``, a tuple, a tensor), the differentiable ones through one autograd node;
- when autograd reaches that node, the gradients it is given (of the loss, of per-token log-probs: whatever
  the caller computed from the outputs, scaled however it likes, eagerly) are copied into the backward
  graph, which replays and adds every parameter's gradient into its ``.grad`` as ``backward()`` adds it
  (into gradient buffers kept across steps, which become the ``.grad`` tensors). The optimizer, gradient
  clipping and the loss arithmetic around the call stay outside the graphs.

Signatures beyond ``max_graphs``, arguments that cannot be captured and a call made before the backward of
the previous one run eagerly, each said once (``warnings.warn``). :class:`CapturedStep` (a loss function's
step) and :mod:`fuselm.integrations.trainer` (Hugging Face's Trainer) are built on it. torch and the
standard library only: any model whose forward and backward capture (no host sync, no data-dependent
shapes, CUDA tensors) works, fuselm-patched or not.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["CapturedStep", "GraphCache"]

# fuselm's activation offloading, looked up (not imported: this module needs torch only) where a capture
# may hold its calls: the host buffers their captured copies use are the graphs' while they live, and their
# copies out are joined before a forward's capture ends
_OFFLOAD = "fuselm.offload"

# the device types a graph holds work of (tests emulate graphs on the CPU by adding "cpu")
CAPTURE_DEVICES = ("cuda",)
# argument values other than tensors that a signature holds (captured as constants)
CONSTANTS = (type(None), bool, int, float, str)


class _Ticket:
    """One replayed forward, until its backward has run (the cache keeps a weak reference to the last)."""

    __slots__ = ("done", "__weakref__")

    def __init__(self) -> None:
        self.done = False


class _GradientBuffers:
    """One gradient tensor per parameter, kept across steps and shapes: it is the parameter's ``.grad``
    after each replay. The first signature is captured twice, forward and backward: once with no ``.grad``
    (the gradients its backward writes become the buffers: a step after ``zero_grad()`` replays it, nothing
    to zero or add), once adding into the buffers; later signatures add into them (zeroed first where
    ``.grad`` is None; a ``.grad`` an eager backward made is copied in first)."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def has_any(self, params: Sequence[torch.Tensor]) -> bool:
        return any(id(p) in self._of for p in params)

    def adopt(self, params: Sequence[torch.Tensor]) -> None:
        """Make each parameter's current ``.grad`` its buffer (zeros where it has none)."""
        for p in params:
            self._of[id(p)] = (p, p.grad if p.grad is not None else torch.zeros_like(p))

    def pairs(self, params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its buffer) for each of ``params``, buffers made (zeros) on first need."""
        out = []
        for p in params:
            entry = self._of.get(id(p))
            if entry is None or entry[0] is not p:
                entry = self._of[id(p)] = (p, torch.zeros_like(p))
            out.append(entry)
        return out

    @staticmethod
    def prepare(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make each buffer hold its parameter's ``.grad`` (zero for None) before a backward adds to it."""
        zero = []
        for p, buffer in pairs:
            grad = p.grad
            if grad is buffer:
                continue
            if grad is None:
                zero.append(buffer)
            else:
                buffer.copy_(grad)
        if zero:
            torch._foreach_zero_(zero)

    @staticmethod
    def publish(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for p, buffer in pairs:
            if p.grad is not buffer:
                p.grad = buffer


class _Pass:
    """A captured forward and the backward that reads its activations, with the tensors they write."""

    __slots__ = ("forward", "backward", "outputs", "spec", "diff", "grad_outputs")

    def __init__(self, forward, backward, outputs, spec, diff, grad_outputs):
        self.forward, self.backward = forward, backward
        self.outputs = outputs  # the output leaves: static tensors (detached) and constants
        self.spec = spec  # their structure (torch.utils._pytree)
        self.diff = diff  # the indices of the leaves that require grad
        self.grad_outputs = grad_outputs  # their gradients, read by the backward graph


class _Graphs:
    """The captured passes of one signature: one whose backward adds into the gradient buffers, and for the
    first signature one whose backward writes them (a step after ``zero_grad()``)."""

    __slots__ = ("inputs", "add", "write", "pairs", "host_buffers", "__weakref__")

    def __init__(self, inputs, add: _Pass, write: _Pass | None, pairs, host_buffers: list):
        self.inputs = inputs  # the static input tensors (each call copies into them)
        self.add, self.write = add, write
        self.pairs = pairs  # (parameter, gradient buffer) of the parameters the backward reaches
        # (device index, pool entry) of the host buffers offloaded activations are copied into and out of
        # (fuselm.offload.captured_host_buffers): the pool's again once these graphs are gone
        self.host_buffers = host_buffers
        if host_buffers:
            weakref.finalize(self, sys.modules[_OFFLOAD].give_back_host_buffers, host_buffers)

    def pass_for_grads(self) -> _Pass:
        """The write pass when there is one and no parameter has a ``.grad``, else the add pass."""
        if self.write is not None and all(p.grad is None for p, _ in self.pairs):
            return self.write
        return self.add


class _Replay(torch.autograd.Function):
    """A forward graph's replay as one autograd node; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, cache, graphs, captured, ticket, anchor):
        ctx.set_materialize_grads(False)
        ctx.cache, ctx.graphs, ctx.captured, ctx.ticket = cache, graphs, captured, ticket
        captured.forward.replay()
        # scalars (the loss) are copied: callers keep them; the rest alias the graph's outputs without being
        # autograd views (which may not be changed in place: Trainer scales its loss with *=)
        return tuple(_copy_or_alias(captured.outputs[i]) for i in captured.diff)

    @staticmethod
    def backward(ctx, *grads):
        ctx.cache._replay_backward(ctx.graphs, ctx.captured, ctx.ticket, grads)
        return None, None, None, None, None


def _copy_or_alias(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 1:
        return t.clone()
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class GraphCache:
    """Forward and backward graphs of a callable per input signature, replayed by autograd.

    ``cache(fn, params, args, kwargs)`` returns what ``fn(*args, **kwargs)`` returns, computed by the forward
    graph of that signature (captured on its first call: ``warmup`` eager forward + backward passes on a side
    stream, which compile every Triton kernel and settle the allocator, then the capture); autograd runs the
    backward graph, which adds the gradients of ``params()`` into their ``.grad`` (the first signature has a
    second forward and backward for a step where no ``.grad`` exists, whose backward writes them instead:
    :class:`_GradientBuffers`). The graphs of all signatures share one memory pool (about one step's
    activations at the largest shape), so a call's outputs hold their values until the next captured call,
    and a call made while the backward of the previous one is still to come runs eagerly (its activations
    would be overwritten).

    Runs ``fn`` eagerly (the same results, autograd as usual) and warns once per cause: grad mode off
    (silently: nothing to capture), an argument that is no tensor of a captured device and no None / bool /
    int / float / str, a tensor argument that requires grad, a new signature beyond ``max_graphs``, a call
    before the previous call's backward. A capture that fails (a host synchronization, a data-dependent
    shape) raises RuntimeError naming the cause.

    Args:
        max_graphs: signatures captured at most (>= 1); the graphs of each are kept.
        warmup: eager forward + backward passes before each capture (>= 1).
        owner: the name warnings and errors give.
        capture_context: a context manager factory entered around the forward calls of the warm-up and the
            capture (e.g. a library's switch to a path without host synchronizations).
    """

    def __init__(
        self,
        *,
        max_graphs: int,
        warmup: int,
        owner: str,
        capture_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.max_graphs = check_count("max_graphs", max_graphs)
        self.warmup = check_count("warmup", warmup)
        self.owner = owner
        self._context = capture_context
        self._graphs: dict[tuple, _Graphs] = {}
        self._buffers = _GradientBuffers()
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._pool = None
        self._last: Callable[[], _Ticket | None] = lambda: None
        self._warned: set[str] = set()
        self.replays = 0  # calls replayed from a graph
        self.eager = 0  # calls run eagerly (not counting those without grad mode)

    @property
    def signatures(self) -> list[tuple]:
        """The captured signatures, in capture order."""
        return list(self._graphs)

    def __call__(self, fn: Callable, params: Callable[[], Sequence[torch.Tensor]], args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        signature = _signature(args, kwargs)
        if isinstance(signature, str):
            return self._eager(fn, args, kwargs, signature, signature)
        key, tensors, rebuild = signature
        last = self._last()
        if last is not None and not last.done:
            return self._eager(
                fn,
                args,
                kwargs,
                "pending",
                "a call before the backward of the previous call (which would overwrite its activations): "
                "it runs eagerly",
            )
        graphs = self._graphs.get(key)
        if graphs is None:
            if len(self._graphs) >= self.max_graphs:
                return self._eager(
                    fn,
                    args,
                    kwargs,
                    "max_graphs",
                    f"a batch of a new shape ({_describe_key(key)}) beyond max_graphs={self.max_graphs} "
                    "captured ones: it runs eagerly, as every further new shape does (pad batches to fewer "
                    "shapes, or raise max_graphs)",
                )
            graphs = self._graphs[key] = self._capture(fn, list(params()), key, tensors, rebuild)
        for static, t in zip(graphs.inputs, tensors, strict=True):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        ticket = _Ticket()
        self._last = weakref.ref(ticket)
        self.replays += 1
        captured = graphs.pass_for_grads()
        outputs = list(captured.outputs)
        replayed = _Replay.apply(self, graphs, captured, ticket, self._anchor(graphs))
        for i, t in zip(captured.diff, replayed, strict=True):
            outputs[i] = t
        return pytree.tree_unflatten(outputs, captured.spec)

    def capture(self, fn: Callable, params: Sequence[torch.Tensor], args: tuple, kwargs: dict) -> None:
        """Capture the signature of ``fn(*args, **kwargs)`` now (warm-up and capture, nothing replayed), as
        its first call would; ValueError when it cannot be captured."""
        signature = _signature(args, kwargs)
        if isinstance(signature, str):
            raise ValueError(f"{self.owner}: {signature}")
        key, tensors, rebuild = signature
        if key not in self._graphs:
            self._graphs[key] = self._capture(fn, list(params), key, tensors, rebuild)

    def _eager(self, fn, args, kwargs, cause: str, message: str):
        if cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(f"{self.owner}: {message}", stacklevel=3)
        self.eager += 1
        return fn(*args, **kwargs)

    def _anchor(self, graphs: _Graphs) -> torch.Tensor:
        """A leaf that requires grad on the graphs' device: the replayed node's input, so that its outputs
        require grad (its gradient stays None)."""
        device = graphs.pairs[0][0].device
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return anchor

    def _capture(self, fn, params, key, tensors, rebuild) -> _Graphs:
        for i, p in enumerate(params):
            if p.device.type not in CAPTURE_DEVICES:
                raise ValueError(
                    f"{self.owner}: trainable parameter {i} is on {p.device}: a graph holds GPU work only"
                )
        device = tensors[0].device if tensors else params[0].device
        inputs = [t.detach().clone() for t in tensors]
        args, kwargs = rebuild(inputs)

        def call():
            with self._context():
                return fn(*args, **kwargs)

        reached = self._warm_up(call, params, device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stash = [p.grad for p in reached]
        write = None
        offload = sys.modules.get(_OFFLOAD)  # offloaded calls exist only where it was imported
        with offload.captured_host_buffers() if offload else contextlib.nullcontext([]) as host_buffers:
            try:
                if not self._buffers.has_any(reached):
                    # AccumulateGrad takes a gradient as .grad where there is none: the buffers
                    for p in reached:
                        p.grad = None
                    write = self._capture_pass(call, key, reached)
                    self._buffers.adopt(reached)
                pairs = self._buffers.pairs(reached)
                # AccumulateGrad adds into an existing .grad in place: into the buffer
                for p, buffer in pairs:
                    p.grad = buffer
                add = self._capture_pass(call, key, reached)
            except BaseException:
                offload.give_back_host_buffers(host_buffers)  # no graph of this capture replays
                raise
            finally:
                for p, grad in zip(reached, stash, strict=True):
                    p.grad = grad
        return _Graphs(inputs, add, write, pairs, host_buffers)

    def _capture_pass(self, call, key, reached) -> _Pass:
        """Capture a forward and its backward (into the parameters' ``.grad`` as they are now)."""
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        offload = sys.modules.get(_OFFLOAD)
        with self._capturing(forward, key):
            leaves, spec = pytree.tree_flatten(call())
            if offload:  # the copies of offloaded inputs out to host memory: joined before the capture ends
                offload.join_captured_copies()
        diff = [i for i, o in enumerate(leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        grad_outputs = [torch.empty_like(leaves[i]) for i in diff]
        with self._capturing(backward, key):  # (reaches no other leaf: _warm_up checked)
            torch.autograd.backward([leaves[i] for i in diff], grad_outputs)
        outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in leaves]
        return _Pass(forward, backward, outputs, spec, diff, grad_outputs)

    def _warm_up(self, call, params, device) -> list[torch.Tensor]:
        """``warmup`` eager forward + backward passes on a side stream (the parameters' ``.grad`` as they
        were afterwards); returns the parameters the backward reaches."""
        stash = [p.grad for p in params]
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        reached: list[torch.Tensor] = []
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    for p in params:
                        p.grad = None
                    leaves = pytree.tree_leaves(call())
                    diff = [o for o in leaves if isinstance(o, torch.Tensor) and o.requires_grad]
                    reached = []
                    if diff:
                        self._check_leaves(diff, params)
                        torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
                        reached = [p for p in params if p.grad is not None]
                    if not reached:
                        raise ValueError(
                            f"{self.owner}: no output of the captured call reaches a trainable parameter "
                            "(nothing to train: no output requires grad)"
                        )
                    del leaves, diff
        finally:
            for p, grad in zip(params, stash, strict=True):
                p.grad = grad
        torch.cuda.current_stream(device).wait_stream(side)
        return reached

    def _check_leaves(self, outputs: list[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """ValueError when a tensor outside ``params`` would get a gradient from the outputs' backward (a
        leaf that requires grad and holds elements): the captured backward is a plain ``backward()`` (as a
        gradient checkpoint's recompute needs), so every leaf it reaches must be a parameter of the step."""
        own = {id(p) for p in params}
        seen, todo = set(), [o.grad_fn for o in outputs]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
            if leaf is not None and id(leaf) not in own and leaf.numel() > 0:
                raise ValueError(
                    f"{self.owner}: the step's backward reaches a tensor that requires grad and is not one "
                    f"of its parameters ({leaf.dtype} {list(leaf.shape)} on {leaf.device}): add it to the "
                    "parameters, or detach it"
                )
            todo.extend(next_node for next_node, _ in node.next_functions)

    @contextlib.contextmanager
    def _capturing(self, graph, key):
        """Capture into ``graph`` (the cache's pool; other threads' CUDA calls allowed: a data loader's
        pinning thread); a failure raises RuntimeError naming the signature and the cause."""
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                yield
        except Exception as e:
            raise RuntimeError(
                f"{self.owner}: the step of a batch of {_describe_key(key)} cannot be captured in a CUDA "
                f"graph: {type(e).__name__}: {e}. A capture fails on a host synchronization (.item(), a "
                "tensor's value read by Python, a data-dependent shape such as indexing by a boolean mask) "
                "or a tensor off the GPU; run these steps without capture"
            ) from e

    def _replay_backward(self, graphs: _Graphs, captured: _Pass, ticket: _Ticket, grads) -> None:
        if self._last() is not ticket:
            raise RuntimeError(
                f"{self.owner}: a backward through a captured forward after a later captured call overwrote "
                "its activations (call backward before the next forward)"
            )
        for static, grad in zip(captured.grad_outputs, grads, strict=True):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        if captured is graphs.write:  # writes the buffers: a .grad set since the forward is added after
            kept = [
                (b, p.grad.clone() if p.grad is b else p.grad) for p, b in graphs.pairs if p.grad is not None
            ]
            captured.backward.replay()
            for buffer, grad in kept:
                buffer.add_(grad)
        else:
            self._buffers.prepare(graphs.pairs)
            captured.backward.replay()
        self._buffers.publish(graphs.pairs)
        ticket.done = True


def check_count(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _signature(args: tuple, kwargs: dict):
    """(key, tensors, rebuild) of a call: the key holds each tensor's shape, dtype and device and each other
    argument's value; ``rebuild(tensors)`` gives (args, kwargs) with those tensors in place. Or a string:
    why the call cannot be captured."""
    named = [*enumerate(args), *sorted(kwargs.items())]
    key, tensors, slots = [], [], []
    for name, value in named:
        if isinstance(value, torch.Tensor):
            if value.device.type not in CAPTURE_DEVICES:
                return f"argument {name!r} is a tensor on {value.device}: calls with it run eagerly"
            if value.requires_grad:
                return f"argument {name!r} requires grad: calls with it run eagerly"
            key.append(("tensor", name, tuple(value.shape), value.dtype, value.device))
            slots.append(name)
            tensors.append(value)
        elif isinstance(value, CONSTANTS):
            key.append(("value", name, type(value).__name__, value))
        else:
            return (
                f"argument {name!r} is a {type(value).__name__} (a graph takes tensors and None / bool / "
                "int / float / str values): calls with it run eagerly"
            )
    if tensors:  # a graph replays the casts autocast made when it was captured
        device = tensors[0].device.type
        key.append(("autocast", torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
    n_args = len(args)

    def rebuild(statics: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        call_args, call_kwargs = list(args), dict(kwargs)
        for name, t in zip(slots, statics, strict=True):
            if isinstance(name, int) and name < n_args:
                call_args[name] = t
            else:
                call_kwargs[name] = t
        return tuple(call_args), call_kwargs

    return tuple(key), tensors, rebuild


def _describe_key(key: tuple) -> str:
    """The tensor arguments' shapes of a signature: ``input_ids [1, 2048], labels [1, 2048]``."""
    names = {True: "args[{}]", False: "{}"}
    shapes = [f"{names[isinstance(e[1], int)].format(e[1])} {list(e[2])}" for e in key if e[0] == "tensor"]
    return ", ".join(shapes) or "no tensor arguments"


class CapturedStep:
    """Forward + backward of ``loss_fn`` captured in CUDA graphs, replayed on each call.

    Built from example inputs (CUDA tensors): they are copied into static tensors, ``warmup`` forward +
    backward passes run on a side stream (compiling every Triton kernel, settling the allocator), then the
    forward and the backward are captured. Each call copies the new inputs into the static ones, replays both
    and returns the loss; every parameter's gradient is added into its ``.grad`` as ``loss.backward()`` adds
    it (so gradient accumulation over micro-batches works as in eager code: run ``optimizer.step()`` and
    ``optimizer.zero_grad()`` between steps). The optimizer stays outside the graphs. Parameters the loss
    does not reach keep their ``.grad``.

    Inputs of another shape (or dtype) are captured too, up to ``max_graphs`` shapes; beyond that a call runs
    eagerly (the same loss and gradients), said once by a warning. The graphs share one memory pool.

    The step must capture: fuselm's ops make no host sync while a graph is being captured; a model that
    syncs (``.item()``, data-dependent shapes; HF's eager attention builds its mask from a host scalar: use
    SDPA) raises RuntimeError naming the cause. Dropout draws new masks on every replay. Gradient
    checkpointing captures with fuselm's recompute (``fuselm.hf.patch(model, checkpointing="recompute")``
    or ``"offload"``; :func:`fuselm.offload.recompute_checkpoint`, ``offloaded_checkpoint``) in layers that
    draw no random numbers (dropout raises RuntimeError at the capture); offloaded inputs go to host buffers
    that the graphs own while they live (every replay copies out and back); torch's checkpoint is not
    checked here for an exact recompute inside a graph.

    Args:
        loss_fn: ``loss_fn(*inputs) -> loss`` (a scalar tensor), e.g. ``lambda ids, labels:
            model(input_ids=ids, labels=labels).loss``.
        params: the parameters to differentiate (those that require grad): every tensor the loss's
            backward would give a gradient (ValueError at the capture naming one that is not among them).
        example_inputs: CUDA tensors shaped as the first calls' inputs (their values are used by the warm-up
            passes).
        warmup: forward + backward passes before each capture (>= 1).
        max_graphs: input shapes captured at most (>= 1).

    Call: ``step(*inputs) -> loss`` (a fresh tensor, detached); ``inputs`` are CUDA tensors.

    Example (the inputs must be on a GPU):
        >>> import torch
        >>> from fuselm import CapturedStep
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> CapturedStep(lambda x: (w * x).sum(), [w], [torch.ones(3)])
        Traceback (most recent call last):
        ValueError: example_inputs[0] must be a CUDA tensor, got a tensor on cpu

    On a GPU, a patched model's step:
        >>> import fuselm.hf                                              # doctest: +SKIP
        >>> model = fuselm.hf.patch(model)                                # doctest: +SKIP
        >>> params = [p for p in model.parameters() if p.requires_grad]   # doctest: +SKIP
        >>> step = CapturedStep(lambda ids: model(input_ids=ids, labels=ids).loss, params,
        ...                     [batches[0]])                            # doctest: +SKIP
        >>> for ids in batches:                                           # doctest: +SKIP
        ...     loss = step(ids)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        params: Iterable[torch.nn.Parameter],
        example_inputs: Sequence[torch.Tensor],
        *,
        warmup: int = 3,
        max_graphs: int = 1,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self._graphs = GraphCache(max_graphs=max_graphs, warmup=warmup, owner="CapturedStep")
        self.params = list(params)
        if not self.params:
            raise ValueError("params is empty: give the parameters whose gradients the step computes")
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor) or not p.requires_grad:
                raise ValueError(f"params[{i}] must be a tensor that requires grad")
        if isinstance(example_inputs, torch.Tensor):
            raise TypeError("example_inputs must be a sequence of tensors (wrap a single tensor in a list)")
        examples = list(example_inputs)
        if not examples:
            raise ValueError("example_inputs is empty: give the step's input tensors (e.g. [input_ids])")
        _check_inputs("example_inputs", examples)
        self._loss_fn = loss_fn
        self._graphs.capture(self._loss, self.params, tuple(examples), {})

    def _loss(self, *inputs: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(*inputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {_describe(loss)}")
        return loss

    @property
    def graphs(self) -> GraphCache:
        """The graphs and their counters (``replays``, ``eager``, ``signatures``)."""
        return self._graphs

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        _check_inputs("inputs", inputs)
        loss = self._graphs(self._loss, lambda: self.params, inputs, {})
        loss.backward()
        return loss.detach()


def _check_inputs(name: str, inputs: Sequence[Any]) -> None:
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.device.type not in CAPTURE_DEVICES:
            where = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a tensor on {t.device}"
            raise ValueError(f"{name}[{i}] must be a CUDA tensor, got {where}")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {list(x.shape)} on {x.device}"
    return type(x).__name__
