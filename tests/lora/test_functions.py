"""fuselm.lora: lora_linear and lora_gated_mlp against the float64 reference and PEFT's own modules
(the numerics rule), PEFT's dropout masks under the same seed, the saved tensors README.md lists,
bitsandbytes bases (bit-exact dequantization; LoRA over 4-bit and 8-bit layers against
PEFT-on-bitsandbytes), contracts and bad input.

Every numeric check goes through assert_numerics: err(fuselm) <= 2 * err(eager) + atol[dtype], errors
against lora_*_reference run on float64 copies with the same dropout masks. "eager" is PEFT's LoRA
``Linear`` (and HF's MLP composition of three of them) in the test dtype, called under the same seed.
"""

from __future__ import annotations

import contextlib
import doctest
import functools
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import kernel_device
from kit.spies import LaunchSpy

import fuselm.lora as L
from fuselm.lora import frozen as lora_frozen
from fuselm.lora import functions as lora_functions
from fuselm.lora import reference as lora_reference
from fuselm.ops._common.testing import assert_numerics
from fuselm.ops.dequantize_4bit import op as dequantize_4bit_op

peft = pytest.importorskip("peft")
from peft import LoraConfig  # noqa: E402
from peft.tuners.lora import Linear as PeftLinear  # noqa: E402

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
README = Path(L.__file__).with_name("README.md")
DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# float64 and float32 everywhere; bf16 on the CPU too (CPU bf16 GEMMs accumulate in fp32); fp16 on the GPU
DTYPES = (torch.float64, torch.float32, torch.bfloat16) + ((torch.float16,) if ON_GPU else ())
LEAD = (2, 37)  # N = 74 tokens
IN, OUT = 96, 80  # a projection
H, I = 64, 160  # an MLP
SEED = 1234
ACTS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}


def randn(gen, shape, dtype, scale=1.0, device=DEVICE):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def bnb_or_skip():
    return pytest.importorskip("bitsandbytes")


# ---- PEFT's modules and the three implementations ----


def peft_linear(gen, in_f, out_f, r, p, dtype, adapter_dtype, bias=False, alpha=24, base=None):
    """PEFT's LoRA Linear around a frozen nn.Linear (or ``base``), random adapters (B nonzero), training."""
    if base is None:
        base = nn.Linear(in_f, out_f, bias=bias, device=DEVICE, dtype=dtype)
        with torch.no_grad():
            base.weight.copy_(randn(gen, (out_f, in_f), dtype, in_f**-0.5))
            if bias:
                base.bias.copy_(randn(gen, (out_f,), dtype))
    base.requires_grad_(False)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=p)
    layer = PeftLinear(base, "default", config=cfg, r=r, lora_alpha=alpha)
    lora_a, lora_b = layer.lora_A["default"], layer.lora_B["default"]
    lora_a.to(device=DEVICE, dtype=adapter_dtype)
    lora_b.to(device=DEVICE, dtype=adapter_dtype)
    with torch.no_grad():
        lora_a.weight.copy_(randn(gen, (r, in_f), adapter_dtype, in_f**-0.5))
        # the LoRA update about as large as the base output (s * B A x ~ N(0, 1) per element)
        lora_b.weight.copy_(randn(gen, (out_f, r), adapter_dtype, r**-0.5 / layer.scaling["default"]))
    return layer.train()


def operands(layer, dense_base=None):
    """(base, LoraAdapter, bias) of a PEFT layer: what fuselm.hf.lora reads (here by hand)."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    drop = layer.lora_dropout["default"]
    p = drop.p if isinstance(drop, nn.Dropout) else 0.0
    base = layer.base_layer
    return (
        base.weight if dense_base is None else dense_base,
        L.LoraAdapter(a, b, layer.scaling["default"], p),
        base.bias,
    )


def adapter64(adapter, A64, B64):
    return L.LoraAdapter(A64, B64, adapter.scaling, adapter.dropout)


def leaf64(t):
    return t.detach().to(torch.float64).requires_grad_()


@contextlib.contextmanager
def dropout_masks(layers):
    """Collects the keep-mask of each PEFT layer's dropout module, as (out != 0, in == 0): where the
    input is exactly 0 (a saturated activation) the mask cannot be read off the output."""
    got = []
    hooks = [
        layer.lora_dropout["default"].register_forward_hook(
            lambda m, i, o: got.append((o.detach() != 0, i[0].detach() == 0))
        )
        for layer in layers
    ]
    try:
        yield got
    finally:
        for hk in hooks:
            hk.remove()


def assert_same_mask(kept, zero, mask):
    """PEFT's mask (kept where its input was nonzero) is ours, and the comparison covers almost all."""
    assert zero.float().mean() < 0.05, "too many exact zeros in the dropout input to compare masks"
    assert torch.equal(kept | zero, mask | zero), "PEFT drew another dropout mask under the same seed"


def check(name, ours, eager, ref, dtype):
    assert ours.dtype == eager.dtype, f"{name}: dtype {ours.dtype} != PEFT's {eager.dtype}"
    assert ours.shape == eager.shape, name
    assert_numerics(name, ours, eager, ref, dtype)


# ---- lora_linear ----


# (model dtype, adapter dtype): adapters of the model's dtype, and fp32 adapters on a 16-bit model (what
# get_peft_model makes by default)
DTYPE_PAIRS = [(d, d) for d in DTYPES] + [(d, torch.float32) for d in DTYPES if d.itemsize == 2]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("r", [8, 16], ids=lambda r: f"r{r}")
@pytest.mark.parametrize(
    "dtype,adapter_dtype", DTYPE_PAIRS, ids=lambda d: DTYPE_IDS[d] if isinstance(d, torch.dtype) else None
)
def test_lora_linear_numerics(dtype, adapter_dtype, r, p, bias, gen):
    layer = peft_linear(gen, IN, OUT, r, p, dtype, adapter_dtype, bias=bias)
    W, ad, b = operands(layer)
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, OUT), dtype)
    wrt = (x, ad.A, ad.B)

    torch.manual_seed(SEED)
    mask = L.dropout_mask(x, p, adapter_dtype)
    torch.manual_seed(SEED)
    y = L.lora_linear(x, W, ad, b)
    g = torch.autograd.grad(y, wrt, dy)
    torch.manual_seed(SEED)
    with dropout_masks([layer]) as dropped:
        y_e = layer(x)
    g_e = torch.autograd.grad(y_e, wrt, dy)
    if p:
        assert_same_mask(*dropped[0], mask)
        assert 0 < (~mask).sum() < mask.numel()
    x64, A64, B64 = leaf64(x), leaf64(ad.A), leaf64(ad.B)
    b64 = b.double() if b is not None else None
    y_r = L.lora_linear_reference(x64, W.double(), adapter64(ad, A64, B64), b64, mask)
    g_r = torch.autograd.grad(y_r, (x64, A64, B64), dy.double())

    check("y", y, y_e, y_r, dtype)
    for name, t, e, ref in zip(("dx", "dA", "dB"), g, g_e, g_r, strict=True):
        assert t.dtype == e.dtype, f"{name}: {t.dtype} != PEFT's {e.dtype}"
        assert_numerics(name, t, e, ref, dtype)


