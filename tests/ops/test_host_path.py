"""The eager host path of the fused ops: every launch after the first of a specialization goes
through the cached launch binding (ops/_common/launch.py) with the same results, and a step of fused ops
is captured in a CUDA graph, forward and backward (README: "Making a patched step cheaper on the host")."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, TRITON_PATH, kernel_device

import fuselm
from fuselm.ops._common import launch
from fuselm.ops._common.launch import launch_counts
from fuselm.ops.linear_log_probs import linear_log_probs
from fuselm.ops.swiglu import swiglu_linear

DEVICE = kernel_device()
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32  # the interpreter truncates fp32 stored as bf16


def _randn(gen, *shape, scale=1.0, grad=True):
    t = (torch.randn(*shape, generator=gen) * scale).to(DEVICE, DTYPE)
    return t.requires_grad_(grad)


def _targets(gen, n, v):
    return torch.randint(0, v, (n,), generator=gen).to(DEVICE)


def _tables(gen, t, d):
    angle = torch.rand(t, d // 2, generator=gen) * 6.0
    emb = torch.cat([angle, angle], dim=-1)
    return emb.cos().to(DEVICE, DTYPE), emb.sin().to(DEVICE, DTYPE)


# name -> builder(gen) -> (call: () -> tuple of outputs, the inputs whose gradients are compared)
def _rms_norm(gen):
    x, w = _randn(gen, 2, 8, 256), _randn(gen, 256)
    return lambda: (fuselm.rms_norm(x, w),), (x, w)


def _rms_norm_residual(gen):
    x, r, w = _randn(gen, 2, 8, 256), _randn(gen, 2, 8, 256), _randn(gen, 256)
    return lambda: fuselm.rms_norm(x, w, residual=r, offset=1.0, casting="gemma"), (x, r, w)


def _layer_norm(gen):
    x, w, b = _randn(gen, 16, 200), _randn(gen, 200), _randn(gen, 200)
    return lambda: (fuselm.layer_norm(x, w, b),), (x, w, b)


def _layer_norm_residual(gen):
    x, r, w, b = _randn(gen, 16, 200), _randn(gen, 16, 200), _randn(gen, 200), _randn(gen, 200)
    return lambda: fuselm.layer_norm(x, w, b, residual=r), (x, r, w, b)


def _apply_rotary(gen):
    q, k = _randn(gen, 1, 4, 8, 64), _randn(gen, 1, 2, 8, 64)
    cos, sin = _tables(gen, 8, 64)
    return lambda: fuselm.apply_rotary(q, k, cos, sin), (q, k)


def _swiglu(gen):
    g, u = _randn(gen, 2, 8, 384), _randn(gen, 2, 8, 384)
    return lambda: (fuselm.swiglu(g, u),), (g, u)


def _geglu(gen):
    g, u = _randn(gen, 7, 781), _randn(gen, 7, 781)  # a flat size not a multiple of 16: two launches
    return lambda: (fuselm.geglu(g, u),), (g, u)


def _swiglu_packed(gen):
    gu = _randn(gen, 2, 8, 512)
    return lambda: (fuselm.swiglu_packed(gu),), (gu,)


def _swiglu_linear(gen):
    g, u, w = _randn(gen, 16, 128), _randn(gen, 16, 128), _randn(gen, 64, 128, scale=0.1)
    return lambda: (swiglu_linear(g, u, w),), (g, u, w)


def _cross_entropy(gen):
    z, t = _randn(gen, 32, 1000), _targets(gen, 32, 1000)
    t[:3] = -100
    return lambda: (fuselm.cross_entropy(z, t),), (z,)


def _cross_entropy_lse(gen):
    z, t = _randn(gen, 32, 1000), _targets(gen, 32, 1000)
    kw = dict(reduction="none", return_lse=True, label_smoothing=0.1, z_loss=1e-3)
    return lambda: fuselm.cross_entropy(z, t, **kw), (z,)


def _linear_cross_entropy(gen):
    x, w, t = _randn(gen, 24, 64), _randn(gen, 500, 64, scale=0.1), _targets(gen, 24, 500)
    t[:5] = -100
    return lambda: (fuselm.linear_cross_entropy(x, w, t),), (x, w)


def _linear_log_probs(gen):
    x, w, t = _randn(gen, 24, 64), _randn(gen, 500, 64, scale=0.1), _targets(gen, 24, 500)
    outs = ("entropy",)
    return lambda: tuple(o for o in linear_log_probs(x, w, t, outputs=outs) if o is not None), (x, w)


CASES = {
    "rms_norm": _rms_norm,
    "rms_norm_residual": _rms_norm_residual,
    "layer_norm": _layer_norm,
    "layer_norm_residual": _layer_norm_residual,
    "apply_rotary": _apply_rotary,
    "swiglu": _swiglu,
    "geglu": _geglu,
    "swiglu_packed": _swiglu_packed,
    "swiglu_linear": _swiglu_linear,
    "cross_entropy": _cross_entropy,
    "cross_entropy_lse": _cross_entropy_lse,
    "linear_cross_entropy": _linear_cross_entropy,
    "linear_log_probs": _linear_log_probs,
}


def _fwd_bwd(call, inputs, gen):
    """The op's outputs and the gradients of its inputs for fixed random output gradients."""
    outs = call()
    diff = [o for o in outs if o.requires_grad]
    gos = [torch.randn(o.shape, generator=gen).to(DEVICE, o.dtype) for o in diff]
    grads = torch.autograd.grad(diff, inputs, gos)
    return [o.detach() for o in outs], list(grads)


