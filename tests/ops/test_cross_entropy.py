"""fuselm.cross_entropy: numerics (docs/design.md section 5), features, shapes, contracts and failure modes.

Every numeric check goes through assert_numerics: err(fuselm) <= 2 * err(eager) + atol[dtype],
errors measured against cross_entropy_reference run on float64 copies of the inputs.
"eager" is what a PyTorch user writes, every op in the input dtype: F.cross_entropy where it
has the feature, composed with torch.tanh / torch.logsumexp for softcap, z-loss and lse.

Sizes: on CUDA the real ones; on the CPU the Triton interpreter (TRITON_INTERPRET=1) is numpy,
so rows stay few and vocabularies small (the interpreter caps blocks at 256 columns, so V > 256
still walks the multi-block path of the kernels).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_PATH, kernel_device
from kit.oracles import eager_cross_entropy, reference64
from kit.spies import counting

import fuselm
from fuselm.ops._common.loss import rows as loss_rows
from fuselm.ops._common.loss.options import LossOptions, LossScales, loss_scales, reduce_rows
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.cross_entropy import cross_entropy_reference
from fuselm.ops.cross_entropy import op as ce_op

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

# leading shape [B, T] and vocabularies of the feature matrix: one that fits a single block, one that loops
LEAD = (3, 111) if ON_GPU else (2, 3)
VOCABS = (3001, 50257) if ON_GPU else (200, 601)
# odd vocabularies next to the real ones
ODD_VOCABS = (1, 63, 781, 3000, 32003) + ((128256, 256000) if ON_GPU else ())
ODD_ROWS = 64 if ON_GPU else 3

triton_path_only = pytest.mark.skipif(
    not TRITON_PATH, reason="Triton kernels not exercised (no CUDA, TRITON_INTERPRET unset)"
)


# ---- inputs ----


def make_inputs(
    gen: torch.Generator,
    lead: tuple[int, ...],
    n_cols: int,
    dtype: torch.dtype,
    *,
    ignore_index: int = -100,
    ignore_frac: float = 0.25,
    weight: bool = False,
    device: str = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logits N(0, 3^2) in `dtype`, targets in [0, V) with about `ignore_frac` set to ignore_index
    (at least one ignored and one kept when there are two tokens or more), weights in [0.5, 1.5)."""
    x = (torch.randn(*lead, n_cols, generator=gen) * 3).to(dtype)
    t = torch.randint(0, n_cols, lead, generator=gen)
    if ignore_frac > 0 and t.numel() > 1:
        drop = (torch.rand(lead, generator=gen) < ignore_frac).reshape(-1)
        drop[0], drop[-1] = True, False
        t = torch.where(drop.reshape(lead), torch.full_like(t, ignore_index), t)
    w = (torch.rand(n_cols, generator=gen) + 0.5).to(dtype) if weight else None
    return x.to(device), t.to(device), (w.to(device) if w is not None else None)


def grad_outputs(gen, shapes, dtype, device=DEVICE, scalar=1.0):
    """Upstream gradients: `scalar` for 0-d outputs, random per element otherwise, exact in `dtype`."""
    out = []
    for shape in shapes:
        if len(shape) == 0:
            out.append(torch.tensor(scalar, dtype=torch.float64, device=device))
        else:
            g = torch.randn(shape, generator=gen).to(dtype).to(torch.float64)
            out.append(g.to(device))
    return out


# ---- the three implementations ----


def fwd_bwd(fn, x, t, kw, gos):
    """Outputs (a tuple) and d(sum_i <out_i, go_i>)/dx, on a fresh leaf copy of x (a float64 leaf for
    the oracle, so that its gradient is not rounded back to the input dtype)."""
    leaf_dtype = torch.float64 if fn is reference64 else x.dtype
    xr = x.detach().to(leaf_dtype).clone().requires_grad_()
    outs = fn(xr, t, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    (gx,) = torch.autograd.grad(outs, xr, [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)])
    return tuple(o.detach() for o in outs), gx


def output_shapes(t, kw):
    shapes = [tuple(t.shape) if kw.get("reduction", "mean") == "none" else ()]
    if kw.get("return_lse", False):
        shapes.append(tuple(t.shape))
    return shapes


