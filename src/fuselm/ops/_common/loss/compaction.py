"""Eager mode's one host sync of the linear ops: which rows to compute, and whether a target is bad."""

from __future__ import annotations

import torch

from ..guard import bad_targets, raise_target_range


def kept_rows(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor | None:
    """The int64 indices of the rows of target [N] that are not ignore_index (None when that is every row);
    raises ValueError (TargetRangeError) naming a target outside [0, n_classes) that is not ignored.

    One ``nonzero`` over N + 1 flags: the kept rows and a last one, False; a bad target sets every flag, so
    the count is N + 1 exactly when some target is bad (a count of kept rows is at most N)."""
    n = target.shape[0]
    bad = bad_targets(target, n_classes, ignore_index)
    any_bad = bad.any().reshape(1)
    flags = torch.cat([target != ignore_index, any_bad]) | any_bad
    idx = flags.nonzero().reshape(-1)  # the host sync: its length
    if idx.shape[0] > n:
        raise_target_range(target, bad, n_classes, ignore_index)
    return idx if idx.shape[0] < n else None
