"""The op suites' harness: suites, providers, timing, peak memory, the card's ceilings, ratios."""

from __future__ import annotations

import contextlib
import importlib
import math
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cases import Case, Row, run_cases
from .training import free_memory, sync

Shape = tuple[int, ...]
Inputs = dict[str, torch.Tensor]

MODES: tuple[str, ...] = ("fwd", "bwd", "full")
MIB = 1 << 20

CUDA_BUDGET_MS = {False: (25, 100), True: (5, 20)}  # by quick: triton.testing.do_bench's warmup and rep
CPU_REPS = {False: 5, True: 3}  # by quick: calls timed on a CPU


class SkipProvider(Exception):
    """Raised by ``Provider.setup`` when the provider cannot run here; the message is the reason."""


Setup = Callable[[torch.device], Callable[[Inputs], Any]]


def compiled_setup(fn: Callable[..., Any], args: Callable[[Inputs], tuple] | None = None) -> Setup:
    """A ``torch_compile`` provider's setup: ``torch.compile(fn, dynamic=False)`` afresh per case (Dynamo's
    cache reset: no cache-limit surprises), called as ``fn(*args(inputs))`` (no ``args``: ``fn(inputs)``)."""

    def setup(device: torch.device) -> Callable[[Inputs], Any]:
        if device.type != "cuda":
            raise SkipProvider("skipped on CPU (compile time would dominate a CPU smoke run)")
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=False)
        return compiled if args is None else lambda x: compiled(*args(x))

    return setup


def torch_providers(
    fn: Callable[..., Any], args: Callable[[Inputs], tuple] | None, description: str
) -> tuple[Provider, Provider]:
    """The ``torch`` provider, eager ``fn(*args(inputs))`` (else ``fn(inputs)``), and ``torch_compile``."""
    eager = fn if args is None else lambda x: fn(*args(x))
    return (
        Provider("torch", lambda device: eager, description),
        Provider("torch_compile", compiled_setup(fn, args), "torch.compile of the eager function"),
    )


def import_peer(
    device: torch.device, module: str, name: str, package: str = "liger_kernel", *, cuda: bool = True
) -> Any:
    """``module.name`` of a peer; :class:`SkipProvider` when it cannot be imported, or on a CPU (``cuda``)."""
    if cuda and device.type != "cuda":
        raise SkipProvider("needs CUDA")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        raise SkipProvider(f"{package} not importable ({type(e).__name__}: {e})") from None


def liger_provider(module: str, name: str, args: Callable[[Inputs], tuple]) -> Provider:
    """The ``liger`` provider: Liger-Kernel's ``module.name`` (CUDA only), as ``.apply(*args(inputs))``."""

    def setup(device: torch.device) -> Callable[[Inputs], Any]:
        function = import_peer(device, module, name)
        return lambda x: function.apply(*args(x))

    return Provider("liger", setup, f"liger_kernel {name}")


def bytes_cost(accesses: dict[str, int], elements: Callable[[Shape], int] = math.prod) -> CostFn:
    """A suite's ``cost``: ``accesses[mode]`` reads or writes of ``elements(shape)`` elements per call."""
    return lambda shape, mode, dtype: Cost(bytes=float(elements(shape) * accesses[mode] * dtype.itemsize))


@dataclass(frozen=True)
class Cost:
    """Bytes and FLOPs one call of a mode must at least move and do (``None``: not counted)."""

    bytes: float | None = None
    flops: float | None = None


CostFn = Callable[[Shape, str, torch.dtype], Cost]


@dataclass(frozen=True)
class Provider:
    """One implementation to time. ``setup(device)`` returns ``fn(inputs) -> Tensor | tuple``."""

    name: str
    setup: Setup
    description: str = ""


@dataclass(frozen=True)
class Suite:
    """An op to benchmark: ``make_inputs(shape, dtype, device)``, each provider's ``setup(device)(inputs)``,
    ``cost(shape, mode, dtype)``; ``forward_grad``: fwd records autograd (else ``no_grad``); ``cuda_graph``:
    on CUDA, ms from replays of a CUDA graph of the call."""

    name: str
    description: str
    shape_dims: tuple[str, ...]
    gpu_shapes: tuple[Shape, ...]
    cpu_shapes: tuple[Shape, ...]
    providers: tuple[Provider, ...]
    make_inputs: Callable[[Shape, torch.dtype, torch.device], Inputs]
    cost: CostFn
    columns: tuple[str, ...] = ("ms", "tbps", "x_copy", "extra_mib")
    forward_grad: bool = False
    cuda_graph: bool = False
    notes: tuple[str, ...] = ()

    def provider(self, name: str) -> Provider:
        """The provider called ``name`` (KeyError with the known names otherwise)."""
        found = [p for p in self.providers if p.name == name]
        if not found:
            raise KeyError(f"suite {self.name!r} has no provider {name!r}; known: {self.provider_names}")
        return found[0]

    @property
    def provider_names(self) -> list[str]:
        return [p.name for p in self.providers]


