"""What the ``e2e`` and ``grpo_step`` benchmarks share: one case per fresh ``python -m ... --worker`` process.

The worker side (:func:`worker_main`) runs one case and writes its result as JSON to the file the parent
named; the parent side (:func:`run_worker`) starts that process with a timeout and reads the result back
(a failure of the worker becomes an ``error`` result, never an exception). :func:`run_cases` runs every
(shape, provider) of a report that way, :class:`CaseRows` looks rows up; :func:`row_from_result`,
:func:`rows_json` and :func:`write_report_files` are the parts of the row and report handling both share.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .arguments import UsageError, parse_list, parse_shapes, pick_device, results_dir, warmup_steps_dtype
from .report import DTYPE_NAMES, collect_metadata, md_table, ratio


class SkipRun(Exception):
    """The provider cannot run here (missing package, needs CUDA); the message is the reason."""


def error_text(e: BaseException, limit: int = 200) -> str:
    """``Type: message`` on one line, at most ``limit`` characters of message (OOM: its first two
    sentences, "CUDA out of memory. Tried to allocate X GiB.")."""
    text = " ".join(str(e).split())
    if isinstance(e, torch.cuda.OutOfMemoryError):
        text = ". ".join(text.split(". ")[:2]).rstrip(".") + "."
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def worker_parser(
    prog: str,
    description: str,
    case: Sequence[tuple[str, dict[str, Any]]],
    *,
    dtypes: Sequence[str],
    seed: int,
) -> argparse.ArgumentParser:
    """The worker's arguments: ``--worker``, ``--provider``, the ``case`` ones (flag, ``add_argument``
    keywords; all required), ``--dtype``, ``--device``, ``--warmup``, ``--steps``, ``--seed``,
    ``--result``."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--provider", required=True)
    for flag, kwargs in case:
        p.add_argument(flag, required=True, **kwargs)
    p.add_argument("--dtype", choices=sorted(dtypes), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--result", required=True, help="file the JSON result is written to")
    return p


def worker_main(
    result: dict[str, Any], device: torch.device, result_path: str | Path, run: Callable[[], dict[str, Any]]
) -> int:
    """The worker process: ``run()`` one case, ``result`` updated with what it returns, written as JSON to
    ``result_path`` and printed (without losses and traceback); returns the exit code.

    Status ``ok`` (exit 0), ``oom`` or ``skipped`` (exit 0: a result, not a failure), ``error`` (exit 1,
    with the exception and the tail of its traceback).
    """
    if device.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: OpenMP thread wake-ups would cost more than the math
    code = 0
    try:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        result.update(run())
    except SkipRun as e:
        result.update(status="skipped", error=str(e))
    except torch.cuda.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        result.update(status="oom", error=error_text(e), peak_bytes=peak)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on with the next run
        tb = traceback.format_exc().strip().splitlines()
        result.update(status="error", error=error_text(e), traceback="\n".join(tb[-15:]))
        code = 1
    Path(result_path).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "traceback")}))
    return code


def memory_figures(device: torch.device) -> dict[str, int | None]:
    """``peak_bytes`` and ``reserved_bytes``: ``torch.cuda``'s maxima since the last reset (None on CPU)."""
    cuda = device.type == "cuda"
    return {
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


def worker_command(module: str, provider: str, case: dict[str, Any], **options: Any) -> list[str]:
    """``python -m <module> --worker --provider=<provider>`` with ``--<key>=<value>`` for each entry of
    ``case`` then of ``options`` (dtype, device, warmup, steps, result).

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


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_worker(command: Callable[[Path], list[str]], *, timeout: float, prefix: str) -> dict[str, Any]:
    """Run ``command(result file)`` in a fresh process; return the worker's result with ``wall_s`` added.

    Never raises for a failure of the worker: a timeout, or an exit without a readable result, gives
    ``{"status": "error", "error": <what happened>, "wall_s": ...}``.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = command(result_path)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"worker timed out after {timeout:.0f} s", "wall_s": timeout}
        wall = time.perf_counter() - t0
        data: dict[str, Any] | None = None
        if result_path.exists():
            try:
                data = json.loads(result_path.read_text())
            except json.JSONDecodeError:
                data = None
    if data is None:
        output = _tail((proc.stdout or "") + "\n" + (proc.stderr or ""))
        error = f"worker exited with code {proc.returncode} and wrote no result; its last output:\n{output}"
        return {"status": "error", "error": error, "wall_s": wall}
    return {**data, "wall_s": wall}


