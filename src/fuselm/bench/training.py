"""Training a Hugging Face Llama and measuring it: the loop ``fuselm demo`` and ``fuselm bench e2e`` /
``grpo_step`` share.

- :func:`causal_lm_config` (:func:`llama_config`): a ``LlamaConfig`` or ``Qwen3Config`` from keyword
  arguments (no cache, the attention asked for), rope settings in whichever form the installed
  transformers takes.
- :func:`build_causal_lm` (:func:`build_llama`): the model built on the device in the given dtype (the
  rotary buffers stay fp32, as ``from_pretrained(dtype=...)`` leaves them), optionally loaded from a state
  dict.
- :class:`SavedTensorMeter`: the bytes of the activations autograd keeps for backward.
- :func:`train`: AdamW steps over a list of batches, ``warmup`` steps then timed ones between two device
  synchronizations, the logged values of every step, the saved activations of the first.
- :func:`causal_lm_loss`: the step's forward of a causal LM, ``labels = input_ids``.
- :func:`optimizer_step` and :func:`run_steps`: the training benchmarks' loop, per step: wall time, the
  process's CPU time, and from a short ``torch.profiler`` window after the timed steps the device time of
  the CUDA kernels and their count (:class:`KernelProfile`).

Peak memory is the caller's: it resets ``torch.cuda`` peak statistics where its figure starts (before the
model is built, or before the loop) and reads them after :func:`train`.
"""

from __future__ import annotations

import gc
import inspect
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .harness import sync

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


def llama_config(model: dict[str, Any], attn_implementation: str = "sdpa"):
    """:func:`causal_lm_config` of a ``LlamaConfig``."""
    return causal_lm_config("llama", model, attn_implementation)


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


def build_llama(
    config, device: str | torch.device, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None
):
    """:func:`build_causal_lm` of a ``LlamaConfig`` (a ``LlamaForCausalLM``)."""
    return build_causal_lm(config, device, dtype, state)


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


# ---- the training benchmarks' loop: per-step wall, CPU and kernel time ----


Step = Callable[[int], torch.Tensor]
"""One whole training step (forward, backward, optimizer): step index -> the detached values to log."""