@dataclass(frozen=True)
class Ceilings:
    """The card's ceilings measured in this process (``None`` where not measured)."""

    copy_tbps: float | None = None
    gemm_tflops: float | None = None
    copy_what: str = ""
    gemm_what: str = ""

    def describe(self, missing: str) -> str:
        """'copy 3.10 TB/s (what); GEMM 700.0 TFLOP/s (what)', ``missing`` for a ceiling not measured."""
        copy = f"{self.copy_tbps:.2f} TB/s ({self.copy_what})" if self.copy_tbps else missing
        gemm = f"{self.gemm_tflops:.1f} TFLOP/s ({self.gemm_what})" if self.gemm_tflops else missing
        return f"copy {copy}; GEMM {gemm}"


@dataclass
class OpRow(Row):
    """One op-suite case (shape, provider, mode); ``status`` follows from ``error``."""

    shape: Shape
    provider: str
    mode: str
    ms: float | None = None
    ms_eager: float | None = None
    extra_bytes: int | None = None
    peak_bytes: int | None = None
    grad_bytes: int | None = None
    bytes: float | None = None
    flops: float | None = None
    tbps: float | None = None
    x_copy: float | None = None
    tflops: float | None = None
    x_gemm: float | None = None
    x_floor: float | None = None
    error: str | None = None
    note: str | None = None

    @property
    def status(self) -> str:
        if self.error is None:
            return "ok"
        if self.error.startswith("skipped: "):
            return "skipped"
        return "oom" if self.error.startswith("OutOfMemoryError") else "error"

    @classmethod
    def label(cls, shape: Sequence[Any]) -> str:
        return "x".join(map(str, shape))

    def figures(self) -> tuple[str, str]:
        return f"{self.ms:.4g} ms", self.mode

    @property
    def extra_mib(self) -> float | None:
        return None if self.extra_bytes is None else self.extra_bytes / MIB


