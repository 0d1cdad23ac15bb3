"""A fixed-shape training step's forward and backward captured once in a CUDA graph, then replayed.

At small batches a patched model's step is bound by the host (Python, the autograd engine and ~15-25 us of
launch cost per kernel, see the README's "Small batches"); replaying one CUDA graph launches the whole
forward and backward with one call. torch and the standard library only: any model whose step captures
(no host sync, no data-dependent shapes, CUDA tensors) works, fuselm-patched or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["CapturedStep"]


class CapturedStep:
    """Forward + backward of ``loss_fn`` captured in one CUDA graph, replayed on each call.

    Built from example inputs (CUDA tensors with the shapes and dtypes of every later batch): they are
    copied into static tensors, ``warmup`` forward + backward passes run on a side stream (compiling every
    Triton kernel, settling the allocator), then one pass is captured. Each call copies the new inputs into
    the static ones and replays the graph: the loss and every parameter's gradient are written into static
    tensors; the parameters' ``.grad`` are those gradient tensors (overwritten by the next call: run
    ``optimizer.step()`` in between; to accumulate over micro-batches, add ``.grad`` into your own buffers).
    The optimizer stays outside the graph. Parameters the loss does not reach get ``.grad = None``.

    The step must capture: fuselm's ops make no host sync while a graph is being captured; a model that
    syncs (``.item()``, data-dependent shapes; HF's eager attention builds its mask from a host scalar: use
    SDPA) fails at construction with CUDA's error. Dropout draws new masks on every replay.

    Args:
        loss_fn: ``loss_fn(*inputs) -> loss`` (a scalar tensor), e.g. ``lambda ids, labels:
            model(input_ids=ids, labels=labels).loss``.
        params: the parameters to differentiate (those that require grad).
        example_inputs: CUDA tensors shaped as every later call's inputs (their values are used by the
            warm-up passes).
        warmup: forward + backward passes before capture (>= 1).

    Call: ``step(*inputs) -> loss`` (a fresh tensor, detached); ``inputs`` must match the example inputs'
    shapes, dtypes and device.

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
    """

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        params: Iterable[torch.nn.Parameter],
        example_inputs: Sequence[torch.Tensor],
        *,
        warmup: int = 3,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
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
        for i, t in enumerate(examples):
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                where = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a tensor on {t.device}"
                raise ValueError(f"example_inputs[{i}] must be a CUDA tensor, got {where}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
        self._loss_fn = loss_fn
        self.static_inputs = [t.detach().clone() for t in examples]

        side = torch.cuda.Stream(device=self.static_inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._forward_backward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss, self.static_grads = self._forward_backward()

    def _forward_backward(self) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        loss = self._loss_fn(*self.static_inputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {_describe(loss)}")
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        return loss.detach(), grads

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(
                f"expected {len(self.static_inputs)} inputs (as example_inputs), got {len(inputs)}"
            )
        for i, (t, static) in enumerate(zip(inputs, self.static_inputs, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"inputs[{i}] must be a tensor, got {type(t).__name__}")
            if t.shape != static.shape or t.dtype != static.dtype or t.device != static.device:
                raise ValueError(
                    f"inputs[{i}] must be {_describe(static)} as captured, got {_describe(t)} "
                    "(a graph replays fixed shapes: capture one step per shape)"
                )
        for t, static in zip(inputs, self.static_inputs, strict=True):
            if t.data_ptr() != static.data_ptr():
                static.copy_(t)
        self.graph.replay()
        for p, g in zip(self.params, self.static_grads, strict=True):
            p.grad = g
        return self.static_loss.clone()


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {list(x.shape)} on {x.device}"
    return type(x).__name__
