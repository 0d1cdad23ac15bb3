"""fuselm.nn.LinearLogProbs: holds the options, returns what fuselm.linear_log_probs returns."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_device

import fuselm

DEVICE = kernel_device()


def _inputs(seed=0, n=10, h=16, v=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(DEVICE)
    w = (torch.randn(v, h, generator=g) / 4).to(DEVICE)
    b = torch.randn(v, generator=g).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    t[:3] = -1
    return x, w, b, t


def test_module_equals_function():
    x, w, b, t = _inputs()
    opts = dict(temperature=0.8, softcap=5.0, logit_scale=1.5, ignore_index=-1, memory="min")
    head = fuselm.nn.LinearLogProbs(outputs=("entropy", "is_top1"), **opts)
    got = head(x, w, t, b)
    want = fuselm.linear_log_probs(x, w, t, linear_bias=b, outputs=("entropy", "is_top1"), **opts)
    assert isinstance(got, fuselm.LogProbs)
    for name in fuselm.LogProbs._fields:
        a, e = getattr(got, name), getattr(want, name)
        if e is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert "temperature=0.8" in repr(head) and "entropy" in repr(head)


def test_module_gradients_flow_to_the_weight():
    x, w, b, t = _inputs(1)
    w = w.requires_grad_()
    head = fuselm.nn.LinearLogProbs(outputs="entropy", ignore_index=-1)
    out = head(x, w, t)
    (out.log_probs.sum() - 0.1 * out.entropy.sum()).backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    assert not w.grad[t[t >= 0]].eq(0).all()


def test_module_checks_its_options_when_called():
    x, w, _, t = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        fuselm.nn.LinearLogProbs(temperature=0.0, ignore_index=-1)(x, w, t)
    with pytest.raises(ValueError, match="outputs"):
        fuselm.nn.LinearLogProbs(outputs=("entropie",), ignore_index=-1)(x, w, t)
