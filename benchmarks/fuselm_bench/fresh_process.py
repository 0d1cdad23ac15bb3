"""What ``e2e`` and ``finetune`` share: one case per fresh worker process."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import fuselm

from .arguments import UsageError, parse_dtype, parse_list, parse_shapes, pick_device, results_dir
from .cases import Case, Row, run_cases
from .harness import blocking_sync, run_measured
from .report import (
    CPU_FIGURES,
    DTYPE_NAMES,
    bar_chart,
    collect_metadata,
    document,
    dtype_name,
    fmt_num,
    md_table,
    print_written,
    ratio,
    run_facts,
    versions,
    write_files,
)

DTYPES = {v: k for k, v in DTYPE_NAMES.items()}  # the worker's --dtype
SEED = 0  # every worker's (weights, batch)


@dataclass(frozen=True)
class Plan:
    """A benchmark's defaults on a GPU (full-size models, bf16, fused AdamW) or a CPU (tiny ones, fp32)."""

    name: str  # "gpu" or "cpu"
    shapes: tuple[tuple[Any, ...], ...]
    warmup: int
    steps: int
    quick_warmup: int
    quick_steps: int
    profile_steps: int | None = None  # steps under torch.profiler after the timed ones (e2e, finetune)

    @property
    def tiny(self) -> bool:
        return self.name == "cpu"


@dataclass(frozen=True)
class WorkerCase:
    """What one worker runs (``bench.train(case) -> result``); ``extra``: the benchmark's own settings."""

    provider: str
    shape: tuple[Any, ...]
    plan: Plan
    dtype: torch.dtype
    device: torch.device
    warmup: int
    steps: int
    seed: int = SEED
    extra: dict[str, Any] = field(default_factory=dict)


Train = Callable[[WorkerCase], dict[str, Any]]


@dataclass(frozen=True)
class Bench:
    """One fresh-process benchmark."""

    name: str
    description: str
    providers: tuple[str, ...]
    provider_descriptions: dict[str, str]
    row_type: Any
    plans: tuple[Plan, Plan]  # the GPU's, the CPU's
    train: Train
    timeout_s: float
    versions: tuple[str, ...]
    peers: dict[str, str]
    metrics: dict[str, tuple[str, str]] = field(
        default_factory=lambda: {"time": ("step_ms", "time"), "peak": ("peak_bytes", "peak")}
    )  # <key>_vs_<peer> in ratios: (row attribute, title)
    precheck: Callable[[str, torch.device], str | None] = lambda provider, device: None  # a skip's reason
    default_providers: tuple[str, ...] | None = None
    worker_prefix: Callable[[str], list[str] | None] = lambda provider: None  # None: python -m <module>
    variant_description: Callable[[str], str] = "variant @{}".format  # of <provider>@<setting>
    worker_env: Callable[[str, dict[str, Any] | None], dict[str, str] | None] = lambda provider, extra: None
    # the report (:func:`markdown`, :func:`report_json`, :func:`write_report`)
    facts: Callable[[CaseReport], list[str]] = lambda report: []
    tables: Callable[[CaseReport], str] = lambda report: ""
    notes: Callable[[CaseReport], list[str]] = lambda report: []
    plan_json: Callable[[CaseReport], dict[str, Any]] = lambda report: {}
    panels: tuple[tuple[str, str, float], ...] = (("step_ms", "ms/step", 1.0), ("peak_gib", "peak GiB", 1.0))
    plot: Callable[[CaseReport, Path], None] | None = None  # instead of :func:`write_bars`

    @property
    def module(self) -> str:
        return f"fuselm_bench.{self.name}"

    def describe(self, provider: str) -> str:
        """A provider's description (a variant ``<provider>@<setting>``: its base's, and the setting)."""
        base, at, setting = provider.partition("@")
        text = self.provider_descriptions[base]
        return f"{text}; {self.variant_description(setting)}" if at else text


# ---- the worker (a fresh process) ----


