"""``fuselm bench <op suite>``: from the parsed arguments to the printed and written reports. :func:`start`
and :func:`finish` are shared with ``linear_log_probs``, which has a runner of its own."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .arguments import UsageError, parse_dtype, parse_list, parse_shapes, pick_device, results_dir
from .harness import MODES, Report, Shape, Suite, measure_ceilings, run_suite
from .report import collect_metadata, markdown, markdown_table, print_written, write_report


def plan_suite(
    suite: Suite,
    args: argparse.Namespace,
    device: torch.device,
    check_shape: Callable[[Shape], Any] | None = None,
) -> tuple[list[Shape], list[str]]:
    """The shapes (each through ``check_shape``, whose ValueError is a bad shape) and providers of a run of
    ``suite``."""
    if args.shapes:
        shapes = parse_shapes(args.shapes, len(suite.shape_dims))
    else:
        shapes = list(suite.gpu_shapes if device.type == "cuda" else suite.cpu_shapes)
    providers = parse_list(args.providers, suite.provider_names, "provider") if args.providers else None
    for shape in shapes if check_shape is not None else ():
        try:
            check_shape(shape)
        except ValueError as e:
            raise UsageError(f"bad shape {'x'.join(map(str, shape))}: {e}") from None
    return shapes, providers or suite.provider_names


def start(
    suites: Sequence[Suite],
    args: argparse.Namespace,
    argv: list[str],
    metadata: dict[str, Any] | None = None,
    check_shape: Callable[[Shape], Any] | None = None,
) -> tuple[Path, Callable[..., Report], list[tuple[Suite, list[Shape], list[str]]]]:
    """Check the options (``UsageError`` before anything runs), say what runs where, measure the ceilings; the
    output folder, ``run(suite, shapes=, providers=[, log=])`` (:func:`run_suite` with the run's options) and
    ``(suite, shapes, providers)`` per suite."""
    dtype = parse_dtype(args.dtype)
    modes = parse_list(args.modes, MODES, "mode")
    device = pick_device(args.device)
    plans = [(suite, *plan_suite(suite, args, device, check_shape)) for suite in suites]
    cuda = device.type == "cuda"
    meta = collect_metadata(device, argv)
    meta.update(metadata or {})
    if not cuda:
        print(
            "No CUDA device in use: these are CPU figures (tiny shapes, few repetitions, no memory figures), "
            "not comparable to GPU results."
        )
    print(
        f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, fuselm @ {meta['commit']}"
    )
    out_dir = results_dir(args.out, meta["device"] if cuda else None)
    print("measuring ceilings ...", flush=True)
    ceilings = measure_ceilings(device, quick=args.quick)
    copy = f"{ceilings.copy_tbps:.2f} TB/s" if ceilings.copy_tbps else "n/a"
    gemm = f"{ceilings.gemm_tflops:.1f} TFLOP/s" if ceilings.gemm_tflops else "n/a"
    print(f"ceilings: copy {copy} ({ceilings.copy_what}); GEMM {gemm} ({ceilings.gemm_what})", flush=True)
    options = {"dtype": dtype, "modes": modes, "device": device, "quick": args.quick, "ceilings": ceilings}
    run = functools.partial(run_suite, **options, metadata=meta, progress=not args.no_progress)
    return out_dir, run, plans


def finish(
    report: Report, out_dir: Path, *, extra_markdown: str = "", text: str | None = None, **options
) -> int:
    """Write the report, print ``text`` (default: the markdown); the exit code (1: nothing measured)."""
    paths = write_report(report, out_dir, extra_markdown=extra_markdown, **options)
    print_written(markdown(report, extra_markdown) if text is None else text, paths)
    return 0 if any(r.ms is not None for r in report.rows) else 1


def run_op_suites(suites: list[Suite], args: argparse.Namespace, argv: list[str]) -> int:
    """Run and write each of ``suites``; the exit code (1: a suite measured nothing)."""
    out_dir, run, plans = start(suites, args, argv)
    status = 0
    for suite, shapes, providers in plans:
        report = run(suite, shapes=shapes, providers=providers)
        text = None if len(plans) == 1 else markdown_table(report)
        status = max(status, finish(report, out_dir, text=text))
    return status
