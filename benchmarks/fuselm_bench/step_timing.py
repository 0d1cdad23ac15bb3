"""The step loop of ``e2e`` and ``finetune``: per step wall time, the process's CPU time and, from a
``torch.profiler`` window after the timed steps, the CUDA kernels' device time and count
(:class:`KernelProfile`); the same figures of ``Trainer.train()`` (:func:`run_trainer`)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from fuselm import CapturedStep

from .training import Forward, sync

Step = Callable[[int], torch.Tensor]
"""One whole training step (forward, backward, optimizer): step index -> the detached values to log."""


def optimizer_step(
    forward: Forward,
    params: Sequence[torch.nn.Parameter],
    batches: Sequence[Any],
    *,
    lr: float,
    fused: bool,
    graphed: bool = False,
) -> Step:
    """A :data:`Step`: forward, backward, ``AdamW.step()``, ``zero_grad(set_to_none=True)``; ``logged``.
    ``graphed``: forward and backward replayed from one CUDA graph (:class:`fuselm.CapturedStep`, 3 warmup
    passes), AdamW outside it; logs the loss."""
    params = list(params)
    if graphed:
        captured = CapturedStep(lambda batch: forward(batch)[0], params, [batches[0]], warmup=3)
    optimizer = torch.optim.AdamW(params, lr=lr, fused=fused)

    def step(i: int) -> torch.Tensor:
        if graphed:
            logged = captured(batches[i % len(batches)])  # the replay adds into .grad
        else:
            loss, logged = forward(batches[i % len(batches)])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return logged

    return step


def watch_first_step(step: Step, called: set[int]) -> Step:
    """``step``, its first call adding the id of every module it calls to ``called``."""

    def watched(i: int) -> torch.Tensor:
        if i != 0:
            return step(i)
        hook = register_module_forward_pre_hook(lambda module, args: called.add(id(module)))
        try:
            return step(0)
        finally:
            hook.remove()

    return watched


@dataclass
class KernelProfile:
    """The CUDA kernels and memory copies (count, summed device time) of a profiled window of ``steps``."""

    steps: int
    kernels: int = 0
    kernel_s: float = 0.0
    memcpys: int = 0
    memcpy_s: float = 0.0
    by_name: dict[str, list[float]] = field(default_factory=dict)  # kernel name: [seconds, launches]
    idle_s: float = 0.0  # the device running nothing between its first event's start and its last's end
    idle_before: dict[str, list[float]] = field(default_factory=dict)  # next event's name: [idle s, gaps]

    @classmethod
    def from_events(cls, events: Iterable[Any], steps: int) -> KernelProfile:
        """Sum the CUDA events of ``prof.events()`` (``Memcpy*``: copies; ``Memset*``: not counted)."""
        from torch.autograd import DeviceType

        out = cls(steps=steps)
        spans = []
        for event in events:
            if event.device_type != DeviceType.CUDA:
                continue
            seconds = event.time_range.elapsed_us() * 1e-6
            start = getattr(event.time_range, "start", None)
            if start is not None:
                spans.append((start, start + event.time_range.elapsed_us(), event.name))
            if event.name.startswith("Memcpy"):
                out.memcpys += 1
                out.memcpy_s += seconds
            elif not event.name.startswith("Memset"):
                out.kernels += 1
                out.kernel_s += seconds
                entry = out.by_name.setdefault(event.name, [0.0, 0])
                entry[0], entry[1] = entry[0] + seconds, entry[1] + 1
        # idle: the gaps between events (any stream), each charged to the event that ends it: what the device
        # waited for (the host launching it, a synchronization)
        busy_until = None
        for start, end, name in sorted(spans):
            if busy_until is not None and start > busy_until:
                gap = (start - busy_until) * 1e-6
                out.idle_s += gap
                entry = out.idle_before.setdefault(name, [0.0, 0])
                entry[0], entry[1] = entry[0] + gap, entry[1] + 1
            busy_until = end if busy_until is None else max(busy_until, end)
        return out

    def top(self, n: int = 25, table: str = "by_name") -> list[tuple[str, float, float]]:
        """The ``n`` kernels of most device time (``table="idle_before"``: the events the device waited
        longest before): (name, ms per step, launches or gaps per step)."""
        steps = max(self.steps, 1)
        ranked = sorted(getattr(self, table).items(), key=lambda kv: -kv[1][0])[:n]
        return [(name[:120], s * 1e3 / steps, count / steps) for name, (s, count) in ranked]

    def per_step(self, field_name: str) -> float | None:
        return getattr(self, field_name) / self.steps if self.steps else None


@dataclass
class StepRun:
    """What :func:`run_steps` measured (``cpu_s``: the timed steps' summed CPU time)."""

    logged: list[Any]
    warmup_s: float
    step_s: list[float]
    cpu_s: float
    profile: KernelProfile | None


def device_profiler(device: torch.device) -> Any:
    """A ``torch.profiler.profile`` of CPU and (on CUDA) CUDA activity; no shapes, stacks or memory."""
    from torch.profiler import ProfilerActivity, profile

    cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    return profile(activities=[ProfilerActivity.CPU, *cuda])


def run_steps(step: Step, *, warmup: int, steps: int, profiled: int, device: torch.device) -> StepRun:
    """``warmup`` steps, ``steps`` timed steps, then ``profiled`` steps under ``torch.profiler``.

    Each timed step runs between two device synchronizations; the CPU time is read before the closing one,
    so waiting for the device is not counted (a spinning synchronize would make every step look
    host-bound). The logged values stay on the device until the end.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> forward = lambda x: (((w * x).sum() - 1) ** 2,) * 2
        >>> step = optimizer_step(forward, [w], [torch.ones(3)], lr=0.1, fused=False)
        >>> run = run_steps(step, warmup=1, steps=3, profiled=1, device=torch.device("cpu"))
        >>> len(run.logged), len(run.step_s), run.logged[0], run.profile.steps, run.profile.kernels
        (5, 3, 4.0, 1, 0)
    """
    sync(device)
    t0 = time.perf_counter()
    logged = [step(i) for i in range(warmup)]
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
        with device_profiler(device) as prof:
            for i in range(warmup + steps, warmup + steps + profiled):
                logged.append(step(i))
            sync(device)
        profile = KernelProfile.from_events(prof.events(), profiled)
    values = torch.stack([t.detach().double() for t in logged]).cpu().tolist() if logged else []
    return StepRun(values, warmup_s, step_s, cpu_s, profile)


def run_trainer(
    model,
    ids: torch.Tensor,
    *,
    graphs: bool,
    lr: float,
    fused: bool,
    warmup: int,
    steps: int,
    profiled: int,
    device: torch.device,
    seed: int,
) -> StepRun:
    """``Trainer.train()`` of ``model`` on ``ids`` (labels = ids), timed as :func:`run_steps` does; a step:
    one optimizer step's end to the next's (data loader, clipping, AdamW, logging)."""
    import transformers
    from transformers import trainer_callback

    rows = [{"input_ids": r, "labels": r} for r in ids.cpu()]
    total = warmup + steps + profiled
    run = StepRun([], 0.0, [], 0.0, None)

    class Clock(trainer_callback.TrainerCallback):
        """The figures of :func:`run_steps`, read at the end of every optimizer step."""

        def on_train_begin(self, args, state, control, **kwargs):
            sync(device)
            self.wall, self.cpu, self.profiler = time.perf_counter(), time.process_time(), None

        def on_step_end(self, args, state, control, **kwargs):
            cpu = time.process_time() - self.cpu  # before the synchronization: host work only
            sync(device)
            wall, step = time.perf_counter() - self.wall, state.global_step
            if step <= warmup:
                run.warmup_s += wall
            elif step <= warmup + steps:
                run.step_s.append(wall)
                run.cpu_s += cpu
            if step == warmup + steps and profiled:
                self.profiler = device_profiler(device)
                self.profiler.start()
            if step == total and self.profiler is not None:
                self.profiler.stop()
                run.profile = KernelProfile.from_events(self.profiler.events(), profiled)
            self.wall, self.cpu = time.perf_counter(), time.process_time()

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            out,
            per_device_train_batch_size=ids.shape[0],
            max_steps=total,
            learning_rate=lr,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused" if fused else "adamw_torch",
            logging_steps=1,
            train_sampling_strategy="sequential",
            dataloader_num_workers=0,
            use_cpu=device.type != "cuda",
            report_to="none",
            save_strategy="no",
            seed=seed,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=rows * total, callbacks=[Clock()]
        )
        for quiet in (trainer_callback.PrinterCallback, trainer_callback.ProgressCallback):
            trainer.remove_callback(quiet)
        if graphs:
            from fuselm.integrations.trainer import capture_training_steps

            capture_training_steps(trainer)
        trainer.train()
    run.logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return run