def row_from_result(cls: Any, key: dict[str, Any], data: dict[str, Any]) -> Any:
    """``cls(**key, ...)`` with the fields of ``data`` that ``cls`` has (other than the key's)."""
    known = set(cls.__dataclass_fields__) - set(key)
    return cls(**key, **{k: v for k, v in data.items() if k in known})


def add_row(
    report: Any, provider: str, row: Any, log: Callable[[str], None], summary: Callable[[Any], str]
) -> bool:
    """Put a worker's row into ``report`` and log it; a ``skipped`` row instead marks the provider skipped
    (``report.skipped``) and returns False."""
    if row.status == "skipped":
        report.skipped[provider] = row.error or "skipped"
        log(f"skipping provider {provider}: {row.error}")
        return False
    report.rows.append(row)
    log(summary(row))
    if row.traceback:
        log(row.traceback)
    return True


GIB = 1 << 30


class WorkerRow:
    """For a row dataclass of a worker's result: ``shape`` (its ``SHAPE_FIELDS``) and ``peak_gib``."""

    SHAPE_FIELDS: tuple[str, ...] = ()
    peak_bytes: int | None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in self.SHAPE_FIELDS)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB


class CaseRows:
    """For a report dataclass with ``rows`` whose items have ``provider`` and ``shape``: :meth:`row`."""

    rows: list[Any]

    def row(self, provider: str, shape: Sequence[int]) -> Any:
        """The row of (provider, shape), or None."""
        for r in self.rows:
            if r.provider == provider and r.shape == tuple(shape):
                return r
        return None


def run_cases(
    report: Any,
    run_case: Callable[[str, tuple[int, ...]], Any],
    row_type: Any,
    *,
    name: str,
    log: Callable[[str], None],
    summary: Callable[[Any], str],
    progress: bool = True,
    on_row: Callable[[Any], None] | None = None,
) -> None:
    """Every (shape, provider) of ``report`` (shapes outer) not yet skipped: ``run_case(provider, shape)``,
    its row added with :func:`add_row`, then ``on_row(report)``. The first size of a shape is its batch: a
    provider out of memory at batch B is not run at a larger batch of the same other sizes (its row says
    so: ``row_type(provider, *shape, "oom", error=...)``)."""
    from tqdm.auto import tqdm

    oom_at: dict[tuple[str, tuple[int, ...]], int] = {}  # (provider, other sizes) -> smallest batch out
    cases = [(s, p) for s in report.shapes for p in report.providers]
    bar = tqdm(cases, desc=name, disable=not progress, leave=False)
    for shape, provider in bar:
        if provider in report.skipped:
            continue
        bar.set_postfix_str(f"{provider} {'x'.join(map(str, shape))}")
        batch, key = shape[0], (provider, shape[1:])
        smallest = oom_at.get(key)
        if smallest is not None and batch >= smallest:
            row = row_type(
                provider, *shape, "oom", error=f"not run: out of memory at batch {smallest} already"
            )
        else:
            row = run_case(provider, shape)
        if row.status == "oom":
            oom_at[key] = min(batch, oom_at.get(key, batch))
        if add_row(report, provider, row, log, summary) and on_row is not None:
            on_row(report)
    bar.close()


