"""fuselm.rms_norm: numerics (docs/design.md section 5), casting modes, residual, shapes, contracts, compile.

Every numeric check goes through assert_numerics: err(fuselm) <= 2 * err(eager) + atol[dtype],
errors measured against rms_norm_reference run on float64 copies of the inputs. "eager" is the
Hugging Face code in the input dtype (LlamaRMSNorm / GemmaRMSNorm written out, the residual add in
the input dtype before it), with weights in the input dtype as in a bf16 model.

Sizes: on CUDA the real ones; on the CPU the Triton interpreter is numpy, so rows stay few and
rows stay short (the interpreter caps blocks at 256 columns, so H > 256 walks the looped path).
"""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import pytest
import torch
from conftest import TRITON_PATH, kernel_device
from kit.spies import counting

import fuselm
from fuselm.ops._common import launch, normalization
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.rms_norm import op as rms_op
from fuselm.ops.rms_norm import rms_norm, rms_norm_reference

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

LEAD = (3, 111) if ON_GPU else (2, 3)
HIDDEN = (4096, 20000) if ON_GPU else (128, 600)  # one block / looped
MODES = {  # (casting, offset)
    "llama": ("llama", 0.0),
    "llama+offset": ("llama", 0.5),
    "gemma": ("gemma", 1.0),
    "none": ("none", 0.0),
}

triton_path_only = pytest.mark.skipif(
    not TRITON_PATH, reason="Triton kernels not exercised (no CUDA, TRITON_INTERPRET unset)"
)


def make_inputs(gen, lead, hidden, dtype, *, residual=False, weight_dtype=None, offset=0.0, device=DEVICE):
    """x ~ N(0.3, 1.5^2), residual ~ N(0, 1), weight around 1 - offset + U[-0.5, 0.5)."""
    x = (torch.randn(*lead, hidden, generator=gen) * 1.5 + 0.3).to(dtype)
    r = torch.randn(*lead, hidden, generator=gen).to(dtype) if residual else None
    w = (1.0 - offset + torch.rand(hidden, generator=gen) - 0.5).to(weight_dtype or dtype)
    return x.to(device), (r.to(device) if r is not None else None), w.to(device)


# ---- eager (HF as written) and the oracle ----


def eager_rms_norm(x, weight, eps=1e-6, *, offset=0.0, residual=None, casting="llama"):
    """Hugging Face's code in the input dtype: the residual add, then LlamaRMSNorm / GemmaRMSNorm."""
    if residual is not None:
        x = residual + x
    summed = x
    input_dtype = x.dtype
    if casting == "llama":  # LlamaRMSNorm.forward
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        y = h.to(input_dtype)
        if weight is not None:
            y = (weight + offset if offset else weight) * y
    elif casting == "gemma":  # GemmaRMSNorm.forward
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            h = h * (offset + weight.float())
        y = h.type_as(x)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * (weight.to(input_dtype) + offset)
    return (y, summed) if residual is not None else y


def reference64(x, weight, eps=1e-6, *, offset=0.0, residual=None, casting="llama"):
    return rms_norm_reference(
        x.double(),
        weight.double() if weight is not None else None,
        eps,
        offset=offset,
        residual=residual.double() if residual is not None else None,
        casting=casting,
    )


def fwd_bwd(fn, x, weight, residual, kw, gos, leaf_dtype=None):
    """Outputs (a tuple) and the gradients of sum_i <out_i, go_i> w.r.t. (x, weight[, residual]),
    on fresh leaves (cast to leaf_dtype if given: float64 for the oracle, so that its gradients are
    not rounded back to the input dtype)."""
    leaf = lambda t: t.detach().to(leaf_dtype or t.dtype, copy=True).requires_grad_()  # noqa: E731
    leaves = [leaf(x)]
    w = leaf(weight) if weight is not None else None
    if w is not None:
        leaves.append(w)
    r = None
    if residual is not None:
        r = leaf(residual)
        leaves.append(r)
    outs = fn(leaves[0], w, residual=r, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for g, o in zip(gos, outs, strict=True)])
    return tuple(o.detach() for o in outs), grads


def check_case(name, x, weight, residual, kw, gen, *, fn=rms_norm, eager_weight_dtype=None):
    """The numerics rule for y, the residual sum, dx, dweight and dresidual; dtypes and shapes."""
    gos = [torch.randn(x.shape, generator=gen).to(x.device) for _ in range(1 + (residual is not None))]
    ours, g_ours = fwd_bwd(fn, x, weight, residual, kw, gos)
    w_eager = weight.to(eager_weight_dtype) if eager_weight_dtype and weight is not None else weight
    eager, g_eager = fwd_bwd(eager_rms_norm, x, w_eager, residual, kw, gos)
    ref, g_ref = fwd_bwd(reference64, x, weight, residual, kw, gos, torch.float64)
    dtype = x.dtype
    assert len(ours) == len(ref) == 1 + (residual is not None)
    for what, o, e, r in zip(("y", "sum"), ours, eager, ref, strict=False):
        assert o.shape == x.shape and o.device == x.device, f"{name} {what}: {tuple(o.shape)}"
        assert_numerics(f"{name} {what}", o, e, r, dtype)
    if len(ours) == 2:
        assert ours[1].dtype == dtype
    names = (
        ["dx"] + (["dweight"] if weight is not None else []) + (["dresidual"] if residual is not None else [])
    )
    for what, o, e, r in zip(names, g_ours, g_eager, g_ref, strict=True):
        assert_numerics(f"{name} {what}", o, e, r, dtype)
    assert g_ours[0].dtype == dtype
    if weight is not None:
        assert g_ours[1].dtype == weight.dtype and g_ours[1].shape == weight.shape
    return ours, g_ours