def optimizer_step(
    forward: Forward, params: Sequence[torch.nn.Parameter], batches: Sequence[Any], *, lr: float, fused: bool
) -> Step:
    """A :data:`Step` over ``batches`` (step ``i`` takes ``batches[i % len(batches)]``): ``loss, logged =
    forward(batch)``, ``loss.backward()``, ``AdamW.step()`` (``lr`` constant),
    ``zero_grad(set_to_none=True)``; returns ``logged``."""
    optimizer = torch.optim.AdamW(list(params), lr=lr, fused=fused)

    def step(i: int) -> torch.Tensor:
        loss, logged = forward(batches[i % len(batches)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return logged

    return step


@dataclass
class KernelProfile:
    """What the device did during a ``torch.profiler`` window of ``steps`` steps: CUDA kernels (count and
    summed device time), memory copies and memsets (count and time), each over the whole window."""

    steps: int
    kernels: int = 0
    kernel_s: float = 0.0
    memcpys: int = 0
    memcpy_s: float = 0.0
    memsets: int = 0
    memset_s: float = 0.0

    @classmethod
    def from_events(cls, events: Iterable[Any], steps: int) -> KernelProfile:
        """Sum the device-side events of a profile (``prof.events()``): those whose ``device_type`` is CUDA;
        a name starting with ``Memcpy`` or ``Memset`` is a copy or a memset, anything else a kernel, each
        lasting ``time_range.elapsed_us()``.

        Example:
            >>> from types import SimpleNamespace as E
            >>> from torch.autograd import DeviceType
            >>> def ev(name, us, dev=DeviceType.CUDA):
            ...     return E(name=name, device_type=dev, time_range=E(elapsed_us=lambda: us))
            >>> p = KernelProfile.from_events([ev("gemm", 30), ev("Memcpy HtoD", 5), ev("aten::mm", 40,
            ...     DeviceType.CPU), ev("triton_rms", 10)], steps=2)
            >>> p.kernels, round(p.kernel_s * 1e6), p.memcpys, p.per_step("kernels")
            (2, 40, 1, 1.0)
        """
        from torch.autograd import DeviceType

        out = cls(steps=steps)
        for event in events:
            if event.device_type != DeviceType.CUDA:
                continue
            seconds = event.time_range.elapsed_us() * 1e-6
            if event.name.startswith("Memcpy"):
                out.memcpys += 1
                out.memcpy_s += seconds
            elif event.name.startswith("Memset"):
                out.memsets += 1
                out.memset_s += seconds
            else:
                out.kernels += 1
                out.kernel_s += seconds
        return out

    def per_step(self, field_name: str) -> float | None:
        """``field_name``'s total over the window / its steps (None without steps)."""
        return getattr(self, field_name) / self.steps if self.steps else None


def profile_steps(step: Step, first: int, count: int, device: torch.device) -> KernelProfile:
    """Run steps ``first .. first + count - 1`` under ``torch.profiler`` (CPU and, on CUDA, CUDA activity;
    no shapes, stacks or memory recorded) and return their :class:`KernelProfile` (all zero on a CPU);
    the logged values of those steps are returned by :func:`run_steps`, not here."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(first, first + count):
            step(i)
        sync(device)
    return KernelProfile.from_events(prof.events(), count)


@dataclass
class StepRun:
    """What :func:`run_steps` measured.

    Attributes:
        logged: the logged values of every step (warmup, timed, profiled), ``Tensor.tolist()`` of each.
        warmup_s: wall time of the warmup steps (synchronized).
        step_s: wall time of each timed step, from the device synchronization before it to the one after.
        cpu_s: the process's CPU time (``time.process_time``, every thread) of the timed steps, summed;
            each step's is read before its closing synchronization, so waiting for the device is not in it.
        profile: the kernels of the profiled steps after the timed ones (None when there were none).
    """

    logged: list[Any]
    warmup_s: float
    step_s: list[float]
    cpu_s: float
    profile: KernelProfile | None

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    @property
    def cpu_step_s(self) -> float | None:
        """CPU time per timed step."""
        return self.cpu_s / len(self.step_s) if self.step_s else None


def run_steps(step: Step, *, warmup: int, steps: int, profiled: int, device: torch.device) -> StepRun:
    """``warmup`` steps, ``steps`` timed steps, then ``profiled`` steps under :func:`profile_steps`.

    Each timed step runs between two device synchronizations (its wall time is theirs); the process's CPU
    time is read before the closing one, so a host that waits for the device does not count the wait (a
    spinning ``cudaDeviceSynchronize`` would otherwise make every step look host-bound). The logged values
    stay on the device until the end. Exceptions (``torch.cuda.OutOfMemoryError`` too) propagate.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> forward = lambda x: (((w * x).sum() - 1) ** 2,) * 2
        >>> step = optimizer_step(forward, [w], [torch.ones(3)], lr=0.1, fused=False)
        >>> run = run_steps(step, warmup=1, steps=3, profiled=1, device=torch.device("cpu"))
        >>> len(run.logged), len(run.step_s), run.logged[0], run.profile.steps, run.profile.kernels
        (5, 3, 4.0, 1, 0)
    """
    logged: list[torch.Tensor] = []
    sync(device)
    t0 = time.perf_counter()
    for i in range(warmup):
        logged.append(step(i))
    sync(device)
    warmup_s = time.perf_counter() - t0
    step_s: list[float] = []
    cpu_s = 0.0
    for i in range(warmup, warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logged.append(step(i))
        cpu_s += time.process_time() - c0
        sync(device)
        step_s.append(time.perf_counter() - t0)
    profile = None
    if profiled > 0:
        first = warmup + steps
        profile = profile_steps(lambda i: logged.append(step(i)), first, profiled, device)
    return StepRun(
        logged=torch.stack([t.detach().double() for t in logged]).cpu().tolist() if logged else [],
        warmup_s=warmup_s,
        step_s=step_s,
        cpu_s=cpu_s,
        profile=profile,
    )
