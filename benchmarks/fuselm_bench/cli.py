"""The lab's command line: ``python -m fuselm_bench ...``, or ``fuselm bench ...`` when it is importable."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .arguments import UsageError, positive_int
from .report import set_offline_env


def build_parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(
        prog="fuselm bench",
        description=(
            "Time forward, backward and forward+backward of an op for several providers, measure extra peak "
            "memory and the card's ceilings (copy bandwidth, bf16 GEMM rate) in the same process, and write "
            "<suite>.md, .json and .png. Without a suite name: list the suites."
        ),
    )
    bench.add_argument("suite", nargs="?", help="suite to run ('all' for every suite); omit to list them")
    bench.add_argument(
        "--shapes",
        help="comma-separated shapes like 8192x128256,16384x32000 (default: the suite's GPU shapes)",
    )
    bench.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    bench.add_argument(
        "--modes", default="fwd,bwd,full", help="comma-separated from fwd,bwd,full (default: all)"
    )
    bench.add_argument("--providers", help="comma-separated provider names (default: all of the suite's)")
    bench.add_argument(
        "--out",
        help="output folder (default: benchmarks/results/<gpu>, e.g. .../h100; without CUDA bench-out/cpu)",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (a rough number fast)")
    bench.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: cuda when available (default)",
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--steps", type=int, help="e2e, finetune: timed training steps per run (default 10; CPU 3)"
    )
    bench.add_argument(
        "--warmup", type=int, help="e2e, finetune: warmup steps before timing (default 3; CPU 2)"
    )
    bench.add_argument(
        "--models",
        help="e2e, finetune: comma-separated model shapes (e2e: llama3.2-1b, qwen3-0.6b, llama3-8b; default: "
        "the grid's; finetune default: llama3-8b)",
    )
    bench.add_argument(
        "--repeats",
        type=positive_int,
        help="e2e, finetune: fresh-process runs per configuration and provider (default: e2e 3, finetune 1)",
    )
    bench.add_argument(
        "--profile-steps",
        type=int,
        help="e2e, finetune: steps profiled with torch.profiler after the timed ones, for the GPU kernel "
        "time and launch count (default: e2e 3, finetune 2; CPU 1; 0: none)",
    )
    bench.add_argument(
        "--merge",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="e2e, finetune: join the rows of an earlier report (same device and dtype) with this run's, "
        "e.g. a grid split over several commands: the output folder's <suite>.json, or PATH (a JSON file or "
        "a folder holding <suite>.json); this run's configurations replace the earlier rows of the same ones",
    )
    bench.add_argument("--scenarios", help="finetune: comma-separated from qlora,lora (default: both)")
    bench.add_argument(
        "--caps", help="max-context: GPU memory caps in GiB, comma-separated (default 16,40,80)"
    )
    bench.add_argument("--seq-range", help="max-context: LO:HI tokens to search (default 1024:524288)")
    bench.add_argument(
        "--rel-tol", type=float, help="max-context: stop when HI / LO <= 1 + this (default 0.05)"
    )
    bench.add_argument("--max-probes", type=positive_int, help="max-context: probes per search (default 12)")
    bench.add_argument(
        "--mlp-chunk-tokens",
        type=positive_int,
        help="max-context, fuselm: the patched MLP over chunks of this many tokens (mlp_chunk_tokens=)",
    )
    bench.add_argument(
        "--memory-budgets",
        help="finetune: GiB, comma-separated: fuselm once per budget, patch(checkpointing='auto', "
        "memory_budget=) (providers fuselm@<GiB>), step time against peak memory in the plot",
    )
    bench.add_argument("--rank", type=positive_int, help="finetune: LoRA rank r (default 16; alpha = r)")
    bench.add_argument("--lora-alpha", type=float, help="finetune: LoRA alpha (default: the rank)")
    bench.add_argument("--lora-dropout", type=float, help="finetune: LoRA dropout (default 0)")
    bench.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="finetune: fuselm.hf.patch(..., checkpointing='offload') for the fuselm provider when fuselm "
        "has that option (default: on)",
    )
    bench.add_argument(
        "--unsloth-compile",
        action="store_true",
        help="finetune: leave Unsloth's per-block torch.compile on (default: UNSLOTH_COMPILE_DISABLE=1; the "
        "compile takes minutes)",
    )
    bench.add_argument(
        "--gpus",
        help="max-context: run every (provider, cap) search at once, on these GPUs in turn (e.g. 0,1: "
        "each probe sees its GPU alone)",
    )
    bench.add_argument(
        "--model-dir",
        help="finetune, max-context: folder for the saved random-init models (reused when already there; "
        "default: a temporary folder removed after the run)",
    )
    return bench


def _list_suites() -> None:
    from .registry import SUITES, TRAINING_SUITES

    print("benchmark suites (fuselm bench <suite>):")
    width = max(len(n) for n in [*SUITES, *TRAINING_SUITES])
    for name, (_, desc) in SUITES.items():
        print(f"  {name:<{width}}  {desc}")
    print(f"  {'all':<{width}}  every suite above")
    for name, (_, desc) in TRAINING_SUITES.items():
        print(f"  {name:<{width}}  {desc}; not part of 'all'")


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from .registry import TRAINING_SUITES, get_suite, get_training_runner, suite_names
    from .runner import run_op_suites

    if args.suite is None:
        _list_suites()
        return 0
    if args.suite in TRAINING_SUITES:  # whole training runs (e2e): their own runner, not the op harness
        return get_training_runner(args.suite)(args, argv)
    if args.suite != "all" and args.suite not in suite_names():
        known = ", ".join([*suite_names(), "all", *TRAINING_SUITES])
        raise UsageError(f"unknown suite {args.suite!r}; known: {known}")
    if args.suite == "all" and args.shapes:
        raise UsageError("--shapes needs a single suite")
    names = suite_names() if args.suite == "all" else [args.suite]
    return run_op_suites([get_suite(n) for n in names], args, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``fuselm bench`` with these arguments; the exit code (0 ok, 1 nothing measured, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    set_offline_env()
    try:
        return _bench(args, ["bench", *argv])
    except UsageError as e:
        print(f"fuselm bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
