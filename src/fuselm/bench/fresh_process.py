"""What the ``e2e`` and ``grpo_step`` benchmarks share: one case per fresh ``python -m ... --worker`` process.

A benchmark describes itself with a :class:`Bench` (its name, providers, row type, plans, peers, and its
``train`` function); everything else is here. The worker side (:func:`worker_main`) runs one case and writes
its result as JSON to the file the parent named; the parent side (:func:`run_case`) starts that process with
a timeout and reads the result back (a failure of the worker becomes an ``error`` row, never an exception).
:func:`run` runs every (shape, provider) of a report that way; :func:`ratios`, :func:`ratio_table`,
:func:`markdown`, :func:`report_json`, :func:`write_bars` and :func:`write_report` build the report files;
:func:`start_cli` and :func:`run_cli` are the command line's steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from .arguments import UsageError, parse_list, parse_shapes, pick_device, results_dir, warmup_steps_dtype
from .harness import SkipProvider, error_text
from .report import DTYPE_NAMES, collect_metadata, document, md_table, ratio
from .runner import print_written

DTYPES = {v: k for k, v in DTYPE_NAMES.items()}  # the worker's --dtype
GIB = 1 << 30


class WorkerRow:
    """For a row dataclass of a worker's result: its sizes (``SHAPE_FIELDS``), how a shape is named
    (``SHAPE_DIMS`` in the JSON, ``SHAPE_TITLE`` over the tables' first column, ``SHAPE_FORMAT`` of a label),
    ``shape`` and ``peak_gib``."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ()
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ()
    SHAPE_TITLE: ClassVar[str] = ""
    SHAPE_FORMAT: ClassVar[str] = ""
    provider: str
    status: str
    peak_bytes: int | None
    error: str | None
    traceback: str | None

    @classmethod
    def label(cls, shape: Sequence[int]) -> str:
        return cls.SHAPE_FORMAT.format(*shape)

    def figures(self) -> tuple[str, str]:
        """An ok row's main figure and what follows its peak memory in :meth:`summary`."""
        raise NotImplementedError

    def summary(self) -> str:
        """The row's progress line: ``<provider> <shape>: <figure>, peak X GiB, <more>``, or its status and
        error."""
        label = f"{self.provider} {self.label(self.shape)}"
        if self.status != "ok":
            return f"{label}: {self.status}: {self.error}"
        figure, more = self.figures()
        peak = f", peak {self.peak_gib:.1f} GiB" if self.peak_gib is not None else ""
        return f"{label}: {figure}{peak}, {more}"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in self.SHAPE_FIELDS)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB


Train = Callable[..., dict[str, Any]]
"""A worker's run: ``train(plan, provider, *shape, dtype=, device=, warmup=, steps=, seed=) -> result``."""


@dataclass(frozen=True)
class Bench:
    """One fresh-process benchmark, as the shared parts need it.

    ``plans``: name -> plan (what ``--<plan_flag>`` of a worker names); ``peers``: the providers fuselm's
    figures are divided by, with the names the ratio table gives them; ``metrics``: ratio key -> (row
    attribute, title in the ratio table); ``precheck(provider, device)``: a reason to skip a provider without
    starting a process (None: try it).
    """

    name: str
    description: str
    providers: tuple[str, ...]
    provider_descriptions: dict[str, str]
    row_type: Any
    plan_flag: str
    plans: dict[str, Any]
    train: Train
    timeout_s: float
    seed: int
    versions: tuple[str, ...]
    peers: dict[str, str]
    metrics: dict[str, tuple[str, str]]
    precheck: Callable[[str, torch.device], str | None] | None = None

    @property
    def module(self) -> str:
        return f"fuselm.bench.{self.name}"

    def check_providers(self, providers: Sequence[str]) -> None:
        for p in providers:
            if p not in self.providers:
                raise ValueError(f"unknown provider {p!r}; known: {', '.join(self.providers)}")


# ---- the worker (a fresh process) ----


