"""Benchmarks of fuselm's ops against torch eager, torch.compile and peers (``fuselm bench <suite>``).

- ``harness``: the suite interface (:class:`Suite`, :class:`Provider`, :class:`Cost`,
  :class:`SkipProvider`), timing, peak memory, the card's ceilings and ratios; its docstring says
  how to add a suite.
- ``cases``: the one row type (:class:`Row`, every suite's rows extend it) and the one case loop
  (:func:`run_cases`) that runs cases in this process (``harness``), in fresh worker processes
  (``fresh_process``) or on groups of ranks (``rank_group``).
- ``report``: run metadata and the markdown / JSON / PNG writers.
- ``registry``: the known suites, imported lazily.
- ``cross_entropy``: the cross-entropy suite.
"""

from .cases import Case, Row, run_cases
from .harness import Ceilings, Cost, OpRow, Provider, Report, SkipProvider, Suite, compute_ratios, run_suite
from .registry import SUITES, get_suite, suite_names
from .report import write_report

__all__ = [
    "SUITES",
    "Case",
    "Ceilings",
    "Cost",
    "OpRow",
    "Provider",
    "Report",
    "Row",
    "SkipProvider",
    "Suite",
    "compute_ratios",
    "run_cases",
    "get_suite",
    "run_suite",
    "suite_names",
    "write_report",
]
