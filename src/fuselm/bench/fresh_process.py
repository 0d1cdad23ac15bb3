"""What the ``e2e`` and ``grpo_step`` benchmarks share: one case per fresh ``python -m ... --worker`` process.

The worker side (:func:`worker_main`) runs one case and writes its result as JSON to the file the parent
named; the parent side (:func:`run_worker`) starts that process with a timeout and reads the result back
(a failure of the worker becomes an ``error`` result, never an exception). :func:`row_from_result`,
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch


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


def cli_steps_dtype(args: argparse.Namespace, plan: Any, cuda: bool) -> tuple[int, int, torch.dtype]:
    """``(warmup, steps, dtype)`` of a ``fuselm bench`` run: ``--warmup`` / ``--steps`` or the plan's (its
    quick ones with ``--quick``), ``--dtype`` on CUDA, fp32 otherwise. Raises ``fuselm.cli.UsageError``."""
    from ..cli import DTYPES as CLI_DTYPES
    from ..cli import UsageError

    warmup = getattr(args, "warmup", None)
    steps = getattr(args, "steps", None)
    warmup = (plan.quick_warmup if args.quick else plan.warmup) if warmup is None else warmup
    steps = (plan.quick_steps if args.quick else plan.steps) if steps is None else steps
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    if warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {warmup}")
    if not cuda:
        return warmup, steps, torch.float32
    if args.dtype.lower() not in CLI_DTYPES:
        raise UsageError(f"unknown dtype {args.dtype!r}; known: bf16, fp16, fp32")
    return warmup, steps, getattr(torch, CLI_DTYPES[args.dtype.lower()])


def main(argv: Sequence[str] | None, name: str, worker: Callable[[Sequence[str]], int]) -> int:
    """``python -m fuselm.bench.<name> --worker ...`` runs ``worker(argv)``; anything else is ``fuselm bench
    <name> ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        return worker(argv)
    from ..cli import main as cli_main

    return cli_main(["bench", name, *argv])
