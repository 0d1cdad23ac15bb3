"""Tests of the ``rope`` benchmark suite: inputs, cost, providers, the CLI on CPU.

GPU-only checks (peers and fuselm computing the same outputs on CUDA) are marked ``gpu``.
"""

from __future__ import annotations

import json

import pytest
import torch
from fuselm_bench import registry
from fuselm_bench import rope as rope_bench
from fuselm_bench.harness import Ceilings, SkipProvider, compute_ratios

from fuselm.cli import main

CPU = torch.device("cpu")
COLUMNS = "| B, T, Hq, Hkv, D | provider | mode | ms | eager ms | TB/s | x copy | extra MiB |"
LLAMA3_8B = (4, 4096, 32, 8, 128)


@pytest.fixture
def registered(monkeypatch):
    """The suite in the registry for CLI runs (also before registry.py lists it)."""
    monkeypatch.setitem(registry.SUITES, "rope", ("fuselm_bench.rope", "rotary position embedding"))


# ---- the suite's definition ----


def test_registry_lists_the_suite():
    assert "rope" in registry.suite_names()
    assert registry.get_suite("rope") is rope_bench.SUITE


def test_suite_definition():
    suite = rope_bench.SUITE
    assert suite.name == "rope"
    assert suite.provider_names == ["torch", "torch_compile", "fuselm", "liger"]
    assert suite.columns == ("ms", "ms_eager", "tbps", "x_copy", "extra_mib") and suite.cuda_graph
    assert not suite.forward_grad
    assert LLAMA3_8B in suite.gpu_shapes
    for shapes in (suite.gpu_shapes, suite.cpu_shapes):
        assert all(len(s) == 5 and all(isinstance(d, int) and d > 0 for d in s) for s in shapes)


def test_cost_against_anchors():
    b, t, hq, hk, d = LLAMA3_8B
    n = b * t * (hq + hk) * d
    assert rope_bench.cost(LLAMA3_8B, "fwd", torch.bfloat16).bytes == 4 * n
    assert rope_bench.cost(LLAMA3_8B, "bwd", torch.bfloat16).bytes == 4 * n
    assert rope_bench.cost(LLAMA3_8B, "full", torch.bfloat16).bytes == 8 * n
    assert rope_bench.cost(LLAMA3_8B, "full", torch.float32).bytes == 16 * n
    assert rope_bench.cost(LLAMA3_8B, "full", torch.bfloat16).flops is None
    # docs/peers.md: torch.compile 0.188 ms fwd+bwd = 3.56 TB/s, 0.84x a 4.23 TB/s copy; Liger 0.855 ms
    r = compute_ratios(0.188, rope_bench.cost(LLAMA3_8B, "full", torch.bfloat16), Ceilings(copy_tbps=4.23))
    assert r["tbps"] == pytest.approx(3.56, abs=0.015) and r["x_copy"] == pytest.approx(0.84, abs=0.005)
    r = compute_ratios(0.855, rope_bench.cost(LLAMA3_8B, "full", torch.bfloat16), Ceilings(copy_tbps=4.23))
    assert r["tbps"] == pytest.approx(0.78, abs=0.005)


# ---- inputs ----


def test_make_inputs():
    torch.manual_seed(0)
    x = rope_bench.make_inputs((2, 16, 4, 2, 32), torch.bfloat16, CPU)
    assert list(x) == ["q", "k", "cos", "sin"]
    assert x["q"].shape == (2, 4, 16, 32) and x["k"].shape == (2, 2, 16, 32)
    assert x["cos"].shape == (2, 16, 32) and x["sin"].shape == (2, 16, 32)
    assert all(v.dtype == torch.bfloat16 for v in x.values())
    assert x["q"].requires_grad and x["k"].requires_grad
    assert not x["cos"].requires_grad and not x["sin"].requires_grad
    assert x["q"].is_contiguous() and x["k"].is_contiguous()
    # Hugging Face's tables: duplicated halves, cos^2 + sin^2 = 1, position 0 is the identity
    cos, sin = x["cos"].float(), x["sin"].float()
    assert torch.equal(cos[..., :16], cos[..., 16:]) and torch.equal(sin[..., :16], sin[..., 16:])
    torch.testing.assert_close(cos.square() + sin.square(), torch.ones_like(cos), atol=1e-2, rtol=0)
    assert torch.equal(cos[:, 0], torch.ones_like(cos[:, 0])) and torch.equal(
        sin[:, 0], torch.zeros_like(sin[:, 0])
    )


def test_make_inputs_is_deterministic_after_seed():
    shape = (2, 16, 4, 2, 32)
    torch.manual_seed(0)
    a = rope_bench.make_inputs(shape, torch.bfloat16, CPU)
    torch.manual_seed(0)
    b = rope_bench.make_inputs(shape, torch.bfloat16, CPU)
    for key in a:
        assert torch.equal(a[key], b[key])