# ---- the feature matrix ----


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("hidden", HIDDEN, ids=lambda h: f"H{h}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, hidden, mode, residual, gen):
    casting, offset = MODES[mode]
    x, r, w = make_inputs(gen, LEAD, hidden, dtype, residual=residual, offset=offset)
    ours, _ = check_case(mode, x, w, r, dict(casting=casting, offset=offset), gen)
    assert ours[0].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_reference_is_the_eager_code(dtype, gen):
    """The CPU fallback (the reference in the input dtype) is HF's code bit for bit."""
    for casting, offset in MODES.values():
        for residual in (False, True):
            x, r, w = make_inputs(gen, (3,), 40, dtype, residual=residual, offset=offset)
            kw = dict(casting=casting, offset=offset, residual=r)
            a, b = rms_norm_reference(x, w, **kw), eager_rms_norm(x, w, **kw)
            for u, v in zip(a if residual else (a,), b if residual else (b,), strict=True):
                assert u.dtype == v.dtype and torch.equal(u, v)


# ---- shapes and strides ----

ODD_HIDDEN = (1, 63, 781, 3000)
ODD_ROWS = (1, 7, 513)


def _odd_cases():
    for h in ODD_HIDDEN:
        for n in ODD_ROWS:
            # the interpreter walks long rows block by block in Python: keep 513 rows to the short ones
            if not ON_GPU and TRITON_PATH and n * h > 40000:
                continue
            yield n, h


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,hidden", list(_odd_cases()), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_odd_shapes(dtype, rows, hidden, residual, gen):
    x, r, w = make_inputs(gen, (rows,), hidden, dtype, residual=residual)
    check_case(f"{rows}x{hidden}", x, w, r, dict(casting="llama"), gen)


@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (2, 1, 3)], ids=["H", "NH", "BTH", "B1TH"])
def test_leading_shapes(lead, gen):
    x, r, w = make_inputs(gen, lead, 96, torch.bfloat16, residual=True)
    ours, _ = check_case(f"{lead}", x, w, r, dict(), gen)
    assert ours[0].shape == x.shape and ours[1].shape == x.shape


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_row_strided_input(residual, gen):
    """x = big[..., :H] (rows strided, columns contiguous): read in place, not copied."""
    hidden = 300
    big, rbig, w = make_inputs(gen, (2, 4), hidden + 37, torch.bfloat16, residual=True)
    x, w = big[..., :hidden], w[:hidden]
    r = rbig[..., 5 : 5 + hidden] if residual else None
    assert not x.is_contiguous() and x.stride(-1) == 1
    check_case("strided", x, w, r, dict(), gen)
    if TRITON_PATH:  # rows_view keeps the strides: the kernel sees big's buffer
        assert fuselm.ops._common.guard.rows_view(x).data_ptr() == x.data_ptr()


def test_column_strided_input_is_copied(gen):
    x, _, w = make_inputs(gen, (64,), 8, torch.float32)
    xt = x.t()  # [8, 64], stride(-1) != 1
    check_case("transposed", xt, torch.rand(64, generator=gen).to(DEVICE) + 0.5, None, dict(), gen)


# ---- casting modes, offset, weight dtypes, no weight ----


@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_fp32_weight(dtype, casting, gen):
    """An fp32 weight with half-precision x (autocast training): "llama" returns fp32 like HF's
    `weight * h.to(input_dtype)`; "gemma" and "none" return x's dtype."""
    x, r, w = make_inputs(gen, LEAD, 200, dtype, residual=True, weight_dtype=torch.float32)
    (y, s), _ = check_case(casting, x, w, r, dict(casting=casting), gen)
    assert y.dtype == (torch.float32 if casting == "llama" else dtype)
    assert s.dtype == dtype


# Where bit-exactness cannot be checked on the CPU: the interpreter converts fp32 to bf16 by truncation
# (the GPU rounds to nearest even), and PyTorch's CPU rsqrt of a half tensor rounds twice (its CUDA
# kernel rounds the fp32 result once, as the kernels do).
INTERPRETER = TRITON_PATH and not ON_GPU


def exact_here(dtype: torch.dtype, casting: str) -> bool:
    """Bit-exactness is promised for Hugging Face's casting modes ("llama", "gemma"); "none" (every
    step in the input dtype) is held to the numerics rule like every other op."""
    if casting == "none" and dtype != torch.float32:
        return False
    if not INTERPRETER or dtype == torch.float32:
        return True
    return dtype == torch.float16


