"""Training a Hugging Face causal LM and measuring it: the loop of the lab's step benchmarks (``e2e``,
``finetune``, ``grpo_step``). ``fuselm demo`` has its own, smaller loop in the package.

- :func:`causal_lm_config`: a ``LlamaConfig`` or ``Qwen3Config`` from keyword
  arguments (no cache, the attention asked for), rope settings in whichever form the installed
  transformers takes.
- :func:`build_causal_lm`: the model built on the device in the given dtype (the
  rotary buffers stay fp32, as ``from_pretrained(dtype=...)`` leaves them), optionally loaded from a state
  dict.
- :class:`SavedTensorMeter`: the bytes of the activations autograd keeps for backward.
- :func:`train`: AdamW steps over a list of batches, ``warmup`` steps then timed ones between two device
  synchronizations, the logged values of every step, the saved activations of the first.
- :func:`causal_lm_loss`: the step's forward of a causal LM, ``labels = input_ids``.
- :func:`sync`, :func:`free_memory`: wait for the device; hand cached memory back between runs.

Peak memory is the caller's: it resets ``torch.cuda`` peak statistics where its figure starts (before the
model is built, or before the loop) and reads them after :func:`train`.
"""

from __future__ import annotations

import gc
import inspect
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand cached blocks back (CUDA), between runs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


Forward = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
"""One step's forward: batch -> (the loss to backpropagate, the detached values to log for the step)."""


FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
"""model family -> (config class, causal LM class) in ``transformers``."""