@dataclass
class Report:
    """Everything a run produced; ``report.py`` writes it as markdown, JSON and PNG."""

    suite: Suite
    dtype: torch.dtype
    modes: tuple[str, ...]
    shapes: tuple[Shape, ...]
    providers: tuple[str, ...]
    metadata: dict[str, Any]
    ceilings: Ceilings
    rows: list[OpRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def row(self, shape: Shape, provider: str, mode: str) -> OpRow | None:
        """The row for (shape, provider, mode), or None."""
        key = (tuple(shape), provider, mode)
        return next((r for r in self.rows if (tuple(r.shape), r.provider, r.mode) == key), None)


# ---- ratios ----


def compute_ratios(ms: float | None, cost: Cost, ceilings: Ceilings) -> dict[str, float | None]:
    """``tbps``, ``x_copy``, ``tflops``, ``x_gemm``, ``x_floor`` of one time (None where an input is missing).

    Example:
        >>> r = compute_ratios(2.0, Cost(bytes=4e9), Ceilings(copy_tbps=4.0))
        >>> r["tbps"], r["x_copy"]
        (2.0, 0.5)
    """
    out: dict[str, float | None] = dict.fromkeys(("tbps", "x_copy", "tflops", "x_gemm", "x_floor"))
    if ms is None or not ms > 0 or not math.isfinite(ms):
        return out
    if cost.bytes is not None:
        out["tbps"] = cost.bytes / ms / 1e9
        if ceilings.copy_tbps:
            out["x_copy"] = out["tbps"] / ceilings.copy_tbps
    if cost.flops is not None:
        out["tflops"] = cost.flops / ms / 1e9
        if ceilings.gemm_tflops:
            out["x_gemm"] = out["tflops"] / ceilings.gemm_tflops
            out["x_floor"] = ms * ceilings.gemm_tflops * 1e9 / cost.flops
    return out


# ---- timing, memory, ceilings ----


def blocking_sync(ordinal: int = 0) -> str:
    """GPU ``ordinal``'s primary context waits by sleeping (``CU_CTX_SCHED_BLOCKING_SYNC``); call first."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "spin (no libcuda.so.1)"
    device = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return "spin (cuInit / cuDeviceGet failed)"
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    code = set_flags(device, 0x04)  # CU_CTX_SCHED_BLOCKING_SYNC
    return "blocking" if code == 0 else f"spin (cuDevicePrimaryCtxSetFlags returned {code})"


def call_times_ms(
    call: Callable[[Any], Any], n: int, device: torch.device, prepare: Callable[[], Any] = lambda: None
) -> list[float]:
    """Milliseconds of each of ``n`` calls ``call(prepare())``, ``prepare()`` untimed: on CUDA between two
    events (one host sync, at the end), on a CPU ``time.perf_counter``."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            arg = prepare()
            t0 = time.perf_counter()
            call(arg)
            times.append((time.perf_counter() - t0) * 1e3)
            del arg
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        arg = prepare()
        start.record()
        call(arg)
        end.record()
        del arg
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def time_ms(fn: Callable[[], Any], device: torch.device, *, quick: bool = False) -> float:
    """Median time of ``fn()`` in ms: ``triton.testing.do_bench`` on CUDA, perf_counter on CPU."""
    if device.type == "cuda":
        import triton.testing

        warmup, rep = CUDA_BUDGET_MS[quick]
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return statistics.median(call_times_ms(lambda _: fn(), CPU_REPS[quick], device))


def capture_graph(
    call: Callable[..., Any], device: torch.device, forward: Callable[[], Any] | None = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``call()`` captured in a CUDA graph after two calls on a side stream: ``(graph, None)``. With
    ``forward``, the backward alone: ``outs = forward()`` runs eagerly on that stream (autograd's backward
    too), then ``call(outs)`` (with ``retain_graph=True``) is captured there: ``(graph, outs)``."""
    run = call if forward is None else lambda: call(forward())
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
        outs = None if forward is None else forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=None if forward is None else stream):
            call() if forward is None else call(outs)
    except Exception:
        # a failed capture (a host sync in the call, say) leaves the default CUDA generator in capture mode:
        # every later random op would raise "Offset increment outside graph capture"
        torch.cuda.synchronize(device)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.zeros(1, device=device)
        raise
    return graph, outs


BWD_FLUSH_BYTES = 256 << 20  # the L2 flush before each timed backward (do_bench's size)


def time_backward_ms(
    forward: Callable[[], Any], backward: Callable[[Any], Any], device: torch.device, *, quick: bool = False
) -> float:
    """Median ms of ``backward(outs)`` after an untimed ``outs = forward()``: on CUDA between two events after
    the L2 flush of ``triton.testing.do_bench`` (256 MiB zeroed), repetitions from do_bench's budgets; on a
    CPU ``perf_counter``, ``CPU_REPS`` repetitions.

    Example:
        >>> x = torch.randn(64, requires_grad=True)
        >>> backward = lambda y: torch.autograd.grad(y, [x])
        >>> time_backward_ms(lambda: (x * x).sum(), backward, torch.device("cpu")) > 0
        True
    """
    if device.type != "cuda":
        return statistics.median(call_times_ms(backward, CPU_REPS[quick], device, forward))
    warmup_ms, rep_ms = CUDA_BUDGET_MS[quick]
    flush = torch.empty(BWD_FLUSH_BYTES, dtype=torch.int8, device=device)

    def prepare() -> Any:
        outs = forward()
        flush.zero_()
        return outs

    estimate = statistics.median(call_times_ms(backward, 5, device, prepare))
    for _ in range(max(1, int(warmup_ms / max(estimate, 1e-3)))):
        backward(forward())
    reps = max(1, int(rep_ms / max(estimate, 1e-3)))
    return float(statistics.median(call_times_ms(backward, reps, device, prepare)))


def timing_method(device: torch.device, quick: bool, cuda_graph: bool = False) -> str:
    if device.type == "cuda":
        warmup, rep = CUDA_BUDGET_MS[quick]
        graph = "; ms: replays of a CUDA graph of the call, eager ms: the plain call" if cuda_graph else ""
        return (
            f"triton.testing.do_bench median (warmup={warmup} ms, rep={rep} ms); bwd: the backward alone "
            f"after an untimed forward, between CUDA events, L2 flushed, median{graph}"
        )
    reps = CPU_REPS[quick]
    return f"time.perf_counter median of {reps} calls after 2 warmup calls (bwd: of the backward alone)"


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    raise TypeError(f"a provider must return a Tensor or a tuple of Tensors, got {type(x).__name__}")


def fresh_bytes(tensors: Iterable[torch.Tensor | None], inputs: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` that do not alias any of ``inputs``."""
    taken = {t.untyped_storage().data_ptr() for t in inputs}
    total = 0
    for st in (t.untyped_storage() for t in tensors if t is not None):
        if st.data_ptr() not in taken:
            taken.add(st.data_ptr())
            total += st.nbytes()
    return total


def measure_ceilings(device: torch.device, *, quick: bool = False) -> Ceilings:
    """Copy bandwidth (bytes read + written) and GEMM rate, measured now: CUDA 1 GiB copy, bf16 8192^3 GEMM;
    CPU 64 MiB copy, fp32 1024^3 GEMM (so a CPU smoke run has ratios)."""
    cuda = device.type == "cuda"
    copy_bytes, dtype, gemm_n = (1 << 30, torch.bfloat16, 8192) if cuda else (64 * MIB, torch.float32, 1024)

    def copy_tbps() -> float:
        src = torch.randn(copy_bytes // dtype.itemsize, device=device, dtype=dtype)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return 2 * copy_bytes / time_ms(lambda: dst.copy_(src), device, quick=quick) / 1e9

    def gemm_tflops() -> float:
        a, b = (torch.randn(gemm_n, gemm_n, device=device, dtype=dtype) for _ in range(2))
        a @ b
        return 2 * gemm_n**3 / time_ms(lambda: a @ b, device, quick=quick) / 1e9

    rates = {}
    for what, rate in (("copy bandwidth", copy_tbps), ("GEMM rate", gemm_tflops)):
        try:
            rates[what] = rate()
        except Exception as e:  # noqa: BLE001 - a ceiling that cannot be measured is reported missing
            print(f"could not measure {what}: {type(e).__name__}: {e}")
        free_memory(device)
    return Ceilings(
        copy_tbps=rates.get("copy bandwidth"),
        gemm_tflops=rates.get("GEMM rate"),
        copy_what=f"dst.copy_(src), {copy_bytes // MIB} MiB, bytes read + written",
        gemm_what=f"{'bf16' if cuda else 'fp32'} GEMM {gemm_n}^3",
    )


# ---- one case ----


def _measure(suite: Suite, case: Case, dtype: torch.dtype, device: torch.device, quick: bool) -> OpRow:
    """Time (and on CUDA, for fwd and full, measure the memory of) one (shape, provider, mode)."""
    shape, mode = case.shape, case.mode
    row = OpRow(shape=tuple(shape), provider=case.provider, mode=mode)
    torch.manual_seed(0)
    inputs = suite.make_inputs(shape, dtype, device)
    if mode == "fwd" and not suite.forward_grad:
        # an evaluation pass: inputs that do not require grad (some peers test requires_grad alone)
        inputs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    fn = suite.provider(case.provider).setup(device)
    wrt = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    if mode == "fwd":
        grad_ctx = contextlib.nullcontext if suite.forward_grad else torch.no_grad

        def call() -> Any:
            with grad_ctx():
                return fn(inputs)

    else:
        if not wrt:
            raise ValueError(f"suite {suite.name!r}: {mode} mode needs an input with requires_grad")
        outs = _tensors(fn(inputs))
        grad_outputs = [None if o.numel() == 1 else torch.randn_like(o) for o in outs]
        del outs

        def forward() -> list[torch.Tensor]:
            return _tensors(fn(inputs))

        def backward(outs: list[torch.Tensor], retain: bool = False) -> Any:
            return torch.autograd.grad(outs, wrt, grad_outputs=grad_outputs, retain_graph=retain)

        def call() -> Any:
            return backward(forward())

    for _ in range(2):  # compile, autotune, allocator warmup
        call()
    sync(device)
    graphed = suite.cuda_graph and device.type == "cuda"
    if mode == "bwd":  # the backward alone (with suite.cuda_graph, a graph of the backward)
        row.ms = time_backward_ms(forward, backward, device, quick=quick)
        if graphed:
            _replay_time(row, lambda o: backward(o, True), device, quick, forward)
        return row
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = call()
        sync(device)
        extra = row.peak_bytes = torch.cuda.max_memory_allocated(device) - before
        if mode == "full":
            row.grad_bytes = fresh_bytes(result, [t for t in inputs.values() if isinstance(t, torch.Tensor)])
            extra -= row.grad_bytes
        row.extra_bytes = max(extra, 0)
        del result
    row.ms = time_ms(call, device, quick=quick)
    if graphed:
        _replay_time(row, call, device, quick)
    return row


def _replay_time(
    row: OpRow, call: Callable[..., Any], device: torch.device, quick: bool, forward: Callable | None = None
) -> None:
    """``row.ms`` from replays of :func:`capture_graph`, the eager time moved to ``ms_eager``."""
    row.ms_eager = row.ms
    try:
        graph, _outs = capture_graph(call, device, forward)  # _outs: read by the graph, kept alive
    except Exception as e:  # noqa: BLE001 - keep the eager time
        row.note = f"eager time: graph capture failed ({error_text(e)})"
        return
    row.ms = time_ms(graph.replay, device, quick=quick)


def error_text(e: BaseException, limit: int = 120) -> str:
    """``Type: message`` on one line, at most ``limit`` characters of message (OOM: its first sentences)."""
    text = " ".join(str(e).split())
    if isinstance(e, torch.cuda.OutOfMemoryError):
        text = ". ".join(text.split(". ")[:2]).rstrip(".") + "."
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def run_measured(measure: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """``measure()``, or its failure: ``skipped``, ``oom`` (with the peak) or ``error`` (traceback tail)."""
    try:
        return measure()
    except SkipProvider as e:
        return {"status": "skipped", "error": str(e)}
    except torch.cuda.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return {"status": "oom", "error": error_text(e, 200), "peak_bytes": peak}
    except Exception as e:  # noqa: BLE001 - reported in the row; the run goes on
        tb = traceback.format_exc().strip().splitlines()  # its first line and its last 14
        return {"status": "error", "error": error_text(e, 200), "traceback": "\n".join(tb[:1] + tb[1:][-14:])}


def run_suite(
    suite: Suite,
    *,
    shapes: Sequence[Shape],
    dtype: torch.dtype,
    modes: Sequence[str],
    providers: Sequence[str],
    device: torch.device,
    quick: bool = False,
    ceilings: Ceilings | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Report:
    """Every (shape, provider, mode) of ``suite``: the report (nothing written)."""
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"unknown modes {bad}; known: {list(MODES)}")
    modes = tuple(m for m in MODES if m in modes)
    chosen = [suite.provider(name) for name in providers]
    ceilings = measure_ceilings(device, quick=quick) if ceilings is None else ceilings
    shapes = tuple(tuple(s) for s in shapes)
    report = Report(suite, dtype, modes, shapes, tuple(providers), dict(metadata or {}), ceilings)
    report.metadata.setdefault("timing", timing_method(device, quick, suite.cuda_graph))
    report.metadata.setdefault("quick", quick)
    for p in chosen:
        try:
            p.setup(device)
        except Exception as e:  # noqa: BLE001 - SkipProvider's reason, or why the setup failed
            why = str(e) if isinstance(e, SkipProvider) else f"setup failed: {error_text(e)}"
            report.skipped[p.name] = why
            log(f"skipping provider {p.name}: {why}")
    free_memory(device)

    def execute(case: Case) -> OpRow:
        try:
            row = _measure(suite, case, dtype, device, quick)
        except Exception as e:  # noqa: BLE001 - a skip, OOM and friends: record and go on
            error = f"skipped: {e}" if isinstance(e, SkipProvider) else error_text(e)
            row = OpRow(shape=case.shape, provider=case.provider, mode=case.mode, error=error)
        free_memory(device)
        cost = suite.cost(case.shape, case.mode, dtype)
        row.bytes, row.flops = cost.bytes, cost.flops
        for k, v in compute_ratios(row.ms, cost, report.ceilings).items():
            setattr(row, k, v)
        return row

    report.rows = run_cases(
        [Case(p.name, s, mode=m) for s in report.shapes for p in chosen for m in modes],
        execute,
        desc=suite.name,
        describe=lambda c: f"{OpRow.label(c.shape)} {c.provider} {c.mode}",
        skipped=report.skipped,  # run_cases does not run these providers
        skip_provider=False,  # a provider that cannot take one shape may take the next
        progress=progress,
        log=None,
    )
    return report
