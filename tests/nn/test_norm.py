"""fuselm.nn.RMSNorm / LayerNorm: same results as the functions, Hugging Face / torch.nn parameter names,
state dicts that load both ways, docstring examples."""

from __future__ import annotations

import doctest

import pytest
import torch
from conftest import TRITON_PATH, kernel_device

import fuselm
from fuselm.nn.norm import LayerNorm, RMSNorm
from fuselm.ops.layer_norm import layer_norm
from fuselm.ops.rms_norm import rms_norm

DEVICE = kernel_device()


class HFLlamaRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm as written (used when transformers is not installed)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HFGemmaRMSNorm(torch.nn.Module):
    """Hugging Face's GemmaRMSNorm as written (used when transformers is not installed)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def _hf_classes():
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except Exception:  # noqa: BLE001 - not installed here
        return {"llama": HFLlamaRMSNorm, "gemma": HFGemmaRMSNorm}
    return {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm}


HF = _hf_classes()
FUSELM_KW = {"llama": dict(), "gemma": dict(offset=1.0, casting="gemma")}


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_rms_norm_state_dict_both_ways(family, gen):
    hidden = 48
    ours = RMSNorm(hidden, eps=1e-5, **FUSELM_KW[family]).to(DEVICE)
    hf = HF[family](hidden, eps=1e-5).to(DEVICE)
    assert sorted(ours.state_dict()) == sorted(hf.state_dict()) == ["weight"]
    assert torch.equal(ours.weight, hf.weight)  # same init: ones for Llama, zeros for Gemma
    # HF -> fuselm
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden, generator=gen))
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, hidden, generator=gen).to(DEVICE)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
    # fuselm -> HF
    with torch.no_grad():
        ours.weight.copy_(torch.randn(hidden, generator=gen))
    hf.load_state_dict(ours.state_dict())
    assert torch.equal(hf.weight, ours.weight)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


def test_rms_norm_attributes():
    norm = RMSNorm(16, eps=1e-5)
    assert norm.variance_epsilon == 1e-5 and norm.eps == 1e-5
    norm.eps = 1e-6
    assert norm.variance_epsilon == 1e-6
    assert norm.weight.shape == (16,) and torch.equal(norm.weight, torch.ones(16))
    gemma = RMSNorm(16, offset=1.0, casting="gemma")
    assert torch.equal(gemma.weight, torch.zeros(16))
    assert "eps=1e-06" in repr(norm) and "offset=1.0" in repr(gemma)
    bf16 = RMSNorm(16, dtype=torch.bfloat16)
    assert bf16.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="casting"):
        RMSNorm(16, casting="bad")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(offset=1.0, casting="gemma"), dict(casting="none")])
def test_rms_norm_module_matches_function(kw, residual, gen):
    hidden = 64
    norm = RMSNorm(hidden, eps=1e-5, **kw).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(2, 3, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    r = torch.randn(2, 3, hidden, generator=gen).to(DEVICE, torch.bfloat16) if residual else None
    xm, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    wf = norm.weight.detach().clone().requires_grad_()
    out_m = norm(xm, residual=r)
    out_f = rms_norm(xf, wf, 1e-5, residual=r, **kw)
    out_m = out_m if isinstance(out_m, tuple) else (out_m,)
    out_f = out_f if isinstance(out_f, tuple) else (out_f,)
    for a, b in zip(out_m, out_f, strict=True):
        assert torch.equal(a, b)
    sum(o.float().sum() for o in out_m).backward()
    sum(o.float().sum() for o in out_f).backward()
    assert torch.equal(xm.grad, xf.grad) and torch.equal(norm.weight.grad, wf.grad)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_module_in_place(residual, gen):
    """RMSNorm(in_place=True) is rms_norm(..., in_place=True): same outputs and gradients as the module
    without it, and on the Triton path the gradient of x is written over the gradient of y."""
    hidden = 64
    plain = RMSNorm(hidden, eps=1e-5).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(hidden, generator=gen))
    in_place = RMSNorm(hidden, eps=1e-5, in_place=True).to(DEVICE, torch.bfloat16)
    in_place.load_state_dict(plain.state_dict())
    assert in_place.in_place and not plain.in_place
    assert "in_place=True" in repr(in_place) and "in_place" not in repr(plain)
    x = torch.randn(2, 3, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    r = torch.randn(2, 3, hidden, generator=gen).to(DEVICE, torch.bfloat16) if residual else None
    gos = [torch.randn(x.shape, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(1 + residual)]
    results = []
    for norm, grads_out in ((plain, [g.clone() for g in gos]), (in_place, gos)):
        xl = x.clone().requires_grad_()
        outs = norm(xl, residual=r)
        outs = outs if isinstance(outs, tuple) else (outs,)
        results.append((outs, torch.autograd.grad(outs, (xl, norm.weight), grads_out)))
    (outs_p, grads_p), (outs_i, grads_i) = results
    for a, b in zip(outs_p + grads_p, outs_i + grads_i, strict=True):
        assert torch.equal(a, b)
    if TRITON_PATH:
        assert grads_i[0].data_ptr() == gos[0].data_ptr()
    with pytest.raises(ValueError, match="in_place"):
        RMSNorm(hidden, in_place="yes")


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_state_dict_both_ways(bias, gen):
    hidden = 48
    ours = LayerNorm(hidden, eps=1e-6, bias=bias).to(DEVICE)
    ref = torch.nn.LayerNorm(hidden, eps=1e-6, bias=bias).to(DEVICE)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    assert (ours.bias is None) == (not bias)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
        if bias:
            ref.bias.copy_(torch.randn(hidden, generator=gen))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, hidden, generator=gen).to(DEVICE)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ours.weight.mul_(2.0)
    ref.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    assert ours.normalized_shape == ref.normalized_shape and ours.eps == ref.eps
    assert ours.elementwise_affine == ref.elementwise_affine


def test_layer_norm_module_matches_function(gen):
    hidden = 64
    norm = LayerNorm(hidden).to(DEVICE)
    x = torch.randn(4, hidden, generator=gen).to(DEVICE)
    r = torch.randn(4, hidden, generator=gen).to(DEVICE)
    y, s = norm(x, residual=r)
    y_f, s_f = layer_norm(x, norm.weight, norm.bias, norm.eps, residual=r)
    assert torch.equal(y, y_f) and torch.equal(s, s_f)
    assert "bias=True" in repr(norm)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm], ids=lambda c: c.__name__)
def test_docstring_examples_run(cls, monkeypatch):
    # the examples use fuselm.nn.<cls>, which exists once the export lines are added
    monkeypatch.setattr(fuselm.nn, cls.__name__, cls, raising=False)
    tests = [t for t in doctest.DocTestFinder().find(cls) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