def causal_lm_config(family: str, model: dict[str, Any], attn_implementation: str = "sdpa"):
    """A ``transformers`` config of ``family`` (a key of :data:`FAMILIES`) from keyword arguments with
    ``rope_theta`` and optionally ``rope_scaling`` (None or absent: default rope), no cache. transformers 5
    takes the rope settings as ``rope_parameters`` (theta inside); older versions as ``rope_theta`` and
    ``rope_scaling``: whichever the installed config class accepts is used.

    Example:
        >>> c = causal_lm_config("qwen3", {"vocab_size": 64, "hidden_size": 16, "rope_theta": 1e6})
        >>> type(c).__name__, c.vocab_size, c.use_cache, c._attn_implementation
        ('Qwen3Config', 64, False, 'sdpa')
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    config_class = getattr(transformers, FAMILIES[family][0])
    kwargs = dict(model)
    theta, scaling = kwargs.pop("rope_theta"), kwargs.pop("rope_scaling", None)
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        kwargs["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    else:
        kwargs.update(rope_theta=theta, rope_scaling=scaling)
    config = config_class(use_cache=False, **kwargs)
    config._attn_implementation = attn_implementation
    return config


def build_causal_lm(
    config, device: str | torch.device, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None
):
    """The causal LM of ``config`` (a config of one of :data:`FAMILIES`) on ``device`` in ``dtype`` (built
    with that default dtype, as ``from_pretrained(dtype=...)`` does, so the rotary buffers stay fp32),
    loaded from ``state`` if given, in training mode. Its initial weights come from the global torch RNG:
    seed it first for a given init."""
    import transformers

    family = config.model_type
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    model_class = getattr(transformers, FAMILIES[family][1])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


class _Packed:
    """What the pack hook hands autograd: a box whose lifetime is that of the saved tensor's slot."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter:
    """Bytes of the tensors autograd keeps for backward, counted while the context is open.

    Every tensor packed by autograd passes through a pack hook; the meter keeps a weak reference to it.
    :meth:`live_bytes`, called after the forward, sums the storages (each counted once, by
    ``untyped_storage().data_ptr()``) of the packed tensors still referenced by the graph: tensors saved
    by a graph that was already freed (e.g. an inner ``torch.autograd.grad`` inside a fused op) and the
    storages of ``exclude`` (the parameters, which exist anyway) are not counted.

    Example:
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> with SavedTensorMeter(exclude=[w]) as meter:
        ...     y = (torch.randn(4, 8) @ w).sin().sum()
        ...     saved = meter.live_bytes()
        >>> saved  # the [4, 8] input of the matmul and the [4, 8] input of sin, fp32
        256
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._boxes: list[weakref.ref] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        box = _Packed(tensor)
        self._boxes.append(weakref.ref(box))
        return box

    @staticmethod
    def _unpack(box: _Packed) -> torch.Tensor:
        return box.tensor

    def live_bytes(self) -> int:
        """Bytes of the unique storages of the packed tensors that are still saved."""
        gc.collect()
        seen: dict[int, int] = {}
        for ref in self._boxes:
            box = ref()
            if box is None:
                continue
            storage = box.tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._exclude:
                seen[ptr] = storage.nbytes()
        return sum(seen.values())

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def causal_lm_loss(model) -> Forward:
    """The forward of a causal LM step: ``model(input_ids=ids, labels=ids).loss`` (Hugging Face shifts the
    labels), the ids moved to the model's device; logs the detached loss. The output (with its logits) is
    dropped at once, so the logits do not outlive the forward."""
    device = next(model.parameters()).device

    def forward(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = ids.to(device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        return loss, loss.detach()

    return forward


@dataclass
class TrainingRun:
    """What :func:`train` measured.

    Attributes:
        logged: the logged values of every step (``Tensor.tolist()`` of what the forward logged).
        warmup_s: wall time from the start to the first timed step (the warmup steps, synchronized).
        timed_s: wall time of the steps after the warmup, between two device synchronizations (None
            when there are none).
        timed_steps: how many steps that is.
        seconds: wall time of the whole loop.
        saved_bytes: activations saved for backward during the first step, parameters excluded (None
            when not measured).
    """

    logged: list[Any]
    warmup_s: float
    timed_s: float | None
    timed_steps: int
    seconds: float
    saved_bytes: int | None = None

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        """Tokens of the timed steps over their wall time (None without timed steps)."""
        if not self.timed_s or not self.timed_steps:
            return None
        return self.timed_steps * tokens_per_step / self.timed_s


def train(
    forward: Forward,
    params: Sequence[torch.nn.Parameter],
    batches: Sequence[Any],
    *,
    lr: float,
    fused_adamw: bool,
    warmup: int,
    measure_saved: bool = False,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> TrainingRun:
    """One AdamW step (``lr`` constant) per batch: ``loss, logged = forward(batch)``, ``loss.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``; then ``on_step(step, logged)``.

    The clock starts after a device synchronization; the timed steps start at step ``warmup``, after
    another, and end with a third. The logged values stay on the device until the end (no host sync in the
    loop unless ``on_step`` makes one). With ``measure_saved`` the first forward runs inside a
    :class:`SavedTensorMeter` that excludes ``params``. Exceptions (``torch.cuda.OutOfMemoryError`` too)
    propagate.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> def forward(x):
        ...     loss = ((w * x).sum() - 1) ** 2
        ...     return loss, loss.detach()
        >>> run = train(forward, [w], [torch.ones(3)] * 4, lr=0.1, fused_adamw=False, warmup=1)
        >>> len(run.logged), run.timed_steps, run.logged[0]
        (4, 3, 4.0)
    """
    params = list(params)
    device = params[0].device
    optimizer = torch.optim.AdamW(params, lr=lr, fused=fused_adamw)
    logged: list[torch.Tensor] = []
    saved_bytes = None
    sync(device)
    t_start = time.perf_counter()
    t_timed = None
    for step, batch in enumerate(batches):
        if step == warmup:
            sync(device)
            t_timed = time.perf_counter()
        if step == 0 and measure_saved:
            with SavedTensorMeter(exclude=params) as meter:
                loss, values = forward(batch)
                saved_bytes = meter.live_bytes()
        else:
            loss, values = forward(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged.append(values)
        if on_step is not None:
            on_step(step, values)
    sync(device)
    t_end = time.perf_counter()
    timed_steps = max(len(batches) - warmup, 0)
    return TrainingRun(
        logged=torch.stack(logged).cpu().tolist() if logged else [],
        warmup_s=(t_end if t_timed is None else t_timed) - t_start,
        timed_s=None if t_timed is None or not timed_steps else t_end - t_timed,
        timed_steps=timed_steps,
        seconds=t_end - t_start,
        saved_bytes=saved_bytes,
    )
