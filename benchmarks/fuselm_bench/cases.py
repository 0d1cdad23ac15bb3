"""The lab's one row type and one case loop: a case (one provider at one configuration, in one mode or repeat)
gives a :class:`Row` whatever runs it (this process, or a fresh worker process)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

GIB = 1 << 30


class Row:
    """The base of every result row (a dataclass per suite)."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ()
    SHAPE_DIMS: ClassVar[tuple[str, ...]] = ()
    SHAPE_TITLE: ClassVar[str] = ""
    SHAPE_FORMAT: ClassVar[str] = ""
    BATCH_FIELD: ClassVar[str | None] = "batch"
    provider: str
    status: str
    peak_bytes: int | None
    error: str | None
    traceback: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.SHAPE_FIELDS and "shape" not in cls.__dict__.get("__annotations__", {}):
            cls.shape = property(lambda row: tuple(getattr(row, f) for f in type(row).SHAPE_FIELDS))

    @classmethod
    def label(cls, shape: Sequence[Any]) -> str:
        return cls.SHAPE_FORMAT.format(*shape)

    def figures(self) -> tuple[str, str]:
        """An ok row's main figure and what follows its peak memory in its progress line."""
        raise NotImplementedError

    def summary(self) -> str:
        """The row's progress line."""
        label = f"{self.provider} {self.label(self.shape)}"
        if self.status != "ok":
            return f"{label}: {self.status}: {self.error}"
        figure, more = self.figures()
        peak = f", peak {self.peak_gib:.1f} GiB" if self.peak_gib is not None else ""
        return f"{label}: {figure}{peak}, {more}"

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB


@dataclass(frozen=True)
class Case:
    """One measurement: ``provider`` at ``shape``, in ``mode`` (op suites), repeat ``repeat`` (0-based)."""

    provider: str
    shape: tuple[Any, ...]
    mode: str | None = None
    repeat: int = 0


def run_cases(
    cases: Sequence[Any],
    execute: Callable[[Any], Row],
    *,
    desc: str,
    describe: Callable[[Any], str],
    skipped: dict[str, str],
    repeats: int = 1,
    batch_at: int | None = None,
    not_run: Callable[[Any, str], Row] | None = None,
    skip_provider: bool = True,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    on_row: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """``execute(case)`` for each case in order, with a progress bar; the rows. A provider in ``skipped`` is
    not run; with ``skip_provider``, a ``skipped`` row adds its provider there (and is dropped). With
    ``batch_at`` (the batch size's index in a shape), a provider out of memory at batch B is not run at B or
    larger of the same other sizes: ``not_run(case, why)`` is its row. ``on_row(rows so far)`` after each.

    Example:
        >>> from fuselm_bench.harness import OpRow
        >>> def row(case, oom=None):
        ...     return OpRow(case.shape, case.provider, "fwd", 1.0, error=oom and f"OutOfMemoryError: {oom}")
        >>> execute = lambda case: row(case, "too big" if case.shape[0] >= 4 else None)
        >>> rows = run_cases([Case("p", (b,)) for b in (2, 4, 8)], execute, desc="demo", describe=str,
        ...                  skipped={}, batch_at=0, progress=False, not_run=row)
        p 2: 1 ms, fwd
        p 4: oom: OutOfMemoryError: too big
        p 8: oom: OutOfMemoryError: not run: out of memory at batch 4 already
    """
    from tqdm.auto import tqdm

    rows: list[Row] = []
    oom_at: dict[tuple[str, tuple[Any, ...]], int] = {}  # (provider, the other sizes) -> smallest batch out
    bar = tqdm(cases, desc=desc, disable=not progress, leave=False)
    for case in bar:
        if case.provider in skipped:
            continue
        bar.set_postfix_str(describe(case))
        key = batch = None
        if batch_at is not None:
            batch = case.shape[batch_at]
            key = (case.provider, case.shape[:batch_at] + case.shape[batch_at + 1 :])
        if key in oom_at and batch >= oom_at[key]:
            row = not_run(case, f"not run: out of memory at batch {oom_at[key]} already")
        else:
            row = execute(case)
        if row.status == "oom" and key is not None:
            oom_at[key] = min(batch, oom_at.get(key, batch))
        if row.status == "skipped" and skip_provider:
            skipped[case.provider] = row.error or "skipped"
            if log is not None:
                log(f"skipping provider {case.provider}: {row.error}")
            continue
        rows.append(row)
        if log is not None:
            log(row.summary() + (f" (repeat {case.repeat + 1}/{repeats})" if repeats > 1 else ""))
            if row.traceback:
                log(row.traceback)
        if on_row is not None:
            on_row(rows)
    bar.close()
    return rows
