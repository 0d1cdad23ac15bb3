"""fuselm.ops.linear_cross_entropy against a float64 chunked reference, under the numerics rule.

Every output and gradient: err(fuselm) <= 2 * err(torch eager, same dtype) + ATOL[dtype] (docs/design.md 5).
Eager is torch's own composition in the input dtype: F.cross_entropy(F.linear(x, W, b), t, ...), with
softcap / z-loss / lse spelled out in torch ops where F.cross_entropy lacks them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, TRITON_PATH, kernel_device
from kit.oracles import eager_cross_entropy

import fuselm.ops._common.loss.budget as loss_budget
import fuselm.ops._common.loss.rows as loss_rows
import fuselm.ops.linear_cross_entropy.chunked as lce_chunked
import fuselm.ops.linear_cross_entropy.fused as lce_fused
import fuselm.ops.linear_cross_entropy.op as lce_op
import fuselm.ops.linear_cross_entropy.reference as lce_ref
from fuselm.nn import LinearCrossEntropyLoss
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

DEVICE = kernel_device()
H, V = 32, 257
SHAPE = (2, 11)  # leading dims of input: N = 22 tokens
gpu = pytest.mark.gpu


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


# ---- helpers ----


def _eager(x, w, t, *, linear_bias=None, **kw):
    """Torch eager in the input dtype (what a user writes without fuselm): the logits, then kit's eager
    cross-entropy on them."""
    return eager_cross_entropy(F.linear(x, w, linear_bias), t, **kw)


def _inputs(
    dtype, *, shape=SHAPE, h=H, v=V, bias=True, ignore=True, class_weight=False, seed=0, device=DEVICE
):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(*shape, h, generator=g)
    w = torch.randn(v, h, generator=g) * (2.0 / math.sqrt(h))  # logits ~ N(0, 4)
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if ignore:
        t[torch.randperm(n, generator=g)[: n // 4]] = -100
    cw = torch.rand(v, generator=g) + 0.5 if class_weight else None
    t = t.reshape(shape)

    def put(a):
        return a.to(device=device, dtype=dtype) if a is not None else None

    return put(x), put(w), put(b), t.to(device), put(cw)


def _upstream(outs, dtype, seed=1):
    """Upstream gradients: 1 for a scalar loss, random (representable in `dtype`) otherwise."""
    g = torch.Generator().manual_seed(seed)
    grads = []
    for o in outs:
        if o.dim() == 0:
            grads.append(torch.ones_like(o))
        else:
            r = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype).to(torch.float64)
            grads.append(r.to(device=o.device, dtype=o.dtype))
    return grads


def _run(fn, x, w, b, t, cw, dtype=None, **kw):
    """Outputs and gradients of fn; `dtype` (default: x's) casts the float inputs (fp64 for the reference)."""
    dtype = dtype or x.dtype
    xs = x.detach().to(dtype).requires_grad_()
    ws = w.detach().to(dtype).requires_grad_()
    bs = b.detach().to(dtype).requires_grad_() if b is not None else None
    cws = cw.to(dtype) if cw is not None else None
    out = fn(xs, ws, t, linear_bias=bs, weight=cws, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    leaves = [xs, ws] + ([bs] if bs is not None else [])
    grads = torch.autograd.grad(outs, leaves, _upstream(outs, x.dtype))
    res = {"loss": outs[0].detach(), "dx": grads[0], "dw": grads[1]}
    if len(outs) > 1:
        res["lse"] = outs[1].detach()
    if bs is not None:
        res["db"] = grads[2]
    return res


def _ref(x, w, b, t, cw, **kw):
    return _run(linear_cross_entropy_reference, x, w, b, t, cw, dtype=torch.float64, **kw)


def _check(ours, eager, ref, dtype, prefix=""):
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    for key in ref:
        assert ours[key].shape == ref[key].shape, key
        assert_numerics(prefix + key, ours[key], eager[key], ref[key], dtype)


def _compare(dtype, inputs, **kw):
    """ours vs eager vs float64 reference for the loss (and lse) and every gradient."""
    x, w, b, t, cw = inputs
    ours = _run(linear_cross_entropy, x, w, b, t, cw, **kw)
    eager_kw = {k: a for k, a in kw.items() if k != "memory"}
    eager = _run(_eager, x, w, b, t, cw, **eager_kw)
    ref = _ref(x, w, b, t, cw, **eager_kw)
    assert ours["loss"].dtype == dtype
    if "lse" in ours:
        assert ours["lse"].dtype == torch.float32
    _check(ours, eager, ref, dtype)
    return ours, ref


# keys of a case that shape the inputs (the rest are keyword arguments of the op)
INPUT_KEYS = ("shape", "h", "v", "bias", "ignore", "class_weight", "seed")
CASES = {
    "plain": {},
    "no_bias_no_ignore": {"bias": False, "ignore": False},
    "class_weight": {"class_weight": True},
    "label_smoothing": {"label_smoothing": 0.1},
    "weight_and_smoothing": {"class_weight": True, "label_smoothing": 0.2},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 5.0},
    "all": {"class_weight": True, "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the two plans: memory=1 forces the chunked plan with chunks of 16 rows; "min" is the fused tile plan
PLANS = {"chunked": 1, "fused": "min"}


def _memory(plan, dtype=torch.float32):
    """The memory argument of a plan; skips bf16 on the fused plan in the interpreter (its bf16 tl.dot
    is wrong on CPU, triton 3.9), where the GPU run covers it."""
    if plan == "fused" and dtype == torch.bfloat16 and TRITON_PATH and not HAS_CUDA:
        pytest.skip("bf16 tl.dot is wrong in the Triton interpreter; the GPU run checks it")
    return PLANS[plan]


def _split(case):
    opts = CASES[case]
    return {k: opts[k] for k in INPUT_KEYS if k in opts}, {
        k: a for k, a in opts.items() if k not in INPUT_KEYS
    }


# ---- numerics ----


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_numerics(dtype, reduction, case, plan):
    """Loss and the gradients of input, linear_weight, linear_bias, on both plans."""
    in_opts, kw = _split(case)
    _compare(dtype, _inputs(dtype, **in_opts), reduction=reduction, memory=_memory(plan, dtype), **kw)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_return_lse_differentiable(dtype, reduction, plan):
    in_opts, kw = _split("all")
    inputs = _inputs(dtype, **in_opts)
    ours, _ = _compare(dtype, inputs, reduction=reduction, return_lse=True, memory=_memory(plan, dtype), **kw)
    assert ours["lse"].shape == SHAPE


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_dtype(reduction, plan):
    """loss_dtype=float32 returns the fp32 accumulation unrounded; the default rounds it to the input's
    dtype; the gradients are the same either way."""
    dtype = torch.float16
    x, w, b, t, _ = _inputs(dtype)
    outs = {}
    for loss_dtype in (None, torch.float32):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = linear_cross_entropy(
            xi, wi, t, linear_bias=b, reduction=reduction, memory=_memory(plan, dtype), loss_dtype=loss_dtype
        )
        loss.backward(torch.ones_like(loss))
        outs[loss_dtype] = (loss, xi.grad, wi.grad)
    (l16, dx16, dw16), (l32, dx32, dw32) = outs[None], outs[torch.float32]
    assert l16.dtype == dtype and l32.dtype == torch.float32
    torch.testing.assert_close(l16, l32.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(dx16, dx32, rtol=0, atol=0)
    torch.testing.assert_close(dw16, dw32, rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss_dtype"):
        linear_cross_entropy(x, w, t, loss_dtype=torch.int32)


@pytest.mark.parametrize("plan", list(PLANS))
def test_autocast_casts_like_f_linear(plan):
    """Under autocast, fp32 operands are cast to the autocast dtype first (as F.linear): the loss is the
    one of the cast operands, and the gradients reach the fp32 leaves in fp32."""
    low = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    if plan == "fused" and TRITON_PATH and not HAS_CUDA and low == torch.bfloat16:
        low = torch.float16  # the interpreter's bf16 tl.dot is wrong (see _memory)
    x, w, b, t, _ = _inputs(torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    with torch.autocast(DEVICE, dtype=low):
        loss = linear_cross_entropy(x, w, t, linear_bias=b, memory=_memory(plan, low))
    want = linear_cross_entropy(
        x.to(low), w.to(low), t, linear_bias=b.to(low), memory=_memory(plan, low), loss_dtype=torch.float32
    )
    assert loss.dtype == torch.float32  # as F.linear_cross_entropy under autocast
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    loss.backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("plan", list(PLANS))
def test_autocast_bf16_loss_is_fp32_accurate(plan):
    """Under bf16 autocast the loss is as accurate as Hugging Face's (bf16 logits, loss on logits.float()):
    the operands are cast to bf16, the math stays fp32 (the CPU reference once rounded each token's loss)."""
    memory = _memory(plan, torch.bfloat16)
    x, w, b, t, _ = _inputs(torch.float32)
    outs = {}
    for name, fn in (("ours", linear_cross_entropy), ("eager", _eager)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            kw = dict(memory=memory, loss_dtype=torch.float32) if name == "ours" else {}
            loss = fn(xs, ws, t, **kw).float()
        loss.backward()
        outs[name] = {"loss": loss.detach(), "dx": xs.grad, "dw": ws.grad}
    xr, wr = (a.to(torch.bfloat16).double().requires_grad_() for a in (x, w))
    loss = linear_cross_entropy_reference(xr, wr, t)
    loss.backward()
    ref = {"loss": loss.detach(), "dx": xr.grad, "dw": wr.grad}
    assert_numerics("loss", outs["ours"]["loss"], outs["eager"]["loss"], ref["loss"], torch.float32)
    for key in ("dx", "dw"):
        assert_numerics(key, outs["ours"][key], outs["eager"][key], ref[key], torch.bfloat16)


@pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason="torch.nn.functional.linear_cross_entropy: torch >= 2.13"
)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_loss_dtype_matches_torch(autocast, reduction, plan):
    """The returned loss has the dtype of torch.nn.functional.linear_cross_entropy's, in and out of autocast,
    for every reduction (under autocast: float32, where the loss was once in the autocast dtype, 5x less
    accurate per token); torch's result is the eager side of the numerics rule."""
    low = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    if plan == "fused" and TRITON_PATH and not HAS_CUDA:
        low = torch.float16  # the interpreter's bf16 tl.dot is wrong (see _memory)
    memory = _memory(plan, low)
    x, w, b, t, _ = _inputs(torch.float32)
    for dtype in (torch.float32, low):
        outs = {}
        for name, fn in (("ours", linear_cross_entropy), ("torch", F.linear_cross_entropy)):
            xs, ws, bs = (a.detach().to(dtype).requires_grad_() for a in (x, w, b))
            with torch.autocast(DEVICE, dtype=low, enabled=autocast):
                kw = dict(memory=memory) if name == "ours" else {}
                loss = fn(xs.reshape(-1, H), ws, t.reshape(-1), linear_bias=bs, reduction=reduction, **kw)
            outs[name] = loss
        assert outs["ours"].dtype == outs["torch"].dtype, (dtype, outs["ours"].dtype, outs["torch"].dtype)
        assert outs["ours"].shape == outs["torch"].shape
        # the float64 reference of the operands the op computes with (cast to `low` under autocast)
        op_dtype = low if autocast else dtype
        xr, wr, br = (a.to(op_dtype).double() for a in (x, w, b))
        ref = linear_cross_entropy_reference(
            xr.reshape(-1, H), wr, t.reshape(-1), linear_bias=br, reduction=reduction
        )
        rule_dtype = torch.float32 if autocast else dtype
        assert_numerics("loss", outs["ours"].detach(), outs["torch"].detach(), ref, rule_dtype)


def test_float64_runs_the_reference():
    inputs = _inputs(torch.float64, class_weight=True)
    _compare(torch.float64, inputs, label_smoothing=0.1, z_loss=1e-3, softcap=4.0)


def test_other_ignore_index_and_int32_target():
    x, w, b, t, cw = _inputs(torch.float32, ignore=False)
    t = t.to(torch.int32)
    t[0, :3] = 5  # ignore a real class
    _compare(torch.float32, (x, w, b, t, cw), ignore_index=5, label_smoothing=0.1)


@pytest.mark.parametrize("plan", list(PLANS))
def test_upstream_gradient_not_one(plan):
    """The gradient-in-forward plan scales the saved gradients by grad_output in the backward."""
    x, w, b, t, cw = _inputs(torch.float32, class_weight=True)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, memory=_memory(plan))

    def scaled(fn):
        return lambda *a, **k: fn(*a, **k) * 2.5

    ours = _run(scaled(linear_cross_entropy), x, w, b, t, cw, **kw)
    del kw["memory"]
    eager = _run(scaled(_eager), x, w, b, t, cw, **kw)
    ref = _run(scaled(linear_cross_entropy_reference), x, w, b, t, cw, dtype=torch.float64, **kw)
    _check(ours, eager, ref, torch.float32)


def _sum_backward(fn, x, w, b, t, needs, dtype=None, **kw):
    """Gradients of fn(...).sum() for the leaves in `needs` (a subset of "x", "w", "b"), others frozen."""
    dtype = dtype or x.dtype
    leaves = {k: a.detach().to(dtype).requires_grad_(k in needs) for k, a in (("x", x), ("w", w), ("b", b))}
    out = fn(leaves["x"], leaves["w"], t, linear_bias=leaves["b"], **kw)
    if not needs:
        return {"loss": out.detach()}
    out.sum().backward()
    return {"d" + k: leaves[k].grad for k in needs}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("needs", ["x", "w", "b", "xb"])
def test_some_gradients_needed(monkeypatch, needs, reduction, plan):
    """A frozen lm_head (only dX), a frozen input (only dW), ...: the GEMMs not needed are skipped."""
    dtype = torch.float16
    x, w, b, t, _ = _inputs(dtype)
    kw = dict(reduction=reduction, label_smoothing=0.1)
    computed = []

    def grads_of(dx, dw, db):
        return "".join(k for k, a in (("x", dx), ("w", dw), ("b", db)) if a)

    if plan == "chunked":
        inner = lce_chunked._accumulate_grads

        def spy(g, xc, w_, idx, s, e, dx, dw, db_acc, first):
            computed.append(grads_of(dx is not None, dw is not None, db_acc is not None))
            return inner(g, xc, w_, idx, s, e, dx, dw, db_acc, first)

        monkeypatch.setattr(lce_chunked, "_accumulate_grads", spy)
    else:
        inner = lce_fused.fused_tile_grads

        def spy(*args):
            computed.append(grads_of(*args[7]))  # needs = (need_dx, need_dw, need_db)
            return inner(*args)

        monkeypatch.setattr(lce_fused, "fused_tile_grads", spy)
    ours = _sum_backward(linear_cross_entropy, x, w, b, t, needs, memory=_memory(plan), **kw)
    if TRITON_PATH:
        assert set(computed) == {needs}  # the GEMMs of frozen tensors were skipped
    eager = _sum_backward(_eager, x, w, b, t, needs, **kw)
    ref = _sum_backward(linear_cross_entropy_reference, x, w, b, t, needs, torch.float64, **kw)
    _check(ours, eager, ref, dtype)


def test_no_grad_forward():
    dtype = torch.float32
    x, w, b, t, _ = _inputs(dtype)
    xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
    with torch.no_grad():
        ours = {"loss": linear_cross_entropy(xs, ws, t, linear_bias=bs, reduction="none")}
        eager = {"loss": _eager(xs, ws, t, linear_bias=bs, reduction="none")}
    assert ours["loss"].grad_fn is None
    ref = {
        "loss": linear_cross_entropy_reference(
            x.double(), w.double(), t, linear_bias=b.double(), reduction="none"
        )
    }
    _check(ours, eager, ref, dtype)


# ---- semantics ----


@pytest.mark.parametrize("plan", list(PLANS))
def test_tied_embeddings(plan):
    """W used by an embedding lookup and as the lm_head: its .grad is the sum of both contributions."""
    dtype = torch.float32
    x0, w, b, t, _ = _inputs(dtype, bias=False)
    ids = torch.randint(0, V, SHAPE, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def run(fn, dt):
        ws = w.detach().to(dt).requires_grad_()
        xs = x0.detach().to(dt).requires_grad_()
        h = torch.tanh(F.embedding(ids, ws) + xs)
        fn(h, ws, t, label_smoothing=0.1).backward()
        return {"dw": ws.grad, "dx": xs.grad}

    def ours(h, ws, t, **kw):
        return linear_cross_entropy(h, ws, t, memory=_memory(plan), **kw)

    _check(
        run(ours, dtype),
        run(_eager, dtype),
        run(linear_cross_entropy_reference, torch.float64),
        dtype,
    )


def test_chunking(monkeypatch):
    """memory=<int> gives several chunks; the results agree with a single chunk under the numerics rule.
    "min" runs the fused plan on the Triton path (no chunk), chunks of 8 MiB on the reference path."""
    dtype = torch.float16
    x, w, b, t, cw = _inputs(dtype, ignore=False)
    calls = []
    module, name = (loss_rows, "rows_fwd_into") if TRITON_PATH else (lce_ref, "chunk_loss_grad")
    inner = getattr(module, name)

    def spy(logits, *args):
        calls.append(logits.shape[0])
        return inner(logits, *args)

    monkeypatch.setattr(module, name, spy)
    kw = dict(label_smoothing=0.1)
    eager = _run(_eager, x, w, b, t, cw, **kw)
    ref = _ref(x, w, b, t, cw, **kw)
    # 16 rows of V logits (+ a little): chunks of 16 rows on both paths (reference: 4-byte logits, floor 16)
    min_chunks = [] if TRITON_PATH else [22]
    for memory, chunks in ((1, [16, 6]), (16 * V * 2 + 100, [16, 6]), ("auto", [22]), ("min", min_chunks)):
        calls.clear()
        _check(
            _run(linear_cross_entropy, x, w, b, t, cw, memory=memory, **kw), eager, ref, dtype, f"{memory}:"
        )
        assert calls == chunks, (memory, calls)


def test_chunk_rows_rule():
    assert lce_chunked.chunk_rows_for(1, 300, 32, 4) == 16
    assert lce_chunked.chunk_rows_for((300 + 2 * 32) * 4 * 47, 300, 32, 4) == 32
    assert lce_chunked.chunk_rows_for(256 * 2**20, 128256, 4096, 2) == 976  # Llama-3 bf16 under "auto"
    assert lce_chunked.chunk_rows_for(8 * 2**20, 128256, 4096, 2) == 16
    cpu = torch.device("cpu")
    assert loss_budget.memory_budget("min", cpu) == 8 * 2**20
    assert loss_budget.memory_budget("auto", cpu) == 256 * 2**20
    assert loss_budget.memory_budget(12345, cpu) == 12345


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ignored_rows_compaction(monkeypatch, reduction, plan):
    """Ignored rows cost nothing: the numbers of the batch without them; compaction on == off."""
    dtype = torch.float32
    x, w, b, t, cw = _inputs(dtype, class_weight=True, ignore=True, seed=5)
    valid = t != -100
    seen = []
    inner = lce_op.run_forward

    def spy(*args):
        seen.append(args[5] is not None)  # rows: the compacted row list, or None
        return inner(*args)

    monkeypatch.setattr(lce_op, "run_forward", spy)
    kw = dict(label_smoothing=0.1, reduction=reduction, memory=_memory(plan))
    full = _sum_backward(linear_cross_entropy, x, w, b, t, "xwb", weight=cw, **kw)
    full_loss = linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, **kw)
    if TRITON_PATH:
        assert seen[0] is True  # rows were compacted
    sub = _sum_backward(linear_cross_entropy, x[valid], w, b, t[valid], "xwb", weight=cw, **kw)
    sub_loss = linear_cross_entropy(x[valid], w, t[valid], linear_bias=b, weight=cw, **kw)
    if reduction == "none":
        assert torch.all(full_loss[~valid] == 0)
        full_loss = full_loss[valid]
    torch.testing.assert_close(full_loss, sub_loss)
    torch.testing.assert_close(full["dw"], sub["dw"])
    torch.testing.assert_close(full["db"], sub["db"])
    torch.testing.assert_close(full["dx"][valid], sub["dx"])
    assert torch.all(full["dx"][~valid] == 0)

    seen.clear()
    monkeypatch.setattr(lce_op, "compaction_allowed", lambda device: False)
    off = _sum_backward(linear_cross_entropy, x, w, b, t, "xwb", weight=cw, **kw)
    if TRITON_PATH:
        assert seen == [False]
    for key in full:
        torch.testing.assert_close(full[key], off[key])


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("compaction", [True, False])
def test_all_ignored(monkeypatch, plan, compaction):
    monkeypatch.setattr(lce_op, "compaction_allowed", lambda device: compaction)
    memory = _memory(plan)
    x, w, b, t, _ = _inputs(torch.float32)
    t = torch.full_like(t, -100)
    xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
    loss = linear_cross_entropy(xs, ws, t, linear_bias=bs, reduction="sum", memory=memory)
    loss.backward()
    assert loss.item() == 0
    for g in (xs.grad, ws.grad, bs.grad):
        assert torch.all(g == 0)
    assert torch.isnan(linear_cross_entropy(x, w, t, linear_bias=b, memory=memory))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("compaction", [True, False])
def test_all_ignored_with_infinite_upstream_gradient(monkeypatch, plan, compaction):
    """Hugging Face divides the summed loss by num_items_in_batch, 0 for a batch without a target: the loss is
    0 / 0 = NaN (as HF's) and the upstream gradient inf; the gradients stay zero (as PyTorch's), never NaN."""
    monkeypatch.setattr(lce_op, "compaction_allowed", lambda device: compaction)
    x, w, b, t, _ = _inputs(torch.float32)
    t = torch.full_like(t, -100)
    xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
    loss = linear_cross_entropy(xs, ws, t, linear_bias=bs, reduction="sum", memory=_memory(plan))
    loss = loss / torch.tensor(0.0)
    assert torch.isnan(loss)
    loss.backward()
    for g in (xs.grad, ws.grad, bs.grad):
        assert torch.all(g == 0)


def _bad_target(value):
    x, w, b, t, _ = _inputs(torch.float32, ignore=True)
    t = t.clone()
    t[0, 1] = value
    return x, w, b, t


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("value", [V, V + 3, -1, -7])
def test_out_of_range_target_raises_in_eager(plan, value):
    """Eager mode: ValueError naming the target and the bad value, found by the host sync that compacts the
    ignored rows (no other sync); the same on the CPU reference path."""
    x, w, b, t = _bad_target(value)
    with pytest.raises(ValueError, match=rf"target holds {value}, outside \[0, {V}\)"):
        linear_cross_entropy(x, w, t, linear_bias=b, memory=_memory(plan))
    t_ok = torch.where(t == value, torch.zeros_like(t), t)
    assert torch.isfinite(linear_cross_entropy(x, w, t_ok, linear_bias=b, memory=_memory(plan)))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_out_of_range_target_without_sync(monkeypatch, plan, reduction):
    """Where no host sync is allowed (torch.compile, CUDA graph capture: no compaction, simulated here):
    the bad token's loss is NaN (visible in the loss), its gradient zero, so the weights are never poisoned;
    the other tokens are exactly as without it. FUSELM_VALIDATE=1 raises ValueError there too."""
    monkeypatch.setattr(lce_op, "compaction_allowed", lambda device: False)
    x, w, b, t = _bad_target(V + 3)
    kw = dict(reduction=reduction, label_smoothing=0.1, memory=_memory(plan))  # smoothing touches every class
    ours = _sum_backward(linear_cross_entropy, x, w, b, t, "xwb", **kw)
    loss = linear_cross_entropy(x, w, t, linear_bias=b, **kw)
    assert torch.isnan(loss).any()
    if reduction == "none":
        assert torch.isnan(loss[0, 1]) and not torch.isnan(loss.reshape(-1)[2:]).any()
    assert torch.all(ours["dx"][0, 1] == 0)
    for key in ("dx", "dw", "db"):
        assert torch.isfinite(ours[key]).all(), key
    # the other tokens: as if the bad one were ignored (sum: same total; mean: its count is in the divisor)
    t_ign = torch.where(t == V + 3, torch.full_like(t, -100), t)
    if reduction == "none":
        want = _sum_backward(linear_cross_entropy, x, w, b, t_ign, "xwb", **kw)
        for key in want:
            torch.testing.assert_close(ours[key], want[key])
    monkeypatch.setenv("FUSELM_VALIDATE", "1")
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(x, w, t, linear_bias=b, **kw)


@pytest.mark.skipif(not TRITON_PATH, reason="the in-place gradient plan runs on the Triton path only")
@pytest.mark.parametrize("plan", list(PLANS))
def test_second_backward_raises(plan):
    x, w, b, t, _ = _inputs(torch.float32)
    xs = x.clone().requires_grad_()
    loss = linear_cross_entropy(xs, w, t, linear_bias=b, memory=_memory(plan))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("return_lse", [False, True], ids=["loss", "lse"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_raises(reduction, return_lse, plan):
    """create_graph=True raises a RuntimeError naming the op and create_graph (once: "element 0 of tensors
    does not require grad" at the second backward, or silently missing second-order terms)."""
    x, w, b, t, _ = _inputs(torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_cross_entropy(
        xs, ws, t, linear_bias=b, reduction=reduction, return_lse=return_lse, memory=_memory(plan)
    )
    loss = out[0] if return_lse else out
    with pytest.raises(
        RuntimeError, match=r"fuselm\.linear_cross_entropy: double backward \(create_graph=True\)"
    ):
        torch.autograd.grad(loss.sum(), (xs, ws), create_graph=True)
    # a plain backward of a fresh graph is unaffected
    loss = linear_cross_entropy(xs, ws, t, linear_bias=b, reduction=reduction, memory=_memory(plan))
    loss.sum().backward()
    assert xs.grad is not None and ws.grad is not None


@pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason="torch.nn.functional.linear_cross_entropy: torch >= 2.13"
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_drop_in_for_torch(dtype, reduction):
    """Same call as torch.nn.functional.linear_cross_entropy; torch's result is the eager side of the rule."""
    x, w, b, t, cw = _inputs(dtype, shape=(22,), class_weight=True)  # torch takes 1-D or 2-D input only
    kw = dict(reduction=reduction, ignore_index=None if reduction == "sum" else -100, label_smoothing=0.1)
    ours = _run(linear_cross_entropy, x, w, b, t, cw, **kw)
    theirs = _run(F.linear_cross_entropy, x, w, b, t, cw, **kw)
    _check(ours, theirs, _ref(x, w, b, t, cw, **kw), dtype)


# ---- argument checking ----


def _bad_calls():
    x, w, b, t, _ = _inputs(torch.float32, device="cpu")
    meta = torch.device("meta")
    return [
        ("input", dict(input=x.to(torch.int64))),
        ("linear_weight", dict(linear_weight=w[:, :-1])),
        ("linear_weight", dict(linear_weight=w.half())),
        ("linear_weight", dict(linear_weight=w[0])),
        ("linear_weight", dict(linear_weight=w.to(meta))),
        ("target", dict(target=t[:, :-1])),
        ("target", dict(target=t.float())),
        ("target", dict(target=t.to(meta))),
        ("linear_bias", dict(linear_bias=b[:-1])),
        ("linear_bias", dict(linear_bias=b.double())),
        ("linear_bias", dict(linear_bias=b.to(meta))),
        ("weight", dict(weight=torch.ones(V + 1))),
        ("weight", dict(weight=torch.ones(V, device=meta))),
        ("reduction", dict(reduction="avg")),
        ("label_smoothing", dict(label_smoothing=1.5)),
        ("label_smoothing", dict(label_smoothing=-0.1)),
        ("z_loss", dict(z_loss=-1.0)),
        ("softcap", dict(softcap=0.0)),
        ("softcap", dict(softcap=-2.0)),
        ("ignore_index", dict(ignore_index=1.0)),
        ("memory", dict(memory="max")),
        ("memory", dict(memory=0)),
        ("memory", dict(memory=-5)),
        ("memory", dict(memory=1.5)),
        ("memory", dict(memory=True)),
        ("memory", dict(memory=None)),
    ]


@pytest.mark.parametrize("name,change", _bad_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_value_errors(name, change):
    x, w, b, t, _ = _inputs(torch.float32, device="cpu")
    args = dict(input=x, linear_weight=w, target=t, linear_bias=b)
    args.update(change)
    with pytest.raises(ValueError, match=name):
        linear_cross_entropy(**args)


# ---- torch.compile ----


def _compile_check(backend, dtype, memory, device=DEVICE):
    x, w, b, t, cw = _inputs(dtype, class_weight=True, device=device)

    def loss_mean(x, w, b, t, cw):
        return linear_cross_entropy(
            x, w, t, linear_bias=b, weight=cw, label_smoothing=0.1, z_loss=1e-3, memory=memory
        )

    def loss_none_lse(x, w, b, t, cw):
        loss, lse = linear_cross_entropy(
            x, w, t, linear_bias=b, reduction="none", return_lse=True, softcap=4.0, memory=memory
        )
        return loss.sum() + 0.1 * lse.square().mean()

    for fn in (loss_mean, loss_none_lse):
        compiled = torch.compile(fn, fullgraph=True, backend=backend)

        def wrap(f):
            return lambda x, w, t, linear_bias=None, weight=None: f(x, w, linear_bias, t, weight)

        ours = _run(wrap(compiled), x, w, b, t, cw)
        eager_ours = _run(wrap(fn), x, w, b, t, cw)
        ref = _run(wrap(fn), x, w, b, t, cw, dtype=torch.float64)
        _check(ours, eager_ours, ref, dtype, f"{fn.__name__}:")


@pytest.mark.skipif(not TRITON_PATH or HAS_CUDA, reason="CPU interpreter variant (GPU runs test_gpu_compile)")
@pytest.mark.parametrize("plan", list(PLANS))
def test_compile_fullgraph_interpreter(plan):
    """The custom ops trace without a graph break (aot_eager: no C++ toolchain needed)."""
    torch._dynamo.reset()
    _compile_check("aot_eager", torch.float32, _memory(plan))


# ---- GPU ----


@gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("plan", list(PLANS))
def test_gpu_compile(plan, dtype, backend):
    """fp32 too: a loss returned as an alias of the graph's own scalar once made every gradient zero on
    CUDA (a same-dtype .to in the autograd.Function, torch 2.11)."""
    torch._dynamo.reset()
    _compile_check(backend, dtype, _memory(plan))


@gpu
@pytest.mark.parametrize("plan", ["chunked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_dtype_id)
def test_gpu_realistic_shape(dtype, plan):
    """A mid-size odd shape on the GPU (several chunks of C rows, or many tiles), every option on."""
    inputs = _inputs(dtype, shape=(3, 1001), h=512, v=32003, class_weight=True)
    memory = 64 * 2**20 if plan == "chunked" else "min"
    _compare(dtype, inputs, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, memory=memory)


@gpu
@pytest.mark.parametrize("plan", ["chunked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_gpu_peaked_inputs(dtype, plan):
    """Trained-model-like softmaxes (the benchmark's peaked inputs: target probability ~0.9, a few
    runner-ups, a long tail), every option on, under the numerics rule."""
    from fuselm_bench.linear_cross_entropy import ignore_targets, mean_target_prob, peaked_hidden

    g = torch.Generator(device="cuda").manual_seed(11)
    n, h, v = 2048, 512, 32003
    w = torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    x = peaked_hidden(w, t)
    assert mean_target_prob(x, w, t) > 0.8
    ignore_targets(t, 7)
    b = torch.randn(v, device="cuda", generator=g) * 0.1
    cw = torch.rand(v, device="cuda", generator=g) + 0.5
    inputs = tuple(a.to(dtype) for a in (x, w, b)) + (t, cw.to(dtype))
    memory = 64 * 2**20 if plan == "chunked" else "min"
    _compare(dtype, inputs, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, memory=memory)


@gpu
@pytest.mark.parametrize("memory, limit_mib", [("auto", 256), ("min", 8)])
def test_gpu_extra_memory(memory, limit_mib):
    """Extra memory beyond the inputs and the returned gradients (Llama-3 shapes, bf16): at most 256 MiB
    under "auto", 8 MiB under "min"."""
    n, h, v = 8192, 4096, 128256
    dev = torch.device("cuda")
    x = (torch.randn(n, h, device=dev, dtype=torch.bfloat16)).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    for _ in range(2):  # warm up: kernels, cuBLAS workspaces
        linear_cross_entropy(x, w, t, memory=memory).backward()
        x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    linear_cross_entropy(x, w, t, memory=memory).backward()
    torch.cuda.synchronize()
    grads = x.grad.nbytes + w.grad.nbytes
    extra = torch.cuda.max_memory_allocated() - before - grads
    assert extra <= limit_mib * 2**20, f"extra {extra / 2**20:.1f} MiB"


@gpu
@pytest.mark.parametrize("plan", list(PLANS))
def test_gpu_cuda_graph(monkeypatch, plan):
    """Capture fwd + bwd in a CUDA graph (no host sync: no compaction under capture) and replay it."""
    dtype = torch.bfloat16
    x, w, b, t, cw = _inputs(dtype, shape=(4, 63), h=64, v=3001, class_weight=True)
    kw = dict(label_smoothing=0.1, z_loss=1e-3)
    xs, ws, bs = (a.detach().clone().requires_grad_() for a in (x, w, b))

    def step():
        return linear_cross_entropy(xs, ws, t, linear_bias=bs, weight=cw, memory=PLANS[plan], **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), monkeypatch.context() as m:
        # warm up on all rows, as the capture will run: every kernel specialization compiled beforehand
        m.setattr(lce_op, "compaction_allowed", lambda device: False)
        for _ in range(3):
            step().backward()
            xs.grad = ws.grad = bs.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not lce_op.compaction_allowed(xs.device)
        loss = step()
        loss.backward()
    for seed in (0, 7):  # new data in the static inputs, then replay
        x2, w2, b2, _, _ = _inputs(dtype, shape=(4, 63), h=64, v=3001, seed=seed)
        with torch.no_grad():
            xs.copy_(x2)
            ws.copy_(w2)
            bs.copy_(b2)
        graph.replay()
        torch.cuda.synchronize()
        ours = {
            "loss": loss.detach().clone(),
            "dx": xs.grad.clone(),
            "dw": ws.grad.clone(),
            "db": bs.grad.clone(),
        }
        eager = _run(_eager, x2, w2, b2, t, cw, **kw)
        ref = _ref(x2, w2, b2, t, cw, **kw)
        _check(ours, eager, ref, dtype, f"graph seed {seed}:")


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["auto", "fused"])
def test_gpu_int64_rows_times_vocab(plan):
    """N * V > 2^31 (N=20000, V=128256): loss and dX rows (also the last) under the numerics rule."""
    dtype = torch.bfloat16
    n, h, v = 20000, 256, 128256
    assert n * v > 2**31
    x, w, _, t, _ = _inputs(dtype, shape=(n,), h=h, v=v, bias=False)
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device=x.device)
    ours = _run(linear_cross_entropy, x, w, None, t, None, memory="auto" if plan == "auto" else "min")
    eager = _run(_eager, x, w, None, t, None)
    ref = _ref(x, w, None, t, None)
    assert_numerics("loss", ours["loss"], eager["loss"], ref["loss"], dtype)
    assert_numerics("dx rows", ours["dx"][rows], eager["dx"][rows], ref["dx"][rows], dtype)
    assert_numerics("dx", ours["dx"], eager["dx"], ref["dx"], dtype)
    assert_numerics("dw", ours["dw"], eager["dw"], ref["dw"], dtype)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_z_loss(plan, reduction):
    """return_z_loss: the z-loss part of the loss (from the lse the op computes anyway), detached, reduced as
    the loss; the loss and the gradients are those of the call without it (same plan, compaction on)."""
    dtype = torch.float32
    x, w, b, t, cw = _inputs(dtype, class_weight=True, ignore=True, seed=3)
    kw = dict(linear_bias=b, weight=cw, z_loss=1e-2, reduction=reduction, memory=_memory(plan))
    loss, z = linear_cross_entropy(x, w, t, return_z_loss=True, **kw)
    assert not z.requires_grad and z.shape == loss.shape
    valid = t != -100

    def by_hand(x, w, b, cw):  # the definition, in the dtype of its inputs
        lse = torch.logsumexp(x @ w.T + b, -1)
        rows = torch.where(valid, 1e-2 * lse * lse, torch.zeros_like(lse))
        if reduction == "none":
            return rows
        return rows.sum() / torch.where(valid, cw[torch.where(valid, t, 0)], torch.zeros_like(lse)).sum()

    expected = by_hand(x.double(), w.double(), b.double(), cw.double())
    assert_numerics("z_loss", z, by_hand(x, w, b, cw), expected, dtype)
    plain = linear_cross_entropy(x, w, t, **kw)
    assert torch.equal(loss, plain)
    out = linear_cross_entropy(x, w, t, return_lse=True, return_z_loss=True, **kw)
    assert len(out) == 3 and out[1].shape == t.shape


def test_module_return_z_loss():
    x, w, b, t, cw = _inputs(torch.float32, class_weight=True)
    module = LinearCrossEntropyLoss(cw, z_loss=1e-2, return_z_loss=True)
    ours = module(x, w, t, b)
    functional = linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, z_loss=1e-2, return_z_loss=True)
    assert len(ours) == 2 and all(torch.equal(a, c) for a, c in zip(ours, functional, strict=True))


TOKEN_WEIGHT_CASES = {
    "mean": dict(),
    "none+lse": dict(reduction="none", return_lse=True),
    "sum+all": dict(reduction="sum", label_smoothing=0.1, z_loss=1e-2, softcap=5.0),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("case", list(TOKEN_WEIGHT_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_token_weights(plan, case, dtype):
    """token_weights multiply each token's loss and gradient, through both plans and both ways (gradient in
    the forward with ignored rows compacted; recompute), class weights on; "mean" keeps its denominator."""
    inputs = _inputs(dtype, class_weight=True, ignore=True, seed=7)
    t = inputs[3]
    g = torch.Generator().manual_seed(8)
    tw = (torch.rand(t.shape, generator=g) * 2).to(DEVICE)
    tw.reshape(-1)[0] = 0.0
    _compare(dtype, inputs, token_weights=tw, memory=_memory(plan, dtype), **TOKEN_WEIGHT_CASES[case])


@pytest.mark.parametrize("plan", list(PLANS))
def test_fp32_weight_grad_accumulation(plan):
    """accum_dtype=torch.float32 sums dW over 8 chunks (or the tiles) in fp32 and rounds once: dW in the
    weight's dtype, within the numerics rule, no further from float64 than the default (a rounding per
    chunk)."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    inputs = _inputs(dtype, shape=(8, 16), ignore=False, seed=11)
    memory = _memory(plan, dtype)
    fp32 = _run(linear_cross_entropy, *inputs, memory=memory, accum_dtype=torch.float32)
    default = _run(linear_cross_entropy, *inputs, memory=memory)
    ref = _ref(*inputs)
    eager = _run(_eager, *inputs)
    _check(fp32, eager, ref, dtype)
    assert fp32["dw"].dtype == dtype
    assert torch.equal(fp32["dx"], default["dx"]) and torch.equal(fp32["loss"], default["loss"])

    def err(a):
        return (a.double() - ref["dw"]).norm() / ref["dw"].norm()

    assert err(fp32["dw"]) <= err(default["dw"]) * 1.001


def test_accum_dtype_bad_value():
    x, w, b, t, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="accum_dtype"):
        linear_cross_entropy(x, w, t, accum_dtype=torch.float16)
    module = LinearCrossEntropyLoss(accum_dtype=torch.float32)
    assert torch.equal(module(x, w, t), linear_cross_entropy(x, w, t, accum_dtype=torch.float32))


@pytest.mark.parametrize("memory", [1, "min", "auto"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_accuracy_and_predicted_tokens(memory, reduction):
    """The argmax of each token's logits (from the row kernel in each chunk's pass; "min" runs 8 MiB chunks
    for it), -1 on ignored tokens (compacted out); the accuracy; loss and gradients unchanged by asking."""
    x, w, b, t, cw = _inputs(torch.float32, class_weight=True, ignore=True, seed=5)
    kw = dict(linear_bias=b, weight=cw, reduction=reduction, memory=memory)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, accuracy, predicted = linear_cross_entropy(
        xa, w, t, return_token_accuracy=True, return_predicted_tokens=True, **kw
    )
    same_plan = dict(
        kw, memory=8 * 2**20 if memory == "min" else memory
    )  # "min" with the argmax: 8 MiB chunks
    plain = linear_cross_entropy(xb, w, t, **same_plan)
    assert torch.equal(loss.detach(), plain.detach())
    loss.sum().backward()
    plain.sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    valid = t != -100
    expected = torch.where(valid, (x.double() @ w.double().T + b.double()).argmax(-1), -1)
    assert predicted.shape == t.shape and torch.equal(predicted, expected)
    right = ((expected == t) & valid).float()
    assert torch.equal(accuracy, right.sum() / valid.sum() if reduction == "mean" else right)
