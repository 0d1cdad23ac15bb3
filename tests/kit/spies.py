"""Spies that say which path ran: wrap a launcher (``launch(grid, **kwargs)``) or any function, count its
calls and keep the keyword arguments of each launch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class LaunchSpy:
    """A stand-in for a fuselm launcher that records each launch's grid (``grids``) and keyword arguments
    (``calls``), then launches. Install it with ``monkeypatch.setattr(op_module, "<kernel>_launch",
    LaunchSpy(op_module.<kernel>_launch))``."""

    def __init__(self, launch: Callable[..., Any]):
        self.launch, self.calls, self.grids = launch, [], []

    def __call__(self, grid, **kwargs):
        self.grids.append(grid)
        self.calls.append(kwargs)
        return self.launch(grid, **kwargs)


def counting(counts: dict[str, int], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that adds one to ``counts[key]`` at each call (a launcher or a reference function); it carries
    ``fn``'s name and signature (``functools.wraps``), so code that inspects what it is given still sees
    ``fn``."""

    @functools.wraps(fn)
    def spy(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return fn(*args, **kwargs)

    return spy
