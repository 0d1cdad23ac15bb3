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
        description="Time an op's fwd, bwd and fwd+bwd (or training steps) for several providers, with peak "
        "memory and the card's ceilings, and write <suite>.md, .json and .png. No suite: list the suites.",
    )
    add = bench.add_argument
    add("suite", nargs="?", help="suite to run ('all' for every op suite); omit to list them")
    add("--shapes", help="comma-separated shapes like 8192x128256,16384x32000 (default: the suite's)")
    add("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    add("--modes", default="fwd,bwd,full", help="comma-separated from fwd,bwd,full (default: all)")
    add("--providers", help="comma-separated provider names (default: all of the suite's)")
    add("--out", help="output folder (default: benchmarks/results/<gpu>; without CUDA bench-out/cpu)")
    add("--quick", action="store_true", help="fewer repetitions (a rough number fast)")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--steps", type=int, help="e2e, finetune: timed training steps per run (default 10; CPU 3)")
    add("--warmup", type=int, help="e2e, finetune: warmup steps before timing (default 3; CPU 2)")
    add("--models", help="e2e, finetune: comma-separated model shapes (default: the grid's, llama3-8b)")
    add("--repeats", type=positive_int, help="e2e, finetune: fresh-process runs per case (default: 3; 1)")
    add("--profile-steps", type=int, help="e2e, finetune: steps under torch.profiler after the timed ones")
    merge = "e2e, finetune: join the rows of an earlier report (<out>/<suite>.json, or PATH) to this run"
    add("--merge", nargs="?", const=True, metavar="PATH", help=merge)
    add("--scenarios", help="finetune: comma-separated from qlora,lora (default: both)")
    add("--caps", help="max-context: GPU memory caps in GiB, comma-separated (default 16,40,80)")
    add("--seq-range", help="max-context: LO:HI tokens to search (default 1024:524288)")
    add("--rel-tol", type=float, help="max-context: stop when HI / LO <= 1 + this (default 0.05)")
    add("--max-probes", type=positive_int, help="max-context: probes per search (default 12)")
    add("--bounds-known", action="store_true", help="max-context: LO fits, HI does not: probe only between")
    add("--mlp-chunk-tokens", type=positive_int, help="max-context, fuselm: patch(mlp_chunk_tokens=)")
    add("--memory-budgets", help="finetune: GiB, comma-separated: providers fuselm@<GiB> (memory_budget=)")
    add("--rank", type=positive_int, help="finetune: LoRA rank r (default 16)")
    add("--lora-alpha", type=float, help="finetune: LoRA alpha (default: the rank)")
    add("--lora-dropout", type=float, help="finetune: LoRA dropout (default 0)")
    add("--offload", action=argparse.BooleanOptionalAction, help="finetune: fuselm offloads (default: on)")
    add("--unsloth-compile", action="store_true", help="finetune: leave Unsloth's torch.compile on")
    add("--trainer", action="store_true", help="finetune: steps through transformers.Trainer.train()")
    add("--gpus", help="max-context: run the searches at once, on these GPUs in turn (e.g. 0,1)")
    add("--model-dir", help="finetune, max-context: folder for the saved models (default: a temporary one)")
    return bench


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from .registry import SUITES, TRAINING_SUITES, get_suite, get_training_runner, suite_names
    from .runner import run_op_suites

    if args.suite is None:  # list the suites
        print("benchmark suites (fuselm bench <suite>):")
        width = max(len(n) for n in [*SUITES, *TRAINING_SUITES])
        for name, (_, desc) in SUITES.items():
            print(f"  {name:<{width}}  {desc}")
        print(f"  {'all':<{width}}  every suite above")
        for name, (_, desc) in TRAINING_SUITES.items():
            print(f"  {name:<{width}}  {desc}; not part of 'all'")
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
