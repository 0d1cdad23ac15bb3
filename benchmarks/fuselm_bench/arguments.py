"""The values of ``fuselm bench`` options: parsing, checking, defaults. ``UsageError`` (printed, exit 2),
``positive_int`` and ``pick_device`` are ``fuselm.cli``'s, which ``fuselm demo`` uses too."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from fuselm.cli import UsageError as UsageError  # the lab's bad values: `fuselm bench` prints them, exit 2
from fuselm.cli import pick_device as pick_device
from fuselm.cli import positive_int as positive_int

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
DTYPES.update({"fp32": "float32", "float32": "float32"})


def parse_shapes(text: str, ndim: int | None = None) -> list[tuple[int, ...]]:
    """'8192x128256,16384x32000' -> [(8192, 128256), (16384, 32000)]; checks dims when ``ndim`` is given.

    Example:
        >>> parse_shapes("8x16, 4X2")
        [(8, 16), (4, 2)]
    """
    shapes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            shape = tuple(int(d) for d in part.split("x"))
        except ValueError:
            raise UsageError(f"bad shape {part!r}: expected sizes joined by 'x', e.g. 8192x128256") from None
        if any(d <= 0 for d in shape):
            raise UsageError(f"bad shape {part!r}: sizes must be positive")
        if ndim is not None and len(shape) != ndim:
            raise UsageError(f"bad shape {part!r}: this suite takes {ndim} sizes")
        shapes.append(shape)
    if not shapes:
        raise UsageError("no shapes given")
    return shapes


def parse_list(
    text: str | None, known: Sequence[str], what: str, variants: bool = False, default: Sequence[str] = ()
) -> list[str]:
    """'a,b' -> ['a', 'b'], each checked against ``known`` (order kept, duplicates dropped), ``default``
    without ``text``; with ``variants``, ``a@<setting>`` is checked as ``a`` (the suite checks the setting).

    Example:
        >>> parse_list("full,fwd,full", ("fwd", "bwd", "full"), "mode")
        ['full', 'fwd']
        >>> parse_list("fuselm@24,hf", ("hf", "fuselm"), "provider", variants=True)
        ['fuselm@24', 'hf']
    """
    if not text and default:
        return list(default)
    items: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item or item in items:
            continue
        if (item.partition("@")[0] if variants else item) not in known:
            raise UsageError(f"unknown {what} {item!r}; known: {', '.join(known)}")
        items.append(item)
    if not items:
        raise UsageError(f"no {what}s given")
    return items


def parse_dtype(text: str) -> torch.dtype:
    """'bf16' -> torch.bfloat16 (also fp16, fp32 and the torch names); UsageError otherwise.

    Example:
        >>> parse_dtype("BF16"), parse_dtype("float32")
        (torch.bfloat16, torch.float32)
    """
    if text.lower() not in DTYPES:
        raise UsageError(f"unknown dtype {text!r}; known: bf16, fp16, fp32")
    return getattr(torch, DTYPES[text.lower()])


def parse_numbers(
    text: str, kind: type, flag: str, what: str, sep: str = ",", count: int | None = None
) -> list:
    """``text`` split at ``sep``, each a ``kind`` (``count`` of them if given); UsageError otherwise."""
    try:
        values = [kind(v) for v in text.split(sep)]
    except ValueError:
        values = []
    if not values or (count is not None and len(values) != count):
        raise UsageError(f"{flag} takes {what}, got {text!r}")
    return values


def parse_caps(text: str) -> list[float]:
    """max-context's ``--caps``: GiB > 0."""
    caps = parse_numbers(text, float, "--caps", "comma-separated GiB numbers")
    if any(not c > 0 for c in caps):
        raise UsageError(f"--caps must be > 0, got {text!r}")
    return caps


def parse_seq_range(text: str) -> tuple[int, int]:
    """max-context's ``--seq-range``: ``LO:HI`` tokens, 0 < LO <= HI."""
    lo, hi = parse_numbers(text, int, "--seq-range", "LO:HI (tokens)", ":", count=2)
    if not 0 < lo <= hi:
        raise UsageError(f"--seq-range must be 0 < LO <= HI, got {text!r}")
    return lo, hi


def parse_gpus(text: str, cuda: bool) -> list[int]:
    """max-context's ``--gpus``: indices of this machine's CUDA devices."""
    if not cuda:
        raise UsageError("--gpus runs the searches side by side on CUDA devices; this run has none")
    gpus = parse_numbers(text, int, "--gpus", "comma-separated GPU indices")
    if any(not 0 <= g < torch.cuda.device_count() for g in gpus):
        raise UsageError(f"--gpus must name GPUs 0..{torch.cuda.device_count() - 1}, got {text!r}")
    return gpus


def results_dir(out: str | None, device_name: str | None) -> Path:
    """``--out``, else ``benchmarks/results/<gpu>`` (the committed GPU results), else (a CPU run)
    ``bench-out/cpu``: CPU figures are smoke runs, never committed (``bench-out/`` is git-ignored).

    Example:
        >>> [str(results_dir(None, gpu)) for gpu in (None, "NVIDIA H100 80GB HBM3")]
        ['bench-out/cpu', 'benchmarks/results/h100']
        >>> str(results_dir("x", None))
        'x'
    """
    from .report import gpu_slug

    if out:
        return Path(out)
    slug = gpu_slug(device_name)  # None: cpu
    return Path("bench-out") / "cpu" if slug == "cpu" else Path("benchmarks") / "results" / slug
