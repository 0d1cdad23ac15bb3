"""The ``fuselm`` command line.

Usage::

    fuselm demo                        # train a small Llama twice: HF eager vs fuselm.hf.patch
    fuselm bench ...                   # the benchmark lab (a clone of the repository: benchmarks/)

``fuselm demo`` writes ``fuselm_demo.png`` and ``fuselm_demo.json`` to ``--out`` (default: the current
folder). ``fuselm bench`` runs the benchmark lab, which is not part of the installed package: it lives in
the repository's ``benchmarks/fuselm_bench`` and runs from a clone with ``benchmarks`` on the import path
(``PYTHONPATH=benchmarks fuselm bench ...``, or ``python -m fuselm_bench ...`` from ``benchmarks/``);
``fuselm bench --help`` lists its options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch

__all__ = ["UsageError", "build_parser", "main", "pick_device", "positive_int"]

LAB = "fuselm_bench"
"""The benchmark lab's package (the repository's ``benchmarks/fuselm_bench``)."""


class UsageError(Exception):
    """A bad command-line value; :func:`main` prints it and returns 2."""


def positive_int(text: str) -> int:
    """An argparse ``type``: a positive integer, or ``argparse.ArgumentTypeError``.

    Example:
        >>> positive_int("3")
        3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def pick_device(choice: str) -> torch.device:
    """The device of ``--device auto|cuda|cpu``: the current CUDA device unless ``cpu`` or none is
    available; ``cuda`` without one is a UsageError.

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device available")
    if torch.cuda.is_available() and choice != "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fuselm`` (``bench`` takes the lab's arguments: ``fuselm bench --help``)."""
    parser = argparse.ArgumentParser(
        prog="fuselm", description="fuselm: fused Triton kernels for LLM training."
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmark ops and training steps against torch eager, torch.compile and peers (from a clone "
        "of the repository: benchmarks/fuselm_bench)",
    )
    _add_demo_parser(sub)
    return parser


def load_lab():
    """The benchmark lab's command line module (``fuselm_bench.cli``) when it is importable; UsageError
    otherwise (an installed wheel has no benchmarks: they run from a clone, ``benchmarks`` on the path)."""
    try:
        return importlib.import_module(f"{LAB}.cli")
    except ModuleNotFoundError as e:
        if e.name != LAB:
            raise
    raise UsageError(
        "the benchmarks are not part of the installed fuselm package: run them from a clone of the "
        "repository with benchmarks/ on the import path (PYTHONPATH=benchmarks fuselm bench ..., or "
        "python -m fuselm_bench ... in benchmarks/)"
    )


def _add_demo_parser(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a small Llama twice from the same init: HF eager, then fuselm.hf.patch",
        description=(
            "Train a Llama-shaped model (CUDA: the Llama-3.2-1B shape in bf16; CPU: a tiny one in fp32) on a "
            "corpus shipped with fuselm (bytes as tokens, nothing downloaded), first with Hugging Face "
            "transformers as it is, then patched with fuselm.hf.patch, from the same weights on the same "
            "batches. Prints the loss agreement, peak memory, saved activations and tokens/s, and writes "
            'fuselm_demo.png and fuselm_demo.json. Needs transformers (pip install "fuselm[demo]").'
        ),
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: cuda when available (default)",
    )
    demo.add_argument("--steps", type=positive_int, help="steps per run (default: CUDA 30, CPU 100)")
    demo.add_argument("--batch", type=positive_int, help="sequences per step (default: CUDA 2, CPU 4)")
    demo.add_argument("--seq", type=positive_int, help="tokens per sequence (default: CUDA 2048, CPU 128)")
    demo.add_argument("--out", default=".", help="folder for fuselm_demo.png/.json (default: current folder)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")


def _demo(args: argparse.Namespace) -> int:
    from .demo.train import INSTALL_HINT, default_settings, format_table, load_corpus, run_demo

    cuda = pick_device(args.device).type == "cuda"
    settings = default_settings("cuda" if cuda else "cpu", steps=args.steps, batch=args.batch, seq=args.seq)
    corpus_len = len(load_corpus())
    if settings.seq > corpus_len:
        raise UsageError(f"--seq {settings.seq}: at most the corpus length, {corpus_len} tokens")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"fuselm demo: error: {INSTALL_HINT}", file=sys.stderr)
        return 1
    if not cuda:
        print("No CUDA device in use: a tiny model (fp32, 256-token vocabulary) trains on the CPU.")
    result = run_demo(settings, args.out, progress=not args.no_progress)
    print()
    print(format_table(result))
    print("wrote " + ", ".join(result.paths.values()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fuselm``; returns the exit code (0 ok, 1 nothing measured, 2 usage error).

    Example:
        >>> main(["demo", "--steps", "0"])
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the lab parses its own arguments
        try:
            lab = load_lab()
        except UsageError as e:
            print(f"fuselm bench: error: {e}", file=sys.stderr)
            return 2
        return lab.main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return _demo(args)
    except UsageError as e:
        print(f"fuselm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
