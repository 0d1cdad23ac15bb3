"""Benchmarks of fuselm's ops against torch eager, torch.compile and peers (``fuselm bench <suite>``).

- ``harness``: the suite interface (:class:`Suite`, :class:`Provider`, :class:`Cost`,
  :class:`SkipProvider`), timing, peak memory, the card's ceilings and ratios; its docstring says
  how to add a suite.
- ``report``: run metadata and the markdown / JSON / PNG writers.
- ``registry``: the known suites, imported lazily.
- ``cross_entropy``: the cross-entropy suite.
"""

from .harness import Ceilings, Cost, Provider, Report, Row, SkipProvider, Suite, compute_ratios, run_suite
from .registry import SUITES, get_suite, suite_names
from .report import write_report

__all__ = [
    "SUITES",
    "Ceilings",
    "Cost",
    "Provider",
    "Report",
    "Row",
    "SkipProvider",
    "Suite",
    "compute_ratios",
    "get_suite",
    "run_suite",
    "suite_names",
    "write_report",
]