def check_case(name, x, t, kw, gen, *, fn=fuselm.cross_entropy, scalar_grad=1.0):
    """The numerics rule for loss, lse and gradient; output dtypes and shapes."""
    dtype = x.dtype
    gos = grad_outputs(gen, output_shapes(t, kw), dtype, device=x.device, scalar=scalar_grad)
    ours, g_ours = fwd_bwd(fn, x, t, kw, gos)
    eager, g_eager = fwd_bwd(eager_cross_entropy, x, t, kw, gos)
    ref, g_ref = fwd_bwd(reference64, x, t, kw, gos)
    assert len(ours) == len(ref)
    for what, o, e, r in zip(("loss", "lse"), ours, eager, ref, strict=False):
        assert o.shape == r.shape, f"{name} {what}: shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert o.device == x.device
        assert_numerics(f"{name} {what}", o, e, r, dtype)
    assert ours[0].dtype == dtype
    if len(ours) == 2:
        assert ours[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert g_ours.dtype == dtype and g_ours.shape == x.shape
    assert_numerics(f"{name} grad", g_ours, g_eager, g_ref, dtype)
    return ours, g_ours


# ---- the feature matrix ----

FEATURES = {
    "plain": {},
    "ignore_index=5": dict(ignore_index=5),
    "ignore_index=-1": dict(ignore_index=-1),
    "weight": dict(weight=True),
    "label_smoothing": dict(label_smoothing=0.2),
    "weight+label_smoothing": dict(weight=True, label_smoothing=0.2),
    "z_loss": dict(z_loss=0.02),
    "softcap": dict(softcap=4.0),
    "all": dict(weight=True, label_smoothing=0.2, z_loss=0.02, softcap=4.0),
}


def build_case(gen, feature, lead, n_cols, dtype, **extra):
    kw = dict(FEATURES[feature], **extra)
    want_weight = kw.pop("weight", False)
    x, t, w = make_inputs(
        gen, lead, n_cols, dtype, ignore_index=kw.get("ignore_index", -100), weight=want_weight
    )
    if w is not None:
        kw["weight"] = w
    return x, t, kw


@pytest.mark.parametrize("return_lse", [False, True], ids=["loss", "loss+lse"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("n_cols", VOCABS, ids=lambda v: f"V{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, n_cols, feature, reduction, return_lse, gen):
    x, t, kw = build_case(gen, feature, LEAD, n_cols, dtype, reduction=reduction, return_lse=return_lse)
    check_case(f"{feature} {reduction}", x, t, kw, gen)


def test_reference_matches_torch_float64(gen):
    """The oracle itself agrees with F.cross_entropy in float64 where torch has the feature."""
    x, t, w = make_inputs(gen, (3, 5), 37, torch.float64, weight=True)
    for kw in (dict(), dict(weight=w), dict(label_smoothing=0.3), dict(weight=w, label_smoothing=0.3)):
        for reduction in ("none", "sum", "mean"):
            ref = cross_entropy_reference(x, t, reduction=reduction, **kw)
            torch_ = F.cross_entropy(x.reshape(-1, 37), t.reshape(-1), reduction=reduction, **kw)
            torch_ = torch_.reshape(t.shape) if reduction == "none" else torch_
            assert_numerics(f"reference {list(kw)} {reduction}", ref, torch_, torch_, torch.float64)


# ---- shapes, strides, target dtypes, vocabulary sizes ----


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("lead", [(2, 3), (5,), ()], ids=["BTV", "NV", "V"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_leading_shapes(dtype, lead, reduction, gen):
    x, t, _ = make_inputs(gen, lead, 300, dtype)
    for return_lse in (False, True):
        ours, _ = check_case(f"{lead}", x, t, dict(reduction=reduction, return_lse=return_lse), gen)
        assert ours[0].shape == (t.shape if reduction == "none" else ())


@pytest.mark.parametrize("mode", ["mean", "none+lse"])
@pytest.mark.parametrize("n_cols", ODD_VOCABS, ids=lambda v: f"V{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_vocab_sizes(dtype, n_cols, mode, gen):
    x, t, _ = make_inputs(gen, (ODD_ROWS,), n_cols, dtype)
    kw = dict(reduction="mean") if mode == "mean" else dict(reduction="none", return_lse=True)
    check_case(f"V={n_cols} {mode}", x, t, kw, gen)


@pytest.mark.parametrize("lead", [(5,), (2, 3)], ids=["NV", "BTV"])
@pytest.mark.parametrize(
    "kw", [dict(), dict(reduction="none", return_lse=True, label_smoothing=0.1)], ids=["mean", "none+lse"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_row_strided_input(dtype, kw, lead, gen):
    """A slice big[..., :V] of a wider tensor: rows strided, columns contiguous."""
    n_cols = 300
    big, t, _ = make_inputs(gen, lead, n_cols + 37, dtype)
    t = torch.where(t >= n_cols, torch.full_like(t, -100), t)
    x = big[..., :n_cols]
    assert not x.is_contiguous() and x.stride(-1) == 1
    check_case("strided", x, t, kw, gen)


@pytest.mark.parametrize("kw", [dict(), dict(reduction="none")], ids=["mean", "none"])
def test_row_strided_inplace_writes_into_the_slice(kw, gen):
    """inplace_backward on big[:, :V]: the gradient lands in that slice of big's buffer, the rest of
    big is untouched (no copy was made)."""
    n_cols, extra, dtype = 300, 37, torch.float32
    base, t, _ = make_inputs(gen, (6,), n_cols + extra, dtype)
    t = torch.where(t >= n_cols, torch.full_like(t, -100), t)
    gos = grad_outputs(gen, output_shapes(t, kw), dtype)
    _, g_expected = fwd_bwd(fuselm.cross_entropy, base[:, :n_cols], t, kw, gos)

    leaf = base.clone().requires_grad_()
    big = leaf.clone()  # owned by autograd, so fuselm may overwrite it
    loss = fuselm.cross_entropy(big[:, :n_cols], t, inplace_backward=True, **kw)
    loss.backward(gos[0].to(loss.dtype))
    assert torch.equal(leaf.grad[:, :n_cols], g_expected)
    assert torch.equal(leaf.grad[:, n_cols:], torch.zeros_like(leaf.grad[:, n_cols:]))
    if TRITON_PATH:
        assert torch.equal(big.detach()[:, :n_cols], g_expected)
        assert torch.equal(big.detach()[:, n_cols:], base[:, n_cols:])


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_int32_targets(reduction, gen):
    x, t, _ = make_inputs(gen, (2, 3), 300, torch.bfloat16)
    gos = grad_outputs(gen, output_shapes(t, dict(reduction=reduction)), x.dtype)
    kw = dict(reduction=reduction, label_smoothing=0.1)
    out64, g64 = fwd_bwd(fuselm.cross_entropy, x, t, kw, gos)
    out32, g32 = fwd_bwd(fuselm.cross_entropy, x, t.to(torch.int32), kw, gos)
    assert torch.equal(out32[0], out64[0]) and torch.equal(g32, g64)
    check_case("int32", x, t.to(torch.int32), kw, gen)


@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_float64_input(reduction, feature, gen):
    """fp64 runs the PyTorch reference, on any device."""
    x, t, kw = build_case(gen, feature, (2, 3), 300, torch.float64, reduction=reduction, return_lse=True)
    check_case("fp64", x, t, kw, gen)


# ---- gradients: upstream values, in place ----


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_scalar_loss_backward_with_grad_output_not_one(dtype, reduction, inplace, gen):
    """loss * 3.5: the kernel skips the rescale only when grad_output == 1."""
    x, t, kw = build_case(gen, "weight+label_smoothing", (2, 3), 601, dtype, reduction=reduction)
    kw["inplace_backward"] = inplace
    fn = fuselm.cross_entropy
    if inplace:
        fn = lambda x, t, **kw: fuselm.cross_entropy(x.clone(), t, **kw)  # noqa: E731
    check_case("loss*3.5", x, t, kw, gen, fn=fn, scalar_grad=3.5)


@pytest.mark.parametrize(
    "reduction,return_lse", [("mean", False), ("sum", False), ("none", False), ("mean", True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_inplace_backward(dtype, reduction, return_lse, gen):
    x, t, kw = build_case(gen, "all", (2, 3), 601, dtype, reduction=reduction, return_lse=return_lse)
    gos = grad_outputs(gen, output_shapes(t, kw), dtype)
    out_expected, g_expected = fwd_bwd(fuselm.cross_entropy, x, t, kw, gos)

    leaf = x.detach().clone().requires_grad_()
    logits = leaf.clone()  # an activation owned by autograd, as in a model
    outs = fuselm.cross_entropy(logits, t, inplace_backward=True, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gos_typed = [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)]
    torch.autograd.backward(outs, gos_typed, retain_graph=True)
    for o, e in zip(outs, out_expected, strict=True):
        assert torch.equal(o.detach(), e)
    assert torch.equal(leaf.grad, g_expected)
    if TRITON_PATH:
        assert torch.equal(logits.detach(), g_expected), "the gradient is not in the logits buffer"
        with pytest.raises(RuntimeError):
            torch.autograd.backward(outs, gos_typed)


SOFTMAX_CASES = {
    "lse only": dict(reduction="none", return_lse=True),  # the loss unused: grad_output 0
    "label_smoothing=1 sum": dict(reduction="sum", label_smoothing=1.0),  # gradient in the forward
    "label_smoothing=1 none": dict(reduction="none", label_smoothing=1.0),  # gradient in the backward
}


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_softmax_dominated_gradients(dtype, case, gen):
    """Gradients that are (nearly) the softmax alone, so its precision is not hidden behind the one-hot:
    backward through lse only, and label_smoothing=1 (the target term is gone), on the multi-block path.
    (Caught the gradient blocks being computed from fp16/bf16 logits instead of fp32.)"""
    kw = SOFTMAX_CASES[case]
    x, t, _ = make_inputs(gen, LEAD, VOCABS[-1], dtype)
    x = (x.float() * 4 / 3).to(dtype)  # logits N(0, 4^2): exponents up to ~25 in base 2
    gos = grad_outputs(gen, output_shapes(t, kw), dtype)
    if case == "lse only":
        gos[0] = torch.zeros_like(gos[0])
    ours, g_ours = fwd_bwd(fuselm.cross_entropy, x, t, kw, gos)
    eager, g_eager = fwd_bwd(eager_cross_entropy, x, t, kw, gos)
    ref, g_ref = fwd_bwd(reference64, x, t, kw, gos)
    for what, o, e, r in zip(("loss", "lse"), ours, eager, ref, strict=False):
        assert_numerics(f"{case} {what}", o, e, r, dtype)
    assert_numerics(f"{case} grad", g_ours, g_eager, g_ref, dtype)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_loss_dtype_matches_torch(autocast, reduction, gen):
    """The returned loss has F.cross_entropy's dtype in and out of autocast, for every reduction (autocast
    runs torch's cross-entropy in float32: the loss is float32 whatever the logits' dtype); torch's result is
    the eager side of the numerics rule."""
    low = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    for dtype in (torch.float32, low):
        x, t, w = make_inputs(gen, (2, 5), 301, dtype, weight=True)
        with torch.autocast(DEVICE, dtype=low, enabled=autocast):
            ours = fuselm.cross_entropy(x, t, weight=w, reduction=reduction, label_smoothing=0.1)
            theirs = F.cross_entropy(
                x.reshape(-1, 301), t.reshape(-1), weight=w, reduction=reduction, label_smoothing=0.1
            )
        assert ours.dtype == theirs.dtype, (dtype, ours.dtype, theirs.dtype)
        theirs = theirs.reshape(ours.shape)
        ref = reference64(x, t, weight=w, reduction=reduction, label_smoothing=0.1)
        assert_numerics("loss", ours, theirs, ref, theirs.dtype)


@pytest.mark.parametrize("return_lse", [False, True], ids=["loss", "lse"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward(reduction, return_lse, gen):
    """create_graph=True: on the Triton path a RuntimeError naming the op and create_graph (once "element 0
    of tensors does not require grad", or silently missing second-order terms); on the reference path the
    Hessian-vector product is right (numerics rule against F.cross_entropy and float64)."""
    x, t, _ = make_inputs(gen, (2, 5), 301, torch.float32)
    v = torch.randn(x.shape, generator=gen).to(x.device)

    def hvp(fn, xd):
        xs = xd.detach().clone().requires_grad_()
        loss = fn(xs, t, reduction)
        (g,) = torch.autograd.grad(loss.sum(), xs, create_graph=True)
        (h,) = torch.autograd.grad((g * v.to(g.dtype)).sum(), xs)
        return h

    def ours(xs, t, reduction):
        out = fuselm.cross_entropy(xs, t, reduction=reduction, return_lse=return_lse)
        return out[0] if return_lse else out

    def torch_ce(xs, t, reduction):
        return F.cross_entropy(xs.reshape(-1, xs.shape[-1]), t.reshape(-1), reduction=reduction)

    def ref_ce(xs, t, reduction):
        return cross_entropy_reference(xs, t, reduction=reduction)

    if TRITON_PATH:
        with pytest.raises(
            RuntimeError, match=r"fuselm\.cross_entropy: double backward \(create_graph=True\)"
        ):
            hvp(ours, x)
        return
    assert_numerics("hvp", hvp(ours, x), hvp(torch_ce, x), hvp(ref_ce, x.double()), x.dtype)


@triton_path_only
def test_second_backward_raises_or_is_right(gen):
    """Without inplace_backward, mean/sum keep the gradient from the forward: a second backward through
    the same graph must raise (or give the right, accumulated, gradient), never garbage."""
    x, t, _ = make_inputs(gen, (6,), 300, torch.float32)
    xr = x.clone().requires_grad_()
    loss = fuselm.cross_entropy(xr, t) * 2.0
    loss.backward(retain_graph=True)
    first = xr.grad.clone()
    try:
        loss.backward()
    except RuntimeError:
        return
    _, g_ref = fwd_bwd(reference64, x, t, {}, [torch.tensor(4.0, dtype=torch.float64)])
    _, g_eager = fwd_bwd(eager_cross_entropy, x, t, {}, [torch.tensor(4.0, dtype=torch.float64)])
    assert_numerics("second backward", xr.grad, g_eager, g_ref, x.dtype)
    assert not torch.equal(first, xr.grad)


# ---- ignored and invalid targets ----


@pytest.mark.parametrize("weight", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_all_ignored(reduction, weight, gen):
    x, _, w = make_inputs(gen, (5,), 300, torch.float32, weight=weight)
    t = torch.full((5,), -100, device=DEVICE)
    xr = x.clone().requires_grad_()
    loss = fuselm.cross_entropy(xr, t, reduction=reduction, weight=w, label_smoothing=0.1)
    expected = F.cross_entropy(x, t, reduction=reduction, weight=w, label_smoothing=0.1)
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(expected)  # like PyTorch
    else:
        assert torch.equal(loss.detach(), torch.zeros_like(expected)) and torch.equal(
            expected, torch.zeros_like(expected)
        )
    loss.sum().backward()
    assert torch.equal(xr.grad, torch.zeros_like(x))


def _out_of_range_case(gen, n_cols=300):
    x, t, _ = make_inputs(gen, (6,), n_cols, torch.float32)
    t[1], t[3] = n_cols, -3  # past the end; negative and not ignore_index
    return x, t, torch.tensor([1, 3], device=DEVICE)


@pytest.mark.parametrize("inplace", [False, True], ids=["grad", "inplace"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_ignored_with_infinite_upstream_gradient(reduction, inplace, gen):
    """Hugging Face divides the summed loss by num_items_in_batch, 0 for a batch without a target: loss
    0 / 0 = NaN (as HF's), upstream gradient inf; the gradient stays zero (as PyTorch's), never NaN."""
    x, _, _ = make_inputs(gen, (5,), 300, torch.float32)
    t = torch.full((5,), -100, device=DEVICE)
    xr = x.clone().requires_grad_()
    leaf = xr.clone() if inplace else xr
    loss = fuselm.cross_entropy(leaf, t, reduction=reduction, inplace_backward=inplace) / torch.tensor(0.0)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(xr.grad, torch.zeros_like(x))


_PATHS = [pytest.param("kernel", marks=triton_path_only), "reference"]


@pytest.mark.parametrize(
    "kw", [{}, dict(label_smoothing=0.1, weight=True, z_loss=0.01)], ids=["plain", "all"]
)
@pytest.mark.parametrize("path", _PATHS)
def test_out_of_range_target_nan_loss_zero_gradient(path, kw, gen):
    """Docstring: a target outside [0, V) that is not ignore_index makes that token's loss NaN (visible in
    the loss) and its gradient zero (the weights are never poisoned), never an out-of-bounds read, and no
    host sync; the other tokens are exactly as if it were ignored."""
    x, t, bad = _out_of_range_case(gen)
    kw = dict(kw, reduction="none")
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(x.shape[-1], generator=gen).to(DEVICE) + 0.5
    if path == "reference":
        x = x.double()
        kw["weight"] = kw["weight"].double() if "weight" in kw else None
    good = torch.ones(t.shape, dtype=torch.bool, device=DEVICE)
    good[bad] = False
    xr = x.clone().requires_grad_()
    loss = fuselm.cross_entropy(xr, t, **kw)
    assert torch.isnan(loss[bad]).all() and not torch.isnan(loss[good]).any()
    gos = grad_outputs(gen, [tuple(t.shape)], x.dtype)
    loss.backward(gos[0].to(loss.dtype))
    assert torch.all(xr.grad[bad] == 0)
    # the other tokens are unaffected
    t_ok = torch.where(good, t, torch.full_like(t, -100))
    out_ref, g_ref = fwd_bwd(reference64, x, t_ok, kw, gos)
    out_eager, g_eager = fwd_bwd(eager_cross_entropy, x, t_ok, kw, gos)
    assert_numerics("loss (valid tokens)", loss.detach()[good], out_eager[0][good], out_ref[0][good], x.dtype)
    assert_numerics("grad (valid tokens)", xr.grad, g_eager, g_ref, x.dtype)
    assert torch.isnan(fuselm.cross_entropy(x, t)).item()  # mean


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=DTYPE_IDS.get)
def test_out_of_range_target_raises_with_validate(dtype, gen, monkeypatch):
    monkeypatch.setenv("FUSELM_VALIDATE", "1")
    x, t, _ = _out_of_range_case(gen)
    with pytest.raises(ValueError, match="target"):
        fuselm.cross_entropy(x.to(dtype), t)
    # targets in range pass validation
    fuselm.cross_entropy(x.to(dtype), torch.where(t == 300, torch.zeros_like(t), t.abs()))


# ---- argument checking ----


def _bad_calls():
    x = torch.randn(4, 10, device=DEVICE)
    t = torch.randint(0, 10, (4,), device=DEVICE)
    ce = fuselm.cross_entropy
    cases = {
        "input (not a tensor)": ("input", lambda: ce(x.tolist(), t)),
        "input (int dtype)": ("input", lambda: ce(t[:, None].expand(4, 10), t)),
        "target shape": ("target", lambda: ce(x, t[:3])),
        "target shape (extra dim)": ("target", lambda: ce(x, t[:, None])),
        "target float": ("target", lambda: ce(x, t.float())),
        "target not a tensor": ("target", lambda: ce(x, t.tolist())),
        "weight shape": ("weight", lambda: ce(x, t, weight=torch.ones(9, device=DEVICE))),
        "weight 2-D": ("weight", lambda: ce(x, t, weight=torch.ones(1, 10, device=DEVICE))),
        "reduction": ("reduction", lambda: ce(x, t, reduction="avg")),
        "label_smoothing < 0": ("label_smoothing", lambda: ce(x, t, label_smoothing=-0.1)),
        "label_smoothing > 1": ("label_smoothing", lambda: ce(x, t, label_smoothing=1.5)),
        "z_loss < 0": ("z_loss", lambda: ce(x, t, z_loss=-1e-4)),
        "softcap = 0": ("softcap", lambda: ce(x, t, softcap=0.0)),
        "softcap < 0": ("softcap", lambda: ce(x, t, softcap=-30.0)),
    }
    if ON_GPU:
        cases["target on another device"] = ("target", lambda: ce(x, t.cpu()))
        cases["weight on another device"] = ("weight", lambda: ce(x, t, weight=torch.ones(10)))
    return cases


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_value_error_naming_them(case):
    name, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        call()


# ---- dispatch, module, compile, CUDA graphs ----


def test_dispatch_runs_the_expected_path(monkeypatch, gen):
    """fp32 on kernel_device() launches the Triton kernels when TRITON_PATH, else runs the reference;
    fp64 always runs the reference."""
    calls = {"fwd_kernel": 0, "bwd_kernel": 0, "reference": 0}

    reference = ce_op.cross_entropy_reference_of

    def reference_spy(*args, **kwargs):
        calls["reference"] += 1
        return reference(*args, **kwargs)

    monkeypatch.setattr(
        loss_rows,
        "cross_entropy_fwd_launch",
        counting(calls, "fwd_kernel", loss_rows.cross_entropy_fwd_launch),
    )
    monkeypatch.setattr(
        loss_rows,
        "cross_entropy_bwd_launch",
        counting(calls, "bwd_kernel", loss_rows.cross_entropy_bwd_launch),
    )
    monkeypatch.setattr(ce_op, "cross_entropy_reference_of", reference_spy)
    x, t, _ = make_inputs(gen, (4,), 100, torch.float32)
    loss, lse = fuselm.cross_entropy(x.clone().requires_grad_(), t, reduction="none", return_lse=True)
    (loss.sum() + lse.sum()).backward()
    if TRITON_PATH:
        assert calls == {"fwd_kernel": 1, "bwd_kernel": 1, "reference": 0}
    else:
        assert calls == {"fwd_kernel": 0, "bwd_kernel": 0, "reference": 1}
    fuselm.cross_entropy(x.double(), t)
    assert calls["reference"] == (1 if TRITON_PATH else 2)


def test_poisoned_allocations():
    """The conftest fixture is active: fresh allocations hold NaN / a sentinel."""
    assert torch.isnan(torch.empty(5, device=DEVICE)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(3, dtype=torch.bfloat16))).all()
    assert torch.isnan(torch.zeros(2).new_empty(4)).all()
    assert (torch.empty(3, dtype=torch.int64) == torch.iinfo(torch.int64).max).all()
    with torch.device("meta"):  # the device context still reaches modules built under it
        assert torch.nn.Embedding(4, 2).weight.device.type == "meta"
        assert torch.empty_strided((2,), (1,)).device.type == "meta"


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(weight=1, ignore_index=7, reduction="sum"),
        dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=5.0, return_lse=True),
    ],
    ids=["default", "weight+sum", "none+extras"],
)
def test_module_matches_functional(kw, gen):
    x, t, w = make_inputs(
        gen, (2, 3), 300, torch.bfloat16, weight=True, ignore_index=kw.get("ignore_index", -100)
    )
    kw = dict(kw)
    if "weight" in kw:
        kw["weight"] = w
    gos = grad_outputs(gen, output_shapes(t, kw), x.dtype)
    module = fuselm.nn.CrossEntropyLoss(**kw)
    out_m, g_m = fwd_bwd(lambda x, t: module(x, t), x, t, {}, gos)
    out_f, g_f = fwd_bwd(fuselm.cross_entropy, x, t, kw, gos)
    assert len(out_m) == len(out_f)
    for a, b in zip(out_m, out_f, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(g_m, g_f)


COMPILE_CASES = {
    "mean": dict(label_smoothing=0.1, z_loss=1e-2),
    "none+lse": dict(reduction="none", return_lse=True, softcap=4.0),
    "mean+inplace": dict(label_smoothing=0.1, inplace_backward=True),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=["fp32", "bf16"]
)
def test_torch_compile_fullgraph(case, backend, dtype, gen):
    """fp32 too on the GPU: a loss returned as an alias of the graph's own scalar once made every
    gradient zero there (a same-dtype .to in the autograd.Function, torch 2.11)."""
    torch._dynamo.reset()
    kw = dict(COMPILE_CASES[case])
    inplace = kw.pop("inplace_backward", False)
    x, t, _ = make_inputs(gen, (2, 3), 601, dtype)

    def loss_fn(x, t):
        # inplace: the logits are an activation of the compiled graph, not its input
        logits = x * 1.0 if inplace else x
        return fuselm.cross_entropy(logits, t, inplace_backward=inplace, **kw)

    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    check_case(f"compiled {case}", x, t, kw, gen, fn=lambda x, t, **_: compiled(x, t))
    # a second call with new data reuses the graph and is still right
    x2, t2, _ = make_inputs(gen, (2, 3), 601, dtype)
    check_case(f"compiled {case} (2nd call)", x2, t2, kw, gen, fn=lambda x, t, **_: compiled(x, t))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(reduction="none", return_lse=True, label_smoothing=0.1, z_loss=1e-2)],
    ids=["mean", "none+lse"],
)
def test_cuda_graph_capture_and_replay(kw, gen):
    """Forward + backward captured once and replayed on new data: no host syncs on the hot path."""
    dtype, lead, n_cols = torch.bfloat16, (300,), 50257
    x0, t0, _ = make_inputs(gen, lead, n_cols, dtype)
    x_static = x0.clone().requires_grad_()
    t_static = t0.clone()
    gos = [g.to("cuda") for g in grad_outputs(gen, output_shapes(t0, kw), dtype)]

    def step():
        outs = fuselm.cross_entropy(x_static, t_static, **kw)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)])
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile the kernels, warm the allocator
            x_static.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    x_static.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outs = step()
    static_grad = x_static.grad

    for _ in range(2):
        x_new, t_new, _ = make_inputs(gen, lead, n_cols, dtype)
        with torch.no_grad():
            x_static.copy_(x_new)
        t_static.copy_(t_new)
        graph.replay()
        torch.cuda.synchronize()
        expected, g_expected = fwd_bwd(fuselm.cross_entropy, x_new, t_new, kw, gos)
        for o, e in zip(static_outs, expected, strict=True):
            assert torch.equal(o.detach(), e)
        assert torch.equal(static_grad, g_expected)
        _, g_ref = fwd_bwd(reference64, x_new, t_new, kw, gos)
        _, g_eager = fwd_bwd(eager_cross_entropy, x_new, t_new, kw, gos)
        assert_numerics("graph replay grad", static_grad, g_eager, g_ref, dtype)


@pytest.mark.gpu
@pytest.mark.slow
def test_rows_times_vocab_over_2_31():
    """N * V > 2^31 elements: every offset needs int64 (docs/design.md section 3). bf16, ~4.4 GB of logits."""
    n_rows, n_cols, dtype = 17000, 128256, torch.bfloat16
    assert n_rows * n_cols > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:  # peak ~16 GiB
        pytest.skip(f"needs ~20 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(2**31)
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype, generator=gen).mul_(3)
    t = torch.randint(0, n_cols, (n_rows,), device="cuda", generator=gen)
    t[::7] = -100
    # rows around the first one past 2^31 elements, and the very last element of the buffer
    first_big = 2**31 // n_cols
    rows = torch.tensor(
        [0, 1, first_big - 1, first_big, first_big + 1, n_rows - 2, n_rows - 1], device="cuda"
    )
    t[n_rows - 1] = n_cols - 1
    t[first_big] = -100
    valid = t != -100
    count = valid.sum().double()

    def chunked(fn, chunk=1024):
        return torch.cat([fn(x[i : i + chunk], t[i : i + chunk]) for i in range(0, n_rows, chunk)])

    ref_rows = chunked(lambda xc, tc: cross_entropy_reference(xc.double(), tc, reduction="none"))
    eager_rows = chunked(lambda xc, tc: F.cross_entropy(xc, tc, reduction="none"))

    # forward kernel, no gradient: every row's loss
    ours_rows = fuselm.cross_entropy(x, t, reduction="none")
    assert_numerics("loss per row", ours_rows, eager_rows, ref_rows, dtype)
    del ours_rows, eager_rows

    def grad_rows_reference(scale):  # [len(rows), V] in float64
        xs = x[rows].double()
        g = torch.softmax(xs, dim=-1)
        ts = t[rows]
        g[torch.arange(len(rows), device="cuda"), ts.clamp(min=0)] -= 1
        g = g * scale[:, None]
        return torch.where(valid[rows][:, None], g, torch.zeros_like(g))

    # gradient in the forward (mean)
    xr = x.detach().requires_grad_()
    loss = fuselm.cross_entropy(xr, t)
    loss.backward()
    g_ours = xr.grad[rows].clone()
    xr.grad = None
    xe = x.detach().requires_grad_()
    loss_eager = F.cross_entropy(xe, t)
    loss_eager.backward()
    g_eager = xe.grad[rows].clone()
    xe.grad = None
    assert_numerics("mean loss", loss.detach(), loss_eager.detach(), ref_rows.sum() / count, dtype)
    assert_numerics(
        "mean grad rows", g_ours, g_eager, grad_rows_reference((1 / count).expand(len(rows))), dtype
    )
    del loss, loss_eager

    # gradient in the backward (reduction none, per-token upstream gradient)
    go = torch.randn(n_rows, device="cuda", generator=gen).to(dtype)
    fuselm.cross_entropy(xr, t, reduction="none").backward(go)
    g_ours = xr.grad[rows].clone()
    xr.grad = None
    F.cross_entropy(xe, t, reduction="none").backward(go)
    g_eager = xe.grad[rows].clone()
    xe.grad = None
    assert_numerics("none grad rows", g_ours, g_eager, grad_rows_reference(go[rows].double()), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [32000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_gpu_gradient_in_place_keeps_every_row_loss(dtype, v):
    """Regression (H200, fp32, rows longer than one block): the per-row loss read the target logit after
    other warps had started writing the gradient over the row in place, and lost it on some rows. Every
    row's loss must be the same whether the gradient goes in place, elsewhere, or nowhere."""
    n = 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    ref = F.cross_entropy(logits.double(), target, reduction="none")
    eager = F.cross_entropy(logits, target, reduction="none")
    scale = torch.full((1,), 1.0 / n, device="cuda")
    for where in ("nowhere", "elsewhere", "in place"):
        buf = logits.clone()
        grad = {"nowhere": None, "elsewhere": torch.empty_like(buf), "in place": buf}[where]
        loss, _ = loss_rows.rows_fwd_into(buf, target, LossOptions(), LossScales(None, scale), grad)
        assert_numerics(f"per-row loss, gradient {where}", loss, eager, ref, dtype)  # one lost row: ~1e-2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_dtype(reduction):
    """loss_dtype=float32 returns the fp32 accumulation unrounded; the default rounds it to the input's
    dtype; the gradient is the same either way."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(37, 1000, generator=g) * 3).to(device=DEVICE, dtype=torch.float16)
    target = torch.randint(0, 1000, (37,), generator=g).to(DEVICE)
    outs = {}
    for loss_dtype in (None, torch.float32):
        x = logits.detach().clone().requires_grad_()
        loss = fuselm.cross_entropy(x, target, reduction=reduction, loss_dtype=loss_dtype)
        loss.backward(torch.ones_like(loss))
        outs[loss_dtype] = (loss, x.grad)
    (l16, g16), (l32, g32) = outs[None], outs[torch.float32]
    assert l16.dtype == torch.float16 and l32.dtype == torch.float32
    torch.testing.assert_close(l16, l32.to(torch.float16), rtol=0, atol=0)
    torch.testing.assert_close(g16, g32, rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss_dtype"):
        fuselm.cross_entropy(logits, target, loss_dtype="float32")


# ---- the z-loss value (return_z_loss) and the z-loss under a weighted mean ----


def _z_loss_by_hand(x64, t, w64, z_loss, reduction, ignore_index=-100):
    """float64, written from the definition: the z-loss term zl * lse**2 of each non-ignored token, reduced
    as the loss ("mean": divided by the sum of the targets' class weights, like every term of the loss)."""
    lse = torch.logsumexp(x64.reshape(-1, x64.shape[-1]), dim=-1)
    tt = t.reshape(-1)
    valid = tt != ignore_index
    rows = torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return rows.reshape(t.shape)
    if reduction == "sum":
        return rows.sum()
    w_t = w64[torch.where(valid, tt, 0)] if w64 is not None else torch.ones_like(lse)
    return rows.sum() / torch.where(valid, w_t, torch.zeros_like(w_t)).sum()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_return_z_loss(gen, dtype, reduction):
    """return_z_loss gives the z-loss part of the loss, reduced as the loss, detached, after lse; the loss
    and the gradient are those of the same call without it (with return_lse the gradient is computed in
    the backward, without it in the forward: each is compared with the call of its own plan)."""
    x, t, w = make_inputs(gen, LEAD, VOCABS[0], dtype, weight=True)
    kw = dict(weight=w, z_loss=1e-2, label_smoothing=0.1, reduction=reduction)
    expected = _z_loss_by_hand(x.double(), t, w.double(), 1e-2, reduction)
    eager = _z_loss_by_hand(x, t, w, 1e-2, reduction)
    (g,) = grad_outputs(gen, [tuple(t.shape) if reduction == "none" else ()], dtype)
    for extra in (dict(return_lse=True), {}):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss, *rest, z = fuselm.cross_entropy(xa, t, return_z_loss=True, **extra, **kw)
        plain = fuselm.cross_entropy(xb, t, **extra, **kw)
        plain_loss, *plain_rest = plain if isinstance(plain, tuple) else (plain,)
        assert not z.requires_grad and z.dtype == loss.dtype and z.shape == loss.shape
        assert_numerics("z_loss", z, eager, expected, dtype)
        assert torch.equal(loss.detach(), plain_loss.detach())
        assert all(torch.equal(a, b) for a, b in zip(rest, plain_rest, strict=True))
        loss.backward(g.to(loss.dtype))
        plain_loss.backward(g.to(plain_loss.dtype))
        assert torch.equal(xa.grad, xb.grad)


def test_z_loss_with_class_weights_divides_by_the_weight_sum(gen):
    """The documented choice (README): with class weights and reduction="mean" the z-loss term is divided
    by the sum of the targets' weights, like the rest of the loss (not by the token count): checked against
    the loss written by hand in float64."""
    x, t, w = make_inputs(gen, (4, 9), 50, torch.float64, weight=True)
    w = w * 3.0  # weights far from 1: the two definitions differ by their mean
    zl = 0.05
    loss = fuselm.cross_entropy(x, t, weight=w, z_loss=zl)
    tt = t.reshape(-1)
    valid = tt != -100
    x2 = x.reshape(-1, 50)
    lse = torch.logsumexp(x2, -1)
    t_safe = torch.where(valid, tt, 0)
    w_t = torch.where(valid, w[t_safe], torch.zeros_like(lse))
    ce = lse - x2.gather(1, t_safe[:, None])[:, 0]
    by_hand = (w_t * ce + torch.where(valid, zl * lse * lse, torch.zeros_like(lse))).sum() / w_t.sum()
    per_token_count = (w_t * ce).sum() / w_t.sum() + (zl * lse * lse)[valid].mean()
    assert torch.allclose(loss, by_hand, rtol=1e-12, atol=0)
    assert not torch.allclose(loss, per_token_count, rtol=1e-6, atol=0)


def test_module_return_z_loss(gen):
    x, t, w = make_inputs(gen, (2, 3), 300, torch.float32, weight=True)
    module = fuselm.nn.CrossEntropyLoss(w, z_loss=1e-2, return_z_loss=True)
    ours = module(x, t)
    functional = fuselm.cross_entropy(x, t, weight=w, z_loss=1e-2, return_z_loss=True)
    assert len(ours) == 2 and all(torch.equal(a, b) for a, b in zip(ours, functional, strict=True))


# ---- per-token loss weights ----

TOKEN_WEIGHT_CASES = {
    "mean": dict(),
    "sum+all": dict(reduction="sum", weight=True, label_smoothing=0.2, z_loss=0.02, softcap=4.0),
    "none+lse": dict(reduction="none", return_lse=True, label_smoothing=0.1),
    "mean+inplace": dict(z_loss=0.01, inplace_backward=True),
}


@pytest.mark.parametrize("case", list(TOKEN_WEIGHT_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_token_weights(gen, case, dtype):
    """token_weights multiply each token's loss and gradient (both plans: gradient in the forward, and
    recompute); "mean" keeps its denominator. Weights in [0, 2), one exactly 0."""
    kw = dict(TOKEN_WEIGHT_CASES[case])
    want_weight = kw.pop("weight", False)
    x, t, w = make_inputs(gen, LEAD, VOCABS[0], dtype, weight=want_weight)
    tw = torch.rand(t.shape, generator=gen).to(DEVICE) * 2
    tw.reshape(-1)[1] = 0.0
    check_case(case, x, t, dict(kw, weight=w, token_weights=tw), gen)


def test_token_weights_of_ones_change_nothing(gen):
    x, t, _ = make_inputs(gen, LEAD, VOCABS[0], torch.float32)
    ones = torch.ones(t.shape, device=DEVICE)
    for reduction in ("mean", "none"):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a = fuselm.cross_entropy(xa, t, reduction=reduction, token_weights=ones)
        b = fuselm.cross_entropy(xb, t, reduction=reduction)
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
        assert torch.equal(xa.grad, xb.grad)


def test_token_weights_bad_input(gen):
    x, t, _ = make_inputs(gen, (2, 3), 50, torch.float32)
    for bad, message in (
        (torch.ones(6, device=DEVICE), "token_weights must have the shape of target"),
        (torch.ones(2, 3, device=DEVICE, dtype=torch.int64), "token_weights must have dtype"),
        (torch.ones(2, 3, device=DEVICE, requires_grad=True), "token_weights must not require grad"),
        ([1.0] * 6, "token_weights must be a torch.Tensor"),
    ):
        with pytest.raises(ValueError, match=message):
            fuselm.cross_entropy(x, t, token_weights=bad)


def test_dft_token_scaling_recipe(gen):
    """The documented DFT recipe: token_weights = the target's probability computed without a graph
    (exp of minus the per-token loss) gives mean_i(p_i.detach() * CE_i), checked in float64 by hand."""
    x, t, _ = make_inputs(gen, (4, 7), 60, torch.float64)
    with torch.no_grad():
        p_target = torch.exp(-fuselm.cross_entropy(x, t, reduction="none"))
    xr = x.clone().requires_grad_()
    loss = fuselm.cross_entropy(xr, t, token_weights=p_target)
    x2 = x.reshape(-1, 60).clone().requires_grad_()
    tt = t.reshape(-1)
    valid = tt != -100
    ce = F.cross_entropy(x2, tt, reduction="none")
    by_hand = (torch.exp(-ce).detach() * ce)[valid].sum() / valid.sum()
    assert torch.allclose(loss, by_hand, rtol=1e-12, atol=0)
    loss.backward()
    by_hand.backward()
    assert torch.allclose(xr.grad.reshape(-1, 60), x2.grad, rtol=1e-10, atol=1e-14)


# ---- token accuracy and predicted tokens ----


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n_cols", [VOCABS[0], VOCABS[1]])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_token_accuracy_and_predicted_tokens(gen, dtype, n_cols, reduction):
    """The argmax the kernel finds in its pass over the row (one block or a loop over blocks): the first
    maximal class as torch.argmax (ties planted), -1 on ignored tokens; the accuracy reduced as the loss
    without weights; the loss and gradient unchanged by asking."""
    x, t, w = make_inputs(gen, LEAD, n_cols, dtype, weight=True)
    x.view(-1, n_cols)[0, 5] = x.view(-1, n_cols)[0, 2] = x.abs().max() + 1  # a tie: class 2 wins
    kw = dict(weight=w, label_smoothing=0.1, reduction=reduction, softcap=30.0)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, accuracy, predicted = fuselm.cross_entropy(
        xa, t, return_token_accuracy=True, return_predicted_tokens=True, **kw
    )
    plain = fuselm.cross_entropy(xb, t, **kw)
    assert torch.equal(loss.detach(), plain.detach())
    loss.sum().backward()
    plain.sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    valid = t != -100
    expected = torch.where(valid, x.argmax(dim=-1), -1)
    assert predicted.dtype == torch.int64 and torch.equal(predicted, expected)
    assert expected.view(-1)[0] in (2, -1)
    right = ((expected == t) & valid).float()
    by_hand = {"mean": right.sum() / valid.sum(), "sum": right.sum(), "none": right}[reduction]
    assert accuracy.dtype == torch.float32 and torch.equal(accuracy, by_hand)
    only = fuselm.cross_entropy(x, t, return_token_accuracy=True, **kw)
    assert len(only) == 2 and torch.equal(only[1], accuracy)


# ---- the batch's scales and the loss reduction, one launch each ----

SCALE_CASES = {
    "mean": dict(reduction="mean"),
    "sum": dict(reduction="sum"),
    "mean+weight": dict(reduction="mean", weight=True),
    "mean+weight+smoothing": dict(reduction="mean", weight=True, label_smoothing=0.1),
    "sum+weight+smoothing": dict(reduction="sum", weight=True, label_smoothing=0.1),
    "all ignored": dict(reduction="mean", all_ignored=True),
    "out of range": dict(reduction="mean", weight=True, out_of_range=True),
}


def _scale_case(case: str, n: int, n_cols: int, ignore_every: int, gen):
    """(targets [n] on the kernel device, every `ignore_every`-th ignored, class weights or None, the
    case's remaining cross_entropy keywords) of SCALE_CASES[case]."""
    kw = dict(SCALE_CASES[case])
    t = torch.randint(0, n_cols, (n,), generator=gen)
    t[::ignore_every] = -100
    if kw.pop("all_ignored", False):
        t[:] = -100
    if kw.pop("out_of_range", False):
        t[5], t[9] = n_cols, -3
    weight = torch.rand(n_cols, generator=gen) + 0.5 if kw.pop("weight", False) else None
    return t.to(DEVICE), weight.to(DEVICE) if weight is not None else None, kw


@triton_path_only
@pytest.mark.parametrize("case", list(SCALE_CASES))
def test_one_launch_scales_and_reduction_match_the_torch_ops(case, gen):
    """batch_scales / reduced_loss (one Triton launch each on the eager path) give loss_scales /
    reduce_rows' values: over more rows and classes than one block (the kernels loop), ignored and
    out-of-range targets, class weights; the reduction in the loss dtype."""
    n, n_cols = 2500, 3001
    t, weight, kw = _scale_case(case, n, n_cols, 7, gen)
    opts = LossOptions.of(weight=weight, **kw)
    ours = loss_rows.batch_scales(t, opts, n_cols)
    eager = loss_scales(t, opts, n_cols)
    exact = loss_scales(t, opts._replace(weight=weight.double() if weight is not None else None), n_cols)
    assert (ours.weight_sum is None) == (eager.weight_sum is None)
    pairs = [("grad_scale", ours.grad_scale, eager.grad_scale, exact.grad_scale)]
    if ours.weight_sum is not None:
        pairs.append(("weight_sum", ours.weight_sum, eager.weight_sum, exact.weight_sum))
    for name, o, e, r in pairs:
        assert o.shape == (1,) and o.dtype == torch.float32
        if case == "all ignored":  # 1 / 0, as torch
            assert torch.isinf(o).all() and torch.isinf(e).all()
        else:
            assert_numerics(f"{case} {name}", o, e, r.double(), torch.float32)
    rows = torch.rand(n, generator=gen).to(DEVICE) * 5
    for dtype in (torch.float32, torch.bfloat16):
        got = loss_rows.reduced_loss(rows, opts, ours, dtype)
        want = reduce_rows(rows, opts, eager).to(dtype)
        ref = reduce_rows(rows.double(), opts, LossScales(None, exact.grad_scale.double()))
        assert got.shape == () and got.dtype == dtype
        if case == "all ignored":
            assert torch.isinf(got) and torch.isinf(want)
        else:
            assert_numerics(f"{case} loss {dtype}", got, want, ref, dtype)


@triton_path_only
@pytest.mark.parametrize("case", list(SCALE_CASES))
@pytest.mark.parametrize("return_lse", [False, True])
def test_scales_found_by_the_forward_kernel_equal_the_separate_launch(case, return_lse, gen, monkeypatch):
    """For a batch small enough (rows.FIND_SCALES_MAX_LOADS) the forward kernel finds the batch's scales
    itself, one launch less: the same loss, lse and gradient bit for bit as with the scales' own launch,
    both plans (gradient in the forward; saved lse), ignored, all-ignored and out-of-range targets."""
    n, n_cols = (300, 3001) if ON_GPU else (12, 601)
    t, weight, kw = _scale_case(case, n, n_cols, 5, gen)
    logits = (torch.randn(n, n_cols, generator=gen) * 3).to(DEVICE)

    def run(max_loads):
        counts: dict[str, int] = {}
        monkeypatch.setattr(loss_rows, "FIND_SCALES_MAX_LOADS", max_loads)
        monkeypatch.setattr(
            loss_rows, "loss_scales_launch", counting(counts, "scales", loss_rows.loss_scales_launch)
        )
        z = logits.clone().requires_grad_()
        out = fuselm.cross_entropy(z, t, weight=weight, return_lse=return_lse, **kw)
        loss, lse = out if return_lse else (out, None)
        loss.backward()
        monkeypatch.undo()
        return counts.get("scales", 0), [loss.detach(), z.grad] + ([lse.detach()] if return_lse else [])

    found_launches, found = run(1 << 20)
    separate_launches, separate = run(0)
    assert (found_launches, separate_launches) == (0, 1)
    for a, b in zip(found, separate, strict=True):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), case
