"""Tests of the ``linear_cross_entropy`` benchmark suite: inputs, cost, providers, the CLI on CPU.

GPU-only checks (peers and fuselm computing the same loss on CUDA) are marked ``gpu``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from fuselm_bench import linear_cross_entropy as lce
from fuselm_bench import registry
from fuselm_bench.harness import Ceilings, SkipProvider, compute_ratios

from fuselm.cli import main

CPU = torch.device("cpu")
COLUMNS = "| N, H, V, inputs (1 random, 2 peaked), 1/k ignored | provider | mode | ms | x floor | extra MiB |"


# ---- the suite's definition ----


def test_registry_lists_the_suite():
    assert "linear_cross_entropy" in registry.suite_names()
    suite = registry.get_suite("linear_cross_entropy")
    assert suite is lce.SUITE
    assert suite.provider_names == ["torch", "torch_compile", "liger", "cce", "fuselm", "fuselm_min"]
    assert suite.columns == ("ms", "x_floor", "extra_mib")
    assert suite.forward_grad
    assert len(suite.shape_dims) == 5
    for shapes in (suite.gpu_shapes, suite.cpu_shapes):
        assert all(len(s) == 5 and all(isinstance(d, int) and d > 0 for d in s) for s in shapes)


def test_gpu_shapes_cover_the_issue():
    shapes = set(lce.SUITE.gpu_shapes)
    for nhv in ((8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 128256), (4096, 3584, 152064)):
        assert (*nhv, lce.RANDOM, 7) in shapes and (*nhv, lce.PEAKED, 7) in shapes
    assert (8192, 4096, 128256, lce.RANDOM, 2) in shapes  # half of the targets ignored


def test_split_shape_and_describe():
    assert lce.split_shape((8, 16, 32)) == (8, 16, 32, lce.RANDOM, 7)
    assert lce.split_shape((8, 16, 32, 2, 2)) == (8, 16, 32, lce.PEAKED, 2)
    assert lce.describe((8192, 4096, 128256, 2, 7)) == "N=8192 H=4096 V=128256, peaked, 1/7 ignored"
    assert lce.describe((8192, 4096, 128256, 1, 2)) == "N=8192 H=4096 V=128256, random, half ignored"
    for bad in ((8, 16), (8, 16, 32, 3, 7), (8, 16, 32, 1, 0)):
        with pytest.raises(ValueError):
            lce.split_shape(bad)


def test_cost_and_floor_against_anchors():
    n, h, v = 8192, 4096, 128256
    shape = (n, h, v, lce.PEAKED, 7)
    assert lce.cost(shape, "fwd", torch.bfloat16).flops == 2 * n * h * v
    assert lce.cost(shape, "bwd", torch.bfloat16).flops == 4 * n * h * v
    assert lce.cost(shape, "full", torch.bfloat16).flops == 6 * n * h * v
    assert lce.cost(shape, "full", torch.bfloat16).bytes is None
    # docs/peers.md: torch eager 47.4 ms fwd+bwd at 694 TFLOP/s is 1.27x the 6NHV floor
    r = compute_ratios(47.4, lce.cost(shape, "full", torch.bfloat16), Ceilings(gemm_tflops=694.0))
    assert r["x_floor"] == pytest.approx(1.27, abs=0.005)


# ---- inputs ----


@pytest.mark.parametrize("k, n_ignored", [(7, round(700 / 7)), (2, 350), (1, 700)])
def test_ignored_fraction_is_exact(k, n_ignored):
    torch.manual_seed(0)
    x = lce.make_inputs((700, 32, 50, lce.RANDOM, k), torch.float32, CPU)
    assert int((x["target"] == -100).sum()) == n_ignored


@pytest.mark.parametrize("inputs", [lce.RANDOM, lce.PEAKED])
def test_make_inputs(inputs):
    torch.manual_seed(0)
    x = lce.make_inputs((256, 128, 1000, inputs, 7), torch.bfloat16, CPU)
    assert list(x) == ["input", "linear_weight", "target"]
    assert x["input"].shape == (256, 128) and x["input"].dtype == torch.bfloat16
    assert x["linear_weight"].shape == (1000, 128) and x["linear_weight"].dtype == torch.bfloat16
    assert x["input"].requires_grad and x["linear_weight"].requires_grad
    t = x["target"]
    assert t.dtype == torch.int64 and not t.requires_grad
    kept = t[t != -100]
    assert kept.numel() == 256 - round(256 / 7) and bool(((kept >= 0) & (kept < 1000)).all())
    assert torch.isfinite(x["input"]).all() and torch.isfinite(x["linear_weight"]).all()
    # logits like a model's: W ~ N(0, 1/H), so |W_j| ~ 1 and the (tail) logits have std O(1)
    assert float(x["linear_weight"].detach().float().norm(dim=1).mean()) == pytest.approx(1.0, rel=0.05)


def test_make_inputs_is_deterministic_after_seed():
    shape = (64, 128, 300, lce.PEAKED, 7)
    torch.manual_seed(0)
    a = lce.make_inputs(shape, torch.bfloat16, CPU)
    torch.manual_seed(0)
    b = lce.make_inputs(shape, torch.bfloat16, CPU)
    for key in a:
        assert torch.equal(a[key], b[key])


@pytest.mark.parametrize("shape", [(256, 128, 1000), (256, 512, 8000)])
def test_peaked_mean_target_prob(shape):
    torch.manual_seed(0)
    x = lce.make_inputs((*shape, lce.PEAKED, 7), torch.bfloat16, CPU)
    p = lce.mean_target_prob(x["input"], x["linear_weight"], x["target"])
    assert p > 0.5
    assert p == pytest.approx(lce.PEAKED_TARGET_PROB, abs=0.03)


def test_peaked_softmax_shape():
    """The target is the top class, a few runner-ups carry a few percent, the rest is a long tail."""
    torch.manual_seed(0)
    x = lce.make_inputs((256, 512, 8000, lce.PEAKED, 7), torch.float32, CPU)
    keep = x["target"] != -100
    probs = (x["input"][keep] @ x["linear_weight"].T).detach().softmax(-1)
    top = probs.topk(len(lce.PEAKED_GAPS) + 2, dim=1)
    assert (top.indices[:, 0] == x["target"][keep]).float().mean() > 0.99
    runner_up = top.values[:, 1].mean()
    assert 0.02 < runner_up < 0.1  # about 0.9 * exp(-3)
    assert top.values[:, -1].mean() < 1e-2  # past the runner-ups: the tail
    assert (probs > 1e-6).sum(1).float().mean() > 100  # a long tail, not a one-hot


def test_random_mean_target_prob_is_low():
    torch.manual_seed(0)
    x = lce.make_inputs((256, 128, 1000, lce.RANDOM, 7), torch.bfloat16, CPU)
    p = lce.mean_target_prob(x["input"], x["linear_weight"], x["target"])
    assert p < 0.05


def test_mean_target_prob_matches_a_direct_computation():
    torch.manual_seed(0)
    x, w = torch.randn(40, 16), torch.randn(30, 16)
    t = torch.randint(0, 30, (40,))
    t[::3] = -100
    keep = t != -100
    direct = (x[keep] @ w.T).softmax(-1).gather(1, t[keep][:, None]).mean()
    assert lce.mean_target_prob(x, w, t, chunk_rows=7) == pytest.approx(float(direct), rel=1e-5)
    assert lce.mean_target_prob(x, w, t, max_rows=5) == pytest.approx(
        float((x[keep][:5] @ w.T).softmax(-1).gather(1, t[keep][:5, None]).mean()), rel=1e-5
    )
    assert math.isnan(lce.mean_target_prob(x, w, torch.full((40,), -100)))


# ---- providers ----


@pytest.mark.parametrize("inputs", [lce.RANDOM, lce.PEAKED])
def test_cpu_providers_compute_the_same_loss_and_gradients(inputs):
    shape = (96, 128, 700, inputs, 7)
    results = {}
    for name in ("torch", "fuselm", "fuselm_min"):
        torch.manual_seed(0)
        x = lce.make_inputs(shape, torch.float32, CPU)
        loss = lce.SUITE.provider(name).setup(CPU)(x)
        grads = torch.autograd.grad(loss, [x["input"], x["linear_weight"]])
        results[name] = (loss.detach(), *grads)
    for name in ("fuselm", "fuselm_min"):
        for got, want in zip(results[name], results["torch"], strict=True):
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["torch_compile", "liger", "cce"])
def test_gpu_only_providers_skip_on_cpu(name):
    with pytest.raises(SkipProvider):
        lce.SUITE.provider(name).setup(CPU)


# ---- the CLI on CPU ----


def test_cli_bench_linear_cross_entropy_cpu_defaults(tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["bench", "linear_cross_entropy", "--device", "cpu", "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "CPU figures" in printed and COLUMNS in printed
    for name in ("torch_compile", "liger", "cce"):
        assert f"skipping provider {name}" in printed

    md = (out / "linear_cross_entropy.md").read_text()
    assert COLUMNS in md and "256x128x1000x2x7" in md and "256x128x1000x1x2" in md
    assert "fwd records autograd" in md and "2 = peaked" in md
    data = json.loads((out / "linear_cross_entropy.json").read_text())
    assert set(data["skipped"]) == {"torch_compile", "liger", "cce"}
    assert [tuple(s) for s in data["shapes"]] == list(lce.SUITE.cpu_shapes)
    rows = data["rows"]
    assert len(rows) == 3 * 3 * 3  # shapes x providers (torch, fuselm, fuselm_min) x modes
    assert {r["provider"] for r in rows} == {"torch", "fuselm", "fuselm_min"}
    for r in rows:
        assert r["error"] is None, r
        assert r["extra_mib"] is None  # no memory figures on CPU
        n, h, v = r["shape"][:3]
        assert r["flops"] == {"fwd": 2, "bwd": 4, "full": 6}[r["mode"]] * n * h * v
        if r["mode"] != "bwd":  # bwd = full - fwd can come out <= 0 on a busy CPU, and then has no rates
            assert r["ms"] > 0 and r["x_floor"] > 0
    assert (out / "linear_cross_entropy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_shapes_select_variants(tmp_path):
    rc = main(
        [
            "bench",
            "linear_cross_entropy",
            "--device",
            "cpu",
            "--shapes",
            "64x128x500x2x7,64x128x500x1x2",
            "--modes",
            "full",
            "--providers",
            "torch,fuselm",
            "--quick",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "linear_cross_entropy.json").read_text())
    assert [(tuple(r["shape"]), r["provider"], r["mode"]) for r in data["rows"]] == [
        ((64, 128, 500, 2, 7), "torch", "full"),
        ((64, 128, 500, 2, 7), "fuselm", "full"),
        ((64, 128, 500, 1, 2), "torch", "full"),
        ((64, 128, 500, 1, 2), "fuselm", "full"),
    ]
    assert all(r["error"] is None for r in data["rows"])


@pytest.mark.parametrize("shapes", ["64x128x500", "64x128x500x3x7"])
def test_cli_bad_variant_shapes(tmp_path, capsys, shapes):
    args = ["bench", "linear_cross_entropy", "--device", "cpu", "--shapes", shapes, "--no-progress"]
    rc = main([*args, "--providers", "torch", "--modes", "full", "--quick", "--out", str(tmp_path)])
    if shapes.count("x") != 4:
        assert rc == 2 and "5 sizes" in capsys.readouterr().err  # N x H x V x inputs x k
    else:  # a bad inputs code: the row records the error, nothing measured
        assert rc == 1
        data = json.loads((tmp_path / "linear_cross_entropy.json").read_text())
        assert "inputs must be 1 (random) or 2 (peaked)" in data["rows"][0]["error"]


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("inputs", [lce.RANDOM, lce.PEAKED])
def test_gpu_providers_compute_the_same_loss(inputs):
    device = torch.device("cuda")
    shape = (1024, 512, 8000, inputs, 7)
    losses = {}
    for p in lce.SUITE.providers:
        try:
            fn = p.setup(device)
        except SkipProvider:
            continue
        torch.manual_seed(0)
        x = lce.make_inputs(shape, torch.bfloat16, device)
        losses[p.name] = float(fn(x).float())
    assert {"torch", "fuselm", "fuselm_min"} <= set(losses)
    for name, value in losses.items():
        assert value == pytest.approx(losses["torch"], rel=2e-2), (name, losses)
    if inputs == lce.PEAKED:
        torch.manual_seed(0)
        x = lce.make_inputs(shape, torch.bfloat16, device)
        assert lce.mean_target_prob(x["input"], x["linear_weight"], x["target"]) == pytest.approx(
            0.9, abs=0.03
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_bench_linear_cross_entropy_gpu_small(tmp_path):
    shapes = "1024x512x8000x1x7,1024x512x8000x2x7,1024x512x8000x1x2"
    rc = main(
        [
            "bench",
            "linear_cross_entropy",
            "--shapes",
            shapes,
            "--quick",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "linear_cross_entropy.json").read_text())
    for r in data["rows"]:
        if r["provider"] in ("torch", "fuselm", "fuselm_min"):
            assert r["error"] is None, r
            if r["mode"] != "bwd":
                assert r["extra_mib"] is not None and r["extra_mib"] >= 0 and r["x_floor"] > 0
