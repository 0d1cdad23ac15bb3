"""fuselm.swiglu / geglu / *_packed / swiglu_linear / swiglu_mlp: numerics (docs/design.md section 5),
shapes, strides, contracts, dispatch, torch.compile, memory saved for backward, int64 addressing.

Every numeric check goes through assert_numerics: err(fuselm) <= 2 * err(eager) + atol[dtype],
errors measured against gated_reference run on float64 copies. "eager" is what a PyTorch user
writes, in the input dtype: ``F.silu(gate) * up`` / ``F.gelu(gate, approximate=...) * up``.

Sizes: real ones on CUDA; on the CPU the Triton interpreter (TRITON_INTERPRET=1) is numpy and pays
milliseconds per program, so the biggest odd shapes are left to the GPU there. The CPU shapes still
walk several programs, row tiles with masked rows, several column blocks and masked tails.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_INTERPRET, TRITON_PATH, kernel_device
from kit.spies import LaunchSpy, counting

from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.swiglu import geglu, geglu_packed, swiglu, swiglu_linear, swiglu_mlp, swiglu_packed
from fuselm.ops.swiglu import op as sw_op
from fuselm.ops.swiglu.reference import (
    activation_grad_reference,
    activation_reference,
    gated_bwd_reference,
    gated_reference,
    split_packed,
)

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

LEAD = (2, 129) if ON_GPU else (2, 37)
N_COLS = (4096, 14336) if ON_GPU else (781,)
ODD_COLS = (1, 63, 781, 3000) + ((11008, 14336) if ON_GPU else ())
ODD_ROWS = (1, 7, 513)
INTERPRETER_MAX_ELEMENTS = 500_000  # larger odd shapes run on the GPU only (the interpreter is slow)

triton_path_only = pytest.mark.skipif(
    not TRITON_PATH, reason="Triton kernels not exercised (no CUDA, TRITON_INTERPRET unset)"
)

# name -> (fuselm function, eager function, activation of the reference)
OPS = {
    "swiglu": (swiglu, lambda g, u: F.silu(g) * u, "silu"),
    "geglu_tanh": (
        lambda g, u: geglu(g, u, approximate="tanh"),
        lambda g, u: F.gelu(g, approximate="tanh") * u,
        "gelu_tanh",
    ),
    "geglu_none": (
        lambda g, u: geglu(g, u, approximate="none"),
        lambda g, u: F.gelu(g, approximate="none") * u,
        "gelu",
    ),
}
PACKED = {
    "swiglu": swiglu_packed,
    "geglu_tanh": geglu_packed,
    "geglu_none": lambda x: geglu_packed(x, "none"),
}


# ---- inputs and the three implementations ----


def randn(gen, shape, dtype, scale=1.0, device=DEVICE):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def make_pair(gen, lead, n_cols, dtype, gate_scale=2.0):
    """gate N(0, 2^2) (both tails of the activation), up N(0, 1)."""
    return randn(gen, (*lead, n_cols), dtype, gate_scale), randn(gen, (*lead, n_cols), dtype)


def fwd_bwd(fn, inputs, dout):
    """fn(*inputs) and d<out, dout>/d inputs, on fresh leaf copies (strides kept)."""
    leaves = [x.detach().clone() if x.is_contiguous() else x.detach() for x in inputs]
    leaves = [x.requires_grad_() for x in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), grads


def reference64(act):
    return lambda g, u: gated_reference(g.double(), u.double(), act)


def check_pair(name, op, gate, up, dout=None, gen=None):
    """The numerics rule for out, dgate and dup; dtypes, shapes, devices."""
    ours_fn, eager_fn, act = OPS[op]
    if dout is None:
        dout = randn(gen, gate.shape, gate.dtype, device=gate.device)
    out, (dg, du) = fwd_bwd(ours_fn, (gate, up), dout)
    out_e, (dg_e, du_e) = fwd_bwd(eager_fn, (gate, up), dout)
    out_r, (dg_r, du_r) = fwd_bwd(reference64(act), (gate, up), dout.double())
    dtype = gate.dtype
    for what, t in (("out", out), ("dgate", dg), ("dup", du)):
        assert t.dtype == dtype and t.shape == gate.shape and t.device == gate.device, what
    assert_numerics(f"{name} out", out, out_e, out_r, dtype)
    assert_numerics(f"{name} dgate", dg, dg_e, dg_r, dtype)
    assert_numerics(f"{name} dup", du, du_e, du_r, dtype)
    return out, dg, du


def check_packed(name, op, gate_up, dout=None, gen=None):
    """The numerics rule for out and the [.., 2I] gradient of the packed form."""
    _, eager_fn, act = OPS[op]
    n = gate_up.shape[-1] // 2
    if dout is None:
        dout = randn(gen, (*gate_up.shape[:-1], n), gate_up.dtype, device=gate_up.device)
    out, (g,) = fwd_bwd(PACKED[op], (gate_up,), dout)
    out_e, (g_e,) = fwd_bwd(lambda x: eager_fn(x[..., :n], x[..., n:]), (gate_up,), dout)
    out_r, (g_r,) = fwd_bwd(lambda x: reference64(act)(*split_packed(x)), (gate_up,), dout.double())
    dtype = gate_up.dtype
    assert out.dtype == dtype and out.shape == (*gate_up.shape[:-1], n)
    assert g.dtype == dtype and g.shape == gate_up.shape
    assert_numerics(f"{name} out", out, out_e, out_r, dtype)
    assert_numerics(f"{name} d gate_up", g, g_e, g_r, dtype)
    return out, g


def assert_same(a, b):
    """Bit for bit on the kernels (flat and row-tile paths do the same arithmetic per element); the
    CPU reference's vectorized and strided loops may round differently in the last place."""
    if TRITON_PATH:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)