def exact_inputs(gen, rows, hidden, dtype):
    """x = +-k/8 with k in [1, 16]: with a power-of-two H the fp32 sum of squares is exact in any order."""
    sign = torch.randint(0, 2, (rows, hidden), generator=gen) * 2 - 1
    return ((torch.randint(1, 17, (rows, hidden), generator=gen) * sign).float() / 8).to(dtype).to(DEVICE)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_bit_exact_with_eager_on_exact_inputs(dtype, casting, offset, gen):
    """Where the fp32 statistics are exact, every rounding is the one the eager code makes: bit-equal
    (the test against transformers' own modules is below)."""
    x = exact_inputs(gen, 4 * LEAD[0], 256, dtype)
    w = (torch.rand(256, generator=gen) + 0.5 - offset).to(dtype).to(DEVICE)
    r = exact_inputs(gen, 4 * LEAD[0], 256, dtype)
    y, s = rms_norm(x, w, offset=offset, casting=casting, residual=r)
    y_e, s_e = eager_rms_norm(x, w, offset=offset, casting=casting, residual=r)
    assert torch.equal(s, s_e)
    if exact_here(dtype, casting):
        assert y.dtype == y_e.dtype and torch.equal(y, y_e)
    else:
        assert_numerics(casting, y, y_e, reference64(x, w, offset=offset, casting=casting, residual=r)[0])


def test_no_weight(gen):
    x, r, w = make_inputs(gen, LEAD, 200, torch.bfloat16, residual=True)
    check_case("no weight", x, None, r, dict(), gen)
    with pytest.raises(ValueError, match="offset"):
        rms_norm(x, None, offset=1.0)


def test_weight_not_requiring_grad(gen):
    x, _, w = make_inputs(gen, LEAD, 200, torch.bfloat16)
    xr = x.clone().requires_grad_()
    y = rms_norm(xr, w)
    (gx,) = torch.autograd.grad(y, xr, torch.ones_like(y))
    _, (g_full, _) = fwd_bwd(rms_norm, x, w, None, {}, [torch.ones_like(y)])
    assert torch.equal(gx, g_full)


