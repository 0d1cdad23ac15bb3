"""fuselm.nn.SwiGLUMLP / GeGLUMLP: Hugging Face parameter names, numerics against the eager MLP,
what autograd keeps for backward, fallbacks, torch.compile, autocast.

Numerics follow docs/design.md section 5: err(fuselm) <= 2 * err(eager) + atol[dtype], against the same
MLP composed in float64. With `transformers` importable (the GPU machine), also against
LlamaMLP / GemmaMLP given the same weights.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_device

from fuselm.nn.mlp import GeGLUMLP, SwiGLUMLP, gated_mlp
from fuselm.ops._common.testing import assert_numerics

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
HIDDEN, INTER = (512, 1408) if ON_GPU else (24, 40)  # H != I, so saved tensors can be told apart
TORCH_ACT = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def hf_state_dict(gen, hidden, inter, bias=False, dtype=torch.float32):
    """A state dict named (and ordered) as Hugging Face's LlamaMLP names it."""
    sd = {}
    for name, (n_out, n_in) in (
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ):
        sd[f"{name}.weight"] = (torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).to(dtype)
        if bias:
            sd[f"{name}.bias"] = (torch.randn(n_out, generator=gen) * 0.1).to(dtype)
    return sd


def eager_mlp(mlp, x, activation):
    """What Hugging Face's LlamaMLP computes: down(act(gate(x)) * up(x)), in the module's dtype."""
    act = TORCH_ACT[activation]
    return F.linear(
        act(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias),
        mlp.down_proj.weight,
        mlp.down_proj.bias,
    )


def fwd_bwd(fn, module, x, dy):
    """Output and gradients w.r.t. x and every parameter (in named_parameters order)."""
    xr = x.detach().clone().requires_grad_()
    out = fn(module, xr)
    params = [p for _, p in module.named_parameters()]
    grads = torch.autograd.grad(out, [xr, *params], dy.to(out.dtype))
    return out.detach(), grads


def check_module(name, mlp, x, dy, activation, eager_module=None, eager_fn=None):
    """The numerics rule for the output and for the gradients of x and of every parameter."""
    eager_module = eager_module if eager_module is not None else mlp
    eager_fn = eager_fn or (lambda m, x: eager_mlp(m, x, activation))
    ref_module = copy.deepcopy(eager_module).double()
    dtype = x.dtype
    out, grads = fwd_bwd(lambda m, x: m(x), mlp, x, dy)
    out_e, grads_e = fwd_bwd(eager_fn, eager_module, x, dy)
    out_r, grads_r = fwd_bwd(eager_fn, ref_module, x.double(), dy.double())
    assert out.dtype == dtype and out.shape == x.shape
    assert_numerics(f"{name} out", out, out_e, out_r, dtype)
    names = ["x"] + [n for n, _ in mlp.named_parameters()]
    assert names[1:] == [n for n, _ in eager_module.named_parameters()]
    for n, g, e, r in zip(names, grads, grads_e, grads_r, strict=True):
        assert g.dtype == dtype
        assert_numerics(f"{name} d{n}", g, e, r, dtype)


