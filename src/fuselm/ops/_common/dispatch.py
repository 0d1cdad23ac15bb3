"""Where an op runs: Triton on CUDA (or on CPU under TRITON_INTERPRET=1), else the reference."""

from __future__ import annotations

import os
import warnings

import torch

# Read once at import, as Triton itself does (triton.jit picks the interpreter when a kernel is decorated):
# setting the variable later would not move the kernels to the interpreter anyway. A constant also costs
# no host time per launch.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET=1 (at import): Triton kernels run on the CPU through the interpreter."""
    return _INTERPRET


def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


# Probed once at import: a constant that torch.compile reads while tracing (a cached function would be
# traced through, with a warning at every compile).
_TRITON = _import_triton()


def triton_available() -> bool:
    """Can Triton be imported here?"""
    return _TRITON


def kernels_run(t: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The one choice between an op's Triton kernels and its PyTorch reference: the kernels run when ``t``
    takes the Triton path (:func:`use_triton`) and neither it nor any of ``others`` is float64 (the
    reference computes in float64; None entries are skipped)."""
    if t.dtype == torch.float64 or not use_triton(t):
        return False
    for o in others:
        if o is not None and o.dtype == torch.float64:
            return False
    return True


def compiled_or_launcher(op, launcher):
    """The one choice between a kernel's registered custom op and its launcher: a function that calls
    ``op`` while torch.compile traces (the graph has no break) and ``launcher`` in eager mode (a custom op
    costs tens of microseconds of host time per call), with the same arguments.

    Example:
        >>> run = compiled_or_launcher(lambda x: ("op", x), lambda x: ("launcher", x))
        >>> run(1)
        ('launcher', 1)
    """

    def run(*args):
        return op(*args) if torch.compiler.is_compiling() else launcher(*args)

    run.__qualname__ = f"compiled_or_launcher({getattr(launcher, '__name__', launcher)})"
    return run


def use_triton(tensor: torch.Tensor) -> bool:
    """Run the Triton kernels for this tensor? CUDA tensors: yes. CPU tensors: only when interpreting."""
    if not triton_available():
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and interpret_mode()


_SAID: set[str] = set()


def say_once(message: str) -> None:
    """A RuntimeWarning the first time ``message`` is said in this process (a slower path than the user
    may expect runs, e.g. the PyTorch reference for an input the kernels do not cover), never again.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     say_once("fuselm.example: the reference runs"); say_once("fuselm.example: the reference runs")
        >>> len(caught)
        1
    """
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


try:  # os.environ's own dict: an unset variable is one dict lookup (host time), set ones are read as usual
    _ENV_DATA, _VALIDATE_KEY = os.environ._data, os.environ.encodekey("FUSELM_VALIDATE")
except AttributeError:  # pragma: no cover - another Python
    _ENV_DATA = _VALIDATE_KEY = None


def validate_enabled() -> bool:
    """Opt-in checks that need a host sync (e.g. target range): FUSELM_VALIDATE=1 (read at every call)."""
    if _ENV_DATA is not None and _VALIDATE_KEY not in _ENV_DATA:
        return False
    return os.environ.get("FUSELM_VALIDATE", "0") == "1"


def capturing(device: torch.device | None = None) -> bool:
    """Is a CUDA graph being captured on the stream that work for `device` goes to (None: the current CUDA
    device's; False where CUDA is not available)?"""
    if device is None:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def compaction_allowed(device: torch.device) -> bool:
    """May an op find its kept (non-ignored) rows? That costs one host sync: only in eager mode, outside
    torch.compile and CUDA graph capture."""
    return not torch.compiler.is_compiling() and not capturing(device)
