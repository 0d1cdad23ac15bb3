"""fuselm.ops.projections.linear_projections: several projections of one input as one node. Numerics
(docs/design.md section 5) against F.linear per projection in the same dtype and in float64, what is
saved, partial and unused gradients, autocast, contracts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_device

from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.projections import linear_projections, linear_projections_reference

DEVICE = kernel_device()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
H, OUTS = 64, (128, 32, 32)  # an attention's q, k, v with GQA


def _operands(gen, dtype, bias):
    x = torch.randn(2, 9, H, generator=gen).to(dtype).to(DEVICE)
    ws = [(torch.randn(o, H, generator=gen) * H**-0.5).to(dtype).to(DEVICE) for o in OUTS]
    bs = [(torch.randn(o, generator=gen) * 0.1).to(dtype).to(DEVICE) for o in OUTS] if bias else [None] * 3
    return x, ws, bs


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, bias, gen):
    x, ws, bs = _operands(gen, dtype, bias)
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *(b for b in bs if b is not None))]
    twins = [t.clone().requires_grad_() for t in leaves]
    refs = [t.double().requires_grad_() for t in leaves]

    def split(ts):
        return ts[0], tuple(ts[1:4]), (tuple(ts[4:]) if bias else None)

    out = linear_projections(*split(leaves))
    out_e = linear_projections_reference(*split(twins))
    out_r = linear_projections_reference(*split(refs))
    dys = [torch.randn(o.shape, generator=gen).to(dtype).to(DEVICE) for o in out_e]
    for i, (o, e, r) in enumerate(zip(out, out_e, out_r, strict=True)):
        assert o.shape == e.shape and o.dtype == dtype
        assert_numerics(f"y{i}", o, e, r, dtype)
    got = torch.autograd.grad(out, leaves, dys)
    want = torch.autograd.grad(out_e, twins, dys)
    ref = torch.autograd.grad(out_r, refs, [d.double() for d in dys])
    for i, (g, e, r) in enumerate(zip(got, want, ref, strict=True)):
        assert g.dtype == dtype
        assert_numerics(f"grad {i}", g, e, r, dtype)


def test_saves_x_and_the_weights_only(gen):
    x, ws, _ = _operands(gen, torch.float32, False)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = linear_projections(x, tuple(ws))
    assert sorted(tuple(t.shape) for t in saved) == sorted([(18, H), *((o, H) for o in OUTS)])
    sum(o.sum() for o in outs).backward()


def test_unused_output_and_partial_gradients(gen):
    """Only q used, only the k weight requiring grad besides x: x's gradient is q's path, k's weight gets
    zeros (its output unused), the others none."""
    x, ws, _ = _operands(gen, torch.float64, False)
    x.requires_grad_()
    ws[1].requires_grad_()
    q, _, _ = linear_projections(x, tuple(ws))
    dx, dk = torch.autograd.grad(q.sum(), (x, ws[1]))
    torch.testing.assert_close(dx, torch.ones_like(q) @ ws[0], rtol=1e-12, atol=1e-12)
    assert not dk.any()


def test_autocast_casts_like_linear(gen):
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    x, ws, _ = _operands(gen, torch.float32, False)
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    twins = [t.clone().requires_grad_() for t in (x, *ws)]
    refs = [t.double().requires_grad_() for t in (x, *ws)]
    with torch.autocast(device_type, dtype=torch.bfloat16):
        out = linear_projections(leaves[0], tuple(leaves[1:]))
        out_e = tuple(F.linear(twins[0], w) for w in twins[1:])
    out_r = tuple(F.linear(refs[0], w) for w in refs[1:])
    dys = [torch.randn(o.shape, generator=gen).to(DEVICE) for o in out_e]
    for o, e, r in zip(out, out_e, out_r, strict=True):
        assert o.dtype == e.dtype == torch.bfloat16
        assert_numerics("y", o, e, r, torch.bfloat16)
    got = torch.autograd.grad(out, leaves, [d.bfloat16() for d in dys])
    want = torch.autograd.grad(out_e, twins, [d.bfloat16() for d in dys])
    ref = torch.autograd.grad(out_r, refs, [d.double() for d in dys])
    for g, e, r in zip(got, want, ref, strict=True):
        assert g.dtype == torch.float32
        assert_numerics("grad", g, e, r, torch.bfloat16)


def _bad_calls():
    x = torch.randn(2, 3, 8)
    w = torch.randn(4, 8)
    return {
        "no weights": ("weights", lambda: linear_projections(x, ())),
        "weights not a tuple": ("weights", lambda: linear_projections(x, w)),
        "x int": ("x", lambda: linear_projections(x.long(), (w,))),
        "weight columns": (r"weights\[1\]", lambda: linear_projections(x, (w, torch.randn(4, 7)))),
        "weight dtype": (r"weights\[0\]", lambda: linear_projections(x, (w.double(),))),
        "biases count": ("biases", lambda: linear_projections(x, (w, w), (None,))),
        "bias shape": (r"biases\[0\]", lambda: linear_projections(x, (w,), (torch.randn(3),))),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_value_error_naming_them(case):
    name, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=rf"^{name}"):
        call()
