"""ops/_common/testing.py: the numerics rule every test's tolerance comes from, checked on known errors."""

from __future__ import annotations

import math

import pytest
import torch

from fuselm.ops._common.testing import ATOL, assert_numerics, rel_err


def test_relative_norm_error():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert rel_err(ref, ref) == 0.0
    assert math.isclose(rel_err(torch.tensor([3.0, 4.5]), ref), 0.5 / 5.0)
    assert rel_err(torch.tensor([0.0, 1e-3]), torch.zeros(2)) == pytest.approx(1e-3)  # ||ref|| = 0: max abs


def test_nan_must_be_where_the_reference_has_it():
    """A NaN of ours where the reference is finite, or a finite value where the reference is NaN (a
    reference that went NaN proves nothing), is an infinite error; NaN in both at the same places is
    skipped and the rest compared."""
    nan = float("nan")
    ref = torch.tensor([1.0, nan, 2.0], dtype=torch.float64)
    assert rel_err(torch.tensor([1.0, nan, 2.0]), ref) == 0.0
    assert rel_err(torch.tensor([1.0, nan, 2.5]), ref) == pytest.approx(0.5 / math.sqrt(5.0))
    assert rel_err(torch.tensor([1.0, 7.0, 2.0]), ref) == math.inf
    assert rel_err(torch.tensor([nan, nan, 2.0]), ref) == math.inf
    assert rel_err(torch.tensor([1.0, 2.0]), torch.full((2,), nan, dtype=torch.float64)) == math.inf


def test_assert_numerics_bound():
    ref = torch.ones(4, dtype=torch.float64)
    eager = torch.ones(4) * (1 + 1e-3)
    assert_numerics("within 2x eager", torch.ones(4) * (1 + 2e-3), eager, ref, torch.float32)
    with pytest.raises(AssertionError, match="beyond"):
        assert_numerics("beyond", torch.ones(4) * (1 + 3e-3), eager, ref, torch.float32)
    assert ATOL[torch.bfloat16] > ATOL[torch.float16] > ATOL[torch.float32]
