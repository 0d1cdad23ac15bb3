"""The contract every public op keeps, checked over one table of ops (new op: add a row).

Per op (:class:`OpSpec`): how to make small inputs, a plain PyTorch formula of the same math (the eager
baseline in the input's dtype and, on float64 inputs, the reference of the numerics rule), and the bad
arguments that must be refused naming the argument. The contract:

- bad arguments raise ValueError naming the argument: the op's own cases, plus two derived from its
  inputs for every op (an integer tensor where the first floating input goes; another device for the
  second tensor input);
- dispatch: the Triton path launches kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``), the CPU
  reference path none, and float64 inputs always run the reference (no launch);
- outputs and gradients under the conftest's NaN-poisoned allocations are finite and keep the numerics
  rule against the float64 reference;
- ``torch.compile(fullgraph=True)`` (aot_eager: no C++ toolchain needed) traces without a graph break and
  keeps the numerics rule;
- the int64 addressing path: each op's file holds a slow GPU test past 2^31 elements (checked by name
  here; they need several GiB and run with ``--runslow``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kit.oracles import naive_log_probs

import fuselm
from fuselm.ops._common.dispatch import use_triton
from fuselm.ops._common.launch import launch_counts
from fuselm.ops._common.testing import assert_numerics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Inputs = dict[str, torch.Tensor]


@dataclass
class OpSpec:
    """One public op: ``make(gen)`` its tensor inputs (fp32, on DEVICE; floating ones get gradients),
    ``run(fn, inputs)`` the op (``fn`` is the fuselm function, or a compiled wrapper) returning a tuple of
    tensors, ``formula(inputs)`` the same math in plain PyTorch, and ``bad``: (case, change of the inputs or
    keyword arguments, the argument the error must name)."""

    name: str
    make: Callable[[torch.Generator], Inputs]
    run: Callable[[Callable, Inputs], tuple[torch.Tensor, ...]]
    formula: Callable[[Inputs], tuple[torch.Tensor, ...]]
    bad: list[tuple[str, Callable[[Inputs], tuple[Inputs, dict]], str]] = field(default_factory=list)
    test_file: str = ""
    constants: tuple[str, ...] = ()  # floating inputs that get no gradient (rope's cos and sin)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _targets(gen, n, v):
    t = torch.randint(0, v, (n,), generator=gen)
    t[::4] = -100
    return t.to(DEVICE)


def _with(**changes):
    """A change of inputs (tensors by name) and keyword arguments (``kw_<name>``)."""

    def change(inputs):
        new = {k: v for k, v in changes.items() if not k.startswith("kw_")}
        kw = {k[3:]: v for k, v in changes.items() if k.startswith("kw_")}
        return {**inputs, **{k: (v(inputs) if callable(v) else v) for k, v in new.items()}}, kw

    return change


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope_formula(i):
    cos, sin = i["cos"].unsqueeze(1), i["sin"].unsqueeze(1)
    return i["q"] * cos + _rotate_half(i["q"]) * sin, i["k"] * cos + _rotate_half(i["k"]) * sin


def _rope_make(gen):
    b, t, d = 2, 5, 8
    angle = torch.rand(b, t, d // 2, generator=gen) * 6.0
    angle = torch.cat((angle, angle), dim=-1)
    return {
        "q": _randn(gen, b, 4, t, d),
        "k": _randn(gen, b, 2, t, d),
        "cos": angle.cos().to(DEVICE),
        "sin": angle.sin().to(DEVICE),
    }


V, H = 37, 16
SPECS = [
    OpSpec(
        "cross_entropy",
        lambda gen: {"input": _randn(gen, 3, 5, V), "target": _targets(gen, 15, V).reshape(3, 5)},
        lambda fn, i: (fn(i["input"], i["target"], label_smoothing=0.1),),
        lambda i: (F.cross_entropy(i["input"].flatten(0, 1), i["target"].flatten(), label_smoothing=0.1),),
        [
            ("target shape", _with(target=lambda i: i["target"][:2]), "target"),
            ("float target", _with(target=lambda i: i["target"].float()), "target"),
            ("reduction", _with(kw_reduction="avg"), "reduction"),
            ("label_smoothing", _with(kw_label_smoothing=1.5), "label_smoothing"),
            ("class weight shape", _with(kw_weight=torch.ones(3, device=DEVICE)), "weight"),
            ("z_loss NaN", _with(kw_z_loss=float("nan")), "z_loss"),
            ("softcap inf", _with(kw_softcap=float("inf")), "softcap"),
            ("label_smoothing string", _with(kw_label_smoothing="0.1"), "label_smoothing"),
        ],
        "test_cross_entropy.py",
    ),
    OpSpec(
        "linear_cross_entropy",
        lambda gen: {
            "input": _randn(gen, 15, H),
            "linear_weight": _randn(gen, V, H) / 4,
            "target": _targets(gen, 15, V),
        },
        lambda fn, i: (fn(i["input"], i["linear_weight"], i["target"], z_loss=1e-3),),
        lambda i: (
            F.cross_entropy(i["input"] @ i["linear_weight"].T, i["target"])
            + 1e-3
            * (torch.logsumexp(i["input"] @ i["linear_weight"].T, -1)[i["target"] != -100] ** 2).mean(),
        ),
        [
            ("weight width", _with(linear_weight=lambda i: i["linear_weight"][:, :5]), "linear_weight"),
            ("weight dtype", _with(linear_weight=lambda i: i["linear_weight"].double()), "linear_weight"),
            ("target shape", _with(target=lambda i: i["target"][:2]), "target"),
            ("target range", _with(target=lambda i: i["target"].abs() + V), "target"),
            ("bias shape", _with(kw_linear_bias=torch.zeros(3, device=DEVICE)), "linear_bias"),
            ("memory", _with(kw_memory="huge"), "memory"),
            ("z_loss NaN", _with(kw_z_loss=float("nan")), "z_loss"),
        ],
        "test_linear_cross_entropy.py",
    ),
    OpSpec(
        "linear_log_probs",
        lambda gen: {
            "input": _randn(gen, 15, H),
            "linear_weight": _randn(gen, V, H) / 4,
            "target": _targets(gen, 15, V),
        },
        lambda fn, i: tuple(
            fn(i["input"], i["linear_weight"], i["target"], outputs=("log_probs", "entropy"))[:2]
        ),
        lambda i: tuple(naive_log_probs(i["input"], i["linear_weight"], i["target"])[:2]),
        [
            ("weight width", _with(linear_weight=lambda i: i["linear_weight"][:, :5]), "linear_weight"),
            ("target range", _with(target=lambda i: i["target"].abs() + V), "target"),
            ("outputs", _with(kw_outputs=("nope",)), "outputs"),
            ("temperature", _with(kw_temperature=0.0), "temperature"),
            ("logit_scale NaN", _with(kw_logit_scale=float("nan")), "logit_scale"),
            ("softcap negative", _with(kw_softcap=-1.0), "softcap"),
            ("target dtype", _with(target=lambda i: i["target"].float()), "target"),
        ],
        "test_linear_log_probs.py",
    ),
    OpSpec(
        "rms_norm",
        lambda gen: {"x": _randn(gen, 6, 24), "weight": _randn(gen, 24)},
        lambda fn, i: (fn(i["x"], i["weight"]),),
        lambda i: (i["x"] * torch.rsqrt(i["x"].pow(2).mean(-1, keepdim=True) + 1e-6) * i["weight"],),
        [
            ("weight shape", _with(weight=lambda i: i["weight"][:3]), "weight"),
            ("casting", _with(kw_casting="nope"), "casting"),
            ("residual shape", _with(kw_residual=torch.zeros(2, 24, device=DEVICE)), "residual"),
            ("eps", _with(kw_eps=-1.0), "eps"),
        ],
        "test_rms_norm.py",
    ),
    OpSpec(
        "layer_norm",
        lambda gen: {"x": _randn(gen, 6, 24), "weight": _randn(gen, 24), "bias": _randn(gen, 24)},
        lambda fn, i: (fn(i["x"], i["weight"], i["bias"]),),
        lambda i: (F.layer_norm(i["x"], (24,), i["weight"], i["bias"]),),
        [
            ("weight shape", _with(weight=lambda i: i["weight"][:3]), "weight"),
            ("bias shape", _with(bias=lambda i: i["bias"][:3]), "bias"),
        ],
        "test_layer_norm.py",
    ),
    OpSpec(
        "apply_rotary",
        _rope_make,
        lambda fn, i: tuple(fn(i["q"], i["k"], i["cos"], i["sin"])),
        _rope_formula,
        [
            ("layout", _with(kw_layout="xyz"), "layout"),
            ("sin shape", _with(sin=lambda i: i["sin"][..., :4]), "sin"),
            ("k head dim", _with(k=lambda i: i["k"][..., :6]), "k"),
        ],
        "test_rope.py",
        constants=("cos", "sin"),
    ),
    OpSpec(
        "swiglu",
        lambda gen: {"gate": _randn(gen, 6, 20), "up": _randn(gen, 6, 20)},
        lambda fn, i: (fn(i["gate"], i["up"]),),
        lambda i: (F.silu(i["gate"]) * i["up"],),
        [
            ("up shape", _with(up=lambda i: i["up"][:2]), "up"),
            ("up dtype", _with(up=lambda i: i["up"].double()), "up"),
        ],
        "test_swiglu.py",
    ),
    OpSpec(
        "geglu",
        lambda gen: {"gate": _randn(gen, 6, 20), "up": _randn(gen, 6, 20)},
        lambda fn, i: (fn(i["gate"], i["up"]),),
        lambda i: (F.gelu(i["gate"], approximate="tanh") * i["up"],),
        [("approximate", _with(kw_approximate="nope"), "approximate")],
        "test_swiglu.py",
    ),
    OpSpec(
        "swiglu_packed",
        lambda gen: {"gate_up": _randn(gen, 6, 40)},
        lambda fn, i: (fn(i["gate_up"]),),
        lambda i: (F.silu(i["gate_up"][..., :20]) * i["gate_up"][..., 20:],),
        [("odd width", _with(gate_up=lambda i: i["gate_up"][..., :7]), "gate_up")],
        "test_swiglu.py",
    ),
    OpSpec(
        "geglu_packed",
        lambda gen: {"gate_up": _randn(gen, 6, 40)},
        lambda fn, i: (fn(i["gate_up"]),),
        lambda i: (F.gelu(i["gate_up"][..., :20], approximate="tanh") * i["gate_up"][..., 20:],),
        [("odd width", _with(gate_up=lambda i: i["gate_up"][..., :7]), "gate_up")],
        "test_swiglu.py",
    ),
]
BY_NAME = {s.name: s for s in SPECS}
TRITON_PATH = use_triton(torch.empty(0, device=DEVICE))


def _op(spec: OpSpec):
    return getattr(fuselm, spec.name)


def _call(spec: OpSpec, fn, inputs: Inputs, kw: dict | None = None):
    """The op on ``inputs`` with extra keyword arguments ``kw`` (passed through ``fn``)."""
    if not kw:
        return spec.run(fn, inputs)
    return spec.run(lambda *a, **k: fn(*a, **{**k, **kw}), inputs)


def _fresh(inputs: Inputs, dtype: torch.dtype | None = None, constants: tuple[str, ...] = ()) -> Inputs:
    """Leaf copies (in ``dtype``); floating ones require grad, but ``constants``."""
    out = {}
    for k, v in inputs.items():
        v = v.detach().clone()
        if v.is_floating_point():
            v = v.to(dtype or v.dtype).requires_grad_(k not in constants)
        out[k] = v
    return out


def _outputs_and_grads(outputs, inputs: Inputs, gen) -> list[torch.Tensor]:
    """The outputs, then the gradients of the floating inputs under fixed random output weights."""
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device) for o in outputs]
    total = sum((o.double() * w).sum() for o, w in zip(outputs, weights, strict=True))
    leaves = [v for v in inputs.values() if v.requires_grad]
    return [o.detach() for o in outputs] + list(torch.autograd.grad(total, leaves))


def _numerics(spec: OpSpec, fn, what: str) -> None:
    """fn's outputs and gradients on fp32 inputs keep the numerics rule against the formula in float64
    (the formula in fp32 is the eager baseline); everything finite."""
    gen = torch.Generator().manual_seed(7)
    base = spec.make(gen)
    c = spec.constants
    ours = _outputs_and_grads(
        _call(spec, fn, x := _fresh(base, None, c)), x, torch.Generator().manual_seed(1)
    )
    eager = _outputs_and_grads(spec.formula(x := _fresh(base, None, c)), x, torch.Generator().manual_seed(1))
    ref = _outputs_and_grads(
        spec.formula(x := _fresh(base, torch.float64, c)), x, torch.Generator().manual_seed(1)
    )
    for i, (o, e, r) in enumerate(zip(ours, eager, ref, strict=True)):
        assert torch.isfinite(o).all(), f"{spec.name} {what}: value {i} not finite"
        assert_numerics(f"{spec.name} {what}: value {i}", o, e, r, torch.float32)


# ---- bad arguments ----

BAD_CASES = [(s.name, case, change, arg) for s in SPECS for case, change, arg in s.bad]


@pytest.mark.parametrize(
    "op, case, change, arg", BAD_CASES, ids=[f"{op}-{case}" for op, case, _, _ in BAD_CASES]
)
def test_bad_argument_is_refused_naming_it(op, case, change, arg):
    spec = BY_NAME[op]
    inputs, kw = change(spec.make(torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        _call(spec, _op(spec), inputs, kw)


@pytest.mark.parametrize("op", list(BY_NAME))
def test_integer_tensor_and_other_device_are_refused_naming_the_argument(op):
    """Derived from the inputs: an integer tensor as the first floating input; the second tensor input on
    the meta device (another device than the first's)."""
    spec = BY_NAME[op]
    inputs = spec.make(torch.Generator().manual_seed(0))
    first = next(k for k, v in inputs.items() if v.is_floating_point())
    with pytest.raises(ValueError, match=rf"\b{first}\b.*dtype"):
        _call(spec, _op(spec), {**inputs, first: inputs[first].long()})
    if len(inputs) < 2:  # one tensor input: no other device to disagree with
        return
    second = list(inputs)[1]
    with pytest.raises(ValueError, match=rf"\b{second}\b.*\bon\b"):
        _call(spec, _op(spec), {**inputs, second: inputs[second].to("meta")})


# ---- dispatch ----


def _launches(fn) -> int:
    before = sum(launch_counts())
    fn()
    return sum(launch_counts()) - before


@pytest.mark.parametrize("op", list(BY_NAME))
def test_dispatch_path(op):
    """Triton path: kernels launch; reference path (CPU without the interpreter): none; float64 always
    runs the reference."""
    spec = BY_NAME[op]
    inputs = spec.make(torch.Generator().manual_seed(0))
    fp32 = _launches(lambda: _call(spec, _op(spec), _fresh(inputs, None, spec.constants)))
    assert (fp32 > 0) == TRITON_PATH, (
        f"{op}: {fp32} launches on the {'Triton' if TRITON_PATH else 'reference'} path"
    )
    assert _launches(lambda: _call(spec, _op(spec), _fresh(inputs, torch.float64, spec.constants))) == 0


# ---- numerics under poisoned allocations, eager and compiled ----


@pytest.mark.parametrize("op", list(BY_NAME))
def test_poisoned_allocations_keep_the_numerics_rule(op):
    """Every fresh allocation is NaN (conftest): an op that reads memory it did not write shows here."""
    _numerics(BY_NAME[op], _op(BY_NAME[op]), "eager")


@pytest.mark.parametrize("op", list(BY_NAME))
def test_compile_fullgraph(op):
    torch._dynamo.reset()
    spec = BY_NAME[op]
    _numerics(spec, torch.compile(_op(spec), fullgraph=True, backend="aot_eager"), "compiled")
    torch._dynamo.reset()


# ---- int64 addressing ----


@pytest.mark.parametrize("op", list(BY_NAME))
def test_each_op_file_has_a_slow_int64_gpu_test(op):
    """The int64 path needs tensors past 2^31 elements (GiBs): each op's own test file runs it on the GPU
    under --runslow; this checks that the test is there."""
    source = (Path(__file__).parent / BY_NAME[op].test_file).read_text()
    assert "int64" in source and "slow" in source and "2**31" in source.replace(" ", ""), BY_NAME[
        op
    ].test_file


def test_the_table_covers_every_public_op():
    public = {
        n for n in fuselm.__all__ if callable(getattr(fuselm, n)) and not isinstance(getattr(fuselm, n), type)
    }
    assert public - {"nn", "distributed"} == set(BY_NAME), public ^ set(BY_NAME)