def worker_main(bench: Bench, argv: Sequence[str]) -> int:
    """The worker process: one (provider, shape) run of ``bench.train``, its result written as JSON to
    ``--result`` and printed (without losses and traceback); returns the exit code.

    Status ``ok`` (exit 0), ``oom`` or ``skipped`` (exit 0: a result, not a failure), ``error`` (exit 1,
    with the exception and the tail of its traceback).
    """
    sizes = bench.row_type.SHAPE_FIELDS
    p = argparse.ArgumentParser(
        prog=f"python -m {bench.module} --worker", description=f"one {bench.name} run"
    )
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--provider", required=True)
    for size in sizes:
        p.add_argument(f"--{size}", type=int, required=True)
    p.add_argument(f"--{bench.plan_flag}", choices=sorted(bench.plans), required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=bench.seed)
    p.add_argument("--result", required=True, help="file the JSON result is written to")
    args = p.parse_args(argv)
    shape = [getattr(args, size) for size in sizes]
    result: dict[str, Any] = {"provider": args.provider, **dict(zip(sizes, shape, strict=True))}
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: OpenMP thread wake-ups would cost more than the math
    code = 0
    try:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        plan = bench.plans[getattr(args, bench.plan_flag)]
        options = {"warmup": args.warmup, "steps": args.steps, "seed": args.seed}
        result.update(
            bench.train(plan, args.provider, *shape, dtype=DTYPES[args.dtype], device=device, **options)
        )
    except SkipProvider as e:  # the provider cannot run here: the message is the reason
        result.update(status="skipped", error=str(e))
    except torch.cuda.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        result.update(status="oom", error=error_text(e, 200), peak_bytes=peak)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on with the next run
        tb = traceback.format_exc().strip().splitlines()
        result.update(status="error", error=error_text(e, 200), traceback="\n".join(tb[-15:]))
        code = 1
    Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "traceback")}))
    return code


