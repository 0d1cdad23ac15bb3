"""Tests of the ``rms_norm`` and ``layer_norm`` benchmark suites: inputs, cost, providers, a CPU run.

GPU-only checks (every provider computing the same outputs on CUDA) are marked ``gpu``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from fuselm_bench import layer_norm as ln_bench
from fuselm_bench import registry
from fuselm_bench import rms_norm as rms_bench
from fuselm_bench.harness import Ceilings, SkipProvider, compute_ratios, run_suite
from fuselm_bench.report import write_report

from fuselm.cli import main

CPU = torch.device("cpu")
SUITES = {"rms_norm": rms_bench.SUITE, "layer_norm": ln_bench.SUITE}


# ---- definitions ----


def test_suites_define_the_issue_shapes_and_providers():
    assert rms_bench.SUITE.provider_names == [
        "torch",
        "torch_compile",
        "liger",
        "fuselm",
        "fuselm_residual",
        "torch_add_then_fuselm",
    ]
    assert ln_bench.SUITE.provider_names == ["torch", "torch_compile", "fuselm", "liger"]
    for nh in ((16384, 4096), (32768, 8192)):
        assert (*nh, 1) in rms_bench.SUITE.gpu_shapes and (*nh, 2) in rms_bench.SUITE.gpu_shapes
        assert nh in ln_bench.SUITE.gpu_shapes
    for suite in SUITES.values():
        assert all(len(s) == len(suite.shape_dims) for s in suite.gpu_shapes + suite.cpu_shapes)
        assert suite.columns == ("ms", "ms_eager", "tbps", "x_copy", "extra_mib") and suite.cuda_graph


@pytest.mark.parametrize("name", list(SUITES))
def test_registry(name):
    if name not in registry.SUITES:
        pytest.skip(f"registry line for {name!r} not added yet (fuselm_bench/registry.py)")
    assert registry.get_suite(name) is SUITES[name]


def test_cost_matches_the_anchors():
    """docs/peers.md counts 10 bytes per element fwd + bwd in bf16: torch.compile at 16384 x 4096 in
    0.265 ms is 2.53 TB/s; Liger at 32768 x 8192 in 0.798 ms is 3.36 TB/s."""
    c = rms_bench.cost((16384, 4096, 1), "full", torch.bfloat16)
    assert c.bytes == 10 * 16384 * 4096
    assert compute_ratios(0.265, c, Ceilings(copy_tbps=4.23))["tbps"] == pytest.approx(2.53, abs=0.005)
    c = rms_bench.cost((32768, 8192, 1), "full", torch.bfloat16)
    assert compute_ratios(0.798, c, Ceilings(copy_tbps=4.23))["tbps"] == pytest.approx(3.36, abs=0.005)
    n, h = 128, 64
    for mode, per in (("fwd", 2), ("bwd", 3), ("full", 5)):
        assert rms_bench.cost((n, h, 1), mode, torch.float32).bytes == per * 4 * n * h
        assert ln_bench.cost((n, h), mode, torch.bfloat16).bytes == per * 2 * n * h
    for mode, per in (("fwd", 4), ("bwd", 4), ("full", 8)):
        assert rms_bench.cost((n, h, 2), mode, torch.bfloat16).bytes == per * 2 * n * h
    assert rms_bench.cost((n, h), "full", torch.bfloat16).bytes == 10 * n * h  # N x H means S = 1


def test_split_shape():
    assert rms_bench.split_shape((8, 16)) == (8, 16, 1)
    assert rms_bench.split_shape((8, 16, 2)) == (8, 16, 2)
    for bad in ((8, 16, 0), (8, 16, 3), (8,), (8, 16, 1, 1)):
        with pytest.raises(ValueError):
            rms_bench.split_shape(bad)


def test_make_inputs():
    torch.manual_seed(0)
    x = rms_bench.make_inputs((64, 32, 2), torch.bfloat16, CPU)
    assert list(x) == ["x", "weight", "residual"]
    assert x["x"].shape == (64, 32) and x["weight"].shape == (32,) and x["residual"].shape == (64, 32)
    assert all(t.requires_grad and t.dtype == torch.bfloat16 for t in x.values())
    assert list(rms_bench.make_inputs((64, 32, 1), torch.bfloat16, CPU)) == ["x", "weight"]
    y = ln_bench.make_inputs((64, 32), torch.float32, CPU)
    assert list(y) == ["x", "weight", "bias"] and all(t.requires_grad for t in y.values())


# ---- providers ----


def _run(fn, inputs):
    outs = fn(inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    wrt = [t for t in inputs.values() if t.requires_grad]
    gos = [torch.ones_like(o) * 0.5 for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, wrt, gos))


@pytest.mark.parametrize("summed", [1, 2])
def test_rms_norm_cpu_providers_agree(summed):
    names = ("torch", "fuselm") if summed == 1 else ("torch", "fuselm_residual", "torch_add_then_fuselm")
    results = {}
    for name in names:
        torch.manual_seed(0)
        inputs = rms_bench.make_inputs((48, 64, summed), torch.float32, CPU)
        results[name] = _run(rms_bench.SUITE.provider(name).setup(CPU), inputs)
    for name in names[1:]:
        for got, want in zip(results[name], results["torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_norm_cpu_providers_agree():
    results = {}
    for name in ("torch", "fuselm"):
        torch.manual_seed(0)
        results[name] = _run(
            ln_bench.SUITE.provider(name).setup(CPU), ln_bench.make_inputs((48, 64), torch.float32, CPU)
        )
    for got, want in zip(results["fuselm"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fuselm", "fuselm_residual", "torch_add_then_fuselm"])
def test_residual_providers_skip_the_other_shapes(name):
    fn = rms_bench.SUITE.provider(name).setup(CPU)
    summed = 2 if name == "fuselm" else 1
    with pytest.raises(SkipProvider, match=f"S = {3 - summed}"):
        fn(rms_bench.make_inputs((4, 8, summed), torch.float32, CPU))


@pytest.mark.parametrize("suite,name", [(s, p) for s in SUITES for p in ("torch_compile", "liger")])
def test_gpu_only_providers_skip_on_cpu(suite, name):
    with pytest.raises(SkipProvider):
        SUITES[suite].provider(name).setup(CPU)


# ---- a CPU run through the harness and the report writers ----


@pytest.mark.parametrize("name", list(SUITES))
def test_cpu_run_and_report(name, tmp_path):
    suite = SUITES[name]
    report = run_suite(
        suite,
        shapes=suite.cpu_shapes,
        dtype=torch.float32,
        modes=("fwd", "bwd", "full"),
        providers=suite.provider_names,
        device=CPU,
        quick=True,
        ceilings=Ceilings(copy_tbps=10.0),
        metadata={"device": "cpu", "device_type": "cpu"},
        progress=False,
        log=lambda _: None,
    )
    assert set(report.skipped) == {"torch_compile", "liger"}
    ran = [r for r in report.rows if r.error is None]
    assert ran and all(r.bytes == suite.cost(r.shape, r.mode, torch.float32).bytes for r in ran)
    for r in report.rows:
        if r.error is not None:  # only the residual-specific providers on the other shapes
            assert name == "rms_norm" and "skipped: " in r.error, r
            assert r.provider in ("fuselm", "fuselm_residual", "torch_add_then_fuselm")
        elif r.mode != "bwd":
            assert r.ms > 0 and r.x_copy > 0
    paths = write_report(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert len(data["rows"]) == len(suite.cpu_shapes) * 3 * (len(suite.providers) - 2)
    assert math.isfinite(data["rows"][0]["ms"])
    assert paths["md"].read_text().count("|") > 10


@pytest.mark.parametrize("name,shapes", [("rms_norm", "64x128x1,64x128x2"), ("layer_norm", "64x128")])
def test_cli_cpu(name, shapes, tmp_path, capsys, monkeypatch):
    """``fuselm bench <suite>`` on the CPU (the registry line is patched in if not added yet)."""
    module = {"rms_norm": rms_bench, "layer_norm": ln_bench}[name]
    monkeypatch.setitem(registry.SUITES, name, (module.__name__, SUITES[name].description))
    rc = main(
        [
            "bench",
            name,
            "--device",
            "cpu",
            "--shapes",
            shapes,
            "--quick",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "skipping provider torch_compile" in printed and "skipping provider liger" in printed
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert {tuple(r["shape"]) for r in data["rows"]} == {
        tuple(int(d) for d in s.split("x")) for s in shapes.split(",")
    }
    assert any(r["provider"] == "fuselm" and r["error"] is None and r["ms"] > 0 for r in data["rows"])


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096, 1), (1024, 4096, 2)])
def test_gpu_rms_norm_providers_agree(shape):
    device = torch.device("cuda")
    outs = {}
    for p in rms_bench.SUITE.providers:
        try:
            fn = p.setup(device)
            torch.manual_seed(0)
            outs[p.name] = _run(fn, rms_bench.make_inputs(shape, torch.bfloat16, device))
        except SkipProvider:
            continue
    assert "torch" in outs and len(outs) >= 3
    for name, got in outs.items():
        for a, b in zip(got, outs["torch"], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-1, msg=name)


@pytest.mark.gpu
def test_gpu_layer_norm_providers_agree():
    device = torch.device("cuda")
    outs = {}
    for p in ln_bench.SUITE.providers:
        try:
            fn = p.setup(device)
            torch.manual_seed(0)
            outs[p.name] = _run(fn, ln_bench.make_inputs((1024, 4096), torch.bfloat16, device))
        except SkipProvider:
            continue
    assert "torch" in outs and "fuselm" in outs
    for name, got in outs.items():
        for a, b in zip(got, outs["torch"], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-1, msg=name)
