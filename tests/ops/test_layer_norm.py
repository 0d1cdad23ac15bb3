"""fuselm.layer_norm: numerics (docs/design.md section 5), residual, optional weight/bias, shapes, contracts.

Every numeric check goes through assert_numerics: err(fuselm) <= 2 * err(eager) + atol[dtype],
errors measured against layer_norm_reference run on float64 copies of the inputs. "eager" is
``torch.nn.functional.layer_norm`` in the input dtype (what torch.nn.LayerNorm in a bf16 model runs),
after the residual add in the input dtype.
"""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_PATH, kernel_device
from kit.spies import counting

import fuselm
from fuselm.ops._common import normalization
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.layer_norm import layer_norm, layer_norm_reference
from fuselm.ops.layer_norm import op as ln_op

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

LEAD = (3, 111) if ON_GPU else (2, 3)
HIDDEN = (4096, 20000) if ON_GPU else (128, 600)  # one block / looped
AFFINE = {"weight+bias": (True, True), "weight": (True, False), "none": (False, False)}


def make_inputs(gen, lead, hidden, dtype, *, residual=False, weight=True, bias=True, param_dtype=None):
    """x ~ N(2, 1.5^2) (a mean to remove), residual ~ N(0, 1), weight U[0.5, 1.5), bias N(0, 1)."""
    x = (torch.randn(*lead, hidden, generator=gen) * 1.5 + 2.0).to(dtype).to(DEVICE)
    r = torch.randn(*lead, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    pd = param_dtype or dtype
    w = (torch.rand(hidden, generator=gen) + 0.5).to(pd).to(DEVICE) if weight else None
    b = torch.randn(hidden, generator=gen).to(pd).to(DEVICE) if bias else None
    return x, r, w, b


def eager_layer_norm(x, weight, bias, eps=1e-5, *, residual=None):
    if residual is not None:
        x = residual + x
    w = weight.to(x.dtype) if weight is not None else None
    b = bias.to(x.dtype) if bias is not None else None
    y = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return (y, x) if residual is not None else y


def reference64(x, weight, bias, eps=1e-5, *, residual=None):
    as64 = lambda t: t.double() if t is not None else None  # noqa: E731
    return layer_norm_reference(as64(x), as64(weight), as64(bias), eps, residual=as64(residual))


def fwd_bwd(fn, x, weight, bias, residual, gos, leaf_dtype=None):
    """Outputs and the gradients of sum_i <out_i, go_i> w.r.t. x, weight, bias, residual (those given),
    on fresh leaves (cast to leaf_dtype if given: float64 for the oracle)."""

    def leaf(t):
        return t.detach().to(leaf_dtype or t.dtype, copy=True).requires_grad_() if t is not None else None

    xl, wl, bl, rl = leaf(x), leaf(weight), leaf(bias), leaf(residual)
    outs = fn(xl, wl, bl, residual=rl)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [t for t in (xl, wl, bl, rl) if t is not None]
    grads = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)])
    return tuple(o.detach() for o in outs), grads


def check_case(name, x, weight, bias, residual, gen, *, fn=layer_norm):
    gos = [torch.randn(x.shape, generator=gen).to(x.device) for _ in range(1 + (residual is not None))]
    ours, g_ours = fwd_bwd(fn, x, weight, bias, residual, gos)
    eager, g_eager = fwd_bwd(eager_layer_norm, x, weight, bias, residual, gos)
    ref, g_ref = fwd_bwd(reference64, x, weight, bias, residual, gos, torch.float64)
    dtype = x.dtype
    assert len(ours) == len(ref) == 1 + (residual is not None)
    for what, o, e, r in zip(("y", "sum"), ours, eager, ref, strict=False):
        assert o.shape == x.shape and o.dtype == dtype and o.device == x.device
        assert_numerics(f"{name} {what}", o, e, r, dtype)
    names = ["dx"] + [
        n for n, t in (("dweight", weight), ("dbias", bias), ("dresidual", residual)) if t is not None
    ]
    for what, o, e, r in zip(names, g_ours, g_eager, g_ref, strict=True):
        assert_numerics(f"{name} {what}", o, e, r, dtype)
    params = [t for t in (x, weight, bias, residual) if t is not None]
    for g, t in zip(g_ours, params, strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape
    return ours, g_ours


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("affine", list(AFFINE))
@pytest.mark.parametrize("hidden", HIDDEN, ids=lambda h: f"H{h}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, hidden, affine, residual, gen):
    has_w, has_b = AFFINE[affine]
    x, r, w, b = make_inputs(gen, LEAD, hidden, dtype, residual=residual, weight=has_w, bias=has_b)
    check_case(affine, x, w, b, r, gen)


def test_reference_is_torch(gen):
    """The oracle is F.layer_norm (float64), the residual sum is x + residual bit for bit."""
    x, r, w, b = make_inputs(gen, (3,), 40, torch.float64, residual=True)
    y, s = layer_norm_reference(x, w, b, residual=r)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (40,), w, b, 1e-5), rtol=1e-13, atol=1e-13)


