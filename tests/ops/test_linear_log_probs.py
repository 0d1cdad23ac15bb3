"""fuselm.ops.linear_log_probs against a float64 full-logits formula, under the numerics rule.

Every output and every gradient: err(fuselm) <= 2 * err(torch eager, same dtype) + ATOL[dtype], errors
against float64 (fuselm.ops._common.testing). Eager is the naive composition a user writes, in the input
dtype: F.linear, the logit transform, log_softmax, gather, the entropy sum; the float64 reference is the
same formula on float64 copies. Upstream gradients are random per token, on log_probs, entropy and lse,
one at a time and together.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, TRITON_PATH, kernel_device
from kit.oracles import naive_log_probs

import fuselm
import fuselm.ops.linear_log_probs.op as llp_op
import fuselm.ops.linear_log_probs.reference as llp_ref
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.linear_log_probs import LogProbs, linear_log_probs, linear_log_probs_reference

DEVICE = kernel_device()
H, V = 32, 257
SHAPE = (2, 11)  # leading dims of input: N = 22 tokens
ALL = ("log_probs", "entropy", "lse", "log_sum_sq_probs", "mean_logits", "is_top1")
FLOAT_OUTS = ALL[:5]
gpu = pytest.mark.gpu


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


# ---- helpers ----


def _inputs(dtype, *, shape=SHAPE, h=H, v=V, bias=True, ignore=True, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(*shape, h, generator=g)
    w = torch.randn(v, h, generator=g) * (2.0 / math.sqrt(h))  # logits ~ N(0, 4)
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if ignore:
        t[torch.randperm(n, generator=g)[: n // 4]] = -100
    t = t.reshape(shape)

    def put(a):
        return a.to(device=device, dtype=dtype) if a is not None else None

    return put(x), put(w), put(b), t.to(device)


def _upstream(shape, dtype, names, seed=1):
    """Random per-token upstream gradients (representable in `dtype`) for the outputs in `names`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("log_probs", "entropy", "lse"):
        r = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(torch.float64)
        if name in names:
            out[name] = r
    return out


def _run(fn, x, w, b, t, upstream, dtype=None, **kw):
    """Outputs of fn and the gradients of sum_k upstream[k] * out[k] w.r.t. input, weight, bias."""
    dtype = dtype or x.dtype
    xs = x.detach().to(dtype).requires_grad_()
    ws = w.detach().to(dtype).requires_grad_()
    bs = b.detach().to(dtype).requires_grad_() if b is not None else None
    out = fn(xs, ws, t, linear_bias=bs, **kw)
    res = {name: getattr(out, name).detach() for name in ALL if getattr(out, name) is not None}
    if upstream:
        objective = sum((getattr(out, k) * u.to(getattr(out, k))).sum() for k, u in upstream.items())
        leaves = [xs, ws] + ([bs] if bs is not None else [])
        grads = torch.autograd.grad(objective, leaves)
        res.update(dx=grads[0], dw=grads[1])
        if bs is not None:
            res["db"] = grads[2]
    return res


def _ours(x, w, t, **kw):
    return linear_log_probs(x, w, t, outputs=ALL, **kw)


def _check(ours, eager, ref, dtype, prefix=""):
    for key in ref:
        if key == "is_top1":
            continue
        assert ours[key].shape == ref[key].shape, key
        assert_numerics(prefix + key, ours[key], eager[key], ref[key], dtype)


def _compare(dtype, inputs, upstream_names=("log_probs", "entropy", "lse"), **kw):
    x, w, b, t = inputs
    up = _upstream(t.shape, dtype, upstream_names)
    ours = _run(_ours, x, w, b, t, up, **kw)
    opts = {k: a for k, a in kw.items() if k != "memory"}
    eager = _run(naive_log_probs, x, w, b, t, up, **opts)
    ref = _run(naive_log_probs, x, w, b, t, up, dtype=torch.float64, **opts)
    for name in FLOAT_OUTS:
        want = torch.float64 if dtype == torch.float64 else torch.float32
        assert ours[name].dtype == want, name
    assert ours["is_top1"].dtype == torch.bool
    _check(ours, eager, ref, dtype)
    # is_top1 exactly where the float64 argmax is clear (a near-tie may flip in low precision)
    clear = _top1_margin(x, w, b, t, **opts) > 1e-2
    assert torch.equal(ours["is_top1"][clear], ref["is_top1"][clear])
    return ours, ref