def worker_main(bench: Bench, argv: Sequence[str]) -> int:
    """``--worker <case JSON> <result file>`` (:func:`run_case`): ``bench.train``'s result as JSON."""
    _, spec, result_file = argv
    case = json.loads(spec)
    shape = tuple(case[size] for size in bench.row_type.SHAPE_FIELDS)
    result: dict[str, Any] = {"provider": case["provider"], **shape_dict(bench, shape)}
    device = torch.device(case["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: OpenMP thread wake-ups would cost more than the math

    def measure() -> dict[str, Any]:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        if device.type == "cuda":  # waits for the GPU sleep: CPU time is host work (harness.blocking_sync)
            result["gpu_wait"] = blocking_sync()
        plan = next(p for p in bench.plans if p.name == case["plan"])
        run = (case["provider"], shape, plan, DTYPES[case["dtype"]], device, case["warmup"], case["steps"])
        return bench.train(WorkerCase(*run, case["seed"], case["extra"]))

    result.update(run_measured(measure, device))
    Path(result_file).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "traceback")}))
    return 1 if result["status"] == "error" else 0


def build_measured(build: Callable[[], Any], device: torch.device) -> tuple[Any, dict[str, int | None]]:
    """``build()`` after resetting the peak statistics; the model, its ``params`` and ``weights_bytes``."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build()
    params = sum(p.numel() for p in model.parameters())
    return model, {"weights_bytes": torch.cuda.memory_allocated(device) if cuda else None, "params": params}


def memory_figures(device: torch.device) -> dict[str, int | None]:
    """``torch.cuda``'s peak allocated and reserved since the last reset (None on CPU)."""
    cuda = device.type == "cuda"
    return {
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


# ---- the parent: one fresh process per case ----


def run_worker(
    command: Callable[[Path], list[str]], *, timeout: float, prefix: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``command(result file)`` in a fresh process, ``env`` added to ours; its result, ``wall_s``."""
    # this lab's and this fuselm's folders first on PYTHONPATH: the worker runs the same code, whether fuselm
    # is installed or run from src
    folders = (Path(__file__).resolve().parents[1], Path(fuselm.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (*map(str, folders), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        result_path = Path(tmp) / "result.json"
        try:
            proc = subprocess.run(
                command(result_path), capture_output=True, text=True, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"worker timed out after {timeout:.0f} s", "wall_s": timeout}
        wall = time.perf_counter() - t0
        with contextlib.suppress(OSError, json.JSONDecodeError):  # no result: how the worker ended, below
            return {**json.loads(result_path.read_text()), "wall_s": wall}
    output = "\n".join(((proc.stdout or "") + "\n" + (proc.stderr or "")).strip().splitlines()[-12:])
    code = proc.returncode  # the last line says how it ended (the out-of-memory killer sends SIGKILL)
    how = f"{code} ({signal.Signals(-code).name}: the host out of memory?)" if code < 0 else code
    error = f"the worker's last output:\n{output}\nworker exited with code {how} and wrote no result"
    return {"status": "error", "error": error, "wall_s": wall}


def run_case(bench: Bench, case: WorkerCase, repeat: int = 0) -> Any:
    """One case in a fresh worker process (:func:`worker_main`): its row."""
    spec = {"provider": case.provider, **shape_dict(bench, case.shape), "plan": case.plan.name}
    spec.update(dtype=DTYPE_NAMES[case.dtype], device=case.device.type, warmup=case.warmup, steps=case.steps)
    spec.update(seed=case.seed, extra=case.extra)
    start = bench.worker_prefix(case.provider) or [sys.executable, "-m", bench.module]
    data = run_worker(
        lambda result: [*start, "--worker", json.dumps(spec), str(result)],
        timeout=bench.timeout_s,
        prefix=f"fuselm-{bench.name}-",
        env=bench.worker_env(case.provider, case.extra),
    )
    return make_row(bench, case.provider, case.shape, data, repeat)


def make_row(bench: Bench, provider: str, shape: Sequence[Any], data: dict[str, Any], repeat: int = 0) -> Any:
    """The row of (provider, shape) from a worker's result."""
    return row_of(bench, {**data, "provider": provider, **shape_dict(bench, shape), "repeat": repeat})


def row_of(bench: Bench, data: dict[str, Any]) -> Any:
    """A row of ``bench`` from a result or a report's JSON row (unknown keys dropped)."""
    return bench.row_type(**{k: v for k, v in data.items() if k in bench.row_type.__dataclass_fields__})


def shape_dict(bench: Bench, shape: Sequence[Any]) -> dict[str, Any]:
    """``{size field: value}`` of a shape."""
    return dict(zip(bench.row_type.SHAPE_FIELDS, shape, strict=True))


@dataclass(kw_only=True)
class WorkerRow(Row):
    """What every worker's row has: the figures of its steps (``e2e.step_figures``; ``step_ms`` is the median
    of ``step_ms_all``), memory and losses, or why it failed."""

    repeat: int = 0
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    weights_bytes: int | None = None
    params: int | None = None
    losses: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    wall_s: float | None = None
    error: str | None = None
    traceback: str | None = None
    step_ms_all: list[float] = field(default_factory=list)
    cpu_ms: float | None = None
    gpu_ms: float | None = None
    launches: float | None = None
    memcpy_ms: float | None = None
    memcpys: float | None = None
    profile_steps: int | None = None
    top_kernels: list | None = None  # (name, ms/step, launches/step) of the profiled steps, most time first
    idle_ms: float | None = None  # the GPU idle between its kernels and copies, per profiled step
    top_idle: list | None = None  # (next event's name, idle ms/step, gaps/step), most idle first
    first_loss: float | None = None
    # "blocking" (a wait for the GPU sleeps) or "spin (why)": harness.blocking_sync
    gpu_wait: str | None = None

    def figures(self) -> tuple[str, str]:
        cpu = f", CPU {self.cpu_ms:.1f} ms" if self.cpu_ms is not None else ""
        gpu = f", GPU {self.gpu_ms:.1f} ms, {self.launches:.0f} launches" if self.gpu_ms is not None else ""
        loss = "—" if self.first_loss is None else f"{self.first_loss:.4f}"
        step = "—" if self.step_ms is None else f"{self.step_ms:.1f}"
        return f"{fmt_tokens(self.tokens_per_s)} tok/s, {step} ms{cpu}{gpu}", f"first loss {loss}"


def fmt_tokens(x: float | None) -> str:
    """Tokens/s as docs/peers.md writes them: 49123.4 -> '49.1k', 812.0 -> '812'."""
    return "—" if x is None else f"{fmt_num(x / 1e3)}k" if x >= 1e3 else fmt_num(x)


def _ok_values(rows: Sequence[Any], attr: str) -> list[Any]:
    return [v for r in rows if r.status == "ok" and (v := getattr(r, attr)) is not None]


def median_of(rows: Sequence[Any], attr: str) -> float | None:
    """The median of ``attr`` over the ok rows that have it (None if none).

    Example:
        >>> from types import SimpleNamespace as R
        >>> median_of([R(status="ok", x=3.0), R(status="oom", x=None), R(status="ok", x=1.0)], "x")
        2.0
    """
    values = _ok_values(rows, attr)
    return statistics.median(values) if values else None


@dataclass
class CaseReport:
    """Everything one run of a fresh-process benchmark produced; before its rows, what :func:`run_cli` runs
    (:func:`start_cli`: from the parsed ``fuselm bench`` arguments)."""

    plan: Any
    dtype: torch.dtype
    device_type: str
    shapes: tuple[tuple[int, ...], ...]
    providers: tuple[str, ...]
    warmup: int
    steps: int
    metadata: dict[str, Any]
    rows: list[Any] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    repeats: int = 1
    merged: list[dict[str, Any]] = field(default_factory=list)  # earlier runs whose rows were joined
    extra: dict[str, Any] = field(default_factory=dict)  # every worker's WorkerCase.extra
    out_dir: Path | None = None
    merge: bool | str = False  # True: <out>/<suite>.json; a path: that file (or <folder>/<suite>.json)

    def rows_of(self, provider: str, shape: Sequence[Any]) -> list[Any]:
        """Every row (one per repeat) of (provider, shape)."""
        return [r for r in self.rows if r.provider == provider and r.shape == tuple(shape)]

    def groups(self) -> list[tuple[tuple[Any, ...], str, list[Any]]]:
        """``(shape, provider, its rows)`` for every shape and provider with rows, in the report's order."""
        return [(s, p, rows) for s in self.shapes for p in self.providers if (rows := self.rows_of(p, s))]


def run(
    bench: Bench,
    c: CaseReport,
    progress: bool = True,
    on_row: Callable[[CaseReport], None] | None = None,
    log: Callable[[str], None] = print,
) -> CaseReport:
    """Every (shape, repeat, provider) of ``c`` in its own worker; ``on_row(report so far)`` after each."""
    report, device = new_report(c), torch.device(c.device_type)
    for p in c.providers:
        if reason := bench.precheck(p, device):
            report.skipped[p] = reason
            log(f"skipping provider {p}: {reason}")
    fields, batch = bench.row_type.SHAPE_FIELDS, bench.row_type.BATCH_FIELD

    def execute(k: Case) -> Row:
        case = WorkerCase(k.provider, k.shape, c.plan, c.dtype, device, c.warmup, c.steps, extra=c.extra)
        return run_case(bench, case, k.repeat)

    def on_rows(rows: list[Row]) -> None:
        report.rows[:] = rows
        if on_row is not None:
            on_row(report)

    report.rows[:] = run_cases(
        [Case(p, s, repeat=r) for s in report.shapes for r in range(c.repeats) for p in c.providers],
        execute,
        desc=bench.name,
        describe=lambda c: f"{c.provider} {bench.row_type.label(c.shape)} #{c.repeat + 1}",
        skipped=report.skipped,
        repeats=c.repeats,
        batch_at=fields.index(batch) if batch in fields else None,
        not_run=lambda k, why: make_row(bench, k.provider, k.shape, dict(status="oom", error=why), k.repeat),
        progress=progress,
        log=log,
        on_row=on_rows,
    )
    return report


# ---- ratios, tables and report files ----


def pair_ratio(
    report: CaseReport, shape: Sequence[Any], mine: str, other: str, attr: str
) -> tuple[float | None, list[float | None]]:
    """``mine``'s figure over ``other``'s at ``shape``, each the median over its ok repeats, and with several
    repeats the ratio within each repeat (its providers ran back to back)."""
    a, b = report.rows_of(mine, shape), report.rows_of(other, shape)
    at = [([r for r in a if r.repeat == i], [r for r in b if r.repeat == i]) for i in range(report.repeats)]
    each = [ratio(median_of(x, attr), median_of(y, attr)) for x, y in at]
    return ratio(median_of(a, attr), median_of(b, attr)), each if report.repeats > 1 else []


def ratio_text(value: float | None, each: Sequence[float | None]) -> str:
    """``1.23x`` (``—`` if None), with the per-repeat ratios' range where they differ: ``(1.20-1.25)``."""
    if value is None:
        return "—"
    each = [x for x in each if x is not None]
    low, high = (f"{min(each):.2f}", f"{max(each):.2f}") if each else ("", "")
    return f"{value:.2f}x" + (f" ({low}-{high})" if len(each) > 1 and low != high else "")


def ratios(bench: Bench, report: CaseReport) -> list[dict[str, Any]]:
    """Per shape: its sizes, then ``<key>_vs_<peer>`` (:func:`pair_ratio` of fuselm and the peer) for each of
    ``bench.peers`` and ``bench.metrics``, with several repeats also ``<key>_vs_<peer>_repeats``."""
    out = []
    for shape in report.shapes:
        entry: dict[str, Any] = shape_dict(bench, shape)
        for peer in bench.peers:
            for key, (attr, _) in bench.metrics.items():
                entry[f"{key}_vs_{peer}"], each = pair_ratio(report, shape, "fuselm", peer, attr)
                if report.repeats > 1:
                    entry[f"{key}_vs_{peer}_repeats"] = each
        out.append(entry)
    return out


def ratio_table(bench: Bench, report: CaseReport) -> str:
    """:func:`ratios` as a markdown table of :func:`ratio_text`."""
    keys = [f"{key}_vs_{peer}" for peer in bench.peers for key in bench.metrics]
    head = [
        f"{title} fuselm / {name}" for name in bench.peers.values() for _, title in bench.metrics.values()
    ]
    rows = [
        [bench.row_type.label(shape), *(ratio_text(entry[k], entry.get(f"{k}_repeats", [])) for k in keys)]
        for shape, entry in zip(report.shapes, ratios(bench, report), strict=True)
    ]
    return md_table([bench.row_type.SHAPE_TITLE, *head], rows)


def failed_cell(rows: Sequence[Row]) -> str:
    """OOM (a row ran out of memory) or error, ``—`` without rows."""
    return ("OOM" if any(r.status == "oom" for r in rows) else "error") if rows else "—"


def summary_cell(rows: Sequence[Any], attr: str, fmt: Callable[[float], str] = "{:.1f}".format) -> str:
    """The median of ``attr`` over the ok repeats, with their range when several differ: ``56.2 (55.1-57.3)``;
    ``n/a`` when the ok rows have no value, ``—`` without an ok row.

    Example:
        >>> from types import SimpleNamespace as R
        >>> summary_cell([R(status="ok", x=2.0), R(status="ok", x=1.0), R(status="ok", x=4.0)], "x")
        '2.0 (1.0-4.0)'
    """
    if not any(r.status == "ok" for r in rows):
        return "—"
    values = _ok_values(rows, attr)
    if not values:
        return "n/a"
    median, low, high = (fmt(f(values)) for f in (statistics.median, min, max))
    return median + (f" ({low}-{high})" if len(values) > 1 and low != high else "")


def first_cell(rows: Sequence[Any], attr: str, fmt: Callable[[float], str] = "{:.1f}".format) -> str:
    """:func:`summary_cell` and how many repeats failed; OOM or error without an ok row."""
    failed = sum(r.status != "ok" for r in rows)
    if failed == len(rows):
        return failed_cell(rows)
    return summary_cell(rows, attr, fmt) + (f" ({failed} failed)" if failed else "")


def note_cell(rows: Sequence[Row]) -> str:
    """The rows' distinct errors on one line, without the table's separators."""
    errors = ((r.error or "").replace("|", "/").replace("\n", " ") for r in rows if r.error)
    return "; ".join(dict.fromkeys(errors))


def all_notes(bench: Bench, report: CaseReport) -> list[str]:
    """What every fresh-process report says of its runs, then ``bench.notes``, then the providers."""
    n = report.repeats
    return [
        f"Each (configuration, provider) ran {n} time{'s' if n > 1 else ''}, each in a fresh process "
        f"(`python -m {bench.module} --worker`), the providers of one repeat back to back; cells are medians "
        "over the repeats, with their range (min-max) where they differ; the JSON keeps every repeat.",
        "peak GiB = torch.cuda.max_memory_allocated() of the whole process (weights included; GiB = 2^30 "
        "bytes); OOM = torch.cuda.OutOfMemoryError; a provider out of memory at batch B is not run at B or a "
        "larger batch of the same other sizes."
        if report.device_type == "cuda"
        else "No CUDA: one CPU thread per worker; no GPU or memory figures (n/a).",
        *bench.notes(report),
        *(f"{p}: {bench.describe(p)}" for p in report.providers),
    ]


def markdown(bench: Bench, report: CaseReport) -> str:
    """The whole report: facts, ``bench.tables``, the ratio table, notes and skipped providers."""
    m, profiled = report.metadata, report.plan.profile_steps
    steps = f"steps per run: {report.warmup} warmup, {report.steps} timed"
    steps += "" if profiled is None else f", {profiled} profiled"
    merged = [
        f"merged rows of: `{r.get('command')}` ({r.get('date')}, {r.get('commit')})" for r in report.merged
    ]
    repeats = f"{steps}; fresh-process repeats per configuration: {report.repeats}"
    facts = run_facts(m, bench.versions, *bench.facts(report), repeats, *merged)
    return document(
        bench.name,
        f"{bench.description}, {dtype_name(report.dtype)} weights.",
        CPU_FIGURES if report.device_type != "cuda" else None,
        facts,
        [bench.tables(report), ratio_table(bench, report)],
        all_notes(bench, report),
        report.skipped,
    )


def report_json(bench: Bench, report: CaseReport) -> dict[str, Any]:
    """All raw numbers and the metadata, JSON-ready (``bench.plan_json``: what it says of the plan)."""
    fields = bench.row_type.SHAPE_FIELDS
    return {
        "suite": bench.name,
        "description": bench.description,
        **bench.plan_json(report),
        "dtype": dtype_name(report.dtype),
        "device_type": report.device_type,
        "shape_dims": list(bench.row_type.SHAPE_DIMS),
        "shape_fields": list(fields),
        "shapes": [list(s) for s in report.shapes],
        "providers": list(report.providers),
        "warmup": report.warmup,
        "steps": report.steps,
        "repeats": report.repeats,
        "metadata": report.metadata,
        "merged": report.merged,
        "rows": [  # the configuration first (a row type's own fields follow those of its base)
            {"provider": r.provider, **shape_dict(bench, r.shape), **asdict(r), "peak_gib": r.peak_gib}
            for r in report.rows
        ],
        "ratios": ratios(bench, report),
        "skipped": report.skipped,
        "notes": all_notes(bench, report),
    }


def write_report(bench: Bench, report: CaseReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``<name>.md``, ``.json`` and ``.png`` (``bench.plot``, else :func:`write_bars`); their paths."""
    plot = bench.plot or functools.partial(write_bars, bench)
    return write_files(
        bench.name, out_dir, markdown(bench, report), report_json(bench, report), lambda p: plot(report, p)
    )


def write_bars(bench: Bench, report: CaseReport, path: Path) -> None:
    """Grouped bars (medians) per ``bench.panels`` ``(attribute, title, scale)``; OOM or error if none."""
    providers = [p for p in report.providers if p not in report.skipped]

    def value(rows: list[Any], attr: str, scale: float) -> float | str:
        if rows and not any(r.status == "ok" for r in rows):
            return failed_cell(rows)
        v = median_of(rows, attr)
        return float("nan") if v is None else v * scale

    panels = [
        (title, [(p, [value(report.rows_of(p, s), attr, scale) for s in report.shapes]) for p in providers])
        for attr, title, scale in bench.panels
    ]
    labels = [bench.row_type.label(s).replace(" ", "\n") for s in report.shapes]
    title = f"fuselm bench {bench.name} ({report.plan.name} plan), {dtype_name(report.dtype)}"
    bar_chart(
        path,
        f"{title}, {report.metadata.get('device')}",
        labels,
        panels,
        max(8.0, 3.0 + 1.2 * len(panels) * len(labels)),
        xlabel=bench.row_type.SHAPE_TITLE,
        values=True,
        empty="n/a (no CUDA)" if report.device_type != "cuda" else "no results",
    )


# ---- command line ----


def new_report(c: CaseReport) -> CaseReport:
    """``c`` before any row (shapes and providers as tuples, its own metadata)."""
    shapes, providers, metadata = tuple(map(tuple, c.shapes)), tuple(c.providers), dict(c.metadata)
    return replace(c, shapes=shapes, providers=providers, metadata=metadata, rows=[], skipped={})


def start_cli(
    bench: Bench,
    args: Any,
    argv: list[str],
    *,
    grid: Callable[[Any, Any], list[tuple[Any, ...]]] | None = None,
    packages: Sequence[str] = (),
) -> CaseReport:
    """What a run of ``bench`` runs (shapes: ``grid(args, plan)``, else ``--shapes``, else the plan's)."""
    default = bench.default_providers or bench.providers
    chosen = parse_list(args.providers, bench.providers, "provider", variants=True, default=default)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    plan = bench.plans[0] if cuda else bench.plans[1]
    if grid is not None:
        shapes = grid(args, plan)
    else:
        ndim = len(bench.row_type.SHAPE_FIELDS)
        shapes = parse_shapes(args.shapes, ndim) if args.shapes else list(plan.shapes)
    extra = {}
    if plan.profile_steps is not None:  # e2e, finetune: --profile-steps
        profile = args.profile_steps
        if profile is not None and profile < 0:
            raise UsageError(f"--profile-steps must be >= 0, got {profile}")
        plan = replace(plan, profile_steps=plan.profile_steps if profile is None else profile)
        extra["profile_steps"] = plan.profile_steps
    warmup = (plan.quick_warmup if args.quick else plan.warmup) if args.warmup is None else args.warmup
    steps = (plan.quick_steps if args.quick else plan.steps) if args.steps is None else args.steps
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    if warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {warmup}")
    dtype = parse_dtype(args.dtype) if cuda else torch.float32
    meta = collect_metadata(device, argv, packages)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        raise UsageError(f'fuselm bench {bench.name} needs transformers: pip install "fuselm[hf]"') from None
    out_dir = results_dir(args.out, meta["device"] if cuda else None)
    run = dict(repeats=args.repeats or 1, extra=extra, out_dir=out_dir, merge=args.merge or False)
    return CaseReport(plan, dtype, device.type, shapes, chosen, warmup, steps, meta, **run)


def run_cli(
    bench: Bench, c: CaseReport, *, progress: bool, summary: Callable[[CaseReport], str] | None = None
) -> int:
    """Run the cases, writing the files after every row (a stopped run keeps them), print the report
    (``summary(report)``: a table printed last); the exit code (1: no case ran)."""
    write = functools.partial(write_report, bench)
    if c.device_type != "cuda":
        print(CPU_FIGURES)
    print(f"device: {c.metadata['device']}; versions: {versions(c.metadata, bench.versions)}")
    repeats = f" x {c.repeats} repeats" if c.repeats > 1 else ""
    print(
        f"{bench.name}: {len(c.shapes)} configurations x {len(c.providers)} providers{repeats}, {c.warmup} "
        f"warmup + {c.steps} timed steps, one fresh process each",
        flush=True,
    )
    previous = None
    if c.merge:  # the JSON of an earlier report: --merge PATH (a file, or <folder>/<suite>.json), or <out>'s
        path = c.out_dir if c.merge is True else Path(c.merge)
        path = path if path.is_file() else path / f"{bench.name}.json"
        if path.is_file():
            previous = json.loads(path.read_text())
        else:
            print(f"--merge: no {path} yet; nothing to merge")

    def finish(report: CaseReport) -> CaseReport:
        return merge_previous(bench, report, previous) if previous is not None else report

    finish(new_report(c))  # a bad --merge fails before anything runs
    report = finish(run(bench, c, progress, lambda r: write(finish(r), c.out_dir)))
    print_written(markdown(bench, report), write(report, c.out_dir))
    if summary is not None:
        print(f"\n{summary(report)}")
    return 0 if any(r.status == "ok" for r in report.rows) else 1


def merge_previous(bench: Bench, report: CaseReport, previous: dict[str, Any]) -> CaseReport:
    """``report`` with the rows of ``previous`` (an earlier run's JSON) that it did not run again."""
    meta, fields = previous.get("metadata", {}), bench.row_type.SHAPE_FIELDS
    older = f"an older fuselm bench {bench.name} wrote it: run without --merge"
    for what, theirs, mine, hint in (
        ("is of", previous.get("suite"), bench.name, "another benchmark"),
        ("ran on", meta.get("device"), report.metadata.get("device"), "write to another --out"),
        ("is in", previous.get("dtype"), DTYPE_NAMES.get(report.dtype), "another --dtype"),
        ("has configurations", previous.get("shape_fields"), list(fields), older),
    ):
        if theirs != mine:
            raise UsageError(f"--merge: the earlier report {what} {theirs!r}, this run {mine!r} ({hint})")
    ran = {(r.provider, r.shape) for r in report.rows} | {
        (p, s) for p in report.providers for s in report.shapes
    }
    kept = [
        row_of(bench, data)
        for data in previous.get("rows", [])
        if (data["provider"], tuple(data[f] for f in fields)) not in ran
    ]
    skipped = {**previous.get("skipped", {}), **report.skipped}
    for p in report.providers:  # ran here: its skip (or not) is this run's
        if p not in report.skipped:
            skipped.pop(p, None)
    return replace(
        report,
        shapes=tuple(dict.fromkeys([*(tuple(s) for s in previous.get("shapes", [])), *report.shapes])),
        providers=tuple(dict.fromkeys([*previous.get("providers", []), *report.providers])),
        rows=[*kept, *report.rows],
        skipped=skipped,
        repeats=max(report.repeats, int(previous.get("repeats", 1))),
        merged=[*previous.get("merged", []), {k: meta.get(k) for k in ("command", "date", "commit")}],
    )