# ---- providers ----


def test_cpu_providers_compute_the_same_outputs_and_gradients():
    shape = (2, 32, 4, 2, 64)
    results = {}
    for name in ("torch", "fuselm"):
        torch.manual_seed(0)
        x = rope_bench.make_inputs(shape, torch.float32, CPU)
        outs = rope_bench.SUITE.provider(name).setup(CPU)(x)
        gos = [torch.ones_like(o) * 0.5 for o in outs]
        grads = torch.autograd.grad(outs, [x["q"], x["k"]], gos)
        results[name] = (*(o.detach() for o in outs), *grads)
    for got, want in zip(results["fuselm"], results["torch"], strict=True):
        assert torch.equal(got, want)  # fp32: the same roundings as Hugging Face's code


@pytest.mark.parametrize("name", ["torch_compile", "liger"])
def test_gpu_only_providers_skip_on_cpu(name):
    with pytest.raises(SkipProvider):
        rope_bench.SUITE.provider(name).setup(CPU)


# ---- the CLI on CPU ----


def test_cli_bench_rope_cpu_defaults(tmp_path, capsys, registered):
    out = tmp_path / "res"
    rc = main(["bench", "rope", "--device", "cpu", "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "CPU figures" in printed and COLUMNS in printed
    for name in ("torch_compile", "liger"):
        assert f"skipping provider {name}" in printed
    md = (out / "rope.md").read_text()
    assert COLUMNS in md and "1x16x8x2x64" in md
    data = json.loads((out / "rope.json").read_text())
    assert set(data["skipped"]) == {"torch_compile", "liger"}
    assert [tuple(s) for s in data["shapes"]] == list(rope_bench.SUITE.cpu_shapes)
    rows = data["rows"]
    assert len(rows) == 1 * 2 * 3  # shapes x providers (torch, fuselm) x modes
    for r in rows:
        assert r["error"] is None, r
        assert r["extra_mib"] is None  # no memory figures on CPU
        b, t, hq, hk, d = r["shape"]
        assert r["bytes"] == {"fwd": 4, "bwd": 4, "full": 8}[r["mode"]] * b * t * (hq + hk) * d
        if r["mode"] != "bwd":  # bwd = full - fwd can come out <= 0 on a busy CPU
            assert r["ms"] > 0 and r["tbps"] > 0


def test_cli_shapes_and_providers(tmp_path, registered):
    args = ["bench", "rope", "--device", "cpu", "--shapes", "1x8x3x1x64,2x3x4x4x32", "--modes", "full"]
    rc = main([*args, "--providers", "fuselm", "--quick", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "rope.json").read_text())
    assert [(tuple(r["shape"]), r["provider"], r["mode"]) for r in data["rows"]] == [
        ((1, 8, 3, 1, 64), "fuselm", "full"),
        ((2, 3, 4, 4, 32), "fuselm", "full"),
    ]
    assert all(r["error"] is None for r in data["rows"])


def test_cli_bad_shape(tmp_path, capsys, registered):
    rc = main(["bench", "rope", "--device", "cpu", "--shapes", "4x4096x32x128", "--out", str(tmp_path)])
    assert rc == 2 and "5 sizes" in capsys.readouterr().err


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_providers_compute_the_same_outputs():
    device = torch.device("cuda")
    shape = (2, 256, 8, 2, 128)
    results = {}
    for p in rope_bench.SUITE.providers:
        try:
            fn = p.setup(device)
        except SkipProvider:
            continue
        torch.manual_seed(0)
        x = rope_bench.make_inputs(shape, torch.bfloat16, device)
        outs = fn(x)
        grads = torch.autograd.grad(outs, [x["q"], x["k"]], [torch.ones_like(o) for o in outs])
        results[p.name] = [t.detach().float() for t in (*outs, *grads)]
    assert {"torch", "torch_compile", "fuselm"} <= set(results)
    for name, values in results.items():
        for got, want in zip(values, results["torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_bench_rope_gpu_small(tmp_path, registered):
    rc = main(
        ["bench", "rope", "--shapes", "2x1024x32x8x128", "--quick", "--no-progress", "--out", str(tmp_path)]
    )
    assert rc == 0
    data = json.loads((tmp_path / "rope.json").read_text())
    assert data["ceilings"]["copy_tbps"] > 0
    for r in data["rows"]:
        if r["provider"] in ("torch", "fuselm"):
            assert r["error"] is None, r
            if r["mode"] != "bwd":
                assert r["extra_mib"] is not None and r["extra_mib"] >= 0 and r["x_copy"] > 0