def _top1_margin(x, w, b, t, temperature=1.0, softcap=None, logit_scale=1.0, **_):
    z = F.linear(x.double(), w.double(), b.double() if b is not None else None) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if z.shape[-1] == 1:
        return torch.full(z.shape[:-1], math.inf, dtype=z.dtype, device=z.device)
    top2 = (z / temperature).topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


INPUT_KEYS = ("shape", "h", "v", "bias", "ignore", "seed")
CASES = {
    "plain": {},
    "no_bias_no_ignore": {"bias": False, "ignore": False},
    "temperature": {"temperature": 0.7},
    "softcap": {"softcap": 5.0},
    "logit_scale": {"logit_scale": 0.6},
    "all": {"temperature": 1.3, "softcap": 4.0, "logit_scale": 1.7},
}
UPSTREAM = {
    "log_probs": ("log_probs",),
    "entropy": ("entropy",),
    "lse": ("lse",),
    "log_probs_entropy": ("log_probs", "entropy"),
    "all": ("log_probs", "entropy", "lse"),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _split(case):
    opts = CASES[case]
    return {k: opts[k] for k in INPUT_KEYS if k in opts}, {
        k: a for k, a in opts.items() if k not in INPUT_KEYS
    }


# ---- numerics ----


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_numerics(dtype, case):
    """Every output and the gradients of input, weight, bias under random upstream gradients on all three."""
    in_opts, kw = _split(case)
    _compare(dtype, _inputs(dtype, **in_opts), **kw)


@pytest.mark.parametrize("upstream", list(UPSTREAM))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
def test_upstream_combinations(dtype, upstream):
    """Upstream gradients on log_probs, entropy, lse: one at a time, and together."""
    in_opts, kw = _split("all")
    _compare(dtype, _inputs(dtype, **in_opts), UPSTREAM[upstream], **kw)


@pytest.mark.parametrize("memory", ["auto", "min", 1, 3000])
def test_memory_plans(memory):
    """Every budget gives the same numbers (memory=1 and 3000: chunks of 16 rows, slabs of a few classes)."""
    _compare(torch.float32, _inputs(torch.float32), temperature=0.8, softcap=6.0, memory=memory)


def test_slab_edges():
    """Slabs whose width is not a multiple of the kernels' column block, with targets just past a slab's
    end (in the masked columns of its last block) and at both ends of the vocabulary."""
    dtype = torch.float32
    x, w, b, t = _inputs(dtype, shape=(22,), h=16, v=781, ignore=False)
    t[:6] = torch.tensor([384, 400, 450, 511, 0, 780])
    budget = 22 * (llp_op.STATE_ROWS * 4 + 64) + 384 * 22 * 4  # forward slabs of 384 classes
    assert llp_op.slab_cols(budget, 22 * (llp_op.STATE_ROWS * 4 + 64), 22, 781, 4, 128) == 384
    _compare(dtype, (x, w, b, t), temperature=0.9, memory=budget)


@pytest.mark.parametrize(
    "shape,v",
    [((1,), 781), ((63,), 3000), ((3, 1, 5), 64), ((1, 1), 1)],
    ids=["1x781", "63x3000", "3x1x5", "1x1"],
)
def test_odd_shapes(shape, v):
    dtype = torch.float32
    _compare(dtype, _inputs(dtype, shape=shape, v=v, h=24, ignore=False), temperature=0.9)


def test_float64_runs_the_reference():
    _compare(torch.float64, _inputs(torch.float64), temperature=0.8, softcap=3.0, logit_scale=1.1)


def test_reference_matches_naive_float64():
    """The chunked reference (forward chunks, backward slabs) in float64 equals the full-logits formula."""
    x, w, b, t = _inputs(torch.float64, seed=3)
    kw = dict(temperature=0.6, softcap=3.0, logit_scale=1.4)
    up = _upstream(t.shape, torch.float64, ("log_probs", "entropy", "lse"))

    def ref(x, w, t, linear_bias=None, **k):
        return LogProbs(*linear_log_probs_reference(x, w, t, linear_bias=linear_bias, budget=40000, **k))

    ours = _run(ref, x, w, b, t, up, **kw)
    want = _run(naive_log_probs, x, w, b, t, up, **kw)
    for key in want:
        torch.testing.assert_close(ours[key], want[key], rtol=1e-10, atol=1e-12)


# ---- semantics ----


def test_outputs_selection():
    """Fields not asked for are None; log_probs always there; the values do not depend on the selection."""
    x, w, b, t = _inputs(torch.float32)
    full = linear_log_probs(x, w, t, linear_bias=b, outputs=ALL)
    for names in [(), ("entropy",), "lse", ("is_top1", "mean_logits"), ("log_sum_sq_probs",)]:
        out = linear_log_probs(x, w, t, linear_bias=b, outputs=names)
        asked = {names} if isinstance(names, str) else set(names)
        for name in ALL:
            value = getattr(out, name)
            if name == "log_probs" or name in asked:  # kernels specialized per selection: a few ulp apart
                torch.testing.assert_close(value, getattr(full, name))
            else:
                assert value is None, name
    assert isinstance(full, LogProbs) and isinstance(full, tuple)


def test_non_differentiable_outputs():
    x, w, b, t = _inputs(torch.float32)
    x.requires_grad_()
    out = linear_log_probs(x, w, t, linear_bias=b, outputs=ALL)
    for name in ("log_probs", "entropy", "lse"):
        assert getattr(out, name).requires_grad, name
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1"):
        assert not getattr(out, name).requires_grad, name


@pytest.mark.parametrize("memory", ["auto", "min"])
@pytest.mark.parametrize("output", ["log_probs", "entropy", "lse"])
def test_double_backward_raises(output, memory):
    """create_graph=True raises a RuntimeError naming the op and create_graph (once: "element 0 of tensors
    does not require grad" at the second backward)."""
    x, w, b, t = _inputs(torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_log_probs(xs, ws, t, linear_bias=b, outputs=(output,), memory=memory)
    with pytest.raises(
        RuntimeError, match=r"fuselm\.linear_log_probs: double backward \(create_graph=True\)"
    ):
        torch.autograd.grad(getattr(out, output).sum(), (xs, ws), create_graph=True)
    out = linear_log_probs(xs, ws, t, linear_bias=b, outputs=(output,), memory=memory)
    getattr(out, output).sum().backward()  # a plain backward is unaffected
    assert xs.grad is not None and ws.grad is not None


def test_ignored_tokens_are_zero_and_cost_nothing(monkeypatch):
    """Ignored tokens: every output 0 (False), zero gradient; the numbers of the batch without them;
    compaction on == off."""
    x, w, b, t = _inputs(torch.float32, seed=5)
    valid = t != -100
    up = {k: u.to(t.device) for k, u in _upstream(t.shape, torch.float32, ALL[:3]).items()}
    kw = dict(temperature=0.9, softcap=5.0)
    full = _run(_ours, x, w, b, t, up, **kw)
    for name in ALL:
        assert not full[name][~valid].any(), name
    assert not full["dx"][~valid].any()
    sub = _run(_ours, x[valid], w, b, t[valid], {k: u[valid] for k, u in up.items()}, **kw)
    for name in ALL:
        torch.testing.assert_close(full[name][valid], sub[name])
    for key in ("dw", "db"):
        torch.testing.assert_close(full[key], sub[key])
    torch.testing.assert_close(full["dx"][valid], sub["dx"])
    monkeypatch.setattr(llp_op, "compaction_allowed", lambda device: False)
    off = _run(_ours, x, w, b, t, up, **kw)
    for key in full:
        torch.testing.assert_close(full[key], off[key])


@pytest.mark.parametrize("compaction", [True, False])
def test_all_ignored(monkeypatch, compaction):
    monkeypatch.setattr(llp_op, "compaction_allowed", lambda device: compaction)
    x, w, b, t = _inputs(torch.float32)
    t = torch.full_like(t, -100)
    up = _upstream(t.shape, torch.float32, ("log_probs", "entropy", "lse"))
    res = _run(_ours, x, w, b, t, up)
    for key, value in res.items():
        assert not value.any(), key


def test_other_ignore_index_and_int32_target():
    x, w, b, t = _inputs(torch.float32, ignore=False)
    t = t.to(torch.int32)
    t[0, :3] = 5  # ignore a real class
    _compare(torch.float32, (x, w, b, t), ignore_index=5, temperature=0.5)


def test_out_of_range_target(monkeypatch):
    """Eager: ValueError (found in the compaction sync). Without the sync (compile, graph capture): NaN
    log_probs on that token, 0 elsewhere, no gradient; the other tokens are untouched."""
    x, w, b, t = _inputs(torch.float32, ignore=False)
    t = t.clone()
    t[0, 1] = V + 3
    with pytest.raises(ValueError, match="target"):
        linear_log_probs(x, w, t)
    t[0, 1] = -7
    with pytest.raises(ValueError, match="target"):
        linear_log_probs(x, w, t)
    monkeypatch.setattr(llp_op, "compaction_allowed", lambda device: False)
    up = _upstream(t.shape, torch.float32, ("log_probs", "entropy", "lse"))
    up["log_probs"][0, 1] = 0.0  # the NaN itself would carry NaN into any sum
    res = _run(_ours, x, w, b, t, {k: u.nan_to_num() for k, u in up.items()})
    assert torch.isnan(res["log_probs"][0, 1])
    for name in ALL[1:]:
        assert not res[name][0, 1].any(), name
    assert not res["dx"][0, 1].any()
    t_ok = t.clone()
    t_ok[0, 1] = -100
    ok = _run(_ours, x, w, b, t_ok, up)
    for key in ("dw", "db"):
        torch.testing.assert_close(res[key], ok[key])
    keep = torch.ones(SHAPE, dtype=torch.bool, device=t.device)
    keep[0, 1] = False
    torch.testing.assert_close(res["log_probs"][keep], ok["log_probs"][keep])


def test_is_top1_ties():
    """argmax semantics: the first of tied maxima is the top-1 token."""
    h, v = 4, 8
    x = torch.ones(3, h, device=DEVICE)
    w = torch.zeros(v, h, device=DEVICE)
    w[2] = w[5] = 1.0  # classes 2 and 5 tie for the max
    t = torch.tensor([2, 5, 0], device=DEVICE)
    out = linear_log_probs(x, w, t, outputs=("is_top1",))
    assert out.is_top1.tolist() == [True, False, False]


def test_leading_shapes():
    """[B, T, H], [N, H] and one token [H] (target a 0-d tensor)."""
    x, w, b, t = _inputs(torch.float32, shape=(2, 3, 4))
    out = linear_log_probs(x, w, t, linear_bias=b, outputs=ALL)
    flat = linear_log_probs(x.reshape(-1, H), w, t.reshape(-1), linear_bias=b, outputs=ALL)
    for name in ALL:
        assert getattr(out, name).shape == (2, 3, 4)
        torch.testing.assert_close(getattr(out, name).reshape(-1), getattr(flat, name))
    one = linear_log_probs(x[0, 0, 0], w, t[0, 0, 0], linear_bias=b, outputs=ALL)
    assert one.log_probs.shape == ()
    torch.testing.assert_close(one.entropy, out.entropy[0, 0, 0])


def test_autocast_casts_like_f_linear():
    low = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    x, w, b, t = _inputs(torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    with torch.autocast(DEVICE, dtype=low):
        out = linear_log_probs(x, w, t, linear_bias=b, outputs=("entropy",))
    want = linear_log_probs(x.to(low), w.to(low), t, linear_bias=b.to(low), outputs=("entropy",))
    assert out.log_probs.dtype == torch.float32
    torch.testing.assert_close(out.log_probs, want.log_probs, rtol=0, atol=0)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_frozen_weight_and_frozen_input():
    """Only the gradients asked for are computed (and they are right)."""
    dtype = torch.float32
    x, w, b, t = _inputs(dtype)
    for frozen in ("x", "w"):
        xs = x.clone().requires_grad_(frozen != "x")
        ws = w.clone().requires_grad_(frozen != "w")
        out = linear_log_probs(xs, ws, t, outputs=("entropy",))
        (out.log_probs.sum() + out.entropy.sum()).backward()
        full = _run(_ours, x, w, None, t, _ones(t))
        if frozen == "x":
            assert xs.grad is None
            torch.testing.assert_close(ws.grad, full["dw"])
        else:
            assert ws.grad is None
            torch.testing.assert_close(xs.grad, full["dx"])


def _ones(t):
    one = torch.ones(t.shape, dtype=torch.float64)
    return {"log_probs": one, "entropy": one}


def test_no_grad_forward():
    x, w, b, t = _inputs(torch.float32)
    with torch.no_grad():
        out = linear_log_probs(x.requires_grad_(), w, t, linear_bias=b)
    assert out.log_probs.grad_fn is None


# ---- argument checking ----


def _bad_calls():
    x, w, b, t = _inputs(torch.float32, device="cpu")
    meta = torch.device("meta")
    return [
        ("input", dict(input=x.to(torch.int64))),
        ("linear_weight", dict(linear_weight=w[:, :-1])),
        ("linear_weight", dict(linear_weight=w.half())),
        ("linear_weight", dict(linear_weight=w[0])),
        ("linear_weight", dict(linear_weight=w.to(meta))),
        ("linear_weight", dict(linear_weight=w[:0], linear_bias=None)),
        ("target", dict(target=t[:, :-1])),
        ("target", dict(target=t.float())),
        ("target", dict(target=t.to(meta))),
        ("linear_bias", dict(linear_bias=b[:-1])),
        ("linear_bias", dict(linear_bias=b.double())),
        ("ignore_index", dict(ignore_index=1.0)),
        ("temperature", dict(temperature=0.0)),
        ("temperature", dict(temperature=-1.0)),
        ("temperature", dict(temperature=float("inf"))),
        ("temperature", dict(temperature="1")),
        ("softcap", dict(softcap=0.0)),
        ("softcap", dict(softcap=-2.0)),
        ("logit_scale", dict(logit_scale=float("nan"))),
        ("logit_scale", dict(logit_scale=None)),
        ("outputs", dict(outputs=("log_probs", "entropies"))),
        ("outputs", dict(outputs="perplexity")),
        ("outputs", dict(outputs=3)),
        ("memory", dict(memory="max")),
        ("memory", dict(memory=0)),
        ("memory", dict(memory=1.5)),
        ("memory", dict(memory=True)),
    ]


@pytest.mark.parametrize("name,change", _bad_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_value_errors(name, change):
    x, w, b, t = _inputs(torch.float32, device="cpu")
    args = dict(input=x, linear_weight=w, target=t, linear_bias=b)
    args.update(change)
    with pytest.raises(ValueError, match=name):
        linear_log_probs(**args)


# ---- torch.compile ----


def _compile_check(backend, dtype, memory="auto", device=DEVICE):
    x, w, b, t = _inputs(dtype, device=device)
    kw = dict(temperature=0.8, softcap=5.0, logit_scale=1.2, memory=memory)

    def fn(x, w, t, linear_bias=None, **k):
        return linear_log_probs(x, w, t, linear_bias=linear_bias, outputs=ALL, **kw)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    up = _upstream(t.shape, dtype, ("log_probs", "entropy", "lse"))
    ours = _run(compiled, x, w, b, t, up)
    eager = _run(naive_log_probs, x, w, b, t, up, **{k: a for k, a in kw.items() if k != "memory"})
    ref = _run(
        naive_log_probs, x, w, b, t, up, dtype=torch.float64, **{k: a for k, a in kw.items() if k != "memory"}
    )
    _check(ours, eager, ref, dtype)


@pytest.mark.skipif(HAS_CUDA, reason="CPU variant (GPU runs test_gpu_compile)")
def test_compile_fullgraph_cpu():
    """Traces without a graph break (aot_eager: no C++ toolchain needed); every row is computed, ignored
    ones zeroed."""
    torch._dynamo.reset()
    _compile_check("aot_eager", torch.float32)


# ---- GPU ----


@gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_gpu_compile(dtype, backend):
    torch._dynamo.reset()
    _compile_check(backend, dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_gpu_realistic_shape(dtype):
    """A mid-size odd shape: several chunks and slabs, every option on."""
    inputs = _inputs(dtype, shape=(3, 1001), h=512, v=32003)
    _compare(dtype, inputs, temperature=0.9, softcap=30.0, logit_scale=1.1, memory=64 * 2**20)


@gpu
def test_gpu_log_probs_closer_than_fp32_logits_torch():
    """bf16 inputs: log_probs at least as close to float64 as a computation on fp32 logits (what TRL's head
    does with cast_lm_head_to_fp32, and TRL's kernel itself when importable)."""
    dtype = torch.bfloat16
    x, w, b, t = _inputs(dtype, shape=(2048,), h=1024, v=32003, bias=False, ignore=False)
    ref = naive_log_probs(x.double(), w.double(), t).log_probs
    ours = linear_log_probs(x, w, t).log_probs
    z32 = F.linear(x.float(), w.float())
    fp32 = torch.log_softmax(z32, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert_numerics("log_probs vs fp32 logits", ours, fp32, ref, torch.float32)
    err_ours = (ours.double() - ref).norm() / ref.norm()
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except Exception:  # pragma: no cover - depends on the installed TRL
        return
    theirs = ChunkedLogProbFunction.apply(x, w, None, t, 1.0, 4096, None, 1.0, ("log_probs",))[0]
    err_trl = (theirs.double() - ref).norm() / ref.norm()
    assert err_ours <= err_trl * 1.01 + 1e-7, (err_ours.item(), err_trl.item())


@gpu
def test_gpu_cuda_graph(monkeypatch):
    """Capture fwd + bwd in a CUDA graph (no sync: no compaction under capture) and replay it."""
    dtype = torch.bfloat16
    shape, h, v = (4, 63), 64, 3001
    x, w, b, t = _inputs(dtype, shape=shape, h=h, v=v)
    kw = dict(temperature=0.8, softcap=20.0)
    up = _upstream(t.shape, dtype, ("log_probs", "entropy", "lse"))
    xs, ws, bs = (a.detach().clone().requires_grad_() for a in (x, w, b))
    ups = {k: u.to(device="cuda", dtype=torch.float32) for k, u in up.items()}

    def step():
        out = linear_log_probs(xs, ws, t, linear_bias=bs, outputs=ALL, **kw)
        sum((getattr(out, k) * u).sum() for k, u in ups.items()).backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), monkeypatch.context() as m:
        m.setattr(llp_op, "compaction_allowed", lambda device: False)
        for _ in range(3):
            step()
            xs.grad = ws.grad = bs.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (0, 7):
        x2, w2, b2, _ = _inputs(dtype, shape=shape, h=h, v=v, seed=seed)
        with torch.no_grad():
            xs.copy_(x2)
            ws.copy_(w2)
            bs.copy_(b2)
        graph.replay()
        torch.cuda.synchronize()
        ours = {name: getattr(out, name).clone() for name in ALL}
        ours.update(dx=xs.grad.clone(), dw=ws.grad.clone(), db=bs.grad.clone())
        eager = _run(naive_log_probs, x2, w2, b2, t, up, **kw)
        ref = _run(naive_log_probs, x2, w2, b2, t, up, dtype=torch.float64, **kw)
        _check(ours, eager, ref, dtype, f"graph seed {seed}:")


@gpu
@pytest.mark.parametrize("memory, limit_mib", [("auto", 256), ("min", 8 + 64 + 8)])
def test_gpu_extra_memory(memory, limit_mib):
    """Extra memory beyond the inputs and the returned gradients at Llama-3 shapes (bf16), log_probs and
    entropy with per-token gradients: at most 256 MiB under "auto"; under "min" the 8 MiB buffers plus
    the part of the fp32 d input accumulator that the returned bf16 d input does not hold."""
    n, h, v = 8192, 4096, 128256
    dev = torch.device("cuda")
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    a, e = torch.randn(2, n, device=dev)

    def step():
        out = linear_log_probs(x, w, t, outputs=("entropy",), memory=memory)
        ((out.log_probs * a).sum() + (out.entropy * e).sum()).backward()

    for _ in range(2):
        step()
        x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - x.grad.nbytes - w.grad.nbytes
    assert extra <= limit_mib * 2**20, f"extra {extra / 2**20:.1f} MiB"


@gpu
@pytest.mark.slow
def test_gpu_int64_rows_times_vocab():
    """N * V > 2^31 (N=20000, V=128256): outputs and gradients under the numerics rule (float64 side: the
    chunked reference)."""
    dtype = torch.bfloat16
    n, h, v = 20000, 128, 128256
    assert n * v > 2**31
    x, w, _, t = _inputs(dtype, shape=(n,), h=h, v=v, bias=False)
    up = _upstream(t.shape, dtype, ("log_probs", "entropy"))
    ours = _run(_ours, x, w, None, t, up)
    eager = _run(naive_log_probs, x, w, None, t, up)
    ref = _run(_ours, x, w, None, t, up, dtype=torch.float64)
    _check(ours, eager, ref, dtype)
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device=x.device)
    for key in ("log_probs", "entropy", "dx"):
        assert_numerics(key + " rows", ours[key][rows], eager[key][rows], ref[key][rows], dtype)


def test_public_names():
    assert fuselm.linear_log_probs is linear_log_probs and fuselm.LogProbs is LogProbs
    assert llp_ref.OUTPUT_NAMES == ALL
    assert TRITON_PATH in (True, False)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("kept", ["all", "most", "few", "none"])
def test_dx_accumulator_in_the_returned_storage(dtype, kept):
    """The fp32 d input accumulator lives partly (16-bit) or wholly (fp32) in the storage of the returned d
    input; rounding it in place and moving compacted rows to their places gives dx[rows] = acc, 0 elsewhere
    (chunks of 3 rows: every overlap case of the in-place moves)."""
    n_total, h = 13, 5
    n = {"all": 13, "most": 10, "few": 4, "none": 0}[kept]
    g = torch.Generator().manual_seed(0)
    rows = torch.randperm(n_total, generator=g)[:n].sort().values if n < n_total else None
    want = torch.randn(n, h, generator=g, dtype=torch.float64)
    dx, top, bottom = llp_op._dx_accumulator(n_total, n, h, dtype, torch.device("cpu"))
    assert top.shape[0] + bottom.shape[0] == n and top.dtype == bottom.dtype == torch.float32
    assert top.shape[0] == min(n, n_total * dx.element_size() // 4)
    top += want[: top.shape[0]].float()
    bottom += want[top.shape[0] :].float()
    llp_op._dx_finish(dx, top, bottom, rows, chunk_rows=3)
    expect = torch.zeros(n_total, h, dtype=dtype)
    expect[rows if rows is not None else slice(None)] = want.to(dtype)
    torch.testing.assert_close(dx, expect, rtol=0, atol=0)


def test_plan_sizes():
    """Slab widths at the Llama-3 shapes in bf16 under "auto" (256 MiB) and "min" (8 MiB); README.md counts
    them."""
    n, h, v = 8192, 4096, 128256
    per_row = n * (llp_op.STATE_ROWS * 4 + 64)
    assert llp_op.slab_cols(256 * 2**20, per_row, n, v, 4, 1024) == 8064  # forward: fp32 logits
    assert llp_op.slab_cols(8 * 2**20, 0, n, v, 4, 128) == 256
    bottom = (n - llp_op.hosted_rows(n, 2)) * h * 4  # 64 MiB of fp32 accumulator beyond the bf16 d input
    assert bottom == 64 * 2**20
    assert llp_op.slab_cols(256 * 2**20, bottom + n * 64, n, v, 2, 1024) == 12160  # backward: bf16
    assert llp_op.slab_cols(8 * 2**20, 0, n, v, 2, 128) == 512
    n, v = 16384, 151936
    bottom = (n - llp_op.hosted_rows(n, 2)) * h * 4  # 128 MiB
    assert llp_op.slab_cols(256 * 2**20, n * (llp_op.STATE_ROWS * 4 + 64), n, v, 4, 1024) == 3968
    assert llp_op.slab_cols(256 * 2**20, bottom + n * 64, n, v, 2, 1024) == 3968
    assert llp_op.slab_cols(2**20, 0, 4, 100, 2, 1024) == 100
    assert llp_op.slab_cols(0, 10, 8, 5000, 2, 1024) == 1024
