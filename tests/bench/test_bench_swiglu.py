"""Tests of the ``swiglu`` benchmark suite: inputs, cost, providers, a CPU run end to end.

GPU-only checks (every provider computing the same values on CUDA) are marked ``gpu``.
"""

from __future__ import annotations

import json

import pytest
import torch
from fuselm_bench import registry, report
from fuselm_bench import swiglu as sw
from fuselm_bench.harness import Ceilings, SkipProvider, compute_ratios, run_suite

from fuselm.cli import main

CPU = torch.device("cpu")


# ---- the suite's definition ----


def test_suite_definition():
    suite = sw.SUITE
    assert suite.name == "swiglu"
    assert suite.provider_names == ["torch", "torch_compile", "fuselm", "liger"]
    assert (16384, 14336) in suite.gpu_shapes
    assert suite.shape_dims == ("N", "I")
    assert not suite.forward_grad
    for shapes in (suite.gpu_shapes, suite.cpu_shapes):
        assert all(len(s) == 2 and all(isinstance(d, int) and d > 0 for d in s) for s in shapes)


@pytest.mark.skipif(
    "swiglu" not in registry.SUITES,
    reason='not registered yet: add "swiglu" to fuselm_bench/registry.py SUITES',
)
def test_registry_lists_the_suite():
    assert registry.get_suite("swiglu") is sw.SUITE


def test_make_inputs():
    x = sw.make_inputs((5, 7), torch.bfloat16, CPU)
    assert set(x) == {"gate", "up"}
    for t in x.values():
        assert t.shape == (5, 7) and t.dtype == torch.bfloat16 and t.requires_grad and t.is_leaf


def test_cost_against_anchors():
    n, i = 16384, 14336
    assert sw.cost((n, i), "fwd", torch.bfloat16).bytes == 6 * n * i
    assert sw.cost((n, i), "bwd", torch.bfloat16).bytes == 10 * n * i
    assert sw.cost((n, i), "full", torch.bfloat16).bytes == 16 * n * i
    assert sw.cost((n, i), "full", torch.float32).bytes == 32 * n * i
    assert sw.cost((n, i), "full", torch.bfloat16).flops is None
    # docs/peers.md: torch.compile 0.871 ms is 4.31 TB/s; Liger 0.886 ms is 4.24 TB/s (copy 4.25 TB/s)
    full = sw.cost((n, i), "full", torch.bfloat16)
    assert compute_ratios(0.871, full, Ceilings(copy_tbps=4.25))["tbps"] == pytest.approx(4.31, abs=0.005)
    assert compute_ratios(0.886, full, Ceilings(copy_tbps=4.25))["tbps"] == pytest.approx(4.24, abs=0.005)
    assert compute_ratios(1.54, full, Ceilings(copy_tbps=4.25))["tbps"] == pytest.approx(2.44, abs=0.005)


# ---- providers ----


def test_cpu_providers_compute_the_same_values_and_gradients():
    results = {}
    for name in ("torch", "fuselm"):
        torch.manual_seed(0)
        x = sw.make_inputs((33, 300), torch.float32, CPU)
        out = sw.SUITE.provider(name).setup(CPU)(x)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results[name] = (out.detach(), *torch.autograd.grad(out, [x["gate"], x["up"]], dout))
    for got, want in zip(results["fuselm"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["torch_compile", "liger"])
def test_gpu_only_providers_skip_on_cpu(name):
    with pytest.raises(SkipProvider):
        sw.SUITE.provider(name).setup(CPU)


# ---- a CPU run end to end (without the CLI, so it runs before the suite is registered too) ----


def test_run_suite_cpu(tmp_path):
    rep = run_suite(
        sw.SUITE,
        shapes=sw.SUITE.cpu_shapes,
        dtype=torch.float32,
        modes=["fwd", "bwd", "full"],
        providers=sw.SUITE.provider_names,
        device=CPU,
        quick=True,
        ceilings=Ceilings(copy_tbps=0.01),
        progress=False,
        log=lambda s: None,
    )
    assert set(rep.skipped) == {"torch_compile", "liger"}
    assert len(rep.rows) == len(sw.SUITE.cpu_shapes) * 2 * 3  # shapes x (torch, fuselm) x modes
    for r in rep.rows:
        assert r.error is None, r
        n, i = r.shape
        assert r.bytes == sw.ACCESSES[r.mode] * 4 * n * i
        if r.mode != "bwd":  # bwd = full - fwd can come out <= 0 on a busy CPU, and then has no rates
            assert r.ms > 0 and r.tbps > 0 and r.x_copy > 0
    paths = report.write_report(rep, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert [tuple(s) for s in data["shapes"]] == list(sw.SUITE.cpu_shapes)
    assert "| N, I | provider | mode | ms | eager ms | TB/s | x copy | extra MiB |" in paths["md"].read_text()


@pytest.mark.skipif("swiglu" not in registry.SUITES, reason="not registered yet")
def test_cli_bench_swiglu_cpu(tmp_path, capsys):
    rc = main(["bench", "swiglu", "--device", "cpu", "--quick", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    assert "skipping provider liger" in capsys.readouterr().out
    data = json.loads((tmp_path / "swiglu.json").read_text())
    assert {r["provider"] for r in data["rows"]} == {"torch", "fuselm"}
    assert all(r["error"] is None for r in data["rows"])


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_providers_compute_the_same_values():
    device = torch.device("cuda")
    shape = (1024, 14336)
    outs = {}
    for p in sw.SUITE.providers:
        try:
            fn = p.setup(device)
        except SkipProvider:
            continue
        torch.manual_seed(0)
        x = sw.make_inputs(shape, torch.bfloat16, device)
        out = fn(x)
        dout = torch.ones_like(out)
        grads = torch.autograd.grad(out, [x["gate"], x["up"]], dout)
        outs[p.name] = (out.detach().float(), *(g.float() for g in grads))
    assert {"torch", "fuselm"} <= set(outs)
    for name, values in outs.items():
        for got, want in zip(values, outs["torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_small(tmp_path):
    rep = run_suite(
        sw.SUITE,
        shapes=[(2048, 14336)],
        dtype=torch.bfloat16,
        modes=["fwd", "bwd", "full"],
        providers=sw.SUITE.provider_names,
        device=torch.device("cuda"),
        quick=True,
        progress=False,
        log=lambda s: None,
    )
    for r in rep.rows:
        if r.provider in ("torch", "fuselm"):
            assert r.error is None, r
            if r.mode != "bwd":
                assert r.extra_mib is not None and r.extra_mib >= 0 and r.x_copy > 0
