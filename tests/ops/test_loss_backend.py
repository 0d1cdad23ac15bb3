"""The loss family's row backend as code: LocalRows and the vocabulary shard implement the RowBackend
protocol (ops/_common/loss/backend.py) with its exact signatures, so a change of the contract shows here
rather than as a TypeError in one of the two."""

from __future__ import annotations

import inspect

import pytest

from fuselm.ops._common.loss.backend import RowBackend
from fuselm.ops._common.loss.rows import LocalRows

METHODS = ("forward", "backward", "reduce_input_grad_")


def _backends():
    shard = pytest.importorskip("fuselm.distributed.shard")
    return {"LocalRows": LocalRows, "VocabShard": shard.VocabShard}


@pytest.mark.parametrize("name", ["LocalRows", "VocabShard"])
def test_backend_has_the_protocols_signatures(name):
    cls = _backends()[name]
    for method in METHODS:
        want = inspect.signature(getattr(RowBackend, method))
        got = inspect.signature(getattr(cls, method))
        assert list(got.parameters) == list(want.parameters), (name, method)
        for p_got, p_want in zip(got.parameters.values(), want.parameters.values(), strict=True):
            assert p_got.kind == p_want.kind and p_got.default == p_want.default, (name, method, p_got)


def test_local_rows_is_a_row_backend():
    rows = LocalRows(7)
    assert isinstance(rows, RowBackend) and rows.n_classes == 7


def test_an_incomplete_backend_is_not_one():
    class NoBackward:
        n_classes = 3

        def forward(self, logits, target, opts, scales, grad, predicted=None): ...

        def reduce_input_grad_(self, dx): ...

    assert not isinstance(NoBackward(), RowBackend)
