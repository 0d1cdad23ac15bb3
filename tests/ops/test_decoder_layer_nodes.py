"""fuselm.ops.decoder_layer: the two autograd nodes of a pre-norm decoder layer (norm_qkv_rotary,
attention_output_mlp). Numerics (docs/design.md section 5) of every output and gradient against the
reference compositions in the same dtype and in float64, one node each, what is saved, the second
backward, the paths that run the separate ops (float64, autocast), and the argument checks."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_device, triton_path

from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.decoder_layer import (
    attention_output_mlp,
    attention_output_mlp_reference,
    norm_qkv_rotary,
    norm_qkv_rotary_reference,
)
from fuselm.ops.decoder_layer.op import AttentionOutputMLPFunction, NormQKVRotaryFunction

DEVICE = kernel_device()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
B, T, H, D, HQ, HK, I = 2, 7, 64, 16, 4, 2, 96
EPS = 1e-5

triton_path_only = pytest.mark.skipif(not triton_path(), reason="the nodes run on the Triton path only")


def _skip_interpreter_half(dtype):
    if DEVICE == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter truncates fp32 to 16-bit floats; checked on the GPU")


def _rand(gen, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _input_operands(gen, dtype, bias, casting="llama"):
    x = _rand(gen, dtype, B, T, H)
    norm_w = 1 + _rand(gen, dtype, H, scale=0.1)
    ws = [_rand(gen, dtype, n * D, H, scale=H**-0.5) for n in (HQ, HK, HK)]
    bs = [_rand(gen, dtype, n * D, scale=0.1) if bias else None for n in (HQ, HK, HK)]
    angle = torch.arange(T)[:, None] * torch.rand(D // 2, generator=gen)
    emb = torch.cat([angle, angle], -1)[None].expand(B, T, D)
    return x, norm_w, ws, bs, emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _output_operands(gen, dtype, bias):
    attn = _rand(gen, dtype, B, T, HQ, D)
    residual = _rand(gen, dtype, B, T, H)
    norm_w = 1 + _rand(gen, dtype, H, scale=0.1)
    wo = _rand(gen, dtype, H, HQ * D, scale=(HQ * D) ** -0.5)
    wg, wu = _rand(gen, dtype, I, H, scale=H**-0.5), _rand(gen, dtype, I, H, scale=H**-0.5)
    wd = _rand(gen, dtype, H, I, scale=I**-0.5)
    biases = [_rand(gen, dtype, n, scale=0.1) if bias else None for n in (H, I, I, H)]
    return [attn, residual, wo, norm_w, wg, wu, wd], biases


def _leaves(tensors, dtype):
    ours = [t.clone().requires_grad_() for t in tensors]
    eager = [t.clone().requires_grad_() for t in tensors]
    ref = [t.double().requires_grad_() for t in tensors]
    return ours, eager, ref


def _check(outs, eagers, refs, leaves, dtype, gen):
    """Every output and every leaf's gradient under the numerics rule."""
    ours_l, eager_l, ref_l = leaves
    dys = [_rand(gen, dtype, *o.shape) for o in eagers]
    for i, (o, e, r) in enumerate(zip(outs, eagers, refs, strict=True)):
        assert o.shape == e.shape and o.dtype == dtype
        assert_numerics(f"out {i}", o, e, r, dtype)
    got = torch.autograd.grad(outs, ours_l, dys)
    want = torch.autograd.grad(eagers, eager_l, dys)
    ref = torch.autograd.grad(refs, ref_l, [d.double() for d in dys])
    for i, (g, e, r) in enumerate(zip(got, want, ref, strict=True)):
        assert g.dtype == dtype and g.shape == e.shape
        assert_numerics(f"grad {i}", g, e, r, dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_norm_qkv_rotary_numerics(dtype, bias, gen):
    _skip_interpreter_half(dtype)
    x, norm_w, ws, bs, cos, sin = _input_operands(gen, dtype, bias)
    tensors = [x, norm_w, *ws, *(b for b in bs if b is not None)]
    leaves = _leaves(tensors, dtype)

    def run(fn, ts, tables):
        biases = dict(zip(("q_bias", "k_bias", "v_bias"), ts[5:], strict=False))
        return fn(*ts[:5], *tables, head_dim=D, eps=EPS, **biases)

    outs = run(norm_qkv_rotary, leaves[0], (cos, sin))
    if triton_path():
        assert type(outs[0].grad_fn).__name__ == "NormQKVRotaryFunctionBackward"  # one node
        assert outs[0].grad_fn is outs[1].grad_fn is outs[2].grad_fn
    eagers = run(norm_qkv_rotary_reference, leaves[1], (cos, sin))
    refs = run(norm_qkv_rotary_reference, leaves[2], (cos.double(), sin.double()))
    _check(outs, eagers, refs, leaves, dtype, gen)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_attention_output_mlp_numerics(dtype, bias, activation, gen):
    _skip_interpreter_half(dtype)
    tensors, biases = _output_operands(gen, dtype, bias)
    leaves = _leaves(tensors + [b for b in biases if b is not None], dtype)

    def run(fn, ts):
        named = dict(zip(("o_bias", "gate_bias", "up_bias", "down_bias"), ts[7:], strict=False))
        return (fn(*ts[:7], eps=EPS, activation=activation, **named),)

    outs = run(attention_output_mlp, leaves[0])
    if triton_path():
        assert type(outs[0].grad_fn).__name__ == "AttentionOutputMLPFunctionBackward"
    _check(
        outs,
        run(attention_output_mlp_reference, leaves[1]),
        run(attention_output_mlp_reference, leaves[2]),
        leaves,
        dtype,
        gen,
    )


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
def test_norm_styles(casting, offset, gen):
    """Gemma's (1 + weight) and the all-in-dtype style reach both nodes' norms."""
    x, norm_w, ws, _, cos, sin = _input_operands(gen, torch.float32, False)
    style = dict(norm_offset=offset, norm_casting=casting, eps=EPS)
    got = norm_qkv_rotary(x, norm_w, *ws, cos, sin, head_dim=D, **style)
    want = norm_qkv_rotary_reference(
        x.double(),
        norm_w.double(),
        *(w.double() for w in ws),
        cos.double(),
        sin.double(),
        head_dim=D,
        **style,
    )
    eager = norm_qkv_rotary_reference(x, norm_w, *ws, cos, sin, head_dim=D, **style)
    for i, (g, e, r) in enumerate(zip(got, eager, want, strict=True)):
        assert_numerics(f"qkv {i}", g, e, r)
    tensors, _ = _output_operands(gen, torch.float32, False)
    got = attention_output_mlp(*tensors, **style)
    eager = attention_output_mlp_reference(*tensors, **style)
    want = attention_output_mlp_reference(*(t.double() for t in tensors), **style)
    assert_numerics("out", got, eager, want)


@triton_path_only
def test_saved_tensors_are_the_separate_ops(gen):
    """What each node keeps for backward: x, the normalized y and rstd (not q, k, v); attn, the sum s, its
    rstd, h and the gate / up pre-activations (not the MLP product, not the output)."""
    x, norm_w, ws, _, cos, sin = _input_operands(gen, torch.float32, False)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = norm_qkv_rotary(x, norm_w, *ws, cos, sin, head_dim=D, eps=EPS)
    activations = sorted(tuple(t.shape) for t in saved if t.dim() >= 1 and t.shape[0] == B * T)
    assert activations == [(B * T,), (B * T, H), (B * T, H)]
    sum(o.sum() for o in outs).backward()
    tensors, _ = _output_operands(gen, torch.float32, False)
    tensors[0].requires_grad_()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attention_output_mlp(*tensors, eps=EPS)
    activations = sorted(tuple(t.shape) for t in saved if t.dim() >= 1 and t.shape[0] == B * T)
    assert activations == sorted([(B * T, HQ * D), (B * T, H), (B * T,), (B * T, H), (B * T, I), (B * T, I)])
    out.sum().backward()


@triton_path_only
def test_second_backward_raises(gen):
    tensors, _ = _output_operands(gen, torch.float32, False)
    tensors[1].requires_grad_()
    out = attention_output_mlp(*tensors, eps=EPS)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same graph twice"):
        out.sum().backward()


@triton_path_only
def test_partial_gradients(gen):
    """Only the residual stream requires grad (frozen weights): the nodes give it and nothing else."""
    x, norm_w, ws, _, cos, sin = _input_operands(gen, torch.float32, False)
    x64 = x.double().requires_grad_()
    x.requires_grad_()
    q, k, v = norm_qkv_rotary(x, norm_w, *ws, cos, sin, head_dim=D, eps=EPS)
    assert q.grad_fn.needs_input_grad[:2] == (True, False)
    (dx,) = torch.autograd.grad(q.sum() + k.sum() + v.sum(), (x,))
    q, k, v = norm_qkv_rotary_reference(
        x64, norm_w.double(), *(w.double() for w in ws), cos.double(), sin.double(), head_dim=D, eps=EPS
    )
    (want,) = torch.autograd.grad(q.sum() + k.sum() + v.sum(), (x64,))
    torch.testing.assert_close(dx.double(), want, rtol=1e-4, atol=1e-4)  # fp32 against fp64: rounding only


@triton_path_only
def test_norm_qkv_rotary_one_bias_and_a_frozen_projection(gen):
    """Node 1 with a bias on q only (k and v without) and a frozen k projection gives what the reference
    gives, and its gradients accumulate over two backward passes like any gradient."""
    x, norm_w, ws, _, cos, sin = _input_operands(gen, torch.float32, False)
    q_bias = _rand(gen, torch.float32, HQ * D, scale=0.1)
    trainable = {"x": x, "norm_w": norm_w, "wq": ws[0], "wv": ws[2], "q_bias": q_bias}

    def run(fn, t, tables):
        wk = ws[1].to(t["x"].dtype)  # frozen
        return fn(t["x"], t["norm_w"], t["wq"], wk, t["wv"], *tables, head_dim=D, eps=EPS, q_bias=t["q_bias"])

    ours = {n: v.clone().requires_grad_() for n, v in trainable.items()}
    eager = {n: v.clone().requires_grad_() for n, v in trainable.items()}
    ref = {n: v.double().requires_grad_() for n, v in trainable.items()}
    outs = run(norm_qkv_rotary, ours, (cos, sin))
    assert type(outs[0].grad_fn).__name__ == "NormQKVRotaryFunctionBackward"
    eagers = run(norm_qkv_rotary_reference, eager, (cos, sin))
    refs = run(norm_qkv_rotary_reference, ref, (cos.double(), sin.double()))
    dys = [_rand(gen, torch.float32, *o.shape) for o in outs]
    for i, (o, e, r) in enumerate(zip(outs, eagers, refs, strict=True)):
        assert_numerics(f"out {i}", o, e, r, torch.float32)
    torch.autograd.backward(outs, dys)
    torch.autograd.backward(run(norm_qkv_rotary, ours, (cos, sin)), dys)  # accumulates into .grad
    torch.autograd.backward(eagers, dys, retain_graph=True)
    torch.autograd.backward(eagers, dys)
    torch.autograd.backward(refs, [d.double() for d in dys], retain_graph=True)
    torch.autograd.backward(refs, [d.double() for d in dys])
    for name in trainable:
        assert_numerics(f"grad {name}", ours[name].grad, eager[name].grad, ref[name].grad, torch.float32)


def test_float64_and_autocast_run_the_separate_ops(gen):
    """float64 runs the reference; under autocast the separate ops run (nn.Linear's casts): no node."""
    tensors, _ = _output_operands(gen, torch.float64, False)
    out = attention_output_mlp(*(t.requires_grad_() for t in tensors), eps=EPS)
    assert type(out.grad_fn) is not AttentionOutputMLPFunction._backward_cls
    torch.testing.assert_close(out, attention_output_mlp_reference(*tensors, eps=EPS))
    x, norm_w, ws, _, cos, sin = _input_operands(gen, torch.float32, False)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        q, _, _ = norm_qkv_rotary(x.requires_grad_(), norm_w, *ws, cos, sin, head_dim=D, eps=EPS)
    assert q.dtype == torch.bfloat16
    assert type(q.grad_fn) is not NormQKVRotaryFunction._backward_cls


@triton_path_only
def test_autocast_to_the_inputs_dtype_runs_the_nodes(gen):
    """Autocast to the operands' own dtype casts nothing (Trainer's bf16=True on a bf16 model): the nodes
    run and give what they give without autocast, bit for bit."""
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    dtype = torch.bfloat16
    x, norm_w, ws, _, cos, sin = _input_operands(gen, dtype, False)
    tensors, _ = _output_operands(gen, dtype, False)
    tensors[1].requires_grad_()
    runs = []
    for cast in (False, True):
        with torch.autocast(device_type, dtype=dtype, enabled=cast):
            q, k, v = norm_qkv_rotary(x.requires_grad_(), norm_w, *ws, cos, sin, head_dim=D, eps=EPS)
            out = attention_output_mlp(*tensors, eps=EPS)
        assert type(q.grad_fn) is NormQKVRotaryFunction._backward_cls
        assert type(out.grad_fn) is AttentionOutputMLPFunction._backward_cls
        runs.append((q, k, v, out))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_bad_arguments_name_the_argument(gen):
    x, norm_w, ws, _, cos, sin = _input_operands(gen, torch.float32, False)
    with pytest.raises(ValueError, match="x must be 3-D"):
        norm_qkv_rotary(x[0], norm_w, *ws, cos, sin, head_dim=D, eps=EPS)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        norm_qkv_rotary(x, norm_w[:-1], *ws, cos, sin, head_dim=D, eps=EPS)
    with pytest.raises(ValueError, match="k_weight must have shape"):
        norm_qkv_rotary(x, norm_w, ws[0], ws[1][:, :-1], ws[2], cos, sin, head_dim=D, eps=EPS)
    with pytest.raises(ValueError, match="v_weight must have k_weight's"):
        norm_qkv_rotary(x, norm_w, ws[0], ws[1], ws[0], cos, sin, head_dim=D, eps=EPS)
    with pytest.raises(ValueError, match="head_dim"):
        norm_qkv_rotary(x, norm_w, *ws, cos, sin, head_dim=0, eps=EPS)
    with pytest.raises(ValueError, match="eps"):
        norm_qkv_rotary(x, norm_w, *ws, cos, sin, head_dim=D, eps=-1.0)
    with pytest.raises(ValueError, match="norm_casting"):
        norm_qkv_rotary(x, norm_w, *ws, cos, sin, head_dim=D, eps=EPS, norm_casting="bad")
    tensors, _ = _output_operands(gen, torch.float32, False)
    attn, residual, wo, nw, wg, wu, wd = tensors
    with pytest.raises(ValueError, match="attn must be"):
        attention_output_mlp(attn[:, :-1], residual, wo, nw, wg, wu, wd, eps=EPS)
    with pytest.raises(ValueError, match="o_weight must have shape"):
        attention_output_mlp(attn, residual, wo[:, :-1], nw, wg, wu, wd, eps=EPS)
    with pytest.raises(ValueError, match="down_weight must have shape"):
        attention_output_mlp(attn, residual, wo, nw, wg, wu, wd[:, :-1], eps=EPS)
    with pytest.raises(ValueError, match="activation"):
        attention_output_mlp(attn, residual, wo, nw, wg, wu, wd, eps=EPS, activation="relu")
    with pytest.raises(ValueError, match="gate_bias must have shape"):
        attention_output_mlp(attn, residual, wo, nw, wg, wu, wd, eps=EPS, gate_bias=wg[0])