def build_measured(build: Callable[[], Any], device: torch.device) -> tuple[Any, dict[str, int | None]]:
    """``build()`` after resetting ``torch.cuda``'s peak statistics; the model and its ``params`` and
    ``weights_bytes`` (allocated once it is built; None on CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build()
    params = sum(p.numel() for p in model.parameters())
    return model, {"weights_bytes": torch.cuda.memory_allocated(device) if cuda else None, "params": params}


def memory_figures(device: torch.device) -> dict[str, int | None]:
    """``peak_bytes`` and ``reserved_bytes``: ``torch.cuda``'s maxima since the last reset (None on CPU)."""
    cuda = device.type == "cuda"
    return {
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


# ---- the parent: one fresh process per case ----


def worker_command(module: str, provider: str, case: dict[str, Any], **options: Any) -> list[str]:
    """``python -m <module> --worker --provider=<provider>`` with ``--<key>=<value>`` for each entry of
    ``case`` then of ``options`` (plan, dtype, device, warmup, steps, result).

    Example:
        >>> worker_command("fuselm.bench.e2e", "hf", {"batch": 2}, steps=3)[2:]
        ['fuselm.bench.e2e', '--worker', '--provider=hf', '--batch=2', '--steps=3']
    """
    flags = [f"--{key}={value}" for key, value in {**case, **options}.items()]
    return [sys.executable, "-m", module, "--worker", f"--provider={provider}", *flags]


def worker_env() -> dict[str, str]:
    """The parent's environment, with the directory this fuselm was imported from first on PYTHONPATH
    (so the worker runs the same code, whether fuselm is installed or run from ``src``)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(command: Callable[[Path], list[str]], *, timeout: float, prefix: str) -> dict[str, Any]:
    """Run ``command(result file)`` in a fresh process; return the worker's result with ``wall_s`` added.

    Never raises for a failure of the worker: a timeout, or an exit without a readable result, gives
    ``{"status": "error", "error": <what happened>, "wall_s": ...}``.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        result_path = Path(tmp) / "result.json"
        try:
            proc = subprocess.run(
                command(result_path), capture_output=True, text=True, env=worker_env(), timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"worker timed out after {timeout:.0f} s", "wall_s": timeout}
        wall = time.perf_counter() - t0
        try:
            data = json.loads(result_path.read_text())
        except (OSError, json.JSONDecodeError):
            data = None
    if data is None:
        output = "\n".join(((proc.stdout or "") + "\n" + (proc.stderr or "")).strip().splitlines()[-12:])
        error = f"worker exited with code {proc.returncode} and wrote no result; its last output:\n{output}"
        return {"status": "error", "error": error, "wall_s": wall}
    return {**data, "wall_s": wall}


def run_case(
    bench: Bench,
    provider: str,
    shape: Sequence[int],
    *,
    plan: Any,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    timeout: float | None = None,
) -> Any:
    """Run one (provider, shape) in a fresh worker process and return its row (never raises for a failure
    of the worker: the row's status is ``error`` and ``error`` says what happened)."""
    case = {**dict(zip(bench.row_type.SHAPE_FIELDS, shape, strict=True)), bench.plan_flag: plan.name}
    options = {"dtype": DTYPE_NAMES[dtype], "device": device.type, "warmup": warmup, "steps": steps}
    data = run_worker(
        lambda result: worker_command(bench.module, provider, case, **options, result=result),
        timeout=bench.timeout_s if timeout is None else timeout,
        prefix=f"fuselm-{bench.name}-",
    )
    key = {"provider": provider, **dict(zip(bench.row_type.SHAPE_FIELDS, shape, strict=True))}
    known = set(bench.row_type.__dataclass_fields__) - set(key)
    return bench.row_type(**key, **{k: v for k, v in data.items() if k in known})


@dataclass
class CaseReport:
    """Everything one run of a fresh-process benchmark produced; ``row(provider, shape)`` finds a row."""

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

    def row(self, provider: str, shape: Sequence[int]) -> Any:
        """The row of (provider, shape), or None."""
        for r in self.rows:
            if r.provider == provider and r.shape == tuple(shape):
                return r
        return None


def run(
    bench: Bench,
    *,
    plan: Any,
    shapes: Sequence[Sequence[int]],
    providers: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    timeout: float | None = None,
    on_row: Callable[[CaseReport], None] | None = None,
) -> CaseReport:
    """Every (shape, provider) (shapes outer) in its own worker process (:func:`run_case`); returns the
    report (nothing written). Each row is logged (its summary and traceback) and then ``on_row(report
    so far)`` is called. A provider that ``bench.precheck`` or a worker skips is not run again. The first
    size of a shape is its batch: a provider out of memory at batch B is not run at a larger batch of the
    same other sizes (its row says so)."""
    from tqdm.auto import tqdm

    bench.check_providers(providers)
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    report = CaseReport(
        plan, dtype, device.type, shapes, tuple(providers), warmup, steps, dict(metadata or {})
    )
    for p in providers:
        reason = bench.precheck(p, device) if bench.precheck is not None else None
        if reason:
            report.skipped[p] = reason
            log(f"skipping provider {p}: {reason}")
    options = {"plan": plan, "dtype": dtype, "device": device, "warmup": warmup, "steps": steps}
    oom_at: dict[tuple[str, tuple[int, ...]], int] = {}  # (provider, other sizes) -> smallest batch out
    bar = tqdm(
        [(s, p) for s in report.shapes for p in providers], desc=bench.name, disable=not progress, leave=False
    )
    for shape, provider in bar:
        if provider in report.skipped:
            continue
        bar.set_postfix_str(f"{provider} {'x'.join(map(str, shape))}")
        batch, key = shape[0], (provider, shape[1:])
        smallest = oom_at.get(key)
        if smallest is not None and batch >= smallest:
            error = f"not run: out of memory at batch {smallest} already"
            row = bench.row_type(provider, *shape, "oom", error=error)
        else:
            row = run_case(bench, provider, shape, timeout=timeout, **options)
        if row.status == "oom":
            oom_at[key] = min(batch, oom_at.get(key, batch))
        if row.status == "skipped":
            report.skipped[provider] = row.error or "skipped"
            log(f"skipping provider {provider}: {row.error}")
            continue
        report.rows.append(row)
        log(row.summary())
        if row.traceback:
            log(row.traceback)
        if on_row is not None:
            on_row(report)
    bar.close()
    return report


def exit_code(report: CaseReport) -> int:
    """0 when some case ran, 1 when none did."""
    return 0 if any(r.status == "ok" for r in report.rows) else 1


# ---- ratios, tables and report files ----


def ratios(bench: Bench, report: CaseReport) -> list[dict[str, Any]]:
    """Per shape of ``report``: its sizes, then for each of ``bench.peers`` and each of ``bench.metrics``
    ``<key>_vs_<peer>``, fuselm's figure over the peer's (None unless both rows are ok)."""
    out = []
    for shape in report.shapes:
        mine = report.row("fuselm", shape)
        entry: dict[str, Any] = dict(zip(bench.row_type.SHAPE_FIELDS, shape, strict=True))
        for peer in bench.peers:
            other = report.row(peer, shape)
            ok = mine is not None and mine.status == "ok" and other is not None and other.status == "ok"
            for key, (attr, _) in bench.metrics.items():
                entry[f"{key}_vs_{peer}"] = ratio(getattr(mine, attr), getattr(other, attr)) if ok else None
        out.append(entry)
    return out


def ratio_table(bench: Bench, report: CaseReport) -> str:
    """:func:`ratios` as a markdown table, each ratio as ``1.23x`` (``—`` if None)."""
    head = [bench.row_type.SHAPE_TITLE]
    head += [
        f"{title} fuselm / {name}" for name in bench.peers.values() for _, title in bench.metrics.values()
    ]
    rows = []
    for shape, entry in zip(report.shapes, ratios(bench, report), strict=True):
        values = [v for k, v in entry.items() if "_vs_" in k]
        rows.append([bench.row_type.label(shape), *("—" if v is None else f"{v:.2f}x" for v in values)])
    return md_table(head, rows)


def status_cell(row: WorkerRow, ok: str) -> str:
    """``ok`` for an ok row, else OOM or error."""
    return ok if row.status == "ok" else {"oom": "OOM"}.get(row.status, "error")


def note_cell(row: WorkerRow) -> str:
    """The row's error on one line, without the table's separators."""
    return (row.error or "").replace("|", "/").replace("\n", " ")


def markdown(
    bench: Bench,
    report: CaseReport,
    *,
    cpu_figures: str,
    facts: Sequence[str],
    table: str,
    notes: Sequence[str],
) -> str:
    """The whole report: title, ``cpu_figures`` (off CUDA), device, the ``bench.versions`` found in the
    metadata, date, ``facts``, command, the results ``table``, the ratio table, ``notes``, the providers, the
    skipped ones."""
    m = report.metadata
    found = ", ".join(f"{k} {m[k]}" for k in bench.versions if m.get(k) is not None)
    facts = [
        f"device: {m.get('device')}",
        f"versions: {found}; fuselm {m.get('fuselm')} @ {m.get('commit')}",
        f"date: {m.get('date')}",
        *facts,
        f"command: `{m.get('command')}`",
    ]
    return document(
        bench.name,
        f"{bench.description}, {DTYPE_NAMES.get(report.dtype, str(report.dtype))} weights.",
        cpu_figures if report.device_type != "cuda" else None,
        facts,
        [table, ratio_table(bench, report)],
        [*notes, *(f"{p}: {bench.provider_descriptions[p]}" for p in report.providers)],
        report.skipped,
    )


def report_json(bench: Bench, report: CaseReport, plan: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """All raw numbers and the metadata, JSON-ready; ``plan``: what the JSON says of the plan."""
    rows = []
    for r in report.rows:
        rows.append({**asdict(r), "peak_gib": r.peak_gib})
    return {
        "suite": bench.name,
        "description": bench.description,
        **plan,
        "dtype": DTYPE_NAMES.get(report.dtype, str(report.dtype)),
        "device_type": report.device_type,
        "shape_dims": list(bench.row_type.SHAPE_DIMS),
        "shapes": [list(s) for s in report.shapes],
        "providers": list(report.providers),
        "warmup": report.warmup,
        "steps": report.steps,
        "metadata": report.metadata,
        "rows": rows,
        "ratios": ratios(bench, report),
        "skipped": report.skipped,
        "notes": notes,
    }


def write_report(
    name: str, out_dir: str | Path, markdown: str, data: dict[str, Any], write_png: Callable[[Path], None]
) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.json`` and ``<name>.png`` (``write_png(path)``, skipped without
    matplotlib) into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{name}.md", "json": out / f"{name}.json", "png": out / f"{name}.png"}
    paths["md"].write_text(markdown)
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    try:
        write_png(paths["png"])
    except ImportError as e:
        print(f"no plot written ({e}); pip install matplotlib")
        del paths["png"]
    return paths


def write_bars(
    bench: Bench,
    report: CaseReport,
    path: Path,
    *,
    panels: Sequence[tuple[str, str, float]],
    title: str,
    width_per_shape: float,
    mark_failures: bool = False,
) -> None:
    """Panels of grouped bars, one group per shape of ``report``, one bar per provider that ran: each panel
    ``(row attribute, title, scale)``, values of ok rows, labelled; the title ``fuselm bench <name><title>,
    <dtype>, <device>``. ``mark_failures``: OOM or error written where a row failed, an x label, and "n/a (no
    CUDA)" / "no results" in an empty panel."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [bench.row_type.label(s) for s in report.shapes]
    providers = [p for p in report.providers if p not in report.skipped]
    width = 0.8 / max(1, len(providers))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(8.0, 3.0 + width_per_shape * len(labels)), 4))
    for ax, (attr, panel_title, scale) in zip(axes, panels, strict=True):
        any_value = False
        for i, prov in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(labels))]
            vals = []
            for x, shape in zip(xs, report.shapes, strict=True):
                r = report.row(prov, shape)
                v = getattr(r, attr) if r is not None and r.status == "ok" else None
                vals.append(float("nan") if v is None else v * scale)
                any_value |= v is not None
                if mark_failures and r is not None and r.status != "ok":
                    failure = "OOM" if r.status == "oom" else "error"
                    ax.text(x, 0, failure, ha="center", va="bottom", rotation=90, fontsize=8)
            bars = ax.bar(xs, vals, width=width, label=prov)
            ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.1f}" for v in vals], fontsize=7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(panel_title)
        if not mark_failures:
            if providers:
                ax.legend(fontsize=8)
            continue
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_xlabel(bench.row_type.SHAPE_TITLE)
        if any_value:
            ax.legend(fontsize=8)
        else:
            ax.set_yticks([])
            text = "n/a (no CUDA)" if attr == "peak_gib" else "no results"
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    dtype = DTYPE_NAMES.get(report.dtype, str(report.dtype))
    fig.suptitle(f"fuselm bench {bench.name}{title}, {dtype}, {report.metadata.get('device')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line ----


@dataclass
class CliRun:
    """What a fresh-process benchmark's ``run_cli`` runs, from the parsed ``fuselm bench`` arguments."""

    providers: list[str]
    device: torch.device
    plan: Any
    shapes: list[tuple[int, ...]]
    warmup: int
    steps: int
    dtype: torch.dtype
    metadata: dict[str, Any]
    out_dir: Path


def start_cli(bench: Bench, args: Any, argv: list[str], *, plans: tuple[Any, Any]) -> CliRun:
    """``--providers`` (default: all), ``--device``, the GPU or the CPU plan of ``plans``, ``--shapes`` (as
    many sizes as the bench's rows have; default: the plan's), warmup, steps and dtype, the metadata with
    the transformers version, the results folder. Raises ``UsageError`` for bad values and without
    transformers."""
    providers = bench.providers
    chosen = parse_list(args.providers, providers, "provider") if args.providers else list(providers)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    plan = plans[0] if cuda else plans[1]
    ndim = len(bench.row_type.SHAPE_FIELDS)
    shapes = parse_shapes(args.shapes, ndim) if args.shapes else list(plan.shapes)
    warmup, steps, dtype = warmup_steps_dtype(args, plan, cuda)
    meta = collect_metadata(device, argv)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        raise UsageError(f'fuselm bench {bench.name} needs transformers: pip install "fuselm[hf]"') from None
    out_dir = results_dir(args.out, meta["device"] if cuda else None)
    return CliRun(chosen, device, plan, shapes, warmup, steps, dtype, meta, out_dir)


def run_cli(
    bench: Bench,
    c: CliRun,
    *,
    markdown: Callable[[CaseReport], str],
    write: Callable[[CaseReport, Path], dict[str, Path]],
    progress: bool,
    write_each_row: bool = False,
) -> CaseReport:
    """Say what runs, :func:`run` it, then print the report and write its files (``write(report, folder)``;
    after every row too with ``write_each_row``: a run stopped part-way keeps what it measured)."""
    print(
        f"{bench.name}: {len(c.shapes)} shapes x {len(c.providers)} providers, {c.warmup} warmup + {c.steps} "
        "timed steps, one fresh process each",
        flush=True,
    )
    report = run(
        bench,
        plan=c.plan,
        shapes=c.shapes,
        providers=c.providers,
        dtype=c.dtype,
        device=c.device,
        warmup=c.warmup,
        steps=c.steps,
        metadata=c.metadata,
        progress=progress,
        on_row=(lambda r: write(r, c.out_dir)) if write_each_row else None,
    )
    print_written(markdown(report), write(report, c.out_dir))
    return report