def _direct_launch_expected() -> bool:
    lo, hi = launch.DIRECT_TRITON_VERSIONS
    version = launch._triton_version()
    return HAS_CUDA and version is not None and lo <= version <= hi


@pytest.mark.skipif(not TRITON_PATH, reason="Triton kernels not exercised (no CUDA, TRITON_INTERPRET unset)")
@pytest.mark.parametrize("name", list(CASES))
def test_second_call_goes_through_the_cached_binding(name):
    """The op twice eagerly on the same inputs: the same outputs and gradients, and on CUDA the second call
    makes every launch through the cached binding (none through kernel[grid](...)); under the interpreter
    every launch goes through kernel[grid](...)."""
    if HAS_CUDA and not _direct_launch_expected():
        pytest.skip(f"Triton {launch._triton_version()} is outside launch.DIRECT_TRITON_VERSIONS")
    launch.set_direct_launch(None)
    call, inputs = CASES[name](torch.Generator().manual_seed(0))
    first = _fwd_bwd(call, inputs, torch.Generator().manual_seed(1))
    if HAS_CUDA:
        torch.cuda.synchronize()
    before = launch_counts()
    second = _fwd_bwd(call, inputs, torch.Generator().manual_seed(1))
    direct, plain = (a - b for a, b in zip(launch_counts(), before, strict=True))
    if HAS_CUDA:
        assert plain == 0 and direct > 0, (direct, plain)
    else:
        assert direct == 0 and plain > 0, (direct, plain)
    for kind, a_list, b_list in (("output", first[0], second[0]), ("grad", first[1], second[1])):
        for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            assert torch.equal(a, b), f"{name}: {kind} {i} differs between the first and second call"


@pytest.mark.gpu
def test_direct_launch_off_gives_the_same_results():
    """FUSELM_DIRECT_LAUNCH=0 (set_direct_launch(False)): every launch through Triton, same numbers."""
    gen = torch.Generator().manual_seed(0)
    call, inputs = CASES["rms_norm_residual"](gen)
    direct = _fwd_bwd(call, inputs, torch.Generator().manual_seed(1))
    try:
        launch.set_direct_launch(False)
        before = launch_counts()
        plain = _fwd_bwd(call, inputs, torch.Generator().manual_seed(1))
        assert launch_counts()[0] == before[0]
    finally:
        launch.set_direct_launch(None)
    for a, b in zip(direct[0] + direct[1], plain[0] + plain[1], strict=True):
        assert torch.equal(a, b)


def _block_step(x, r, w_norm, c_gate, c_up, cos, sin, target):
    """A step of fused ops and elementwise torch ops: residual RMSNorm, SwiGLU, RoPE, cross-entropy."""
    h, s = fuselm.rms_norm(x, w_norm, residual=r)
    act = fuselm.swiglu(h * c_gate, h * c_up)  # [B, T, 128]
    q = act.view(2, 8, 2, 64)
    k = (act * 0.5).view(2, 8, 2, 64)
    qe, ke = fuselm.apply_rotary(q, k, cos, sin, layout="bthd")
    logits = (qe + ke + s.view(2, 8, 2, 64)).reshape(16, 128)
    return fuselm.cross_entropy(logits, target)


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_fused_step():
    """Forward and backward of a step of fused ops captured once in a CUDA graph and replayed on new data:
    the replays give eager's loss and gradients bit for bit (no host sync, no launch outside the graph)."""
    gen = torch.Generator().manual_seed(0)
    params = [_randn(gen, 128), _randn(gen, 128), _randn(gen, 128)]  # norm weight, gate and up scales
    x_s, r_s = _randn(gen, 2, 8, 128), _randn(gen, 2, 8, 128)
    cos, sin = _tables(gen, 8, 64)
    t_s = _targets(gen, 16, 128)
    leaves = [x_s, r_s, *params]

    def step():
        loss = _block_step(x_s, r_s, *params, cos, sin, t_s)
        return loss, torch.autograd.grad(loss, leaves)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile the kernels, fill the launch caches, warm the allocator
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_grads = step()
    for _ in range(2):
        x, r, t = (
            _randn(gen, 2, 8, 128, grad=False),
            _randn(gen, 2, 8, 128, grad=False),
            _targets(gen, 16, 128),
        )
        with torch.no_grad():
            x_s.copy_(x), r_s.copy_(r)
        t_s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        loss, grads = step()
        assert torch.equal(static_loss, loss)
        for a, b in zip(static_grads, grads, strict=True):
            assert torch.equal(a, b)