@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("hidden", [200, 600], ids=["one_block", "looped"])
def test_persistent_grids(hidden, prefetch, monkeypatch, gen):
    """Few programs walking many row blocks (the GPU's persistent grids, forced small here so that the
    interpreter runs them too): the loops, the prefetch of the next row and the dweight partials of
    several rows per program."""
    monkeypatch.setattr(rms_op, "FWD_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(normalization, "persistent_grid", lambda n, device, per_sm: min(n, 3))
    monkeypatch.setattr(rms_op, "resident_programs", lambda kernel, kw, n, *a, **k: min(n, 3))
    monkeypatch.setattr(rms_op, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(rms_op, "BWD_TILE", 256)  # one row per program iteration: the prefetch path
    x, r, w = make_inputs(gen, (11,), hidden, torch.bfloat16, residual=True)
    check_case("persistent", x, w, r, dict(casting="gemma", offset=1.0), gen)
    x, _, w = make_inputs(gen, (2, 5), hidden, torch.bfloat16)
    check_case("persistent", x, w, None, dict(), gen)


def test_resident_programs_from_registers(monkeypatch):
    """The backward's persistent grid is one wave: programs per SM from the compiled kernel's registers
    (allocated in multiples of 8 a thread), capped, with a fixed fallback when they cannot be read."""

    class Compiled:
        def __init__(self, n_regs):
            self.n_regs, self.metadata = n_regs, SimpleNamespace(shared=1024)

        def _init_handles(self):
            pass

    class Kernel:
        def __init__(self, n_regs):
            self.fn, self.n_regs = SimpleNamespace(__name__=f"k{n_regs}"), n_regs

        def warmup(self, grid, **kwargs):
            if self.n_regs is None:
                raise RuntimeError("no warmup in this Triton")
            return Compiled(self.n_regs)

    monkeypatch.setattr(launch, "_OCCUPANCY", {})
    monkeypatch.setattr(launch, "_sm_limits", lambda index: (132, 65536, 2048, 233472))
    monkeypatch.setattr(launch, "persistent_grid", lambda n, device, per_sm: min(n, 132 * per_sm))
    cuda = SimpleNamespace(type="cuda", index=0)
    caps = (rms_op.BWD_MAX_PROGRAMS_PER_SM, rms_op.BWD_FALLBACK_PROGRAMS_PER_SM)
    programs = lambda regs, warps, per_sm=0: rms_op.resident_programs(  # noqa: E731
        Kernel(regs), dict(num_warps=warps), 10**6, cuda, per_sm, *caps
    )
    assert programs(117, 8) == 2 * 132  # 120 x 256 threads: 2 per SM
    assert programs(41, 8) == 5 * 132  # 48 (not 41) x 256: 5 per SM
    assert programs(16, 4) == rms_op.BWD_MAX_PROGRAMS_PER_SM * 132
    assert programs(200, 16) == 132  # at least one
    assert programs(None, 8) == rms_op.BWD_FALLBACK_PROGRAMS_PER_SM * 132
    assert programs(117, 8, per_sm=3) == 3 * 132
    assert rms_op.resident_programs(Kernel(117), dict(num_warps=8), 10, cuda, 0) == 10


# ---- residual: which outputs carry gradient ----


def _grads_of_one_output(fn, x, w, r, used, go, leaf_dtype=None):
    """d <out, go> / d (x, residual, weight) where out is y or the sum; the other output gets no gradient
    (None reaches the backward)."""
    leaves = [t.detach().to(leaf_dtype or t.dtype, copy=True).requires_grad_() for t in (x, r, w)]
    y, s = fn(leaves[0], leaves[2], residual=leaves[1])
    out = y if used == "y" else s
    return torch.autograd.grad(out, leaves, go.to(out.dtype), allow_unused=True)


@pytest.mark.parametrize("used", ["y", "sum"])
def test_residual_one_output_used(used, gen):
    """Only y (the sum's gradient is None) or only the sum (y's gradient is None) reaches the loss."""
    x, r, w = make_inputs(gen, LEAD, 200, torch.bfloat16, residual=True)
    go = torch.randn(x.shape, generator=gen).to(DEVICE)
    ours = _grads_of_one_output(rms_norm, x, w, r, used, go)
    eager = _grads_of_one_output(eager_rms_norm, x, w, r, used, go)
    ref = _grads_of_one_output(reference64, x, w, r, used, go, torch.float64)
    for what, o, e, g in zip(("dx", "dresidual", "dweight"), ours, eager, ref, strict=True):
        if used == "sum" and what == "dweight":
            assert o is None or torch.equal(o, torch.zeros_like(o))
        else:
            assert_numerics(f"{used} only: {what}", o, e, g, x.dtype)


def test_residual_aliases_x(gen):
    """residual is x itself: the gradients of both uses add up."""
    x, _, w = make_inputs(gen, LEAD, 200, torch.bfloat16)
    go = [torch.randn(x.shape, generator=gen).to(DEVICE) for _ in range(2)]
    grads = []
    for fn, dt in ((rms_norm, None), (eager_rms_norm, None), (reference64, torch.float64)):
        xl = x.detach().to(dt or x.dtype, copy=True).requires_grad_()
        y, s = fn(xl, w, residual=xl)
        grads.append(torch.autograd.grad((y, s), xl, [g.to(y.dtype) for g in go])[0])
    assert_numerics("dx (x is also the residual)", *grads, x.dtype)


def test_second_backward_with_retained_graph(gen):
    """No in-place tricks: a second backward through a retained graph is right."""
    x, r, w = make_inputs(gen, LEAD, 200, torch.float32, residual=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, s = rms_norm(xr, wr, residual=r)
    loss = (y * y).sum() + s.sum()
    loss.backward(retain_graph=True)
    g1 = (xr.grad.clone(), wr.grad.clone())
    loss.backward()
    torch.testing.assert_close(xr.grad, 2 * g1[0])
    torch.testing.assert_close(wr.grad, 2 * g1[1])


def test_deterministic(gen):
    """No atomics: two runs give the same bits."""
    x, r, w = make_inputs(gen, (64,) if not ON_GPU else (4096,), 200, torch.bfloat16, residual=True)
    gos = [torch.randn(x.shape, generator=gen).to(DEVICE) for _ in range(2)]
    a = fwd_bwd(rms_norm, x, w, r, {}, gos)
    b = fwd_bwd(rms_norm, x, w, r, {}, gos)
    for u, v in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=DTYPE_IDS.get)
def test_zero_rows(dtype):
    x = torch.randn(0, 16, dtype=dtype, device=DEVICE, requires_grad=True)
    w = torch.ones(16, dtype=dtype, device=DEVICE, requires_grad=True)
    y, s = rms_norm(x, w, residual=torch.zeros_like(x))
    assert y.shape == (0, 16) and s.shape == (0, 16)
    (y.sum() + s.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_float64_runs_the_reference(gen):
    x, r, w = make_inputs(gen, (2, 3), 50, torch.float64, residual=True)
    check_case("fp64", x, w, r, dict(casting="gemma", offset=1.0), gen)


# ---- in_place: dx written over dy where that is right, a new dx where it is not ----


@pytest.fixture
def refusals(monkeypatch):
    """The reasons the backward gave for not writing over dy, one per backward (None: written over)."""
    seen = []

    def spy(*args):
        reason = real(*args)
        seen.append(reason)
        return reason

    real = rms_op.in_place_refusal
    monkeypatch.setattr(rms_op, "in_place_refusal", spy)
    return seen


def in_place_case(name, x, w, r, kw, gos, *, fn=rms_norm, engaged, create_graph=False):
    """The gradients with in_place=True for the gradients gos of (y[, sum]) (handed to autograd as they
    are: they may be written over), checked by the numerics rule against eager and the float64 reference
    run on copies of gos made before; on the Triton path dx is gos[0]'s memory exactly when `engaged`,
    and a dy that is not written over keeps its values. The leaves share the memory of x, w and r (a
    gradient may alias them)."""
    kept = [g.detach().clone() for g in gos]
    ptrs = [g.data_ptr() for g in gos]
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
    outs = fn(leaves[0], leaves[1], residual=leaves[2] if r is not None else None, in_place=True, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves, gos, create_graph=create_graph)
    _, g_eager = fwd_bwd(eager_rms_norm, x, w, r, kw, kept)
    _, g_ref = fwd_bwd(reference64, x, w, r, kw, kept, torch.float64)
    names = ("dx", "dweight", "dresidual")[: len(grads)]
    for what, o, e, g in zip(names, grads, g_eager, g_ref, strict=True):
        assert_numerics(f"{name} {what}", o, e, g, x.dtype)
    if TRITON_PATH:
        assert (grads[0].data_ptr() == ptrs[0]) == engaged, name
        if r is not None and engaged:
            assert grads[2].data_ptr() == grads[0].data_ptr()  # d residual is dx
    if not (TRITON_PATH and engaged):
        assert all(torch.equal(g, k) for g, k in zip(gos, kept, strict=True)), f"{name}: dy written over"
    return grads


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [1, 200, HIDDEN[1]], ids=["H1", "one_block", "looped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_in_place_engages(dtype, hidden, residual, gen, refusals):
    """A fresh contiguous gradient of x's dtype: dx is written over it (the returned gradient is dy's
    memory), in every kernel path (rows in one block, looped rows, H = 1), plain and residual."""
    x, r, w = make_inputs(gen, LEAD, hidden, dtype, residual=residual)
    gos = [torch.randn(x.shape, generator=gen).to(DEVICE, dtype) for _ in range(1 + residual)]
    in_place_case("in place", x, w, r, dict(), gos, engaged=True)
    assert refusals == ([None] if TRITON_PATH else [])


@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("hidden", [200, 600], ids=["one_block", "looped"])
def test_in_place_persistent_grids(hidden, prefetch, monkeypatch, gen, refusals):
    """Few programs walking many row blocks, one row per iteration (the prefetch of the next row): every
    row of dy is read before dx is written over it, the dweight partials come from dy as read."""
    monkeypatch.setattr(rms_op, "resident_programs", lambda kernel, kw, n, *a, **k: min(n, 3))
    monkeypatch.setattr(rms_op, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(rms_op, "BWD_TILE", 256)
    monkeypatch.setattr(rms_op, "MAX_FUSED_H", 256)  # 600 columns looped on the GPU too
    monkeypatch.setattr(rms_op, "LOOP_BLOCK_H", 256)
    for residual in (False, True):
        x, r, w = make_inputs(gen, (11,), hidden, torch.bfloat16, residual=residual)
        gos = [torch.randn(x.shape, generator=gen).to(DEVICE, x.dtype) for _ in range(1 + residual)]
        in_place_case("persistent", x, w, r, dict(casting="gemma", offset=1.0), gos, engaged=True)
    assert refusals == ([None, None] if TRITON_PATH else [])


@pytest.mark.parametrize("hidden", [200, 600], ids=["one_block", "looped"])
def test_in_place_same_bits_as_a_new_dx(hidden, gen, refusals):
    """A gradient made by autograd (a matmul's backward) in a small model: written over, and the
    gradients are the bits of in_place=False."""
    x, _, w = make_inputs(gen, (3, 5), hidden, torch.float16)
    m = (torch.randn(hidden, 7, generator=gen) / hidden**0.5).to(DEVICE, x.dtype)
    grads = []
    for in_place in (False, True):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = (rms_norm(xl * 2, wl, in_place=in_place) @ m).float().square().sum()
        grads.append(torch.autograd.grad(loss, (xl, wl)))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert refusals == ([None] if TRITON_PATH else [])


def test_in_place_residual_one_gradient_for_both_outputs(gen, refusals):
    """(y + sum) hands one gradient to both outputs: d sum is dy itself (same memory and strides), read
    before dx is written over it."""
    x, r, w = make_inputs(gen, LEAD, 200, torch.bfloat16, residual=True)
    g = torch.randn(x.shape, generator=gen).to(DEVICE, x.dtype)
    kept = g.clone()
    leaves = [t.clone().requires_grad_() for t in (x, w, r)]
    y, s = rms_norm(leaves[0], leaves[1], residual=leaves[2], in_place=True)
    grads = torch.autograd.grad(y + s, leaves, g)
    _, g_eager = fwd_bwd(eager_rms_norm, x, w, r, {}, [kept, kept])
    _, g_ref = fwd_bwd(reference64, x, w, r, {}, [kept, kept], torch.float64)
    order = (0, 1, 2)
    for what, i in zip(("dx", "dweight", "dresidual"), order, strict=True):
        assert_numerics(f"y + sum: {what}", grads[i], g_eager[i], g_ref[i], x.dtype)
    if TRITON_PATH:
        assert refusals == [None] and grads[0].data_ptr() == g.data_ptr()


def _fallback_cases(gen):
    """name: (x, weight, residual, kwargs, gradients of (y[, sum]), expected refusal) for the gradients
    that may not be written over (on the Triton path the backward says why)."""
    dtype = torch.bfloat16
    shape = (*LEAD, 200)
    x, r, w = make_inputs(gen, LEAD, 200, dtype, residual=True)
    fresh = lambda: torch.randn(shape, generator=gen).to(DEVICE, dtype)  # noqa: E731
    n = x.numel()
    cases = {}
    wide = torch.randn(*LEAD, 237, generator=gen).to(DEVICE, dtype)
    cases["row-strided dy"] = (x, w, None, {}, [wide[..., :200]], "not a contiguous")
    columns = torch.randn(200, *LEAD, generator=gen).to(DEVICE, dtype).permute(*range(1, len(shape)), 0)
    cases["column-strided dy"] = (x, w, None, {}, [columns], "not a contiguous")
    ones = torch.ones((), device=DEVICE, dtype=dtype)
    cases["expanded dy (y.sum())"] = (x, w, None, {}, [ones.expand(shape)], "not a contiguous")
    w32 = w.float()  # "llama" with an fp32 weight: y and dy are fp32, dx bf16
    cases["dy of another dtype"] = (x, w32, None, {}, [fresh().float()], "dy is torch.float32")
    cases["dy is x"] = (x, w, None, {}, [x], "saved x")
    buf = torch.randn(200 + n, generator=gen).to(DEVICE, dtype)
    cases["dy shares weight's memory"] = (x, buf[:200], None, {}, [buf[200:].view(shape)], "saved weight")
    cases["dy is residual"] = (x, w, r, {}, [r, fresh()], "an input")
    xbuf = torch.randn(2 * n, generator=gen).to(DEVICE, dtype)
    x_in = xbuf[:n].view(shape)  # the residual variant saves the sum, not x: x is checked as an input
    cases["dy shares x's memory (residual)"] = (x_in, w, r, {}, [xbuf[n:].view(shape), fresh()], "an input")
    sbuf = torch.randn(n + 200, generator=gen).to(DEVICE, dtype)
    shifted = [sbuf[:n].view(shape), sbuf[200:].view(shape)]  # d sum = dy one row on
    cases["d sum overlaps dy"] = (x, w, r, {}, shifted, "d sum overlaps")
    return cases


FALLBACKS = list(_fallback_cases(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("case", FALLBACKS)
def test_in_place_falls_back(case, gen, refusals):
    """Where writing dx over dy could give a wrong answer, a new dx (no error): dy keeps its values and
    the gradients follow the numerics rule."""
    x, w, r, kw, gos, reason = _fallback_cases(gen)[case]
    in_place_case(case, x, w, r, kw, gos, engaged=False)
    if TRITON_PATH:
        assert len(refusals) == 1 and refusals[0] is not None and reason in refusals[0], refusals


def test_in_place_sum_backward_falls_back(gen, refusals):
    """`y.sum().backward()`: the gradient reaching the norm is an expanded scalar (zero strides)."""
    x, _, w = make_inputs(gen, LEAD, 200, torch.float32)
    xl = x.clone().requires_grad_()
    rms_norm(xl, w, in_place=True).sum().backward()
    _, g_eager = fwd_bwd(eager_rms_norm, x, w, None, {}, [torch.ones_like(x)])
    _, g_ref = fwd_bwd(reference64, x, w, None, {}, [torch.ones_like(x)], torch.float64)
    assert_numerics("y.sum() dx", xl.grad, g_eager[0], g_ref[0], x.dtype)
    if TRITON_PATH:
        assert len(refusals) == 1 and "not a contiguous" in refusals[0]


def test_in_place_dy_requiring_grad_falls_back(gen, refusals):
    """A double backward (create_graph=True) with a gradient that requires grad: dy is part of a graph,
    not written over."""
    x, _, w = make_inputs(gen, LEAD, 200, torch.float32)
    g = torch.randn(x.shape, generator=gen).to(DEVICE).requires_grad_()
    in_place_case("dy requires grad", x, w, None, {}, [g], engaged=False, create_graph=True)
    if TRITON_PATH:
        assert len(refusals) == 1 and "requires grad" in refusals[0]


@triton_path_only
def test_in_place_bumps_the_version_of_dy(gen):
    """dx written over dy bumps dy's version: an op that saved dy raises at its backward instead of
    reading dx (the caller broke the in_place promise, and is told)."""
    x, _, w = make_inputs(gen, LEAD, 200, torch.float32)
    g = torch.randn(x.shape, generator=gen).to(DEVICE)
    a = torch.randn(x.shape, generator=gen).to(DEVICE).requires_grad_()
    saved_g = a * g  # mul saves g for the gradient of a
    xl = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(xl, w, in_place=True), xl, g)
    assert dx.data_ptr() == g.data_ptr()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved_g.sum().backward()


def test_in_place_retained_graph_second_backward(gen):
    """Nothing saved is written over: a second backward through a retained graph (with a new gradient)
    is right."""
    x, r, w = make_inputs(gen, LEAD, 200, torch.float32, residual=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, s = rms_norm(xr, wr, residual=r, in_place=True)
    gos = [torch.randn(x.shape, generator=gen).to(DEVICE) for _ in range(2)]
    first = torch.autograd.grad((y, s), (xr, wr), [g.clone() for g in gos], retain_graph=True)
    first = [t.clone() for t in first]
    second = torch.autograd.grad((y, s), (xr, wr), [g.clone() for g in gos])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_in_place_saves_one_buffer_on_cuda(gen):
    """On CUDA the option engages (the earlier reference-count design never did there): the backward's
    peak allocation is one [N, H] buffer lower."""
    n_rows, hidden = 4096, 4096
    x, _, w = make_inputs(gen, (n_rows,), hidden, torch.bfloat16)
    peaks = {}
    for in_place in (False, True):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xl, wl, in_place=in_place)
        g = torch.randn_like(y)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        dx, dw = torch.autograd.grad(y, (xl, wl), g)
        peaks[in_place] = torch.cuda.max_memory_allocated() - base
        assert (dx.data_ptr() == g.data_ptr()) == in_place
        del y, g, dx, dw, xl, wl
    assert peaks[False] - peaks[True] >= n_rows * hidden * 2, peaks


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_in_place_under_torch_compile(backend, gen):
    """Under torch.compile(fullgraph=True) in_place is accepted and ignored (the out-of-place custom op
    runs: the backward graph is functionalized): the gradients follow the numerics rule and the
    caller's gradient keeps its values."""
    torch._dynamo.reset()
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def fn(x, w, residual=None, in_place=False, **kw):
        return rms_norm(x * 1.0, w, residual=residual, in_place=in_place, **kw)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for residual in (False, True):
        x, r, w = make_inputs(gen, LEAD, 200, dtype, residual=residual)
        gos = [torch.randn(x.shape, generator=gen).to(DEVICE, dtype) for _ in range(1 + residual)]
        in_place_case("compiled", x, w, r, dict(casting="gemma", offset=1.0), gos, fn=compiled, engaged=False)
    torch._dynamo.reset()


# ---- argument checking ----


def _bad_calls():
    x = torch.randn(4, 10, device=DEVICE)
    w = torch.ones(10, device=DEVICE)
    f = rms_norm
    cases = {
        "x not a tensor": ("x", lambda: f(x.tolist(), w)),
        "x int": ("x", lambda: f(torch.ones(4, 10, dtype=torch.int64, device=DEVICE), w)),
        "x 0-d": ("x", lambda: f(torch.tensor(1.0, device=DEVICE), w[:1])),
        "x empty last dim": ("x", lambda: f(torch.randn(4, 0, device=DEVICE), w[:0])),
        "weight shape": ("weight", lambda: f(x, w[:9])),
        "weight 2-D": ("weight", lambda: f(x, w[None])),
        "weight int": ("weight", lambda: f(x, w.long())),
        "residual shape": ("residual", lambda: f(x, w, residual=x[:3])),
        "residual dtype": ("residual", lambda: f(x, w, residual=x.half())),
        "residual not a tensor": ("residual", lambda: f(x, w, residual=1.0)),
        "casting": ("casting", lambda: f(x, w, casting="gemma2")),
        "eps < 0": ("eps", lambda: f(x, w, eps=-1e-6)),
        "eps nan": ("eps", lambda: f(x, w, eps=float("nan"))),
        "eps str": ("eps", lambda: f(x, w, eps="1e-6")),
        "offset inf": ("offset", lambda: f(x, w, offset=float("inf"))),
        "offset without weight": ("offset", lambda: f(x, None, offset=1.0)),
        "in_place not a bool": ("in_place", lambda: f(x, w, in_place=1)),
    }
    if ON_GPU:
        cases["weight on another device"] = ("weight", lambda: f(x, w.cpu()))
        cases["residual on another device"] = ("residual", lambda: f(x, w, residual=x.cpu()))
    return cases


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_value_error_naming_them(case):
    name, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        call()


# ---- dispatch, docstring, compile, CUDA graphs, HF ----


def test_dispatch_runs_the_expected_path(monkeypatch, gen):
    calls = {"fwd_kernel": 0, "bwd_kernel": 0, "reference": 0}

    def reference_spy(*args, **kwargs):
        calls["reference"] += 1
        return rms_norm_reference(*args, **kwargs)

    monkeypatch.setattr(
        rms_op, "rms_norm_fwd_launch", counting(calls, "fwd_kernel", rms_op.rms_norm_fwd_launch)
    )
    monkeypatch.setattr(
        rms_op, "rms_norm_bwd_launch", counting(calls, "bwd_kernel", rms_op.rms_norm_bwd_launch)
    )
    monkeypatch.setattr(rms_op, "rms_norm_reference", reference_spy)
    x, r, w = make_inputs(gen, (4,), 100, torch.float32, residual=True)
    y, s = rms_norm(x.clone().requires_grad_(), w, residual=r)
    (y.sum() + s.sum()).backward()
    if TRITON_PATH:
        assert calls == {"fwd_kernel": 1, "bwd_kernel": 1, "reference": 0}
    else:
        assert calls == {"fwd_kernel": 0, "bwd_kernel": 0, "reference": 1}
    rms_norm(x.double(), w)
    assert calls["reference"] == (1 if TRITON_PATH else 2)


def test_docstring_example_runs(monkeypatch):
    monkeypatch.setattr(fuselm, "rms_norm", rms_norm, raising=False)  # before the export exists
    tests = [t for t in doctest.DocTestFinder().find(rms_norm) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        t.globs["fuselm"] = fuselm
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0


COMPILE_CASES = {
    "llama": dict(casting="llama"),
    "gemma+residual": dict(casting="gemma", offset=1.0, residual=True),
}


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)]
)  # inductor on CPU compiles C++ for a minute
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_torch_compile_fullgraph(case, backend, gen):
    torch._dynamo.reset()
    kw = dict(COMPILE_CASES[case])
    residual = kw.pop("residual", False)
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def fn(x, w, residual=None, **kw):
        return rms_norm(x * 1.0, w, residual=residual, **kw)  # the input is an activation of the graph

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for _ in range(2):  # the second call with new data reuses the graph
        x, r, w = make_inputs(gen, LEAD, 200, dtype, residual=residual)
        check_case(case, x, w, r, kw, gen, fn=lambda x, w, **k: compiled(x, w, **k))
    torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(gen):
    """Forward + backward captured once and replayed on new data: no host syncs on the hot path."""
    x0, r0, w0 = make_inputs(gen, (300,), 4096, torch.bfloat16, residual=True)
    x_s, r_s, w_s = x0.clone().requires_grad_(), r0.clone().requires_grad_(), w0.clone().requires_grad_()
    gos = [torch.randn(x0.shape, generator=gen).to(DEVICE).bfloat16() for _ in range(2)]

    def step():
        y, s = rms_norm(x_s, w_s, residual=r_s)
        return torch.autograd.grad((y, s), (x_s, r_s, w_s), gos)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step()
    for _ in range(2):
        x, r, w = make_inputs(gen, (300,), 4096, torch.bfloat16, residual=True)
        with torch.no_grad():
            x_s.copy_(x), r_s.copy_(r), w_s.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        _, expected = fwd_bwd(rms_norm, x, w, r, {}, gos)
        assert torch.equal(static_grads[0], expected[0])
        assert torch.equal(static_grads[2], expected[1])


def _hf_class(path):
    transformers = pytest.importorskip("transformers")
    module_name, cls_name = path.rsplit(".", 1)
    module = __import__(module_name, fromlist=[cls_name])
    del transformers
    return getattr(module, cls_name)


@pytest.mark.parametrize(
    "path,kw",
    [
        ("transformers.models.llama.modeling_llama.LlamaRMSNorm", dict(casting="llama")),
        ("transformers.models.gemma.modeling_gemma.GemmaRMSNorm", dict(casting="gemma", offset=1.0)),
    ],
    ids=["llama", "gemma"],
)
@pytest.mark.parametrize("hidden", [256, 4096] if ON_GPU else [256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_bit_exact_with_transformers(path, kw, hidden, dtype, gen):
    """Forward outputs equal HF's modules bit for bit (torch.equal) where HF computes in fp32:
    inputs k/8 with power-of-two H, so the fp32 sum of squares is exact whatever the order."""
    cls = _hf_class(path)
    hf = cls(hidden, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.copy_((torch.rand(hidden, generator=gen) - 0.5).to(dtype))
    x = exact_inputs(gen, 64, hidden, dtype)
    with torch.no_grad():
        expected = hf(x)
        ours = rms_norm(x, hf.weight, 1e-6, **kw)
    if not exact_here(dtype, kw["casting"]):
        pytest.skip("the interpreter truncates fp32 to bf16; checked on the GPU")
    assert ours.dtype == expected.dtype
    assert torch.equal(ours, expected)


@pytest.mark.gpu
@pytest.mark.slow
def test_rows_times_hidden_over_2_31():
    """rows x H > 2^31 elements: every offset needs int64 (docs/design.md section 3). bf16, ~4.3 GB each
    for x, residual, y, sum, dx; rows around the 2^31 boundary and dweight are checked."""
    hidden, dtype = 4096, torch.bfloat16
    n_rows = 2**31 // hidden + 7
    free, _ = torch.cuda.mem_get_info()
    if free < 48 * 2**30:
        pytest.skip(f"needs ~48 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    g = torch.Generator(device="cuda").manual_seed(2**31)
    x = torch.randn(n_rows, hidden, device="cuda", dtype=dtype, generator=g)
    r = torch.randn(n_rows, hidden, device="cuda", dtype=dtype, generator=g)
    w = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(n_rows, hidden, device="cuda", dtype=dtype, generator=g)
    xr = x.requires_grad_()
    y, s = rms_norm(xr, w, residual=r)
    (dx, dw) = torch.autograd.grad(y, (xr, w), dy)
    first_big = 2**31 // hidden
    rows = torch.tensor(
        [0, 1, first_big - 1, first_big, first_big + 1, n_rows - 2, n_rows - 1], device="cuda"
    )
    gos = [dy[rows], torch.zeros_like(dy[rows])]  # y's gradient only (the sum is not used)
    xs, rs, ws = x[rows].detach(), r[rows], w.detach()
    o_ref, g_ref = fwd_bwd(reference64, xs, ws, rs, {}, gos, torch.float64)
    o_eag, g_eag = fwd_bwd(eager_rms_norm, xs, ws, rs, {}, gos)
    assert_numerics("y rows", y[rows], o_eag[0], o_ref[0], dtype)
    assert_numerics("sum rows", s[rows], o_eag[1], o_ref[1], dtype)
    assert_numerics("dx rows", dx[rows], g_eag[0], g_ref[0], dtype)
    del y, s, dx
    # dweight over all rows: float64 reference and eager, chunk by chunk
    dw_ref = torch.zeros(hidden, dtype=torch.float64, device="cuda")
    dw_eag = torch.zeros(hidden, dtype=torch.float32, device="cuda")
    for i in range(0, n_rows, 16384):
        sl = slice(i, i + 16384)
        chunk_gos = [dy[sl], torch.zeros_like(dy[sl])]
        _, (_, gw, _) = fwd_bwd(reference64, x[sl], ws, r[sl], {}, chunk_gos, torch.float64)
        dw_ref += gw
        _, (_, gw, _) = fwd_bwd(eager_rms_norm, x[sl], ws, r[sl], {}, chunk_gos)
        dw_eag += gw.float()
    assert_numerics("dweight", dw, dw_eag.to(dtype), dw_ref, dtype)