@contextlib.contextmanager
def recording_saved_tensors():
    """Collects every tensor autograd saves for backward while the block runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def build(gen, dtype, activation="silu", bias=False, cls=SwiGLUMLP, **kw):
    mlp = cls(HIDDEN, INTER, bias, activation, **kw) if cls is SwiGLUMLP else cls(HIDDEN, INTER, bias, **kw)
    mlp.load_state_dict(hf_state_dict(gen, HIDDEN, INTER, bias))
    return mlp.to(DEVICE, dtype)


# ---- state dicts ----


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_state_dict_round_trip_with_hf_names(bias, gen):
    sd = hf_state_dict(gen, HIDDEN, INTER, bias)
    mlp = SwiGLUMLP(HIDDEN, INTER, bias=bias)
    mlp.load_state_dict(sd, strict=True)
    out = mlp.state_dict()
    assert list(out) == list(sd)  # same names, same order as LlamaMLP's
    for k in sd:
        assert torch.equal(out[k], sd[k])
    # and back into a fresh module (the other direction)
    other = SwiGLUMLP(HIDDEN, INTER, bias=bias)
    other.load_state_dict(out)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), sd.values(), strict=True))
    assert isinstance(mlp.gate_proj, torch.nn.Linear) and mlp.gate_proj.weight.shape == (INTER, HIDDEN)
    assert mlp.down_proj.weight.shape == (HIDDEN, INTER)


def test_missing_or_extra_keys_fail_loudly(gen):
    sd = hf_state_dict(gen, HIDDEN, INTER)
    mlp = SwiGLUMLP(HIDDEN, INTER)
    with pytest.raises(RuntimeError):
        mlp.load_state_dict({k: v for k, v in sd.items() if k != "up_proj.weight"})
    with pytest.raises(RuntimeError):
        mlp.load_state_dict(sd | {"act_fn.weight": torch.zeros(1)})


# ---- numerics ----


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", list(TORCH_ACT))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_numerics(dtype, activation, bias, gen):
    mlp = build(gen, dtype, activation, bias)
    x = torch.randn(2, 7, HIDDEN, generator=gen).to(DEVICE, dtype)
    dy = torch.randn(2, 7, HIDDEN, generator=gen).to(DEVICE, dtype)
    check_module(f"{activation} bias={bias}", mlp, x, dy, activation)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_geglu_mlp(approximate, gen):
    mlp = build(gen, torch.bfloat16, cls=GeGLUMLP, approximate=approximate)
    assert mlp.activation == ("gelu_pytorch_tanh" if approximate == "tanh" else "gelu")
    x = torch.randn(9, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(9, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    check_module(f"geglu {approximate}", mlp, x, dy, mlp.activation)


def test_down_proj_with_a_hook_is_called_as_a_module(gen):
    """A hooked (or replaced) down_proj is called on the product: hooks fire, results are the same."""
    mlp = build(gen, torch.float32)
    x = torch.randn(5, HIDDEN, generator=gen).to(DEVICE)
    dy = torch.randn(5, HIDDEN, generator=gen).to(DEVICE)
    plain = fwd_bwd(lambda m, x: m(x), mlp, x, dy)
    seen = []
    handle = mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    hooked = fwd_bwd(lambda m, x: m(x), mlp, x, dy)
    handle.remove()
    assert seen == [torch.Size([5, INTER])]
    torch.testing.assert_close(hooked[0], plain[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(hooked[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- multipliers (Falcon-H1's mlp_multipliers) ----


def multiplied_mlp(activation, gate_multiplier, down_multiplier):
    """fuselm's gated_mlp with multipliers, and what Hugging Face's FalconH1MLP computes with them:
    ``down(up(x) * act(gate(x) * g)) * d``, in the module's dtype."""

    def ours(m, x):
        return gated_mlp(
            x,
            m.gate_proj,
            m.up_proj,
            m.down_proj,
            activation,
            gate_multiplier=gate_multiplier,
            down_multiplier=down_multiplier,
        )

    def eager(m, x):
        gate = F.linear(x, m.gate_proj.weight, m.gate_proj.bias) * gate_multiplier
        product = F.linear(x, m.up_proj.weight, m.up_proj.bias) * TORCH_ACT[activation](gate)
        return F.linear(product, m.down_proj.weight, m.down_proj.bias) * down_multiplier

    return ours, eager


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_gated_mlp_multipliers(dtype, activation, gen):
    """Output, dx and every parameter gradient (biases too: the down multiplier scales the bias) follow
    the numerics rule against the eager composition with the multipliers; without one of them they would
    not."""
    mlp = build(gen, dtype, activation, bias=True)
    ref = copy.deepcopy(mlp).double()
    x = torch.randn(2, 7, HIDDEN, generator=gen).to(DEVICE, dtype)
    dy = torch.randn(2, 7, HIDDEN, generator=gen).to(DEVICE, dtype)
    ours, eager = multiplied_mlp(activation, 0.7, 1.3)
    out, grads = fwd_bwd(ours, mlp, x, dy)
    out_e, grads_e = fwd_bwd(eager, mlp, x, dy)
    out_r, grads_r = fwd_bwd(eager, ref, x.double(), dy.double())
    assert out.dtype == dtype
    assert_numerics("out", out, out_e, out_r, dtype)
    names = ["x"] + [n for n, _ in mlp.named_parameters()]
    for n, g, e, r in zip(names, grads, grads_e, grads_r, strict=True):
        assert_numerics(f"d{n}", g, e, r, dtype)
    for gate_multiplier, down_multiplier in ((1.0, 1.3), (0.7, 1.0)):
        dropped, _ = multiplied_mlp(activation, gate_multiplier, down_multiplier)
        with torch.no_grad():
            wrong = dropped(mlp, x)
        with pytest.raises(AssertionError):
            assert_numerics("out", wrong, out_e, out_r, dtype)