def rows_json(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The rows as dicts, each with its ``peak_gib``."""
    out = []
    for r in rows:
        d = asdict(r)
        d["peak_gib"] = r.peak_gib
        out.append(d)
    return out


def write_report_files(
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


def ratios(report: Any, row_type: Any, peers: Sequence[str], metrics: dict[str, str]) -> list[dict[str, Any]]:
    """Per shape of ``report``: its sizes (``row_type.SHAPE_FIELDS``), then for each peer and each
    ``metrics`` entry (key -> row attribute) ``<key>_vs_<peer>``, fuselm's figure over the peer's (None
    unless both rows are ok)."""
    out = []
    for shape in report.shapes:
        mine = report.row("fuselm", shape)
        entry: dict[str, Any] = dict(zip(row_type.SHAPE_FIELDS, shape, strict=True))
        for peer in peers:
            other = report.row(peer, shape)
            ok = mine is not None and mine.status == "ok" and other is not None and other.status == "ok"
            for key, attr in metrics.items():
                entry[f"{key}_vs_{peer}"] = ratio(getattr(mine, attr), getattr(other, attr)) if ok else None
        out.append(entry)
    return out


def ratio_table(
    head: Sequence[str], entries: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]
) -> str:
    """A markdown table of :func:`ratios`: ``label(entry)``, then each ratio as ``1.23x`` (``—`` if None)."""
    rows = []
    for entry in entries:
        values = [v for k, v in entry.items() if "_vs_" in k]
        rows.append([label(entry), *("—" if v is None else f"{v:.2f}x" for v in values)])
    return md_table(head, rows)


def markdown(
    report: Any,
    *,
    name: str,
    description: str,
    cpu_figures: str,
    versions: Sequence[str],
    facts: Sequence[str],
    sections: Sequence[str],
    notes: Sequence[str],
) -> str:
    """A training benchmark's report: title, ``cpu_figures`` (off CUDA), device, the ``versions`` found in
    the metadata, date, ``facts``, command, the ``sections`` (tables), ``notes``, the skipped providers."""
    m = report.metadata
    dtype = DTYPE_NAMES.get(report.dtype, str(report.dtype))
    lines = [f"# fuselm bench {name}", "", f"{description}, {dtype} weights.", ""]
    if report.device_type != "cuda":
        lines += [cpu_figures, ""]
    found = ", ".join(f"{k} {m[k]}" for k in versions if m.get(k) is not None)
    lines += [
        f"- device: {m.get('device')}",
        f"- versions: {found}; fuselm {m.get('fuselm')} @ {m.get('commit')}",
        f"- date: {m.get('date')}",
        *(f"- {fact}" for fact in facts),
        f"- command: `{m.get('command')}`",
        "",
    ]
    for section in sections:
        lines += [section, ""]
    lines += [f"- {n}" for n in notes]
    lines += [f"- skipped {provider}: {reason}" for provider, reason in report.skipped.items()]
    return "\n".join(lines) + "\n"


def write_bars(
    report: Any,
    path: Path,
    *,
    panels: Sequence[tuple[str, str, float]],
    labels: Sequence[str],
    title: str,
    width_per_shape: float,
    mark_failures: bool = False,
    xlabel: str | None = None,
) -> None:
    """Panels of grouped bars, one group per shape of ``report`` (``labels``), one bar per provider that ran:
    each panel ``(row attribute, title, scale)``, values of ok rows, labelled. ``mark_failures``: OOM or
    error written where a row failed, an x label, and "n/a (no CUDA)" / "no results" in an empty panel."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        if xlabel:
            ax.set_xlabel(xlabel)
        if any_value:
            ax.legend(fontsize=8)
        else:
            ax.set_yticks([])
            text = "n/a (no CUDA)" if attr == "peak_gib" else "no results"
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class CliRun:
    """What a training benchmark's ``run_cli`` runs, from the parsed ``fuselm bench`` arguments."""

    providers: list[str]
    device: torch.device
    plan: Any
    shapes: list[tuple[int, ...]]
    warmup: int
    steps: int
    dtype: torch.dtype
    metadata: dict[str, Any]
    out_dir: Path


def start_cli(
    args: Any, argv: list[str], *, name: str, providers: Sequence[str], plans: tuple[Any, Any], ndim: int
) -> CliRun:
    """``--providers`` (default: all), ``--device``, the GPU or the CPU plan of ``plans``, ``--shapes`` of
    ``ndim`` sizes (default: the plan's), warmup, steps and dtype, the metadata with the transformers
    version, the results folder. Raises ``UsageError`` for bad values and without transformers."""
    chosen = parse_list(args.providers, providers, "provider") if args.providers else list(providers)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    plan = plans[0] if cuda else plans[1]
    shapes = parse_shapes(args.shapes, ndim) if args.shapes else list(plan.shapes)
    warmup, steps, dtype = warmup_steps_dtype(args, plan, cuda)
    meta = collect_metadata(device, argv)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        raise UsageError(f'fuselm bench {name} needs transformers: pip install "fuselm[hf]"') from None
    out_dir = results_dir(args.out, meta["device"] if cuda else None)
    return CliRun(chosen, device, plan, shapes, warmup, steps, dtype, meta, out_dir)