@contextlib.contextmanager
def recording_saved_tensors():
    """Collects every tensor autograd saves for backward while the block runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def too_slow_here(n_rows, n_cols):
    return TRITON_INTERPRET and not ON_GPU and n_rows * n_cols > INTERPRETER_MAX_ELEMENTS


# ---- numerics ----


@pytest.mark.parametrize("n_cols", N_COLS, ids=lambda n: f"I{n}")
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, op, n_cols, gen):
    gate, up = make_pair(gen, LEAD, n_cols, dtype)
    check_pair(op, op, gate, up, gen=gen)


@pytest.mark.parametrize("n_cols", N_COLS, ids=lambda n: f"I{n}")
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics_packed(dtype, op, n_cols, gen):
    gate_up = randn(gen, (*LEAD, 2 * n_cols), dtype, 2.0)
    out, g = check_packed(op, op, gate_up, gen=gen)
    # the packed form is the separate form on the two halves, bit for bit
    dout = randn(gen, out.shape, dtype)
    gate, up = gate_up[..., :n_cols].contiguous(), gate_up[..., n_cols:].contiguous()
    out_p, (g_p,) = fwd_bwd(PACKED[op], (gate_up,), dout)
    out_s, (dg_s, du_s) = fwd_bwd(OPS[op][0], (gate, up), dout)
    assert_same(out_p, out_s)
    assert_same(g_p, torch.cat([dg_s, du_s], dim=-1))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, interpreter
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_saturated_gates(dtype, op, gen):
    """Gates far in both tails (|g| up to ~80): sigmoid / erf saturate, nothing turns into NaN or inf."""
    gate, up = make_pair(gen, (5,), 300, dtype, gate_scale=20.0)
    gate[0, :4] = torch.tensor([80.0, -80.0, 1e4, -1e4], dtype=dtype)
    out, dg, du = check_pair(f"{op} saturated", op, gate, up, gen=gen)
    for t in (out, dg, du):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
def test_reference_matches_torch_and_closed_form_backward(act, gen):
    """The oracle agrees with torch's own activations in float64, and the closed-form backward of
    reference.py (the CPU fallback) agrees with autograd through it."""
    g = randn(gen, (7, 33), torch.float64, 3.0, device="cpu")
    u = randn(gen, (7, 33), torch.float64, device="cpu")
    d = randn(gen, (7, 33), torch.float64, device="cpu")
    torch_act = {
        "silu": F.silu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu": F.gelu,
    }[act]
    torch.testing.assert_close(activation_reference(g, act), torch_act(g), rtol=1e-13, atol=1e-13)
    a, da = activation_grad_reference(g, act)
    gr = g.clone().requires_grad_()
    (da_auto,) = torch.autograd.grad(torch_act(gr), gr, torch.ones_like(g))
    torch.testing.assert_close(a, torch_act(g), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(da, da_auto, rtol=1e-12, atol=1e-13)
    _, (dg, du) = fwd_bwd(lambda g, u: gated_reference(g, u, act), (g, u), d)
    dg_c, du_c, out_c = gated_bwd_reference(d, g, u, act, want_out=True)
    torch.testing.assert_close(dg_c, dg, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(du_c, du, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out_c, gated_reference(g, u, act), rtol=1e-13, atol=1e-13)


# ---- shapes and strides ----


@pytest.mark.parametrize("n_rows", ODD_ROWS, ids=lambda n: f"R{n}")
@pytest.mark.parametrize("n_cols", ODD_COLS, ids=lambda n: f"I{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_odd_shapes(dtype, n_cols, n_rows, gen):
    if too_slow_here(n_rows, n_cols):
        pytest.skip("large odd shape: GPU only under the interpreter")
    gate, up = make_pair(gen, (n_rows,), n_cols, dtype)
    check_pair(f"[{n_rows}, {n_cols}]", "swiglu", gate, up, gen=gen)


@pytest.mark.parametrize("n_rows", ODD_ROWS, ids=lambda n: f"R{n}")
@pytest.mark.parametrize("n_cols", ODD_COLS, ids=lambda n: f"I{n}")
@pytest.mark.parametrize("op", ["swiglu", "geglu_tanh"])
def test_odd_shapes_packed(op, n_cols, n_rows, gen):
    if too_slow_here(n_rows, 2 * n_cols):
        pytest.skip("large odd shape: GPU only under the interpreter")
    gate_up = randn(gen, (n_rows, 2 * n_cols), torch.bfloat16, 2.0)
    check_packed(f"{op} [{n_rows}, 2x{n_cols}]", op, gate_up, gen=gen)


@pytest.mark.parametrize("lead", [(), (5,), (2, 3, 4)], ids=["I", "NI", "BTHI"])
@pytest.mark.parametrize("op", ["swiglu", "geglu_none"])
def test_leading_shapes(op, lead, gen):
    gate, up = make_pair(gen, lead, 300, torch.float32)
    check_pair(f"{lead}", op, gate, up, gen=gen)
    check_packed(f"{lead} packed", op, randn(gen, (*lead, 600), torch.float32), gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_strided_rows(dtype, gen):
    """gate and up slices of wider tensors with different row strides (the row-tile path); the result
    equals the one on contiguous copies bit for bit."""
    n_cols = 300
    big_g = randn(gen, (9, n_cols + 20), dtype, 2.0)
    big_u = randn(gen, (9, 2 * n_cols + 3), dtype)
    gate, up = big_g[:, 7 : 7 + n_cols], big_u[:, n_cols : 2 * n_cols]
    assert not gate.is_contiguous() and gate.stride(0) != up.stride(0)
    dout = randn(gen, gate.shape, dtype)
    for op in OPS:
        out, dg, du = check_pair(f"{op} strided", op, gate, up, dout=dout)
        out_c, (dg_c, du_c) = fwd_bwd(OPS[op][0], (gate.contiguous(), up.contiguous()), dout)
        for a, b in ((out, out_c), (dg, dg_c), (du, du_c)):
            assert_same(a, b)


def test_strided_rows_packed_and_non_unit_column_stride(gen):
    dtype = torch.bfloat16
    big = randn(gen, (4, 6, 2 * 200 + 11), dtype, 2.0)
    gate_up = big[..., 5 : 5 + 400]  # rows strided
    assert gate_up.stride(-1) == 1 and not gate_up.is_contiguous()
    check_packed("packed strided", "swiglu", gate_up, gen=gen)
    # columns strided (copied), leading dims transposed (no [R, I] view exists: copied)
    wide = randn(gen, (6, 2 * 128), dtype, 2.0)
    check_pair("column stride 2", "swiglu", wide[:, ::2], wide[:, 1::2], gen=gen)
    t = randn(gen, (5, 3, 128), dtype).transpose(0, 1)
    check_pair("transposed leading dims", "geglu_tanh", t, t.flip(-1), gen=gen)


@pytest.mark.parametrize("kind", ["expanded_row", "scalar_sum", "transposed"])
def test_upstream_gradient_layouts(kind, gen):
    """dout broadcast from one row (row stride 0), from a sum (all strides 0), or transposed."""
    dtype, n_rows, n_cols = torch.float32, 6, 256
    gate, up = make_pair(gen, (n_rows,), n_cols, dtype)
    if kind == "expanded_row":
        dout = randn(gen, (1, n_cols), dtype).expand(n_rows, n_cols)
    elif kind == "scalar_sum":
        dout = torch.ones((), dtype=dtype, device=DEVICE).expand(n_rows, n_cols)
    else:
        dout = randn(gen, (n_cols, n_rows), dtype).t()
    check_pair(f"dout {kind}", "swiglu", gate, up, dout=dout)
    check_packed(f"packed dout {kind}", "swiglu", torch.cat([gate, up], -1), dout=dout)


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (2, 0, 8)], ids=["no_rows", "no_cols", "empty_lead"])
def test_empty(shape):
    gate = torch.randn(shape, device=DEVICE, requires_grad=True)
    up = torch.randn(shape, device=DEVICE, requires_grad=True)
    out = swiglu(gate, up)
    assert out.shape == gate.shape
    out.sum().backward()
    assert gate.grad.shape == gate.shape and up.grad.shape == up.shape
    gu = torch.randn((*shape[:-1], 2 * shape[-1]), device=DEVICE, requires_grad=True)
    out = swiglu_packed(gu)
    assert out.shape == (*shape[:-1], shape[-1])
    out.sum().backward()
    assert gu.grad.shape == gu.shape


def test_float64_runs_the_reference(gen):
    gate, up = make_pair(gen, (3, 4), 100, torch.float64)
    for op in OPS:
        check_pair(f"{op} fp64", op, gate, up, gen=gen)
    check_packed("packed fp64", "geglu_tanh", torch.cat([gate, up], -1), gen=gen)


# ---- contracts ----


def _bad_cases():
    x = torch.randn(3, 8)
    return {
        "gate not a tensor": (lambda: swiglu([1.0], x), "gate"),
        "up not a tensor": (lambda: swiglu(x, 1.0), "up"),
        "gate int": (lambda: swiglu(x.long(), x), "gate"),
        "up dtype": (lambda: swiglu(x, x.half()), "up"),
        "up shape": (lambda: swiglu(x, x[:2]), "up"),
        "up broadcastable shape": (lambda: swiglu(x, x[:1]), "up"),
        "up device": (lambda: swiglu(x, x.to("meta")), "up"),
        "gate 0-d": (lambda: swiglu(x[0, 0], x[0, 0]), "gate"),
        "approximate": (lambda: geglu(x, x, approximate="erf"), "approximate"),
        "packed odd": (lambda: swiglu_packed(torch.randn(3, 7)), "gate_up"),
        "packed dtype": (lambda: geglu_packed(x.int()), "gate_up"),
        "packed approximate": (lambda: geglu_packed(x, approximate=None), "approximate"),
        "linear weight shape": (lambda: swiglu_linear(x, x, torch.randn(4, 7)), "weight"),
        "linear weight dtype": (lambda: swiglu_linear(x, x, torch.randn(4, 8).double()), "weight"),
        "linear bias shape": (lambda: swiglu_linear(x, x, torch.randn(4, 8), torch.randn(5)), "bias"),
        "linear activation": (
            lambda: swiglu_linear(x, x, torch.randn(4, 8), activation="relu"),
            "activation",
        ),
        "mlp x int": (lambda: swiglu_mlp(x.long(), *_mlp_weights()), "x"),
        "mlp gate_weight shape": (
            lambda: swiglu_mlp(x, torch.randn(6, 7), *_mlp_weights()[1:]),
            "gate_weight",
        ),
        "mlp up_weight shape": (
            lambda: swiglu_mlp(x, _mlp_weights()[0], torch.randn(5, 8), _mlp_weights()[2]),
            "up_weight",
        ),
        "mlp down_weight shape": (
            lambda: swiglu_mlp(x, *_mlp_weights()[:2], torch.randn(6, 8)),
            "down_weight",
        ),
        "mlp down_weight dtype": (
            lambda: swiglu_mlp(x, *_mlp_weights()[:2], torch.randn(8, 6).double()),
            "down_weight",
        ),
        "mlp weight device": (
            lambda: swiglu_mlp(x, _mlp_weights()[0].to("meta"), *_mlp_weights()[1:]),
            "gate_weight",
        ),
        "mlp gate_bias shape": (lambda: swiglu_mlp(x, *_mlp_weights(), torch.randn(8)), "gate_bias"),
        "mlp down_bias shape": (
            lambda: swiglu_mlp(x, *_mlp_weights(), down_bias=torch.randn(6)),
            "down_bias",
        ),
        "mlp activation": (lambda: swiglu_mlp(x, *_mlp_weights(), activation="relu"), "activation"),
    }


def _mlp_weights(hidden=8, inter=6):
    """gate, up, down weights of a [.., 8] -> [.., 6] -> [.., 8] MLP."""
    return torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_arguments_raise_value_error_naming_them(case):
    fn, name = _bad_cases()[case]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        fn()


def test_poisoned_allocations():
    """The conftest fixture is active: fresh allocations hold NaN, so an unwritten element fails."""
    assert torch.isnan(torch.empty(5, device=DEVICE)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(3, dtype=torch.bfloat16))).all()


def test_saves_only_gate_and_up(gen):
    """Autograd keeps gate and up (the inputs themselves), nothing else: not act(gate), not the product."""
    gate, up = make_pair(gen, (4,), 64, torch.float32)
    gate.requires_grad_()
    up.requires_grad_()
    for fn in (swiglu, lambda g, u: geglu(g, u, "none")):
        with recording_saved_tensors() as saved:
            fn(gate, up)
        assert len(saved) == 2
        assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}
    gate_up = torch.cat([gate, up], -1).detach().requires_grad_()
    with recording_saved_tensors() as saved:
        swiglu_packed(gate_up)
    assert [t.data_ptr() for t in saved] == [gate_up.data_ptr()]


def test_second_backward_with_retain_graph(gen):
    """Nothing is overwritten in place: a second backward through the same graph accumulates the same
    gradient again."""
    gate, up = make_pair(gen, (5,), 300, torch.float32)
    gate.requires_grad_()
    up.requires_grad_()
    out = swiglu(gate, up)
    dout = torch.randn_like(out)
    out.backward(dout, retain_graph=True)
    first = gate.grad.clone(), up.grad.clone()
    out.backward(dout)
    assert torch.equal(gate.grad, 2 * first[0]) and torch.equal(up.grad, 2 * first[1])


def test_only_needed_gradients(gen):
    gate, up = make_pair(gen, (5,), 300, torch.float32)
    up.requires_grad_()
    out = swiglu(gate, up)
    (du,) = torch.autograd.grad(out, up, torch.ones_like(out))
    torch.testing.assert_close(du, F.silu(gate))


# ---- swiglu_linear: the MLP tail with the product recomputed ----


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_swiglu_linear_numerics(dtype, act, bias, gen):
    n_in, n_out = (1024, 256) if ON_GPU else (96, 40)
    gate, up = make_pair(gen, (3, 11), n_in, dtype)
    weight = randn(gen, (n_out, n_in), dtype, n_in**-0.5)
    b = randn(gen, (n_out,), dtype) if bias else None
    dy = randn(gen, (3, 11, n_out), dtype)
    inputs = (gate, up, weight) + ((b,) if bias else ())
    torch_act = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[act]

    def ours(g, u, w, *bb):
        return swiglu_linear(g, u, w, *bb, activation=act)

    def eager(g, u, w, *bb):
        return F.linear(torch_act(g) * u, w, *bb)

    def ref(g, u, w, *bb):
        return F.linear(gated_reference(g.double(), u.double(), act), w.double(), *(x.double() for x in bb))

    out, grads = fwd_bwd(ours, inputs, dy)
    out_e, grads_e = fwd_bwd(eager, inputs, dy)
    out_r, grads_r = fwd_bwd(ref, inputs, dy.double())
    assert out.dtype == dtype and out.shape == (3, 11, n_out)
    assert_numerics("y", out, out_e, out_r, dtype)
    for name, g, e, r in zip(("dgate", "dup", "dweight", "dbias"), grads, grads_e, grads_r, strict=False):
        assert g.dtype == dtype
        assert_numerics(name, g, e, r, dtype)


def test_swiglu_linear_saves_no_product(gen):
    """Saved: gate, up and the weight; no other tensor (the product is recomputed in backward)."""
    gate, up = make_pair(gen, (6,), 48, torch.float32)
    gate.requires_grad_()
    up.requires_grad_()
    weight = torch.randn(20, 48, device=DEVICE, requires_grad=True)
    with recording_saved_tensors() as saved:
        y = swiglu_linear(gate, up, weight)
    assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr(), weight.data_ptr()}
    assert len(saved) == 3
    y.sum().backward()
    assert weight.grad.shape == weight.shape


@pytest.mark.parametrize("which", ["gate_up_only", "weight_only"])
def test_swiglu_linear_partial_gradients(which, gen):
    gate, up = make_pair(gen, (6,), 48, torch.float32)
    weight = torch.randn(20, 48, device=DEVICE)
    wrt = (
        [gate.requires_grad_(), up.requires_grad_()] if which == "gate_up_only" else [weight.requires_grad_()]
    )
    dy = torch.randn(6, 20, device=DEVICE)
    got = torch.autograd.grad(swiglu_linear(gate, up, weight), wrt, dy)
    g2, u2, w2 = (t.detach().clone().requires_grad_() for t in (gate, up, weight))
    want = torch.autograd.grad(F.linear(F.silu(g2) * u2, w2), [g2, u2] if len(wrt) == 2 else [w2], dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- swiglu_mlp: the whole gated MLP as one autograd node ----


def _mlp_operands(gen, dtype, bias, hidden, inter):
    x = randn(gen, (3, 11, hidden), dtype)
    weights = [
        randn(gen, (inter, hidden), dtype, hidden**-0.5),
        randn(gen, (inter, hidden), dtype, hidden**-0.5),
        randn(gen, (hidden, inter), dtype, inter**-0.5),
    ]
    biases = [randn(gen, (n,), dtype, 0.1) for n in (inter, inter, hidden)] if bias else []
    return x, weights, biases


@pytest.mark.parametrize("chunk_rows", [None, 7], ids=["whole", "chunks7"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_swiglu_mlp_numerics(dtype, act, bias, chunk_rows, gen):
    """Output and the gradients of x, the three weights (and biases) against three F.linear and the
    activation in the same dtype (eager) and in float64 (reference); also over chunks of 7 of the 33
    rows (the last chunk short)."""
    hidden, inter = (1024, 2816) if ON_GPU else (48, 80)
    x, weights, biases = _mlp_operands(gen, dtype, bias, hidden, inter)
    dy = randn(gen, (3, 11, hidden), dtype)
    torch_act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]

    def split(bb):
        return bb if bb else (None, None, None)

    def ours(x, wg, wu, wd, *bb):
        return swiglu_mlp(x, wg, wu, wd, *split(bb), activation=act, chunk_rows=chunk_rows)

    def eager(x, wg, wu, wd, *bb):
        bg, bu, bd = split(bb)
        return F.linear(torch_act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    def ref(x, wg, wu, wd, *bb):
        bg, bu, bd = (t.double() if t is not None else None for t in split(bb))
        g, u = F.linear(x.double(), wg.double(), bg), F.linear(x.double(), wu.double(), bu)
        return F.linear(gated_reference(g, u, act), wd.double(), bd)

    inputs = (x, *weights, *biases)
    out, grads = fwd_bwd(ours, inputs, dy)
    out_e, grads_e = fwd_bwd(eager, inputs, dy)
    out_r, grads_r = fwd_bwd(ref, inputs, dy.double())
    assert out.dtype == dtype and out.shape == (3, 11, hidden)
    assert_numerics("y", out, out_e, out_r, dtype)
    names = ("dx", "dgate_weight", "dup_weight", "ddown_weight", "dgate_bias", "dup_bias", "ddown_bias")
    for name, g, e, r in zip(names, grads, grads_e, grads_r, strict=False):
        assert g.dtype == dtype and g.shape == r.shape
        assert_numerics(name, g, e, r, dtype)


def test_swiglu_mlp_saves_x_gate_up_and_weights(gen):
    """Saved: x, the gate and up projections [N, I] and the three weights; nothing else (the product is
    recomputed in backward)."""
    x, (wg, wu, wd), _ = _mlp_operands(gen, torch.float32, False, 32, 48)
    x.requires_grad_()
    for w in (wg, wu, wd):
        w.requires_grad_()
    with recording_saved_tensors() as saved:
        y = swiglu_mlp(x, wg, wu, wd)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(33, 32), (33, 48), (33, 48), (48, 32), (48, 32), (32, 48)])
    assert {wg.data_ptr(), wu.data_ptr(), wd.data_ptr()} <= {t.data_ptr() for t in saved}
    y.sum().backward()
    assert all(w.grad is not None for w in (x, wg, wu, wd))


@pytest.mark.parametrize("wrt", ["x", "weights", "down_weight", "gate_weight"])
def test_swiglu_mlp_partial_gradients(wrt, gen):
    """Only some inputs require grad: those get eager's gradients, the others none."""
    x, weights, _ = _mlp_operands(gen, torch.float32, False, 32, 48)
    leaves = {"x": [x], "weights": weights, "down_weight": [weights[2]], "gate_weight": [weights[0]]}[wrt]
    for t in leaves:
        t.requires_grad_()
    dy = torch.randn(3, 11, 32, generator=gen).to(DEVICE)
    got = torch.autograd.grad(swiglu_mlp(x, *weights), leaves, dy)
    copies = [t.detach().clone().requires_grad_(any(t is leaf for leaf in leaves)) for t in (x, *weights)]
    cx, cg, cu, cd = copies
    want_out = F.linear(F.silu(F.linear(cx, cg)) * F.linear(cx, cu), cd)
    want = torch.autograd.grad(want_out, [c for c in copies if c.requires_grad], dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_swiglu_mlp_chunks_save_x_alone(gen):
    """Over chunks, only x (and the weights and gate / up biases) is saved: no [N, I] tensor."""
    x, (wg, wu, wd), _ = _mlp_operands(gen, torch.float32, False, 32, 48)
    x.requires_grad_()
    with recording_saved_tensors() as saved:
        y = swiglu_mlp(x, wg, wu, wd, chunk_rows=5)
    assert sorted(tuple(t.shape) for t in saved if t is not None) == sorted(
        [(33, 32), (48, 32), (48, 32), (32, 48)]
    )
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx.shape == x.shape


@pytest.mark.parametrize("wrt", ["x", "down_weight", "gate_weight"])
def test_swiglu_mlp_chunks_partial_gradients(wrt, gen):
    """Over chunks, only what requires grad gets a gradient, equal to the unchunked node's."""
    x, weights, _ = _mlp_operands(gen, torch.float64, False, 32, 48)
    pick = {"x": 0, "gate_weight": 1, "down_weight": 3}[wrt]
    leaves = [t.clone().requires_grad_(i == pick) for i, t in enumerate((x, *weights))]
    dy = torch.randn(3, 11, 32, generator=gen, dtype=torch.float64).to(DEVICE)
    (got,) = torch.autograd.grad(swiglu_mlp(*leaves, chunk_rows=4), [leaves[pick]], dy)
    (want,) = torch.autograd.grad(swiglu_mlp(*leaves), [leaves[pick]], dy)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_swiglu_mlp_bad_chunk_rows_raise(bad):
    with pytest.raises(ValueError, match=r"^chunk_rows\b"):
        swiglu_mlp(torch.randn(4, 8), *_mlp_weights(), chunk_rows=bad)


def test_swiglu_mlp_second_backward_raises(gen):
    """The backward writes over the saved gate and up: a second backward through the graph raises."""
    x, weights, _ = _mlp_operands(gen, torch.float32, False, 32, 48)
    x.requires_grad_()
    y = swiglu_mlp(x, *weights)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same graph twice"):
        y.sum().backward()


def test_swiglu_mlp_autocast_matches_linear_layers(gen):
    """Under autocast the operands are cast to the autocast dtype, as nn.Linear does: a bf16 output and
    fp32 gradients of the fp32 weights, within the numerics rule of three F.linear under the same
    autocast (float64 reference)."""
    device_type = "cuda" if ON_GPU else "cpu"
    x, weights, _ = _mlp_operands(gen, torch.float32, False, 32, 48)
    dy = randn(gen, (3, 11, 32), torch.bfloat16)

    def run(fn, x, wg, wu, wd):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return fn(x, wg, wu, wd)

    def eager(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def ref(x, wg, wu, wd):
        return eager(*(t.double() for t in (x, wg, wu, wd)))

    out, grads = fwd_bwd(lambda *a: run(swiglu_mlp, *a), (x, *weights), dy)
    out_e, grads_e = fwd_bwd(lambda *a: run(eager, *a), (x, *weights), dy)
    out_r, grads_r = fwd_bwd(ref, (x, *weights), dy.double())
    assert out.dtype == out_e.dtype == torch.bfloat16
    assert_numerics("y", out, out_e, out_r, torch.bfloat16)
    names = ("dx", "dgate_weight", "dup_weight", "ddown_weight")
    for name, g, e, r in zip(names, grads, grads_e, grads_r, strict=True):
        assert g.dtype == e.dtype == torch.float32
        assert_numerics(name, g, e, r, torch.bfloat16)


# ---- dispatch, launch configuration, compile, CUDA graphs ----


def test_dispatch_runs_the_expected_path(monkeypatch, gen):
    """fp32 on kernel_device() launches the kernels when TRITON_PATH, else the reference; fp64 always
    runs the reference."""
    calls = {"fwd": 0, "bwd": 0}

    monkeypatch.setattr(sw_op, "swiglu_fwd_launch", counting(calls, "fwd", sw_op.swiglu_fwd_launch))
    monkeypatch.setattr(sw_op, "swiglu_bwd_launch", counting(calls, "bwd", sw_op.swiglu_bwd_launch))
    gate, up = make_pair(gen, (4,), 100, torch.float32)
    gate.requires_grad_()
    swiglu(gate, up).sum().backward()
    swiglu_packed(torch.cat([gate, up], -1)).sum().backward()
    expected = 2 if TRITON_PATH else 0
    assert calls == {"fwd": expected, "bwd": expected}
    g64 = gate.detach().double().requires_grad_()
    swiglu(g64, up.double()).sum().backward()
    assert calls == {"fwd": expected, "bwd": expected}


def test_launch_config():
    """Contiguous operands: flat 1-D tiles of FWD_BLOCK elements. Strided rows: a power-of-two column
    block that wastes little of a row (14336 = 7 x 2048), rows filling the rest of the block."""
    full = torch.empty(16, 2 * 14336, device="meta")
    gate, up = full[:, :14336], full[:, 14336:]
    contiguous = torch.empty(16, 14336, device="meta")
    assert sw_op._config(16, 14336, (contiguous, contiguous), 4096) == (True, 1, 4096, 16 * 14336 // 4096)
    assert sw_op._config(16, 14336, (gate, up, contiguous), 4096) == (False, 2, 2048, 8 * 7)
    x = torch.empty(100, 11008, device="meta")[:, :11000]
    assert sw_op._config(100, 11000, (x,), 4096)[1:3] == (1, 4096)  # 3 blocks, 11.7% masked
    x = torch.empty(100, 64, device="meta")[:, :63]
    assert sw_op._config(100, 63, (x,), 4096) == (False, 64, 64, 2)
    x = torch.empty(3, 8, device="meta")[:, :1]
    assert sw_op._config(3, 1, (x,), 4096) == (False, 4, 1, 1)


@triton_path_only
@pytest.mark.parametrize("n_rows,n_cols,launches", [(8, 1024, 1), (7, 781, 2), (3, 5, 1)])
def test_flat_launches_keep_the_bound_a_multiple_of_16(n_rows, n_cols, launches, monkeypatch, gen):
    """A flat size that is not a multiple of 16 runs as whole blocks plus a one-program tail (so the
    main launch keeps 16-byte vector accesses); sizes below one block run as one launch."""
    spy = LaunchSpy(sw_op.swiglu_fwd_launch)
    monkeypatch.setattr(sw_op, "swiglu_fwd_launch", spy)
    gate, up = make_pair(gen, (n_rows,), n_cols, torch.float32)
    check_pair("flat split", "swiglu", gate, up, gen=gen)
    seen = [(grid[0], kw["n_cols"], kw["FLAT"]) for grid, kw in zip(spy.grids, spy.calls, strict=True)]
    assert len(seen) == launches and all(flat for _, _, flat in seen)
    assert sum(n for _, n, _ in seen) == n_rows * n_cols
    if launches == 2:
        assert seen[0][1] % sw_op.FWD_BLOCK == 0 and seen[1][0] == 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(backend, gen):
    torch._dynamo.reset()
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def fn(gate, up, gate_up):
        return swiglu(gate, up) + geglu_packed(gate_up) * 0.5

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for _ in range(2):  # the second call reuses the graph on new data
        gate, up = make_pair(gen, (3, 5), 256, dtype)
        gate_up = randn(gen, (3, 5, 512), dtype, 2.0)
        dout = randn(gen, (3, 5, 256), dtype)
        out_c, grads_c = fwd_bwd(compiled, (gate, up, gate_up), dout)
        out, grads = fwd_bwd(fn, (gate, up, gate_up), dout)
        torch.testing.assert_close(out_c, out, rtol=1e-2, atol=1e-2)
        for a, b in zip(grads_c, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    torch._dynamo.reset()


def test_torch_compile_swiglu_linear(gen):
    torch._dynamo.reset()
    weight = torch.randn(24, 64, device=DEVICE) / 8

    def fn(gate, up, w):
        return swiglu_linear(gate, up, w, activation="gelu_tanh")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    gate, up = make_pair(gen, (7,), 64, torch.float32)
    dy = randn(gen, (7, 24), torch.float32)
    out_c, grads_c = fwd_bwd(compiled, (gate, up, weight), dy)
    out, grads = fwd_bwd(fn, (gate, up, weight), dy)
    torch.testing.assert_close(out_c, out)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(gen):
    """Forward + backward captured once and replayed on new data: no host syncs on the hot path."""
    dtype, shape = torch.bfloat16, (300, 14336)
    gate = randn(gen, shape, dtype).requires_grad_()
    up = randn(gen, shape, dtype).requires_grad_()
    dout = randn(gen, shape, dtype)

    def step():
        out = swiglu(gate, up)
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            gate.grad = up.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    gate.grad = up.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(2):
        g_new, u_new = make_pair(gen, shape[:1], shape[1], dtype)
        with torch.no_grad():
            gate.copy_(g_new)
            up.copy_(u_new)
        graph.replay()
        torch.cuda.synchronize()
        out, (dg, du) = fwd_bwd(swiglu, (g_new, u_new), dout)
        assert torch.equal(static_out.detach(), out)
        assert torch.equal(gate.grad, dg) and torch.equal(up.grad, du)


# ---- int64 addressing ----


@pytest.mark.gpu
@pytest.mark.slow
def test_rows_times_cols_over_2_31():
    """rows x I > 2^31 elements (bf16, 4.3 GB per operand): every offset needs int64 (docs/design.md
    section 3). Flat path (contiguous) and row-tile path (packed, row stride 2I); checked on the
    rows around element 2^31 and the last rows."""
    n_cols, dtype = 14336, torch.bfloat16
    n_rows = 2**31 // n_cols + 5
    assert n_rows * n_cols > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:  # peak ~26 GiB
        pytest.skip(f"needs ~40 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(2**31)
    first_big = 2**31 // n_cols
    rows = torch.tensor(
        [0, 1, first_big - 1, first_big, first_big + 1, n_rows - 2, n_rows - 1], device="cuda"
    )

    def check(name, op, ours, g, u, d):
        _, eager_fn, act = OPS[op]
        out, dg, du = ours
        e_out, (e_dg, e_du) = fwd_bwd(eager_fn, (g[rows], u[rows]), d[rows])
        r_out, (r_dg, r_du) = fwd_bwd(reference64(act), (g[rows], u[rows]), d[rows].double())
        assert_numerics(f"{name} out", out[rows], e_out, r_out, dtype)
        assert_numerics(f"{name} dgate", dg[rows], e_dg, r_dg, dtype)
        assert_numerics(f"{name} dup", du[rows], e_du, r_du, dtype)

    def randn_cuda(shape, scale=1.0):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen).mul_(scale)

    # flat path
    gate = randn_cuda((n_rows, n_cols), 2.0).requires_grad_()
    up = randn_cuda((n_rows, n_cols)).requires_grad_()
    dout = randn_cuda((n_rows, n_cols))
    out = swiglu(gate, up)
    out.backward(dout)
    check("flat", "swiglu", (out.detach(), gate.grad, up.grad), gate.detach(), up.detach(), dout)
    del gate, up, out
    torch.cuda.empty_cache()

    # row-tile path: packed [n_rows, 2I]
    gate_up = randn_cuda((n_rows, 2 * n_cols), 2.0).requires_grad_()
    out = geglu_packed(gate_up)
    out.backward(dout)
    g, u = split_packed(gate_up.detach())
    dg, du = split_packed(gate_up.grad)
    check("packed", "geglu_tanh", (out.detach(), dg, du), g, u, dout)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_swiglu_mlp_chunks_hold_one_chunks_tensors_at_a_time():
    """Over chunks, the forward holds at most one chunk's g, u and h, the backward one chunk's g, u and dh
    (dg and du written over them): the previous chunk's are freed before the next chunk's are made."""
    torch.manual_seed(0)
    n, h, i, c = 8192, 512, 8192, 1024
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wg, wu = (torch.randn(i, h, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in "gu")
    wd = torch.randn(h, i, device="cuda", dtype=torch.bfloat16) * 0.05
    chunk = c * i * 2  # bytes of one [chunk, I] bf16 tensor
    rows = n * h * 2  # bytes of y, dy or dx
    y = swiglu_mlp(x, wg, wu, wd, chunk_rows=c)  # once first: cuBLAS's workspaces and the kernels made
    torch.autograd.grad(y, x, torch.ones_like(y))
    del y
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = swiglu_mlp(x, wg, wu, wd, chunk_rows=c)
    assert torch.cuda.max_memory_allocated() - before <= rows + 3.5 * chunk  # y, one chunk's g, u, h
    dy = torch.randn_like(y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.cuda.max_memory_allocated() - before <= rows + 3.5 * chunk  # dx, one chunk's g, u, dh