def test_lora_linear_without_adapter_is_the_frozen_linear(gen):
    W = randn(gen, (OUT, IN), torch.float64)
    bias = randn(gen, (OUT,), torch.float64)
    x = randn(gen, (*LEAD, IN), torch.float64).requires_grad_()
    y = L.lora_linear(x, W, None, bias)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.allclose(y, F.linear(x, W, bias), rtol=1e-12, atol=1e-12)
    assert torch.allclose(dx, torch.ones_like(y) @ W, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_lora_linear_under_autocast(p, gen):
    """fp32 model and adapters in an autocast region: the GEMMs run in the autocast dtype, as PEFT's."""
    layer = peft_linear(gen, IN, OUT, 8, p, torch.float32, torch.float32, bias=True)
    W, ad, b = operands(layer)
    x = randn(gen, (*LEAD, IN), torch.float32).requires_grad_()
    wrt = (x, ad.A, ad.B)
    half = torch.bfloat16
    with torch.autocast(DEVICE, dtype=half):
        torch.manual_seed(SEED)
        mask = L.dropout_mask(x, p, torch.float32)
        torch.manual_seed(SEED)
        y = L.lora_linear(x, W, ad, b)
        torch.manual_seed(SEED)
        y_e = layer(x)
    dy = randn(gen, y.shape, half)
    g, g_e = torch.autograd.grad(y, wrt, dy), torch.autograd.grad(y_e, wrt, dy)
    x64, A64, B64 = leaf64(x), leaf64(ad.A), leaf64(ad.B)
    # the reference sees what the autocast region computes from: x, W, b, A, B rounded to bf16
    r64 = lambda t: t.detach().to(half).double()  # noqa: E731
    ad_r = L.LoraAdapter(A64, B64, ad.scaling, p)
    y_r = L.lora_linear_reference(x64, r64(W), ad_r, r64(b), mask)
    g_r = torch.autograd.grad(y_r, (x64, A64, B64), dy.double())
    assert y.dtype == y_e.dtype == half
    assert_numerics("y", y, y_e, y_r, half)
    for name, t, e, ref in zip(("dx", "dA", "dB"), g, g_e, g_r, strict=True):
        assert t.dtype == e.dtype == torch.float32, name
        assert_numerics(name, t, e, ref, half)


# ---- lora_gated_mlp ----


def mlp_layers(gen, r, p, dtype, adapter_dtype, with_adapter=("gate", "up", "down")):
    """gate, up, down: PEFT LoRA layers where named in ``with_adapter``, else frozen nn.Linear."""
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    layers = {}
    for name, (fi, fo) in shapes.items():
        if name in with_adapter:
            layers[name] = peft_linear(gen, fi, fo, r, p, dtype, adapter_dtype)
        else:
            lin = nn.Linear(fi, fo, bias=False, device=DEVICE, dtype=dtype).requires_grad_(False)
            with torch.no_grad():
                lin.weight.copy_(randn(gen, (fo, fi), dtype, fi**-0.5))
            layers[name] = lin
    return layers


def mlp_operands(layers):
    return tuple(
        operands(layers[n]) if isinstance(layers[n], PeftLinear) else (layers[n].weight, None)
        for n in ("gate", "up", "down")
    )


def mlp_masks(x, layers, adapter_dtype):
    """gate's, up's and down's masks, drawn in PEFT's order (down's on an [.., I] tensor)."""
    masks = []
    h_like = torch.empty((*x.shape[:-1], I), dtype=x.dtype, device=x.device)
    for name, inp in (("gate", x), ("up", x), ("down", h_like)):
        drop = layers[name].lora_dropout["default"] if hasattr(layers[name], "lora_dropout") else None
        masks.append(L.dropout_mask(inp, drop.p, adapter_dtype) if isinstance(drop, nn.Dropout) else None)
    return masks


def adapter_params(ops):
    return [t for op in ops if op[1] is not None for t in (op[1].A, op[1].B)]


def ops64(ops):
    """float64 copies (leaves) of the operands, and the list of adapter leaves in order."""
    out, leaves = [], []
    for op in ops:
        base, ad = op[0], op[1]
        if ad is not None:
            A64, B64 = leaf64(ad.A), leaf64(ad.B)
            leaves += [A64, B64]
            ad = adapter64(ad, A64, B64)
        out.append((base.double() if isinstance(base, torch.Tensor) else base, ad))
    return out, leaves


@pytest.mark.parametrize("mode", ["whole", "chunks16", "recompute"])
@pytest.mark.parametrize("with_adapter", ["gate,up,down", "gate,down"], ids=["all3", "up_frozen"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("r", [8, 16], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_lora_gated_mlp_numerics(dtype, act, r, p, with_adapter, mode, gen):
    """Output and every gradient against PEFT's MLP (eager, same dtype, same dropout masks) and the float64
    reference; chunks16: over chunks of 16 of the 74 rows (the last one short); recompute: output=False,
    the backward making gate, up and their product (no output to check). Both with down without dropout
    (a chunked MLP refuses down's: its mask would be [N, I])."""
    adapter_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype  # PEFT's default
    layers = mlp_layers(gen, r, p, dtype, adapter_dtype, tuple(with_adapter.split(",")))
    if mode != "whole":
        layers["down"] = peft_linear(gen, I, H, r, 0.0, dtype, adapter_dtype)
    ops = mlp_operands(layers)
    x = randn(gen, (*LEAD, H), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, H), dtype)
    wrt = (x, *adapter_params(ops))

    torch.manual_seed(SEED)
    masks = mlp_masks(x, layers, adapter_dtype)
    torch.manual_seed(SEED)
    chunk_rows = 16 if mode == "chunks16" else None
    y = L.lora_gated_mlp(x, *ops, act, chunk_rows=chunk_rows, output=mode != "recompute")
    g = torch.autograd.grad(y, wrt, dy)
    peft_layers = [layers[n] for n in ("gate", "up", "down") if isinstance(layers[n], PeftLinear)]
    torch.manual_seed(SEED)
    with dropout_masks(peft_layers) as dropped:
        y_e = layers["down"](ACTS[act](layers["gate"](x)) * layers["up"](x))  # HF's MLP forward
    g_e = torch.autograd.grad(y_e, wrt, dy)
    if p:  # each PEFT layer's mask (in call order: gate, up, down) is ours; no mask where p is 0
        names = [n for n in ("gate", "up", "down") if isinstance(layers[n], PeftLinear)]
        peft_masks = [m for n, m in zip(("gate", "up", "down"), masks, strict=True) if n in names]
        assert len(dropped) == len(peft_masks)
        for (kept, zero), mask in zip(dropped, peft_masks, strict=True):
            if mask is not None:
                assert_same_mask(kept, zero, mask)

    x64 = leaf64(x)
    o64, leaves64 = ops64(ops)
    y_r = L.lora_gated_mlp_reference(x64, *o64, act, masks=tuple(masks))
    g_r = torch.autograd.grad(y_r, (x64, *leaves64), dy.double())
    if mode != "recompute":
        check("y", y, y_e, y_r, dtype)
    with_down = with_adapter if mode == "whole" else with_adapter + ",down"
    names = ["dx"] + [f"d{w}" for n in ("gate", "up", "down") if n in with_down for w in (f"A_{n}", f"B_{n}")]
    for name, t, e, ref in zip(names, g, g_e, g_r, strict=True):
        assert t.dtype == e.dtype, f"{name}: {t.dtype} != PEFT's {e.dtype}"
        assert_numerics(name, t, e, ref, dtype)


@pytest.mark.parametrize("chunk_rows, output", [(10, True), (None, False)], ids=["chunks", "recompute"])
def test_lora_gated_mlp_chunks_save_x_and_masks_alone(chunk_rows, output, gen):
    """Over chunks, or without output (a recompute: the backward makes everything): x and the gate / up
    dropout masks are saved, no [N, I] tensor and no rank-r product."""
    layers = mlp_layers(gen, 8, 0.1, torch.float32, torch.float32, ("gate", "up"))
    layers["down"] = peft_linear(gen, I, H, 8, 0.0, torch.float32, torch.float32)
    x = randn(gen, (*LEAD, H), torch.float32).requires_grad_()
    with recording_saved_tensors() as saved:
        y = L.lora_gated_mlp(x, *mlp_operands(layers), "silu", chunk_rows=chunk_rows, output=output)
    n = x.numel() // H
    got = sorted((tuple(t.shape), str(t.dtype)) for t in saved if t is not None)
    assert got == sorted([((n, H), "torch.float32"), ((n, H), "torch.bool"), ((n, H), "torch.bool")])
    y.sum().backward()


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("chunk_rows", [None, 2048], ids=["one_chunk", "chunks"])
def test_lora_gated_mlp_recompute_peaks_no_higher_than_whole(chunk_rows):
    """output=False (a recompute: the backward makes gate, up and the product) peaks no higher over its
    forward and backward than the whole MLP (output=True) does, and over chunks holds one chunk's [chunk, I]
    buffers beside dx."""
    torch.manual_seed(0)
    n, h, i, r = 8192, 512, 8192, 16
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ops = []
    for out_f, in_f in ((i, h), (i, h), (h, i)):
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.05
        a = (torch.randn(r, in_f, device="cuda") * 0.05).requires_grad_()
        b = (torch.randn(out_f, r, device="cuda") * 0.05).requires_grad_()
        ops.append((w, L.LoraAdapter(a, b, scaling=1.0)))
    dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    leaves = (x, *(t for _, ad in ops for t in (ad.A, ad.B)))

    def peak(**kwargs) -> int:
        torch.autograd.grad(L.lora_gated_mlp(x, *ops, "silu", **kwargs), leaves, dy)  # cuBLAS's workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(L.lora_gated_mlp(x, *ops, "silu", **kwargs), leaves, dy)
        del grads
        return torch.cuda.max_memory_allocated() - before

    whole = peak()
    recompute = peak(output=False, chunk_rows=chunk_rows)
    if chunk_rows is None:
        assert recompute <= whole
    else:  # y, dx and one chunk's g, u, dh (+ the fp32 adapter gradients' sums, small)
        assert recompute <= 2 * n * h * 2 + 3.5 * chunk_rows * i * 2


def test_lora_gated_mlp_chunks_refuse_down_dropout(gen):
    layers = mlp_layers(gen, 8, 0.1, torch.float32, torch.float32)
    x = randn(gen, (*LEAD, H), torch.float32)
    with pytest.raises(ValueError, match=r"chunk_rows=8 needs down's adapter without dropout"):
        L.lora_gated_mlp(x, *mlp_operands(layers), "silu", chunk_rows=8)
    with pytest.raises(ValueError, match=r"^chunk_rows must be"):
        L.lora_gated_mlp(x, *mlp_operands(layers), "silu", chunk_rows=0)


def test_lora_gated_mlp_without_output_saves_and_differentiates_the_same(gen):
    """output=False (a recompute that reads no output) with down's LoRA dropout: the tensors saved for
    backward and every gradient are those of output=True, down's base is never read in the forward; a
    non-bool raises."""
    layers = mlp_layers(gen, 8, 0.1, torch.float32, torch.float32)
    x = randn(gen, (*LEAD, H), torch.float32).requires_grad_()
    dy = randn(gen, (*LEAD, H), torch.float32)
    results = []
    for output in (True, False):
        ops = mlp_operands(layers)
        leaves = (x, *(t for op in ops for t in (op[1].A, op[1].B)))
        reads = []
        dense = lora_functions.dense

        def counted(w, dtype, dense=dense, down=ops[2][0], reads=reads):
            reads.append(w is down)
            return dense(w, dtype)

        lora_functions.dense = counted
        try:
            torch.manual_seed(3)
            with recording_saved_tensors() as saved:
                y = L.lora_gated_mlp(x, *ops, "silu", output=output)
            forward_reads = reads.count(True)
            grads = torch.autograd.grad(y, leaves, dy)
        finally:
            lora_functions.dense = dense
        results.append((forward_reads, [t for t in saved if t is not None], grads))
    (reads_t, saved_t, grads_t), (reads_f, saved_f, grads_f) = results
    assert (reads_t, reads_f) == (1, 0)
    assert len(saved_t) == len(saved_f) and all(
        torch.equal(a, b) for a, b in zip(saved_t, saved_f, strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(grads_t, grads_f, strict=True))
    with pytest.raises(ValueError, match="^output must be a bool, got 1"):
        L.lora_gated_mlp(x, *mlp_operands(layers), "silu", output=1)


@pytest.mark.parametrize("needs", ["x", "adapters", "down_only", "gate_A_and_x"], ids=lambda s: f"grad_{s}")
def test_lora_gated_mlp_partial_gradients(needs, gen):
    """Only what autograd asks for is computed (each path of backward), and it is right (float64)."""
    layers = mlp_layers(gen, 8, 0.1, torch.float64, torch.float64)
    ops = mlp_operands(layers)
    x = randn(gen, (*LEAD, H), torch.float64)
    params = {
        "x": x,
        "A_gate": ops[0][1].A,
        "B_gate": ops[0][1].B,
        "A_up": ops[1][1].A,
        "B_up": ops[1][1].B,
        "A_down": ops[2][1].A,
        "B_down": ops[2][1].B,
    }
    chosen = {
        "x": ["x"],
        "adapters": [k for k in params if k != "x"],
        "down_only": ["A_down", "B_down"],
        "gate_A_and_x": ["x", "A_gate"],
    }[needs]
    for k, t in params.items():
        t.requires_grad_(k in chosen)
    dy = randn(gen, (*LEAD, H), torch.float64)
    torch.manual_seed(SEED)
    masks = mlp_masks(x, layers, torch.float64)
    torch.manual_seed(SEED)
    y = L.lora_gated_mlp(x, *ops, "silu")
    g = torch.autograd.grad(y, [params[k] for k in chosen], dy)
    y_r = L.lora_gated_mlp_reference(x, *ops, "silu", masks=tuple(masks))
    g_r = torch.autograd.grad(y_r, [params[k] for k in chosen], dy)
    assert_numerics("y", y, y_r, y_r, torch.float64)
    for k, t, ref in zip(chosen, g, g_r, strict=True):
        assert_numerics(k, t, ref, ref, torch.float64)


# ---- saved tensors: exactly README.md's lists ----


@contextlib.contextmanager
def recording_saved_tensors():
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def readme_saved(function: str, when: dict[str, bool], dims: dict[str, int], cdt) -> list:
    """[(name, shape, dtype)] README.md's saved-tensor table of ``function`` gives for a configuration."""
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"<!-- saved-tensors: {function} -->\n(.*?)<!-- end -->", text, re.S)
    assert m, f"README.md has no saved-tensors table for {function}"
    rows = [line for line in m.group(1).splitlines() if line.startswith("|")][2:]
    out = []
    for row in rows:
        name, cond, shape, dtype = (c.strip() for c in row.strip("|").split("|"))
        assert cond in when, f"README condition {cond!r} unknown to the test"
        if when[cond]:
            dims_ = tuple(dims[d.strip()] for d in shape.strip("[]").split(","))
            out.append((name, dims_, {"compute": cdt, "bool": torch.bool}[dtype]))
    return out


@pytest.mark.parametrize("config", ["all3_p0", "all3_p0.1", "down_only", "no_adapters"], ids=lambda s: s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_lora_gated_mlp_saves_what_the_readme_lists(dtype, config, gen):
    with_adapter = {"all3_p0": "gate,up,down", "all3_p0.1": "gate,up,down", "down_only": "down"}.get(
        config, ""
    )
    p = 0.1 if config == "all3_p0.1" else 0.0
    r = {"gate": 8, "up": 16, "down": 4}  # distinct ranks: every low's shape is told apart
    layers = {}
    for name, (fi, fo) in {"gate": (H, I), "up": (H, I), "down": (I, H)}.items():
        if name in with_adapter.split(","):
            layers[name] = peft_linear(gen, fi, fo, r[name], p, dtype, torch.float32)
        else:
            layers[name] = nn.Linear(fi, fo, bias=False, device=DEVICE, dtype=dtype).requires_grad_(False)
    ops = mlp_operands(layers)
    x = randn(gen, (*LEAD, H), dtype).requires_grad_()
    with recording_saved_tensors() as saved:
        y = L.lora_gated_mlp(x, *ops, "silu")
    has = {n: n in with_adapter.split(",") for n in ("gate", "up", "down")}
    when = {
        "always": True,
        "gate or up adapter": has["gate"] or has["up"],
        "gate adapter": has["gate"],
        "up adapter": has["up"],
        "down adapter": has["down"],
        "p_gate > 0": has["gate"] and p > 0,
        "p_up > 0": has["up"] and p > 0,
        "p_down > 0": has["down"] and p > 0,
    }
    n = x.numel() // H
    dims = {"N": n, "H": H, "I": I, "r_gate": r["gate"], "r_up": r["up"], "r_down": r["down"]}
    expected = readme_saved("lora_gated_mlp", when, dims, dtype)
    got = [(tuple(t.shape), t.dtype) for t in saved]
    assert got == [(s, d) for _, s, d in expected], f"saved {got}, README lists {expected}"
    y.sum().backward()  # and backward runs from exactly these


@pytest.mark.parametrize("config", ["adapter_p0", "adapter_p0.1", "no_adapter"])
def test_lora_linear_saves_what_the_readme_lists(config, gen):
    dtype = torch.bfloat16
    p = 0.1 if config == "adapter_p0.1" else 0.0
    layer = peft_linear(gen, IN, OUT, 8, p, dtype, torch.float32)
    W, ad, _ = operands(layer)
    if config == "no_adapter":
        ad = None
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    with recording_saved_tensors() as saved:
        y = L.lora_linear(x, W, ad)
    when = {"adapter": ad is not None, "p > 0": ad is not None and p > 0}
    dims = {"N": x.numel() // IN, "K": IN, "r": 8}
    expected = readme_saved("lora_linear", when, dims, dtype)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [(s, d) for _, s, d in expected]
    y.sum().backward()


def test_lora_gated_mlp_saves_less_than_peft(gen):
    """The README's comparison, measured: saved activation bytes of one MLP (bf16 model, fp32 adapters,
    p = 0), parameters excluded, each storage counted once."""
    dtype = torch.bfloat16
    r = 8
    layers = mlp_layers(gen, r, 0.0, dtype, torch.float32)
    params = {t.untyped_storage().data_ptr() for layer in layers.values() for t in layer.parameters()}
    x = randn(gen, (*LEAD, H), dtype).requires_grad_()

    def activation_bytes(fn):
        with recording_saved_tensors() as saved:
            fn()
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in saved
            if t.untyped_storage().data_ptr() not in params
        }
        return sum(storages.values())

    n = x.numel() // H
    ours = activation_bytes(lambda: L.lora_gated_mlp(x, *mlp_operands(layers), "silu"))
    theirs = activation_bytes(lambda: layers["down"](F.silu(layers["gate"](x)) * layers["up"](x)))
    assert ours == n * (2 * H + 4 * I + 6 * r), "README: fuselm saves 2H + 4I + 6r bytes per token (bf16)"
    assert theirs == n * (8 * H + 10 * I + 12 * r), "README: PEFT saves 8H + 10I + 12r bytes per token"


# ---- contracts ----


def test_second_backward(gen):
    """The MLP's backward writes its gradients over the saved gate and up projections (the peak is three
    [N, I] buffers): a second backward through the same graph (retain_graph) raises instead of reading
    them; lora_linear saves nothing it overwrites, so its second backward gives the same gradients."""
    layers = mlp_layers(gen, 8, 0.1, torch.float32, torch.float32)
    ops = mlp_operands(layers)
    x = randn(gen, (*LEAD, H), torch.float32).requires_grad_()
    y = L.lora_gated_mlp(x, *ops, "silu")
    dy = randn(gen, y.shape, torch.float32)
    wrt = (x, *adapter_params(ops))
    torch.autograd.grad(y, wrt, dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same graph twice"):
        torch.autograd.grad(y, wrt, dy)
    W, ad, _ = ops[0]
    y = L.lora_linear(x, W, ad).sum()
    first = torch.autograd.grad(y, (x, ad.A, ad.B), retain_graph=True)
    second = torch.autograd.grad(y, (x, ad.A, ad.B))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_weight_changed_before_backward_raises(gen):
    layer = peft_linear(gen, IN, OUT, 8, 0.0, torch.float32, torch.float32)
    W, ad, _ = operands(layer)
    x = randn(gen, (*LEAD, IN), torch.float32).requires_grad_()
    y = L.lora_linear(x, W, ad)
    with torch.no_grad():
        ad.A.add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        y.sum().backward()


def test_dropout_mask_matches_nn_dropout_on_every_dtype(gen):
    x = randn(gen, (3, 5, 64), torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        torch.manual_seed(SEED)
        mask = L.dropout_mask(x, 0.25, dtype)
        after = torch.rand(3)
        torch.manual_seed(SEED)
        ref = nn.Dropout(0.25)(x.to(dtype)) != 0
        assert torch.equal(mask, ref)
        assert torch.equal(after, torch.rand(3)), "the RNG must be left where nn.Dropout leaves it"
    assert L.dropout_mask(x, 0.0) is None


def test_doctests_run():
    for module in (lora_frozen, lora_functions, lora_reference):
        if module is lora_frozen:
            bnb_or_skip()
        result = doctest.testmod(
            module,
            extraglobs={"torch": torch, "F": F},
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        )
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---- bad input ----


def _bad_cases():
    x = torch.randn(4, 8)
    W = torch.randn(6, 8)
    A, B = torch.randn(2, 8), torch.randn(6, 2)
    ad = L.LoraAdapter(A, B, 1.0)
    meta = L.LoraAdapter(A.to("meta"), B.to("meta"), 1.0)
    return {
        "x_not_tensor": (lambda: L.lora_linear([1.0], W, ad), "x must be a torch.Tensor"),
        "x_int": (lambda: L.lora_linear(x.long(), W, ad), "x must be float16"),
        "base_in_features": (lambda: L.lora_linear(x, torch.randn(6, 9), ad), "base must have shape"),
        "base_dtype": (lambda: L.lora_linear(x, W.double(), ad), "base must have the dtype of x"),
        "base_1d": (lambda: L.lora_linear(x, torch.randn(8), ad), "base must be a 2-D"),
        "base_type": (lambda: L.lora_linear(x, "W", ad), "base must be a torch.Tensor or a FrozenWeight"),
        "base_device": (lambda: L.lora_linear(x, W.to("meta"), None), "base must be on x's device"),
        "base_requires_grad": (
            lambda: L.lora_linear(x, W.clone().requires_grad_(), ad),
            "base requires grad",
        ),
        "A_shape": (
            lambda: L.lora_linear(x, W, L.LoraAdapter(torch.randn(2, 7), B, 1.0)),
            "adapter.A must have shape",
        ),
        "B_shape": (
            lambda: L.lora_linear(x, W, L.LoraAdapter(A, torch.randn(6, 3), 1.0)),
            "adapter.B must have shape",
        ),
        "B_dtype": (
            lambda: L.lora_linear(x, W, L.LoraAdapter(A, B.double(), 1.0)),
            "adapter.B must have the dtype of adapter.A",
        ),
        "adapter_device": (lambda: L.lora_linear(x, W, meta), "adapter.A must be on x's device"),
        "adapter_type": (lambda: L.lora_linear(x, W, (A, B)), "adapter must be a LoraAdapter"),
        "scaling": (
            lambda: L.lora_linear(x, W, L.LoraAdapter(A, B, torch.tensor(1.0))),
            "adapter.scaling must be a finite Python number",
        ),
        "dropout": (lambda: L.lora_linear(x, W, L.LoraAdapter(A, B, 1.0, 1.0)), "adapter.dropout must be"),
        "bias_shape": (lambda: L.lora_linear(x, W, ad, torch.randn(5)), "bias must have shape"),
        "activation": (
            lambda: L.lora_gated_mlp(
                x, (torch.randn(5, 8), None), (torch.randn(5, 8), None), (W.T, None), "relu"
            ),
            "activation must be one of",
        ),
        "mlp_tuple": (
            lambda: L.lora_gated_mlp(x, W, (W, None), (W.T, None)),
            "gate must be a (base, adapter)",
        ),
        "mlp_up_shape": (
            lambda: L.lora_gated_mlp(x, (torch.randn(5, 8), None), (torch.randn(6, 8), None), (W.T, None)),
            "up base must have shape",
        ),
        "mlp_down_shape": (
            lambda: L.lora_gated_mlp(x, (torch.randn(5, 8), None), (torch.randn(5, 8), None), (W.T, None)),
            "down base must have shape",
        ),
        "mlp_down_adapter": (
            lambda: L.lora_gated_mlp(
                x, (torch.randn(6, 8), None), (torch.randn(6, 8), None), (W.T.contiguous(), ad)
            ),
            "down adapter.A must have shape",
        ),
        "int8_CB": (lambda: L.Bnb8bitWeight(torch.randn(3, 4), torch.ones(3)), "CB must be a 2-D int8"),
        "int8_SCB": (
            lambda: L.Bnb8bitWeight(torch.ones(3, 4, dtype=torch.int8), torch.ones(4)),
            "SCB must have shape",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_value_error(case):
    fn, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=re.escape(match)):
        fn()


# ---- bitsandbytes bases ----


def bnb_linear4bit(gen, in_f, out_f, quant_type, double_quant, wdtype, compute_dtype, bias=False):
    bnb = bnb_or_skip()
    layer = bnb.nn.Linear4bit(
        in_f,
        out_f,
        bias=bias,
        compute_dtype=compute_dtype,
        compress_statistics=double_quant,
        quant_type=quant_type,
    )
    w = randn(gen, (out_f, in_f), wdtype, in_f**-0.5, device="cpu")
    layer.weight = bnb.nn.Params4bit(
        w, requires_grad=False, compress_statistics=double_quant, quant_type=quant_type
    )
    if bias:
        layer.bias = nn.Parameter(randn(gen, (out_f,), wdtype, device="cpu"), requires_grad=False)
    return layer.to(DEVICE)  # quantizes


def bnb_linear8bit(gen, in_f, out_f, bias=False, threshold=0.0):
    bnb = bnb_or_skip()
    layer = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias, has_fp16_weights=False, threshold=threshold)
    w = randn(gen, (out_f, in_f), torch.float32, in_f**-0.5, device="cpu")
    layer.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    if bias:
        layer.bias = nn.Parameter(randn(gen, (out_f,), torch.float32, device="cpu"), requires_grad=False)
    return layer.to(DEVICE)  # quantizes


QUANT = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]
QUANT_IDS = ["nf4", "nf4_dq", "fp4", "fp4_dq"]


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("quant", QUANT, ids=QUANT_IDS)
def test_bnb4bit_dequantization_is_bitsandbytes_own(quant, wdtype, gen):
    bnb = bnb_or_skip()
    layer = bnb_linear4bit(gen, 192, 72, *quant, wdtype, wdtype)
    param = layer.weight
    assert param.quant_state.nested == quant[1]
    ref = bnb.functional.dequantize_4bit(param.data, param.quant_state)
    w = L.Bnb4bitWeight(param)
    assert w.shape == (72, 192) and w.dtype == wdtype
    got = w.dense()
    assert got.dtype == wdtype and torch.equal(got, ref)
    for other in (torch.float32, torch.bfloat16):
        assert torch.equal(L.dense(w, other), ref.to(other))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row_chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_bnb8bit_dequantization_is_bitsandbytes_own(dtype, chunked, gen, monkeypatch):
    bnb = bnb_or_skip()
    layer = bnb_linear8bit(gen, 150, 77)
    CB, SCB = layer.weight.data, layer.weight.SCB
    assert CB.dtype == torch.int8 and SCB.dtype == torch.float32
    if chunked:  # 3 rows and a bit per chunk: several chunks and a short last one
        monkeypatch.setattr(lora_frozen, "INT8_CHUNK_ELEMENTS", 3 * 150 + 7)
    ref = bnb.functional.int8_vectorwise_dequant(CB, SCB).to(dtype)
    assert torch.equal(L.Bnb8bitWeight(CB, SCB).dense(dtype), ref)


def test_dequantized_weights_share_one_scratch_buffer(gen):
    bnb_or_skip()
    L.release_scratch()
    small = bnb_linear8bit(gen, 64, 32).weight
    big = bnb_linear8bit(gen, 96, 80).weight
    w_small = L.Bnb8bitWeight(small.data, small.SCB)
    w_big = L.Bnb8bitWeight(big.data, big.SCB)
    a = w_small.dense(torch.bfloat16)
    assert L.scratch_bytes() == 64 * 32 * 2
    b = w_big.dense(torch.bfloat16)  # grows to the largest
    assert L.scratch_bytes() == 96 * 80 * 2
    c = w_small.dense(torch.bfloat16)  # reuses the big one: no growth, same storage
    assert L.scratch_bytes() == 96 * 80 * 2
    assert c.data_ptr() == b.data_ptr() == L.scratch(1, DEVICE, torch.bfloat16).data_ptr()
    assert a.shape == c.shape == (32, 64)
    L.release_scratch()
    assert L.scratch_bytes() == 0


def peft_bnb_layer(base, r, p, adapter_dtype, gen, kind):
    from peft.tuners.lora import bnb as peft_bnb

    cls = peft_bnb.Linear4bit if kind == "4bit" else peft_bnb.Linear8bitLt
    layer = cls(base, "default", config=LoraConfig(r=r, lora_alpha=24, lora_dropout=p), r=r, lora_alpha=24)
    in_f, out_f = layer.in_features, layer.out_features
    lora_a, lora_b = layer.lora_A["default"], layer.lora_B["default"]
    lora_a.to(device=DEVICE, dtype=adapter_dtype)
    lora_b.to(device=DEVICE, dtype=adapter_dtype)
    with torch.no_grad():
        lora_a.weight.copy_(randn(gen, (r, in_f), adapter_dtype, in_f**-0.5))
        lora_b.weight.copy_(randn(gen, (out_f, r), adapter_dtype, r**-0.5 / layer.scaling["default"]))
    return layer.train()


def check_against_peft_layer(layer, frozen, w64, x, dy, p, dtype, eager=None):
    """lora_linear over ``frozen`` vs PEFT's layer (or ``eager``), float64 reference on ``w64``."""
    _, ad, b = operands(layer, dense_base=frozen)
    wrt = (x, ad.A, ad.B)
    torch.manual_seed(SEED)
    mask = L.dropout_mask(x, p, ad.A.dtype)
    torch.manual_seed(SEED)
    y = L.lora_linear(x, frozen, ad, b)
    g = torch.autograd.grad(y, wrt, dy)
    torch.manual_seed(SEED)
    y_e = (eager or layer)(x)
    g_e = torch.autograd.grad(y_e, wrt, dy)
    x64, A64, B64 = leaf64(x), leaf64(ad.A), leaf64(ad.B)
    b64 = b.double() if b is not None else None
    y_r = L.lora_linear_reference(x64, w64, adapter64(ad, A64, B64), b64, mask)
    g_r = torch.autograd.grad(y_r, (x64, A64, B64), dy.double())
    check("y", y, y_e, y_r, dtype)
    for name, t, e, ref in zip(("dx", "dA", "dB"), g, g_e, g_r, strict=True):
        assert_numerics(name, t, e, ref, dtype)


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("quant", QUANT, ids=QUANT_IDS)
def test_lora_over_bnb_4bit_matches_peft(quant, p, gen):
    bnb = bnb_or_skip()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    base = bnb_linear4bit(gen, IN, OUT, *quant, dtype, dtype, bias=True)
    layer = peft_bnb_layer(base, 8, p, torch.float32, gen, "4bit")
    frozen = L.Bnb4bitWeight(base.weight)
    # the weight bitsandbytes computes with, exactly (dequantized in fp32: code * absmax, then rounded)
    w64 = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).double()
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, OUT), dtype)
    check_against_peft_layer(layer, frozen, w64, x, dy, p, dtype)


@pytest.mark.parametrize("threshold", [0.0, 6.0], ids=["t0", "t6"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_lora_over_bnb_8bit_matches_peft(p, threshold, gen):
    """PEFT on an 8-bit layer. On the CPU bitsandbytes' training matmul dequantizes and multiplies (the
    eager side is PEFT's layer); on CUDA it quantizes the activations to int8 too, so there the eager
    side is PEFT's composition on the dequantized weight in the same dtype. The float64 reference is the
    exact dequantized weight CB * SCB / 127 in both cases."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    base = bnb_linear8bit(gen, IN, OUT, bias=True, threshold=threshold)
    CB, SCB = base.weight.data, base.weight.SCB  # read before the first forward moves SCB to the state
    layer = peft_bnb_layer(base, 8, p, torch.float32, gen, "8bit")
    frozen = L.Bnb8bitWeight(CB, SCB)
    w64 = CB.double() * SCB.double().view(-1, 1) / 127.0
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, OUT), dtype)
    eager = None
    if ON_GPU:
        w_dq = frozen.dense(dtype).clone()
        twin = peft_linear(gen, IN, OUT, 8, p, dtype, torch.float32, bias=True)
        with torch.no_grad():
            twin.base_layer.weight.copy_(w_dq)
            twin.base_layer.bias.copy_(base.bias.to(dtype))
        twin.lora_A["default"].weight = layer.lora_A["default"].weight
        twin.lora_B["default"].weight = layer.lora_B["default"].weight
        eager = twin
    check_against_peft_layer(layer, frozen, w64, x.to(dtype), dy, p, dtype, eager)


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_lora_gated_mlp_over_bnb_4bit_matches_peft(p, gen):
    bnb = bnb_or_skip()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    layers, frozen, w64 = {}, {}, {}
    for name, (fi, fo) in shapes.items():
        base = bnb_linear4bit(gen, fi, fo, "nf4", True, dtype, dtype)
        layers[name] = peft_bnb_layer(base, 8, p, torch.float32, gen, "4bit")
        frozen[name] = L.Bnb4bitWeight(base.weight)
        w64[name] = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).double()
    ops = tuple(operands(layers[n], dense_base=frozen[n]) for n in ("gate", "up", "down"))
    x = randn(gen, (*LEAD, H), dtype).requires_grad_()
    dy = randn(gen, (*LEAD, H), dtype)
    wrt = (x, *adapter_params(ops))
    torch.manual_seed(SEED)
    masks = mlp_masks(x, layers, torch.float32)
    torch.manual_seed(SEED)
    y = L.lora_gated_mlp(x, *ops, "silu")
    g = torch.autograd.grad(y, wrt, dy)
    torch.manual_seed(SEED)
    y_e = layers["down"](F.silu(layers["gate"](x)) * layers["up"](x))
    g_e = torch.autograd.grad(y_e, wrt, dy)
    x64 = leaf64(x)
    o64, leaves64 = ops64(tuple((w64[n], op[1]) for n, op in zip(("gate", "up", "down"), ops, strict=True)))
    y_r = L.lora_gated_mlp_reference(x64, *o64, "silu", masks=tuple(masks))
    g_r = torch.autograd.grad(y_r, (x64, *leaves64), dy.double())
    check("y", y, y_e, y_r, dtype)
    for i, (t, e, ref) in enumerate(zip(g, g_e, g_r, strict=True)):
        assert_numerics(f"grad {i}", t, e, ref, dtype)


# ---- GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANT, ids=QUANT_IDS)
def test_bnb4bit_dequantizes_into_the_scratch_on_cuda(quant, gen):
    """On CUDA bitsandbytes has an out= kernel: the dense weight is the shared scratch, bit-exact."""
    bnb = bnb_or_skip()
    L.release_scratch()
    layer = bnb_linear4bit(gen, 4096, 1024, *quant, torch.bfloat16, torch.bfloat16)
    other = bnb_linear4bit(gen, 1024, 512, *quant, torch.bfloat16, torch.bfloat16)
    w = L.Bnb4bitWeight(layer.weight).dense()
    ref = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert torch.equal(w, ref)
    assert w.data_ptr() == L.scratch(1, "cuda", torch.bfloat16).data_ptr()
    assert L.scratch_bytes() == 4096 * 1024 * 2
    w2 = L.Bnb4bitWeight(other.weight).dense()
    assert w2.data_ptr() == w.data_ptr() and L.scratch_bytes() == 4096 * 1024 * 2
    L.release_scratch()


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_lora_gated_mlp_bf16_cuda_real_shape(act, gen):
    """A Llama-like MLP slice in bf16 with fp32 adapters on CUDA: the fused kernels and the fp32-output
    GEMMs of the adapter gradients, against float64 and PEFT."""
    global H, I
    old = (H, I)
    H, I = 1024, 2816
    try:
        layers = mlp_layers(gen, 16, 0.0, torch.bfloat16, torch.float32)
        ops = mlp_operands(layers)
        x = randn(gen, (4, 256, H), torch.bfloat16).requires_grad_()
        dy = randn(gen, x.shape, torch.bfloat16)
        wrt = (x, *adapter_params(ops))
        y = L.lora_gated_mlp(x, *ops, act)
        g = torch.autograd.grad(y, wrt, dy)
        y_e = layers["down"](ACTS[act](layers["gate"](x)) * layers["up"](x))
        g_e = torch.autograd.grad(y_e, wrt, dy)
        x64 = leaf64(x)
        o64, leaves64 = ops64(ops)
        y_r = L.lora_gated_mlp_reference(x64, *o64, act)
        g_r = torch.autograd.grad(y_r, (x64, *leaves64), dy.double())
        check("y", y, y_e, y_r, torch.bfloat16)
        for i, (t, e, ref) in enumerate(zip(g, g_e, g_r, strict=True)):
            assert t.dtype == e.dtype
            assert_numerics(f"grad {i}", t, e, ref, torch.bfloat16)
    finally:
        H, I = old


class _AdapterCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the casts of tensors shaped like an adapter (``[r, *]`` or ``[*, r]``) to the model dtype."""

    def __init__(self, shapes, dtype):
        super().__init__()
        self.shapes, self.dtype, self.count = shapes, dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes:
            self.count += out.dtype == self.dtype
        return out


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_fp32_adapters_are_cast_in_forward_only(p, gen):
    """fp32 adapters on a bf16 model: forward casts each A and B to bf16 once, backward reuses the casts."""
    dtype = torch.bfloat16
    layer = peft_linear(gen, IN, OUT, 8, p, dtype, torch.float32)
    W, ad, _ = operands(layer)
    layers = mlp_layers(gen, 8, 0.0, dtype, torch.float32)
    ops = mlp_operands(layers)
    for run, width in ((lambda x: L.lora_linear(x, W, ad), IN), (lambda x: L.lora_gated_mlp(x, *ops), H)):
        x = randn(gen, (*LEAD, width), dtype).requires_grad_()
        adapters = [ad] if width == IN else [o[1] for o in ops]
        shapes = {tuple(t.shape) for a in adapters for t in (a.A, a.B)}
        with _AdapterCasts(shapes, dtype) as fwd:
            y = run(x)
        with _AdapterCasts(shapes, dtype) as bwd:
            y.backward(torch.ones_like(y))
        # A and B each, and with dropout A / (1 - p) for the masked input's product
        assert fwd.count == 2 * len(adapters) + (p > 0 and width == IN), fwd.count
        assert bwd.count == 0, f"backward cast the adapters {bwd.count} times"
        assert all(a.A.grad.dtype == torch.float32 for a in adapters)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_give_the_training_output(mode, gen):
    layers = mlp_layers(gen, 8, 0.0, torch.float32, torch.float32)
    ops = mlp_operands(layers)
    x = randn(gen, (*LEAD, H), torch.float32)
    expected = L.lora_gated_mlp(x, *ops, "silu")
    expected_lin = L.lora_linear(x, *ops[0])
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        x_in = x.clone()  # an inference tensor under inference_mode
        y = L.lora_gated_mlp(x_in, *ops, "silu")
        y_lin = L.lora_linear(x_in, *ops[0])
    assert not y.requires_grad and torch.equal(y, expected) and torch.equal(y_lin, expected_lin)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["single", "double"])
def test_4bit_weight_dequantizes_in_one_launch_bit_equal(quant_type, nested, monkeypatch):
    """On CUDA a 4-bit weight (single or double quantization) dequantizes in one launch of fuselm's kernel,
    not through bitsandbytes; on the CPU through bitsandbytes; the same bits either way."""
    bnb = bnb_or_skip()
    layer = bnb.nn.Linear4bit(256, 128, bias=False, quant_type=quant_type, compress_statistics=nested)
    layer = layer.to(DEVICE)
    expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    real = bnb.functional.dequantize_4bit
    through_bnb = []
    monkeypatch.setattr(
        bnb.functional, "dequantize_4bit", lambda *a, **k: through_bnb.append(1) or real(*a, **k)
    )
    spy = LaunchSpy(dequantize_4bit_op.dequantize_4bit_launch)
    monkeypatch.setattr(dequantize_4bit_op, "dequantize_4bit_launch", spy)
    got = L.Bnb4bitWeight(layer.weight).dense()
    assert torch.equal(got, expected)
    assert (len(spy.calls), len(through_bnb)) == ((1, 0) if DEVICE == "cuda" else (0, 1))


# ---- lora_projections: q, k and v in one node ----


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize(
    "dtype,adapter_dtype", DTYPE_PAIRS, ids=lambda d: DTYPE_IDS[d] if isinstance(d, torch.dtype) else None
)
def test_lora_projections_are_the_layers_called_in_turn(dtype, adapter_dtype, p, gen):
    """Three projections of one x (one with a bias) in one node: PEFT's outputs and gradients (its layers
    called one after another, drawing their dropout masks in that order) under the numerics rule."""
    outs = (OUT, 32, 32)
    layers = [peft_linear(gen, IN, o, 8, p, dtype, adapter_dtype, bias=i == 1) for i, o in enumerate(outs)]
    ops = [operands(layer) for layer in layers]
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    dys = [randn(gen, (*LEAD, o), dtype) for o in outs]
    wrt = (x, *[t for _, ad, _ in ops for t in (ad.A, ad.B)])

    torch.manual_seed(SEED)
    masks = [L.dropout_mask(x, p, adapter_dtype) for _ in outs]
    torch.manual_seed(SEED)
    ys = L.lora_projections(x, ops)
    g = torch.autograd.grad(ys, wrt, dys)
    torch.manual_seed(SEED)
    ys_e = [layer(x) for layer in layers]
    g_e = torch.autograd.grad(ys_e, wrt, dys)
    x64 = leaf64(x)
    leaves64 = [leaf64(t) for t in wrt[1:]]
    ys_r = [
        L.lora_linear_reference(
            x64, W.double(), adapter64(ad, *leaves64[2 * i : 2 * i + 2]), None if b is None else b.double(), m
        )
        for i, ((W, ad, b), m) in enumerate(zip(ops, masks, strict=True))
    ]
    g_r = torch.autograd.grad(ys_r, (x64, *leaves64), [d.double() for d in dys])
    for y, y_e, y_r in zip(ys, ys_e, ys_r, strict=True):
        check("y", y, y_e, y_r, dtype)
    for i, (t, e, ref) in enumerate(zip(g, g_e, g_r, strict=True)):
        assert t.dtype == e.dtype, i
        assert_numerics(f"grad {i}", t, e, ref, dtype)


def test_lora_projections_with_an_unused_output_or_no_adapter(gen):
    """An output the loss never reads gets no gradient contribution; a projection without an adapter is
    the frozen linear layer (the others keep theirs)."""
    layers = [peft_linear(gen, IN, o, 8, 0.0, torch.float64, torch.float64) for o in (OUT, 32)]
    (Wq, aq, _), (Wk, ak, _) = (operands(layer) for layer in layers)
    x = randn(gen, (*LEAD, IN), torch.float64).requires_grad_()
    q, k = L.lora_projections(x, [(Wq, aq), (Wk, None)])
    (dx,) = torch.autograd.grad(k.sum(), x)
    assert torch.allclose(dx, torch.ones_like(k) @ Wk, rtol=1e-12, atol=1e-12)
    q, k = L.lora_projections(x, [(Wq, aq), (Wk, ak)])
    got = torch.autograd.grad(q.sum(), (x, aq.A, ak.A), allow_unused=True)
    want = torch.autograd.grad(L.lora_linear(x, Wq, aq).sum(), (x, aq.A))
    assert torch.allclose(got[0], want[0], rtol=1e-10) and torch.allclose(got[1], want[1], rtol=1e-10)
    assert got[2] is None or torch.count_nonzero(got[2]) == 0
    with pytest.raises(ValueError, match=r"projections must be a non-empty list"):
        L.lora_projections(x, [])
    with pytest.raises(ValueError, match=r"projections\[1\]"):
        L.lora_projections(x, [(Wq, aq), Wk])


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run, with the shapes of their first two tensor arguments."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]
        self.seen.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


def test_lora_projections_read_x_once_for_the_lows_and_sum_no_dx(gen):
    """No dropout, adapters of one dtype: forward runs one x A^T GEMM for the three (not three), and
    backward makes dX in one buffer (no add of [N, in] tensors, as autograd's sum of three dX would)."""
    outs = (OUT, 32, 32)
    layers = [peft_linear(gen, IN, o, 8, 0.0, torch.float32, torch.float32) for o in outs]
    ops = [operands(layer) for layer in layers]
    x = randn(gen, (40, IN), torch.float32).requires_grad_()
    with _Ops() as fwd:
        ys = L.lora_projections(x, ops)
    x_products = [op for op in fwd.seen if op[0] in ("mm", "addmm", "linear", "addmm_") and (40, IN) in op[1]]
    assert len(x_products) == 1 + len(outs)  # the stacked low GEMM and the three base GEMMs
    with _Ops() as bwd:
        torch.autograd.grad(
            ys, (x, *[t for _, ad, _ in ops for t in (ad.A, ad.B)]), [torch.ones_like(y) for y in ys]
        )
    assert not [op for op in bwd.seen if op[0] in ("add", "add_") and op[1][0] == (40, IN)]
    with _Ops() as bwd_separate:
        y_sep = [L.lora_linear(x, *op) for op in ops]
        torch.autograd.grad(y_sep, x, [torch.ones_like(y) for y in y_sep])
    assert [
        op for op in bwd_separate.seen if op[0] in ("add", "add_") and op[1][0] == (40, IN)
    ]  # what it saves


@pytest.mark.parametrize("checkpoint", ["offloaded", "recompute"])
def test_adapter_casts_are_made_once_per_checkpointed_call(checkpoint, gen, monkeypatch):
    """fp32 adapters under a 16-bit input are cast once for a checkpointed call's forward and reused by its
    recompute; the gradients are those of the call without checkpointing, bit for bit."""
    from fuselm import offload

    run = {"offloaded": offload.offloaded_checkpoint, "recompute": offload.recompute_checkpoint}[checkpoint]
    w = randn(gen, (OUT, IN), torch.bfloat16)
    a = randn(gen, (8, IN), torch.float32).requires_grad_()
    b = randn(gen, (OUT, 8), torch.float32).requires_grad_()
    x = randn(gen, (*LEAD, IN), torch.bfloat16).requires_grad_()
    f = functools.partial(L.lora_linear, base=w, adapter=L.LoraAdapter(a, b, scaling=2.0))
    f(x).float().sum().backward()
    want = [t.grad.clone() for t in (x, a, b)]
    for t in (x, a, b):
        t.grad = None
    casts = []
    real = torch.Tensor.to

    def counting(self, *args, **kwargs):
        if self is a:
            casts.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting)
    run(f, x).float().sum().backward()
    monkeypatch.undo()
    assert len(casts) == 1
    for t, g in zip((x, a, b), want, strict=True):
        assert torch.equal(t.grad, g)


class _CountingWeight(lora_frozen.FrozenWeight):
    """A dense weight that counts how often the functions ask for it (one dense() per base GEMM)."""

    def __init__(self, w: torch.Tensor):
        self.w, self.shape, self.device, self.dtype, self.calls = w, w.shape, w.device, w.dtype, 0

    def dense(self, dtype=None):
        self.calls += 1
        return self.w if dtype in (None, self.w.dtype) else self.w.to(dtype)


@pytest.mark.parametrize("how", ["lora_linear", "lora_projections"])
def test_an_offloaded_recompute_takes_the_forwards_projection_outputs(how, gen):
    """In the recompute of an offloaded call the projections' outputs are the forward's, kept in host memory:
    no base GEMM runs again (one in the forward, one for dX); the gradients are those without
    checkpointing, bit for bit."""
    from fuselm import offload

    offload.set_kept_output_room(None)  # process-wide: a plan made by another test may have set it
    dtype = torch.float32
    outs = (OUT, OUT // 4, OUT // 4) if how == "lora_projections" else (OUT,)  # q, k, v: within the share
    ws = [randn(gen, (o, IN), dtype) for o in outs]
    adapters = [
        L.LoraAdapter(
            randn(gen, (8, IN), dtype).requires_grad_(), randn(gen, (o, 8), dtype).requires_grad_(), 2.0
        )
        for o in outs
    ]
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    leaves = [x, *(t for a in adapters for t in (a.A, a.B))]

    def f(x, bases):
        if how == "lora_linear":
            return L.lora_linear(x, bases[0], adapters[0])
        return torch.cat(L.lora_projections(x, list(zip(bases, adapters, strict=True))), -1)

    f(x, ws).sum().backward()
    want = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    bases = [_CountingWeight(w) for w in ws]
    offload.offloaded_checkpoint(f, x, bases).sum().backward()
    assert [b.calls for b in bases] == [2] * len(bases)
    for t, g in zip(leaves, want, strict=True):
        assert torch.equal(t.grad, g)


def test_an_offloaded_recompute_takes_the_forwards_gate_and_up_outputs(gen):
    """With room for them (kept_per_input), the gated MLP's gate and up outputs come back from the forward
    in the offloaded recompute: gate's and up's base GEMMs run twice (forward, dX), not three times; the
    gradients are those without checkpointing, bit for bit. With the default share (q, k, v's) they are
    made again."""
    from fuselm import offload

    offload.set_kept_output_room(None)  # process-wide: a plan made by another test may have set it
    dtype = torch.float32
    mid = 2 * IN
    shapes = ((mid, IN), (mid, IN), (IN, mid))
    ws = [randn(gen, s, dtype) for s in shapes]
    adapters = [
        L.LoraAdapter(
            randn(gen, (8, s[1]), dtype).requires_grad_(), randn(gen, (s[0], 8), dtype).requires_grad_(), 2.0
        )
        for s in shapes
    ]
    x = randn(gen, (*LEAD, IN), dtype).requires_grad_()
    leaves = [x, *(t for a in adapters for t in (a.A, a.B))]

    def f(x, bases):
        return L.lora_gated_mlp(x, *zip(bases, adapters, strict=True), "silu")

    f(x, ws).sum().backward()
    want = [t.grad.clone() for t in leaves]
    for share, calls in ((4.0, [2, 2]), (offload.KEPT_PER_INPUT, [3, 3])):
        for t in leaves:
            t.grad = None
        bases = [_CountingWeight(w) for w in ws]
        offload.offloaded_checkpoint(f, x, bases, kept_per_input=share).sum().backward()
        assert [b.calls for b in bases[:2]] == calls  # (down's: whether the recompute reads its output)
        for t, g in zip(leaves, want, strict=True):
            assert torch.equal(t.grad, g)