def test_unit_multipliers_are_the_plain_mlp(gen):
    """Multipliers of 1 compute nothing more: the very same bits as without them (other families)."""
    mlp = build(gen, torch.float32, bias=True)
    x = torch.randn(3, HIDDEN, generator=gen).to(DEVICE)
    dy = torch.randn(3, HIDDEN, generator=gen).to(DEVICE)
    plain = fwd_bwd(lambda m, x: m(x), mlp, x, dy)
    unit = fwd_bwd(multiplied_mlp("silu", 1.0, 1)[0], mlp, x, dy)
    assert torch.equal(plain[0], unit[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], unit[1], strict=True))


def test_multipliers_save_nothing_more(gen):
    """With multipliers autograd still keeps x and two [.., I] tensors (the scaled gate in place of the
    gate projection, and up), nothing else."""
    mlp = build(gen, torch.float32)
    x = torch.randn(3, 5, HIDDEN, generator=gen).to(DEVICE).requires_grad_()
    ours, _ = multiplied_mlp("silu", 0.7, 1.3)
    params = {p.data_ptr() for p in mlp.parameters()}
    with recording_saved_tensors() as saved:
        ours(mlp, x)
    saved = [t for t in saved if t.data_ptr() not in params]
    inter = [t for t in saved if t.shape[-1] == INTER]
    hidden = [t for t in saved if t.shape[-1] == HIDDEN]
    assert len(inter) == 2 and len(inter) + len(hidden) == len(saved), [t.shape for t in saved]
    assert {t.data_ptr() for t in hidden} == {x.data_ptr()}


# ---- memory: what autograd keeps ----


def _saved_activations(mlp, x):
    """Tensors autograd saves during mlp(x), parameters excluded (they are not activation memory)."""
    params = {p.data_ptr() for p in mlp.parameters()}
    with recording_saved_tensors() as saved:
        out = mlp(x)
    return out, [t for t in saved if t.data_ptr() not in params]


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_saves_only_gate_and_up_projections(activation, gen):
    """Of size I, only gate_proj(x) and up_proj(x) are kept (not act(gate), not the product fed to
    down_proj); besides them only x itself. Eager PyTorch keeps four [.., I] tensors."""
    mlp = build(gen, torch.float32, activation)
    x = torch.randn(3, 5, HIDDEN, generator=gen).to(DEVICE).requires_grad_()
    out, saved = _saved_activations(mlp, x)
    inter = [t for t in saved if t.shape[-1] == INTER]
    hidden = [t for t in saved if t.shape[-1] == HIDDEN]
    assert len(inter) == 2 and len(inter) + len(hidden) == len(saved), [t.shape for t in saved]
    assert {t.data_ptr() for t in hidden} == {x.data_ptr()}
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        product = TORCH_ACT[activation](gate) * up
    found = sorted((t.reshape(gate.shape) for t in inter), key=lambda t: float((t - gate).abs().sum()))
    torch.testing.assert_close(found[0], gate)
    torch.testing.assert_close(found[1], up)
    assert not any(torch.allclose(t.reshape(product.shape), product) for t in inter)
    out.sum().backward()  # and the graph still differentiates

    # the eager composition keeps gate, act(gate), up and the product
    with recording_saved_tensors() as saved_eager:
        eager_mlp(mlp, x, activation)
    params = {p.data_ptr() for p in mlp.parameters()}
    assert len([t for t in saved_eager if t.shape[-1] == INTER and t.data_ptr() not in params]) == 4


