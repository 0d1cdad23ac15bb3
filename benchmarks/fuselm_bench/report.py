"""Run metadata (device, versions, commit) and the report writers every suite uses: markdown tables, the
report document, and the one writer of ``<name>.md``, ``.json`` and ``.png`` (:func:`write_files`)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from .harness import OpRow, Report

shape_label = OpRow.label  # (8192, 128256) -> '8192x128256'

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


COLUMN_TITLES = {
    "ms": "ms",
    "ms_eager": "eager ms",
    "tbps": "TB/s",
    "x_copy": "x copy",
    "tflops": "TFLOP/s",
    "x_gemm": "x GEMM",
    "x_floor": "x floor",
    "extra_mib": "extra MiB",
}

COLUMN_NOTES = {
    "ms_eager": (
        "ms is the device time (replays of the call captured in a CUDA graph); eager ms the plain Python "
        "call, which also counts the host path (argument checks, autograd engine, launches) whenever the "
        "host is slower than the GPU; rates and ratios come from ms."
    ),
    "tbps": "TB/s: the suite's byte count per call / time.",
    "x_copy": "x copy: TB/s / measured device copy bandwidth (1.0 = at the copy rate; higher is better).",
    "tflops": "TFLOP/s: the suite's FLOP count per call / time.",
    "x_gemm": "x GEMM: TFLOP/s / measured bf16 GEMM rate (higher is better).",
    "x_floor": "x floor: time / (FLOPs at the GEMM rate) (1.0 = at the floor; lower is better).",
    "extra_mib": (
        "extra MiB: peak allocated during one call minus allocated before it (inputs allocated; in full "
        "mode the returned gradients count as already allocated, like .grad, unless they reuse an input's "
        "buffer, which costs nothing either; the JSON keeps the raw peak_bytes and grad_bytes); CUDA only."
    ),
}

PLOT_METRICS = ("x_copy", "x_floor", "x_gemm")

# what a report (and the run's output) says of figures measured without CUDA
CPU_FIGURES = (
    "**CPU figures** (no CUDA device): tiny sizes, few repetitions; a smoke test, not comparable to GPU."
)


# ---- environment ----


def gpu_slug(name: str | None) -> str:
    """Results folder name: 'NVIDIA H100 80GB HBM3' -> 'h100', None -> 'cpu', else the name as a slug."""
    if not name or name.lower().startswith("cpu"):
        return "cpu"
    low = name.lower()
    if m := re.search(r"\b([abhlv]\d{2,3}[a-z]?|gb\d{3}|mi\d{3}[a-z]?)\b", low):
        return m.group(1)
    slug = re.sub(r"[^a-z0-9.]+", "-", low).strip("-")
    return slug.removeprefix("nvidia-") or "gpu"


def git_commit() -> str:
    """Short commit of the checkout ('-dirty' with changes), 'unknown' without; FUSELM_COMMIT overrides it (a
    copy of the tree without .git, e.g. on a remote GPU machine)."""
    if os.environ.get("FUSELM_COMMIT"):
        return os.environ["FUSELM_COMMIT"]
    git = functools.partial(
        subprocess.run, cwd=Path(__file__).resolve().parent, capture_output=True, timeout=10
    )
    try:
        sha = git(["git", "rev-parse", "--short", "HEAD"], text=True)
        if sha.returncode != 0 or not sha.stdout.strip():
            return "unknown"
        dirty = git(["git", "diff", "--quiet", "HEAD", "--"]).returncode
        return sha.stdout.strip() + ("-dirty" if dirty == 1 else "")
    except Exception:  # noqa: BLE001 - no git, not a checkout, ...
        return "unknown"


def package_versions(packages: Sequence[str]) -> dict[str, str]:
    """The versions of those of ``packages`` that are installed (with metadata)."""
    out = {}
    for package in packages:
        with contextlib.suppress(PackageNotFoundError):
            if v := version(package):
                out[package] = v
    return out


def host_cpu() -> str:
    """The host's CPU model and usable cores (the same step's CPU time differs by 1.7x between the hosts of
    two GPU machines)."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


