"""The lab's one case loop (fuselm_bench.cases.run_cases) and its one row type, as every runner uses them."""

from __future__ import annotations

import dataclasses

import pytest
from fuselm_bench import e2e, finetune, harness
from fuselm_bench.cases import Case, Row, run_cases


@dataclasses.dataclass
class _Row(Row):
    SHAPE_FIELDS = ("model", "batch")
    SHAPE_FORMAT = "{} B{}"
    provider: str
    model: str
    batch: int
    status: str = "ok"
    error: str | None = None
    peak_bytes: int | None = None
    repeat: int = 0

    def figures(self):
        return "1 ms", "fine"


def _row(case: Case, status: str = "ok", error: str | None = None) -> _Row:
    return _Row(case.provider, *case.shape, status=status, error=error, repeat=case.repeat)


def _run(cases, execute, **kw):
    kw.setdefault("skipped", {})
    return run_cases(cases, execute, desc="test", describe=str, progress=False, **kw)


def test_every_suite_row_is_a_row():
    for row_type in (harness.OpRow, e2e.E2ERow, finetune.FinetuneRow):
        assert issubclass(row_type, Row), row_type


def test_shape_is_the_named_sizes_or_the_rows_own_field():
    assert _Row("p", "m", 4).shape == ("m", 4)
    row = harness.OpRow(shape=(8, 16), provider="p", mode="full")
    assert row.shape == (8, 16) and row.status == "ok"
    assert harness.OpRow(shape=(1,), provider="p", mode="fwd", error="skipped: no").status == "skipped"
    assert harness.OpRow(shape=(1,), provider="p", mode="fwd", error="OutOfMemoryError: x").status == "oom"
    assert harness.OpRow(shape=(1,), provider="p", mode="fwd", error="ValueError: x").status == "error"
    assert "shape" not in {f.name for f in dataclasses.fields(_Row)}


def test_a_property_error_is_not_hidden():
    """A row's property that fails says what failed (no attribute fallback masks it)."""

    @dataclasses.dataclass
    class Broken(_Row):
        @property
        def ratio(self):
            return self.missing_figure

    with pytest.raises(AttributeError, match="missing_figure"):
        _ = Broken("p", "m", 1).ratio


def test_a_skipping_provider_is_not_tried_again():
    ran, logged = [], []

    def execute(case):
        ran.append(case)
        return _row(case, "skipped", "needs CUDA") if case.provider == "peer" else _row(case)

    skipped: dict[str, str] = {}
    cases = [Case(p, ("m", b)) for b in (1, 2) for p in ("peer", "mine")]
    rows = _run(cases, execute, skipped=skipped, log=logged.append)
    assert [c.provider for c in ran] == ["peer", "mine", "mine"]
    assert skipped == {"peer": "needs CUDA"} and [r.provider for r in rows] == ["mine", "mine"]
    assert logged == ["skipping provider peer: needs CUDA", "mine m B1: 1 ms, fine", "mine m B2: 1 ms, fine"]


def test_a_skipped_case_can_stay_a_row():
    cases = [Case("p", ("m", 1)), Case("p", ("m", 2))]
    rows = _run(cases, lambda c: _row(c, "skipped", "no"), skip_provider=False)
    assert [r.status for r in rows] == ["skipped", "skipped"]


def test_out_of_memory_skips_larger_batches_of_the_same_other_sizes():
    ran = []

    def execute(case):
        ran.append(case.shape)
        return _row(case, "oom", "CUDA out of memory") if case.shape[1] >= 4 else _row(case)

    cases = [Case("p", (m, b)) for m in ("a", "b") for b in (2, 4, 8)]
    rows = _run(cases, execute, batch_at=1, not_run=lambda c, why: _row(c, "oom", why), log=None)
    assert ran == [("a", 2), ("a", 4), ("b", 2), ("b", 4)]
    assert [r.error for r in rows if r.shape[1] == 8] == ["not run: out of memory at batch 4 already"] * 2


def test_rows_are_logged_with_their_repeat_and_traceback_and_handed_on():
    logged, seen = [], []

    def execute(case):
        row = _row(case, "error", "ValueError: bad")
        row.traceback = "Traceback: here"
        return row

    _run([Case("p", ("m", 1), repeat=r) for r in range(2)], execute, repeats=2, log=logged.append,
         on_row=lambda rows: seen.append(len(rows)))  # fmt: skip
    assert logged == ["p m B1: error: ValueError: bad (repeat 1/2)", "Traceback: here",
                      "p m B1: error: ValueError: bad (repeat 2/2)", "Traceback: here"]  # fmt: skip
    assert seen == [1, 2]
