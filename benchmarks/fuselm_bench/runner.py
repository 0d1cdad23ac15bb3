"""``fuselm bench <op suite>``: from the parsed arguments to the printed and written reports."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from .arguments import UsageError, parse_dtype, parse_list, parse_shapes, pick_device, results_dir
from .harness import MODES, Report, Shape, Suite, measure_ceilings, run_suite
from .report import CPU_FIGURES, collect_metadata, markdown, markdown_table, print_written, write_report


def run_op_suites(
    suites: list[Suite],
    args: argparse.Namespace,
    argv: list[str],
    metadata: dict[str, Any] | None = None,
    check_shape: Callable[[Shape], Any] | None = None,
    extras: Callable[[Report], dict[str, Any]] | None = None,
    summary: Callable[[Report], str] | None = None,
) -> int:
    """Measure the ceilings, run each suite a shape at a time, writing its files after each shape; the exit
    code (1: a suite measured nothing). ``extras(report)``: more :func:`write_report` keywords;
    ``summary(report)``: a table printed last. Raises ``UsageError`` before anything runs."""
    dtype = parse_dtype(args.dtype)
    modes = parse_list(args.modes, MODES, "mode")
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    plans = []
    for suite in suites:
        default = suite.gpu_shapes if cuda else suite.cpu_shapes
        shapes = parse_shapes(args.shapes, len(suite.shape_dims)) if args.shapes else list(default)
        for shape in shapes if check_shape is not None else ():
            try:
                check_shape(shape)
            except ValueError as e:
                raise UsageError(f"bad shape {'x'.join(map(str, shape))}: {e}") from None
        names = suite.provider_names
        plans.append((suite, shapes, parse_list(args.providers, names, "provider", default=names)))
    meta = {**collect_metadata(device, argv), **(metadata or {})}
    if not cuda:
        print(CPU_FIGURES)
    print(
        f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, fuselm @ {meta['commit']}"
    )
    out_dir = results_dir(args.out, meta["device"] if cuda else None)
    print("measuring ceilings ...", flush=True)
    ceilings = measure_ceilings(device, quick=args.quick)
    print(f"ceilings: {ceilings.describe('n/a')}", flush=True)
    options = {"dtype": dtype, "modes": modes, "device": device, "quick": args.quick, "ceilings": ceilings}
    options.update(metadata=meta, progress=not args.no_progress)
    status = 0
    for suite, shapes, providers in plans:
        log = functools.cache(print)  # each distinct message once (a provider's setup runs at every shape)
        report: Report | None = None
        for i, shape in enumerate(shapes):
            part = run_suite(suite, shapes=[shape], providers=providers, log=log, **options)
            if report is not None:  # the shapes so far, then this one
                part.shapes, part.rows = (*report.shapes, *part.shapes), [*report.rows, *part.rows]
                part.skipped = {**report.skipped, **part.skipped}
            report = part
            more = extras(report) if extras is not None else {}
            paths = write_report(report, out_dir, **more)
            print(f"{suite.name}: {i + 1}/{len(shapes)} shapes done, written to {out_dir}", flush=True)
        text = markdown(report, more.get("extra_markdown", "")) if len(plans) == 1 else markdown_table(report)
        print_written(text, paths)
        if summary is not None:
            print(f"\n{summary(report)}")
        status = max(status, 0 if any(r.ms is not None for r in report.rows) else 1)
    return status