ODD_HIDDEN = (1, 63, 781, 3000)
ODD_ROWS = (1, 7, 513)


def _odd_cases():
    for h in ODD_HIDDEN:
        for n in ODD_ROWS:
            if not ON_GPU and TRITON_PATH and n * h > 40000:  # the interpreter is slow on long rows
                continue
            yield n, h


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,hidden", list(_odd_cases()), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_odd_shapes(dtype, rows, hidden, residual, gen):
    x, r, w, b = make_inputs(gen, (rows,), hidden, dtype, residual=residual)
    check_case(f"{rows}x{hidden}", x, w, b, r, gen)


@pytest.mark.parametrize("lead", [(), (5,), (2, 1, 3)], ids=["H", "NH", "B1TH"])
def test_leading_shapes(lead, gen):
    x, r, w, b = make_inputs(gen, lead, 96, torch.bfloat16, residual=True)
    check_case(f"{lead}", x, w, b, r, gen)


def test_row_strided_input(gen):
    big, rbig, w, b = make_inputs(gen, (2, 4), 337, torch.bfloat16, residual=True)
    x, r = big[..., :300], rbig[..., 3:303]
    assert not x.is_contiguous() and x.stride(-1) == 1
    check_case("strided", x, w[:300], b[:300], r, gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_fp32_parameters(dtype, gen):
    """fp32 weight and bias with half-precision x: y in x's dtype, gradients in each tensor's dtype."""
    x, r, w, b = make_inputs(gen, LEAD, 200, dtype, residual=True, param_dtype=torch.float32)
    check_case("fp32 params", x, w, b, r, gen)


def test_large_mean_is_removed_accurately(gen):
    """Rows with mean 1000 and std 1: the centred variance keeps the fp32 result accurate."""
    x, _, w, b = make_inputs(gen, LEAD, 600, torch.float32)
    x = x + 1000.0
    check_case("mean 1000", x, w, b, None, gen)


@pytest.mark.parametrize("hidden", [200, 600], ids=["one_block", "looped"])
def test_persistent_grids(hidden, monkeypatch, gen):
    """Few programs walking many row blocks (the GPU's persistent grids, forced small here)."""
    monkeypatch.setattr(ln_op, "FWD_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(normalization, "persistent_grid", lambda n, device, per_sm: min(n, 3))
    monkeypatch.setattr(ln_op, "resident_programs", lambda kernel, kw, n, *a, **k: min(n, 3))
    monkeypatch.setattr(ln_op, "BWD_TILE", 256)
    x, r, w, b = make_inputs(gen, (11,), hidden, torch.bfloat16, residual=True)
    check_case("persistent", x, w, b, r, gen)


@pytest.mark.parametrize("used", ["y", "sum"])
def test_residual_one_output_used(used, gen):
    """Only y (the sum's gradient is None) or only the sum (y's gradient is None) reaches the loss."""
    x, r, w, b = make_inputs(gen, LEAD, 200, torch.bfloat16, residual=True)
    go = torch.randn(x.shape, generator=gen).to(DEVICE)
    results = []
    for fn, dt in ((layer_norm, None), (eager_layer_norm, None), (reference64, torch.float64)):
        leaves = [t.detach().to(dt or t.dtype, copy=True).requires_grad_() for t in (x, r, w, b)]
        y, s = fn(leaves[0], leaves[2], leaves[3], residual=leaves[1])
        out = y if used == "y" else s
        results.append(torch.autograd.grad(out, leaves, go.to(out.dtype), allow_unused=True))
    for what, o, e, g in zip(("dx", "dresidual", "dweight", "dbias"), *results, strict=True):
        if used == "sum" and what in ("dweight", "dbias"):
            assert o is None or torch.equal(o, torch.zeros_like(o))
        else:
            assert_numerics(f"{used} only: {what}", o, e, g, x.dtype)


def test_deterministic(gen):
    x, r, w, b = make_inputs(gen, (4096,) if ON_GPU else (64,), 200, torch.bfloat16, residual=True)
    gos = [torch.randn(x.shape, generator=gen).to(DEVICE) for _ in range(2)]
    a = fwd_bwd(layer_norm, x, w, b, r, gos)
    c = fwd_bwd(layer_norm, x, w, b, r, gos)
    for u, v in zip(a[0] + a[1], c[0] + c[1], strict=True):
        assert torch.equal(u, v)


def test_zero_rows():
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    b = torch.zeros(16, device=DEVICE, requires_grad=True)
    layer_norm(x, w, b).sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_float64_runs_the_reference(gen):
    x, r, w, b = make_inputs(gen, (2, 3), 50, torch.float64, residual=True)
    check_case("fp64", x, w, b, r, gen)


def _bad_calls():
    x = torch.randn(4, 10, device=DEVICE)
    w = torch.ones(10, device=DEVICE)
    f = layer_norm
    cases = {
        "x not a tensor": ("x", lambda: f(x.tolist(), w, w)),
        "x int": ("x", lambda: f(torch.ones(4, 10, dtype=torch.int32, device=DEVICE), w, w)),
        "x empty last dim": ("x", lambda: f(torch.randn(4, 0, device=DEVICE), None, None)),
        "weight shape": ("weight", lambda: f(x, w[:9], w)),
        "bias shape": ("bias", lambda: f(x, w, w[:9])),
        "bias 2-D": ("bias", lambda: f(x, w, w[None])),
        "residual shape": ("residual", lambda: f(x, w, w, residual=x[:, :9])),
        "residual dtype": ("residual", lambda: f(x, w, w, residual=x.bfloat16())),
        "eps < 0": ("eps", lambda: f(x, w, w, eps=-1.0)),
    }
    if ON_GPU:
        cases["bias on another device"] = ("bias", lambda: f(x, w, w.cpu()))
    return cases


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_value_error_naming_them(case):
    name, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        call()


def test_dispatch_runs_the_expected_path(monkeypatch, gen):
    calls = {"fwd_kernel": 0, "bwd_kernel": 0, "reference": 0}

    def reference_spy(*args, **kwargs):
        calls["reference"] += 1
        return layer_norm_reference(*args, **kwargs)

    monkeypatch.setattr(
        ln_op, "layer_norm_fwd_launch", counting(calls, "fwd_kernel", ln_op.layer_norm_fwd_launch)
    )
    monkeypatch.setattr(
        ln_op, "layer_norm_bwd_launch", counting(calls, "bwd_kernel", ln_op.layer_norm_bwd_launch)
    )
    monkeypatch.setattr(ln_op, "layer_norm_reference", reference_spy)
    x, r, w, b = make_inputs(gen, (4,), 100, torch.float32, residual=True)
    y, s = layer_norm(x.clone().requires_grad_(), w, b, residual=r)
    (y.sum() + s.sum()).backward()
    if TRITON_PATH:
        assert calls == {"fwd_kernel": 1, "bwd_kernel": 1, "reference": 0}
    else:
        assert calls == {"fwd_kernel": 0, "bwd_kernel": 0, "reference": 1}


def test_docstring_example_runs(monkeypatch):
    monkeypatch.setattr(fuselm, "layer_norm", layer_norm, raising=False)  # before the export exists
    tests = [t for t in doctest.DocTestFinder().find(layer_norm) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(backend, gen):
    torch._dynamo.reset()
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def fn(x, w, b, residual=None):
        return layer_norm(x * 1.0, w, b, residual=residual)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for _ in range(2):
        x, r, w, b = make_inputs(gen, LEAD, 200, dtype, residual=True)
        check_case("compiled", x, w, b, r, gen, fn=lambda x, w, b, **k: compiled(x, w, b, **k))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.slow
def test_rows_times_hidden_over_2_31():
    """rows x H > 2^31 elements (int64 offsets): bf16, rows around the 2^31 boundary and dweight / dbias."""
    hidden, dtype = 4096, torch.bfloat16
    n_rows = 2**31 // hidden + 7
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs ~40 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    g = torch.Generator(device="cuda").manual_seed(2**31)
    x = torch.randn(n_rows, hidden, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(hidden, device="cuda", generator=g).to(dtype).requires_grad_()
    dy = torch.randn(n_rows, hidden, device="cuda", dtype=dtype, generator=g)
    y = layer_norm(x, w, b)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    first_big = 2**31 // hidden
    rows = torch.tensor([0, first_big - 1, first_big, first_big + 1, n_rows - 1], device="cuda")
    xs, ws, bs = x[rows].detach(), w.detach(), b.detach()
    o_ref, g_ref = fwd_bwd(reference64, xs, ws, bs, None, [dy[rows]], torch.float64)
    o_eag, g_eag = fwd_bwd(eager_layer_norm, xs, ws, bs, None, [dy[rows]])
    assert_numerics("y rows", y[rows], o_eag[0], o_ref[0], dtype)
    assert_numerics("dx rows", dx[rows], g_eag[0], g_ref[0], dtype)
    del y, dx
    dw_ref = torch.zeros(hidden, dtype=torch.float64, device="cuda")
    db_ref = torch.zeros_like(dw_ref)
    dw_eag = torch.zeros(hidden, dtype=torch.float32, device="cuda")
    db_eag = torch.zeros_like(dw_eag)
    for i in range(0, n_rows, 16384):
        sl = slice(i, i + 16384)
        _, (_, gw, gb) = fwd_bwd(reference64, x[sl], ws, bs, None, [dy[sl]], torch.float64)
        dw_ref += gw
        db_ref += gb
        _, (_, gw, gb) = fwd_bwd(eager_layer_norm, x[sl], ws, bs, None, [dy[sl]])
        dw_eag += gw.float()
        db_eag += gb.float()
    assert_numerics("dweight", dw, dw_eag.to(dtype), dw_ref, dtype)
    assert_numerics("dbias", db, db_eag.to(dtype), db_ref, dtype)