# What every run of the lab sets unless the caller's environment says otherwise: GPU machines run
# offline, and transformers >= 5.25 would otherwise look hub kernels up at every from_pretrained (and
# raise offline); recorded in every result's metadata.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "USE_HUB_KERNELS": "0"}


def set_offline_env() -> None:
    """:data:`OFFLINE_ENV` into ``os.environ`` where unset (the lab's processes and workers inherit it)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def collect_metadata(
    device: torch.device, argv: list[str] | None = None, packages: Sequence[str] = ()
) -> dict[str, Any]:
    """Device, versions (the peers' and ``packages``' too), commit, date and hub settings of this run."""
    import fuselm

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    cpu = f"CPU ({platform.machine() or platform.processor() or 'unknown'})"
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "fuselm": fuselm.__version__,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "host": host_cpu(),
        "command": " ".join(["fuselm", *(argv if argv is not None else sys.argv[1:])]),
        "env": {key: os.environ.get(key) for key in OFFLINE_ENV},
    }
    return {**meta, **package_versions(("liger-kernel", "cut-cross-entropy", *packages))}


# ---- formatting ----


def fmt_num(x: float | None, sig: int = 3) -> str:
    """``sig`` significant digits, no exponent, '—' for None/NaN: 0.40612 -> '0.406', 10958.2 -> '10958'."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if x == 0:
        return "0"
    if abs(x) >= 10 ** (sig - 1):
        return f"{x:.0f}"
    x = float(f"{x:.{sig}g}")  # round first: 0.99996 -> 1.0 (then '1.00', not '1.000')
    digits = max(0, sig - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is not positive.

    Example:
        >>> ratio(3.0, 2.0), ratio(3.0, None), ratio(1.0, 0.0)
        (1.5, None, None)
    """
    return None if a is None or b is None or not b > 0 else a / b


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of ``head`` and the cells of each row.

    Example:
        >>> print(md_table(["a", "b"], [["1", "2"]]))
        | a | b |
        |---|---|
        | 1 | 2 |
    """
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def cell(row: OpRow, col: str) -> str:
    """A row's column ``col`` as the tables write it."""
    if col == "ms" and row.ms is None and row.error:
        return "OOM" if row.error.startswith("OutOfMemoryError") else "error"
    value = row.extra_mib if col == "extra_mib" else getattr(row, col)
    if col in PLOT_METRICS and value is not None:
        return f"{value:.2f}"
    return fmt_num(value)


def markdown_table(report: Report) -> str:
    cols = list(report.suite.columns)
    head = [", ".join(report.suite.shape_dims), "provider", "mode", *(COLUMN_TITLES[c] for c in cols)]
    rows = [[shape_label(r.shape), r.provider, r.mode, *(cell(r, c) for c in cols)] for r in report.rows]
    if any(r.error or r.note for r in report.rows):
        head.append("note")
        for cells, r in zip(rows, report.rows, strict=True):
            cells.append((r.error or r.note or "").replace("|", "/"))
    return md_table(head, rows)


def notes(report: Report) -> list[str]:
    out = []
    if "bwd" in report.modes:
        out.append(
            "bwd = the backward alone (torch.autograd.grad after an untimed forward that records autograd), "
            "measured on its own, the same for every provider (no memory figure); a design that computes the "
            "gradient in its forward does that work in full, not in bwd."
        )
    if "fwd" in report.modes and report.suite.forward_grad:
        out.append("fwd records autograd, as the forward of a training step.")
    elif "fwd" in report.modes:
        out.append(
            "fwd runs under torch.no_grad() on inputs that do not require grad (outputs only, the same work "
            "for every provider)."
        )
    out.append(
        "full = forward + torch.autograd.grad w.r.t. the inputs that require grad (no .grad accumulation)."
    )
    out.extend(COLUMN_NOTES[c] for c in report.suite.columns if c in COLUMN_NOTES)
    out.extend(report.suite.notes)
    return out


def versions(m: dict[str, Any], names: Sequence[str]) -> str:
    """The versions of ``names`` found in the metadata ``m``, and fuselm's."""
    found = ", ".join(f"{k} {m[k]}" for k in names if m.get(k) is not None)
    return f"{found}; fuselm {m.get('fuselm')} @ {m.get('commit')}"


def run_facts(m: dict[str, Any], names: Sequence[str], *middle: str) -> list[str]:
    """The facts of a run's metadata ``m`` every report opens with (device, the versions of ``names``, date),
    ``middle``, and its command last."""
    head = [f"device: {m.get('device')}", f"versions: {versions(m, names)}", f"date: {m.get('date')}"]
    return [*head, *middle, f"command: `{m.get('command')}`"]


def document(
    name: str,
    intro: str,
    cpu_figures: str | None,
    facts: Sequence[str],
    sections: Sequence[str],
    notes: Sequence[str],
    skipped: dict[str, str],
) -> str:
    """A markdown report as every suite writes it: title, intro, facts, sections, notes, skipped providers."""
    lines = [f"# fuselm bench {name}", "", intro, ""]
    if cpu_figures:
        lines += [cpu_figures, ""]
    lines += [*(f"- {fact}" for fact in facts), ""]
    for section in sections:
        lines += [section.rstrip("\n"), ""]
    lines += [f"- {n}" for n in notes]
    lines += [f"- skipped {provider}: {reason}" for provider, reason in skipped.items()]
    return "\n".join(lines) + "\n"


def markdown(report: Report, extra: str = "") -> str:
    """An op suite's markdown report (``extra``: more sections after the table)."""
    m, names = report.metadata, ("torch", "triton", "liger-kernel", "cut-cross-entropy")
    ceilings = f"ceilings (measured in this run): device {report.ceilings.describe('not measured')}"
    return document(
        report.suite.name,
        f"{report.suite.description}, {dtype_name(report.dtype)}.",
        CPU_FIGURES if m.get("device_type") == "cpu" else None,
        run_facts(m, names, ceilings, f"timing: {m.get('timing')}"),
        [markdown_table(report), *([extra] if extra else [])],
        notes(report),
        report.skipped,
    )


def to_json(report: Report) -> dict[str, Any]:
    rows = [{**asdict(r), "shape": list(r.shape), "extra_mib": r.extra_mib} for r in report.rows]
    return {
        "suite": report.suite.name,
        "description": report.suite.description,
        "dtype": dtype_name(report.dtype),
        "shape_dims": list(report.suite.shape_dims),
        "shapes": [list(s) for s in report.shapes],
        "modes": list(report.modes),
        "providers": list(report.providers),
        "columns": list(report.suite.columns),
        "metadata": report.metadata,
        "ceilings": asdict(report.ceilings),
        "rows": rows,
        "skipped": report.skipped,
        "notes": notes(report),
    }


# ---- plots and files ----


def pyplot():
    """matplotlib's pyplot on the Agg backend (ImportError without matplotlib: no plot written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(
    path: Path,
    title: str,
    labels: Sequence[str],
    panels: Sequence[tuple[str, list[tuple[str, list[Any]]]]],
    width: float,
    **options: Any,
) -> None:
    """A PNG of grouped bars, one legend below: a panel per ``(title, series)``, ``series`` a ``(name, a value
    per label)`` per bar of each group: a number, NaN (no bar) or a text (no bar: the text at its foot).
    ``options``: ``xlabel``, ``ylabel``, ``ratio_line`` (dashed, at 1.0), ``values`` (on the bars), ``empty``
    (the text of a panel without bars)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4), squeeze=False)
    names = [name for name, _ in panels[0][1]] if panels else []
    bar_width = 0.8 / max(1, len(names))
    for ax, (panel_title, series) in zip(axes[0], panels, strict=True):
        for i, (name, ys) in enumerate(series):
            xs = [j + (i - (len(names) - 1) / 2) * bar_width for j in range(len(labels))]
            nums = [float("nan") if isinstance(y, str) else y for y in ys]
            bars = ax.bar(xs, nums, width=bar_width, label=name)
            if options.get("values"):
                ax.bar_label(bars, labels=["" if v != v else f"{v:.1f}" for v in nums], fontsize=7)
            for x, y in zip(xs, ys, strict=True):
                if isinstance(y, str):
                    ax.text(x, 0, y, ha="center", va="bottom", rotation=90, fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set(xlim=(-0.5, len(labels) - 0.5), title=panel_title)
        ax.set(xlabel=options.get("xlabel", ""), ylabel=options.get("ylabel", ""))
        if options.get("ratio_line"):
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        if all(not v == v for _, ys in series for v in ys):  # NaN or text: no bar
            ax.set_yticks([])
            ax.text(
                0.5, 0.5, options.get("empty", "no results"), ha="center", va="center", transform=ax.transAxes
            )
    fig.suptitle(title, fontsize=10)
    if names:  # one legend for every panel, below them (a legend per panel hides bars)
        handles, legend = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, legend, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 if names else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_png(report: Report, path: Path) -> None:
    """Op suite bars (shape x provider), a panel per mode: its first ratio column with values, else ms."""
    ratios = [c for c in report.suite.columns if c in PLOT_METRICS]
    metric = next((c for c in ratios if any(getattr(r, c) is not None for r in report.rows)), "ms")
    providers = [p for p in report.providers if p not in report.skipped]

    def values(provider: str, mode: str) -> list[float]:
        found = (getattr(report.row(s, provider, mode), metric, None) for s in report.shapes)
        return [float("nan") if v is None else v for v in found]

    panels = [(mode, [(p, values(p, mode)) for p in providers]) for mode in report.modes]
    panel_width = min(8.0, max(4.0, 1.5 + 0.35 * len(report.shapes) * max(1, len(providers))))
    bar_chart(
        path,
        f"fuselm bench {report.suite.name}, {dtype_name(report.dtype)}, {report.metadata.get('device')}",
        [shape_label(s) for s in report.shapes],
        panels,
        max(6.0, panel_width * len(report.modes)),
        ylabel=COLUMN_TITLES[metric],
        ratio_line=metric in PLOT_METRICS,
    )


def write_files(
    name: str,
    out_dir: str | Path,
    markdown: str,
    data: dict[str, Any],
    write_png: Callable[[Path], None] | None = None,
) -> dict[str, Path]:
    """Write ``<name>.md``, ``.json`` and (without matplotlib: not) ``.png`` into ``out_dir``; their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{name}.md", "json": out / f"{name}.json"}
    paths["md"].write_text(markdown)
    paths["json"].write_text(json.dumps(data, indent=2, default=str) + "\n")
    try:
        if write_png is not None:
            write_png(out / f"{name}.png")
            paths["png"] = out / f"{name}.png"
    except ImportError as e:
        print(f"no plot written ({e}); pip install matplotlib")
    return paths


def print_written(text: str, paths: dict[str, Path]) -> None:
    print(f"\n{text}\nwrote " + ", ".join(str(p) for p in paths.values()))


def write_report(
    report: Report, out_dir: str | Path, *, extra_markdown: str = "", extra_json: dict[str, Any] | None = None
) -> dict[str, Path]:
    """An op suite's :func:`write_files` (``extra_json``: merged into the JSON's top level)."""
    return write_files(
        report.suite.name,
        out_dir,
        markdown(report, extra_markdown),
        {**to_json(report), **(extra_json or {})},
        lambda path: write_png(report, path),
    )