# ---- module plumbing ----


def test_constructor_and_repr():
    mlp = SwiGLUMLP(8, 16, bias=True, activation="swish", dtype=torch.float64)
    assert mlp.gate_proj.bias is not None and mlp.down_proj.weight.dtype == torch.float64
    assert "intermediate_size=16" in repr(mlp) and "swish" in repr(mlp)
    with pytest.raises(ValueError, match="activation"):
        SwiGLUMLP(8, 16, activation="relu")
    with pytest.raises(ValueError, match="approximate"):
        GeGLUMLP(8, 16, approximate="erf")
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(mlp(x), eager_mlp(mlp, x, "silu"))


def test_torch_compile_fullgraph(gen):
    torch._dynamo.reset()
    mlp = build(gen, torch.float32)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 3, HIDDEN, generator=gen).to(DEVICE)
    dy = torch.randn(4, 3, HIDDEN, generator=gen).to(DEVICE)
    out_c, grads_c = fwd_bwd(lambda m, x: compiled(x), mlp, x, dy)
    out, grads = fwd_bwd(lambda m, x: m(x), mlp, x, dy)
    torch.testing.assert_close(out_c, out)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_autocast_bf16(gen):
    """fp32 parameters under autocast: bf16 compute like nn.Linear, fp32 parameter gradients."""
    device_type = "cuda" if ON_GPU else "cpu"
    mlp = build(gen, torch.float32)
    x = torch.randn(6, HIDDEN, generator=gen).to(DEVICE)
    dy = torch.randn(6, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)

    def autocast(fn):
        def run(m, x):
            with torch.autocast(device_type, dtype=torch.bfloat16):
                return fn(m, x)

        return run

    out, grads = fwd_bwd(autocast(lambda m, x: m(x)), mlp, x, dy)
    out_e, grads_e = fwd_bwd(autocast(lambda m, x: eager_mlp(m, x, "silu")), mlp, x, dy)
    out_r, grads_r = fwd_bwd(
        lambda m, x: eager_mlp(m, x, "silu"), copy.deepcopy(mlp).double(), x.double(), dy
    )
    assert out.dtype == torch.bfloat16
    assert_numerics("autocast out", out, out_e, out_r, torch.bfloat16)
    for g, e, r in zip(grads, grads_e, grads_r, strict=True):
        assert g.dtype == torch.float32  # x and the parameters are fp32
        assert_numerics("autocast grad", g, e, r, torch.bfloat16)


# ---- Hugging Face transformers (when importable: the GPU machine) ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_matches_hf_mlp(family, dtype, gen):
    pytest.importorskip("transformers")
    if family == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP

        config = LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_attention_heads=4,
            num_key_value_heads=4,
            hidden_act="silu",
            mlp_bias=False,
        )
    else:
        from transformers import GemmaConfig
        from transformers.models.gemma.modeling_gemma import GemmaMLP as HFMLP

        config = GemmaConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=HIDDEN // 4,
            hidden_act="gelu_pytorch_tanh",
        )
    hf = HFMLP(config)
    hf.load_state_dict(hf_state_dict(gen, HIDDEN, INTER))
    hf = hf.to(DEVICE, dtype)
    mlp = SwiGLUMLP(HIDDEN, INTER, activation=config.hidden_act)
    mlp.load_state_dict(hf.state_dict())  # HF -> fuselm
    mlp = mlp.to(DEVICE, dtype)
    assert list(mlp.state_dict()) == list(hf.state_dict())
    hf.load_state_dict(mlp.state_dict())  # and back
    x = torch.randn(3, 11, HIDDEN, generator=gen).to(DEVICE, dtype)
    dy = torch.randn(3, 11, HIDDEN, generator=gen).to(DEVICE, dtype)
    check_module(f"{family} HF", mlp, x, dy, config.hidden_act, eager_module=hf, eager_fn=lambda m, x: m(x))
