"""``fuselm bench <op suite>``: from the parsed command-line arguments to the printed and written reports.

:func:`run_op_suites` runs registered op suites through :func:`~fuselm.bench.harness.run_suite`;
:func:`plan_suite` and :func:`start` are the steps it shares with a suite that has a runner of its own
(``linear_log_probs``): the shapes and providers asked for, then the device line, the results folder and
the card's ceilings measured in this process.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .arguments import parse_dtype, parse_list, parse_shapes, pick_device, results_dir
from .harness import MODES, Ceilings, Shape, Suite, measure_ceilings, run_suite
from .report import collect_metadata, markdown, markdown_table, write_report

CPU_NOTICE = (
    "No CUDA device in use: these are CPU figures (tiny shapes, few repetitions, no memory figures), "
    "not comparable to GPU results."
)


@dataclass
class Session:
    """Where a run measures and writes: the device, the run's metadata, the results folder, the ceilings."""

    device: torch.device
    metadata: dict[str, Any]
    out_dir: Path
    ceilings: Ceilings


def plan_suite(suite: Suite, args: argparse.Namespace, device: torch.device) -> tuple[list[Shape], list[str]]:
    """The shapes (``--shapes``, else the suite's GPU or CPU shapes) and providers (``--providers``, else
    all of the suite's) of a run of ``suite``. Raises ``UsageError``."""
    if args.shapes:
        shapes = parse_shapes(args.shapes, len(suite.shape_dims))
    else:
        shapes = list(suite.gpu_shapes if device.type == "cuda" else suite.cpu_shapes)
    providers = parse_list(args.providers, suite.provider_names, "provider") if args.providers else None
    return shapes, providers or suite.provider_names


def start(
    device: torch.device, args: argparse.Namespace, argv: list[str], metadata: dict[str, Any] | None = None
) -> Session:
    """Print what runs where (a notice on a CPU), pick the results folder and measure the ceilings."""
    cuda = device.type == "cuda"
    meta = collect_metadata(device, argv)
    meta.update(metadata or {})
    if not cuda:
        print(CPU_NOTICE)
    print(
        f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, fuselm @ {meta['commit']}"
    )
    out_dir = results_dir(args.out, meta["device"] if cuda else None)
    print("measuring ceilings ...", flush=True)
    ceilings = measure_ceilings(device, quick=args.quick)
    copy = f"{ceilings.copy_tbps:.2f} TB/s" if ceilings.copy_tbps else "n/a"
    gemm = f"{ceilings.gemm_tflops:.1f} TFLOP/s" if ceilings.gemm_tflops else "n/a"
    print(f"ceilings: copy {copy} ({ceilings.copy_what}); GEMM {gemm} ({ceilings.gemm_what})", flush=True)
    return Session(device, meta, out_dir, ceilings)


def print_written(text: str, paths: dict[str, Path]) -> None:
    """The report printed at the end of a run, and the files written."""
    print()
    print(text)
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def run_op_suites(suites: list[Suite], args: argparse.Namespace, argv: list[str]) -> int:
    """Run each of ``suites`` with the parsed ``fuselm bench`` arguments; write and print the reports.
    Returns the exit code: 0, or 1 when a suite measured nothing. Raises ``UsageError`` for bad values."""
    dtype = parse_dtype(args.dtype)
    modes = parse_list(args.modes, MODES, "mode")
    device = pick_device(args.device)
    plans = [(suite, *plan_suite(suite, args, device)) for suite in suites]
    session = start(device, args, argv)

    status = 0
    for suite, shapes, providers in plans:
        report = run_suite(
            suite,
            shapes=shapes,
            dtype=dtype,
            modes=modes,
            providers=providers,
            device=device,
            quick=args.quick,
            ceilings=session.ceilings,
            metadata=session.metadata,
            progress=not args.no_progress,
        )
        paths = write_report(report, session.out_dir)
        print_written(markdown(report) if len(plans) == 1 else markdown_table(report), paths)
        if not any(r.ms is not None for r in report.rows):
            status = 1
    return status
