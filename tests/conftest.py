"""Shared test machinery: poisoned allocations, the gpu/slow markers, and where the kernels run.

Where fuselm's Triton kernels run in a test session:
- CUDA available: on the GPU (tests use device "cuda").
- CPU with TRITON_INTERPRET=1 in the environment of the pytest process: through Triton's
  interpreter on the CPU (slow: tests keep rows few and vocabularies small there).
- CPU otherwise: not at all; fuselm dispatches to the PyTorch reference, and the tests check that path.

Test modules import the helpers below with ``from conftest import kernel_device, TRITON_PATH``.
"""

from __future__ import annotations

import functools
import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: N workers x N threads oversubscribe the cores, and small CPU
    # matmuls then run orders of magnitude slower (seen on the 2-core CI machine).
    torch.set_num_threads(1)
# Set before triton is imported (it is read at import time), i.e. in the environment of pytest itself.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# True when fuselm's Triton kernels are exercised by tests on kernel_device().
TRITON_PATH = HAS_CUDA or TRITON_INTERPRET


def kernel_device() -> str:
    """The device tests put their tensors on: "cuda" when available, else "cpu"."""
    return "cuda" if HAS_CUDA else "cpu"


def triton_path() -> bool:
    """Do tensors on kernel_device() go through fuselm's Triton kernels (not the PyTorch reference)?"""
    return TRITON_PATH


def _describe_path() -> str:
    if HAS_CUDA:
        return f"Triton kernels run on CUDA ({torch.cuda.get_device_name(0)})"
    if TRITON_INTERPRET:
        return "Triton kernels run on CPU through the interpreter (TRITON_INTERPRET=1)"
    return "Triton kernels NOT exercised: CPU tensors use the PyTorch reference (set TRITON_INTERPRET=1)"


# ---- options, markers, header ----


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    # also declared in pyproject.toml; repeated so that the markers exist whatever the ini file
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running or memory-hungry; run with --runslow")


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # pragma: no cover - depends on the platform
        triton_version = f"not importable ({type(exc).__name__})"
    return [
        f"fuselm: {_describe_path()}",
        f"fuselm: torch {torch.__version__}, triton {triton_version}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '<unset>')}, "
        f"slow tests {'on' if config.getoption('--runslow') else 'off (--runslow)'}",
    ]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    # the header is hidden by -q; this line always reaches the log
    terminalreporter.write_line(f"fuselm: {_describe_path()}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    runslow = config.getoption("--runslow")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not runslow:
            item.add_marker(skip_slow)


# ---- fixtures ----


@pytest.fixture
def device() -> str:
    """The device tensors of a kernel test live on (see kernel_device)."""
    return kernel_device()


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def graph_device(request, monkeypatch) -> str:
    """Where CUDA graphs of a test run (fuselm.graph_step): "cuda" (real graphs, GPU only) or "cpu" (graphs
    emulated on the CPU: kit.fake_graphs)."""
    if request.param == "emulated":
        from kit.fake_graphs import emulate

        emulate(monkeypatch)
        return "cpu"
    return "cuda"


@pytest.fixture
def triton_kernels() -> bool:
    """Whether tensors on `device` run fuselm's Triton kernels."""
    return TRITON_PATH


_POISON_FUNCTIONS = ("empty", "empty_like", "empty_strided")


def _learn_torch_functions_before_poisoning() -> None:
    """torch.compile learns torch's functions (which builtins it may trace) on first use, by name, and
    forgets them when a process group starts (init_process_group clears that cache): learned while a
    poisoning wrapper stands in for torch.empty, the real builtin the wrapper calls is unknown to it and a
    compiled reference path breaks its graph there. Learn them (a cache hit when known) before patching."""
    try:
        from torch._dynamo.trace_rules import get_torch_obj_rule_map
    except ImportError:  # another torch: its compile tests say whether it needs this
        return
    get_torch_obj_rule_map()


def _poison_(t: object) -> None:
    """Fill a fresh allocation with NaN (floating, complex) or a big sentinel (integer, bool)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0:
        return
    if t.device.type == "meta" or t.is_quantized:
        return
    dtype = t.dtype
    if dtype.is_floating_point or dtype.is_complex:
        value: float | int | bool = float("nan")
    elif dtype == torch.bool:
        value = True
    else:
        value = torch.iinfo(dtype).max
    try:
        with torch.no_grad():
            t.fill_(value)
    except (RuntimeError, TypeError):  # exotic dtypes (fp8 without NaN, bits...) stay as they are
        pass


def _poisoning(fn, factory: bool = False):
    """``fn`` whose result is poisoned; a ``factory`` (torch.empty, torch.empty_strided) also gets the
    device of an enclosing ``with torch.device(...)`` when none is passed: that context intercepts torch's
    own functions only, so through this wrapper a model built under it would get CPU parameters."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if factory and kwargs.get("device") is None:
            kwargs["device"] = torch.get_default_device()
        out = fn(*args, **kwargs)
        # Under torch.compile the graph is being traced: no runtime memory to poison.
        if not torch.compiler.is_compiling():
            _poison_(out)
        return out

    wrapper.__fuselm_poison__ = True
    return wrapper


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a test runs, torch.empty / empty_like / empty_strided / Tensor.new_empty return NaN-filled
    floating tensors (integer ones: the dtype's max), so an element a kernel forgot to write shows up."""
    _learn_torch_functions_before_poisoning()
    for name in _POISON_FUNCTIONS:
        fn = getattr(torch, name)
        if not getattr(fn, "__fuselm_poison__", False):
            monkeypatch.setattr(torch, name, _poisoning(fn, factory=name != "empty_like"))
    if not getattr(torch.Tensor.new_empty, "__fuselm_poison__", False):
        monkeypatch.setattr(torch.Tensor, "new_empty", _poisoning(torch.Tensor.new_empty))


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded by the test's id: inputs are fresh per test and reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
