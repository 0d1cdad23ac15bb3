"""Tests of ``fuselm bench linear_log_probs``: shapes, inputs, providers against each other, the accuracy
records and the CLI on CPU (tiny fp32 shapes). GPU-only checks are marked ``gpu``."""

from __future__ import annotations

import json

import pytest
import torch
from fuselm_bench import linear_log_probs as llp
from fuselm_bench import registry
from fuselm_bench.harness import Ceilings, SkipProvider, compute_ratios

import fuselm
from fuselm.cli import main

CPU = torch.device("cpu")
HAS_OP = hasattr(fuselm, "linear_log_probs")
needs_op = pytest.mark.skipif(not HAS_OP, reason="fuselm.linear_log_probs not in this checkout")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001
        return False
    return True


HAS_TRL = _importable("trl.kernels.chunked_logprob")
HAS_LIGER = _importable("liger_kernel.ops.fused_linear_scaled_cross_entropy")


# ---- definition ----


def test_registry_runs_it_through_its_own_runner(capsys):
    assert "linear_log_probs" in registry.TRAINING_SUITES
    assert registry.get_training_runner("linear_log_probs") is llp.run_cli
    assert llp.SUITE.name == "linear_log_probs"
    assert llp.SUITE.provider_names == [
        "torch",
        "torch_compile",
        "trl",
        "liger_cute",
        "liger_fallback",
        "fuselm",
        "fuselm_min",
    ]
    assert llp.SUITE.forward_grad and llp.SUITE.columns == ("ms", "x_floor", "extra_mib")
    assert main(["bench"]) == 0
    assert "linear_log_probs" in capsys.readouterr().out


def test_gpu_shapes_cover_the_issue():
    shapes = set(llp.SUITE.gpu_shapes)
    for nhv in ((8192, 4096, 128256), (16384, 4096, 151936), (8192, 2304, 256000)):
        for outputs in (llp.LOG_PROBS, llp.WITH_ENTROPY):
            assert (*nhv, 7, outputs) in shapes
    assert (8192, 4096, 128256, 2, llp.LOG_PROBS) in shapes and (8192, 4096, 128256, 2, 2) in shapes
    for s in (*llp.SUITE.gpu_shapes, *llp.SUITE.cpu_shapes):
        assert llp.split_shape(s) == s


def test_split_shape_and_cost():
    assert llp.split_shape((8, 16, 32)) == (8, 16, 32, 7, llp.WITH_ENTROPY)
    for bad in ((8, 16), (8, 16, 32, 0, 1), (8, 16, 32, 7, 3)):
        with pytest.raises(ValueError):
            llp.split_shape(bad)
    n, h, v = 8192, 4096, 128256
    for mode, k in (("fwd", 2), ("bwd", 4), ("full", 6)):
        assert llp.cost((n, h, v, 7, 2), mode, torch.bfloat16).flops == k * n * h * v
    # TRL at 54.7 ms fwd+bwd with a 687 TFLOP/s GEMM is 1.46x the 6NHV floor (8NHV = 1.33x)
    r = compute_ratios(54.7, llp.cost((n, h, v, 7, 2), "full", torch.bfloat16), Ceilings(gemm_tflops=687.0))
    assert r["x_floor"] == pytest.approx(1.46, abs=0.01)


@pytest.mark.parametrize("k, outputs", [(7, 1), (2, 2)])
def test_make_inputs(k, outputs):
    torch.manual_seed(0)
    x = llp.make_inputs((700, 32, 50, k, outputs), torch.bfloat16, CPU)
    assert x["input"].shape == (700, 32) and x["input"].requires_grad and x["input"].dtype == torch.bfloat16
    assert x["linear_weight"].shape == (50, 32) and x["linear_weight"].requires_grad
    assert int((x["target"] == -100).sum()) == round(700 / k)
    assert x["outputs"] == llp.OUTPUTS[outputs] and x["case"] == (700, 32, 50, k, outputs)


# ---- providers ----


def _run(name: str, shape, dtype=torch.float32):
    torch.manual_seed(0)
    x = llp.make_inputs(shape, dtype, CPU)
    outs = llp.SUITE.provider(name).setup(CPU)(x)
    torch.manual_seed(1)
    grads = [torch.randn_like(o) for o in outs]
    dx, dw = torch.autograd.grad(outs, [x["input"], x["linear_weight"]], grads)
    return [o.detach().float() for o in outs], dx, dw, x["target"]


@pytest.mark.parametrize("outputs", [llp.LOG_PROBS, llp.WITH_ENTROPY])
def test_cpu_providers_agree(outputs):
    shape = (96, 48, 700, 7, outputs)
    names = ["trl"] * HAS_TRL + ["liger_fallback"] * HAS_LIGER + ["fuselm", "fuselm_min"] * HAS_OP
    want_outs, want_dx, want_dw, target = _run("torch", shape)
    assert len(want_outs) == outputs
    ignored = target == -100
    for o in want_outs:
        assert o.dtype == torch.float32 and o.shape == (96,) and bool((o[ignored] == 0).all())
    # the log-probs of a row sum to 1 in probability: check one against log_softmax directly
    torch.manual_seed(0)
    x = llp.make_inputs(shape, torch.float32, CPU)
    i = int((~ignored).nonzero()[0])
    z = (x["input"][i] @ x["linear_weight"].T).detach()
    assert float(want_outs[0][i]) == pytest.approx(float(torch.log_softmax(z, 0)[x["target"][i]]), abs=1e-5)
    for name in names:
        outs, dx, dw, _ = _run(name, shape)
        assert len(outs) == outputs, name
        for got, want in zip(outs, want_outs, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(dx, want_dx, rtol=1e-3, atol=1e-5, msg=name)
        torch.testing.assert_close(dw, want_dw, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["torch_compile", "liger_cute"])
def test_gpu_only_providers_skip_on_cpu(name):
    with pytest.raises(SkipProvider):
        llp.SUITE.provider(name).setup(CPU)


def test_accuracy_records_each_provider_once():
    llp.ACCURACY.clear()
    shape = (64, 32, 300, 2, llp.WITH_ENTROPY)
    torch.manual_seed(0)
    x = llp.make_inputs(shape, torch.bfloat16, CPU)
    fn = llp.SUITE.provider("torch").setup(CPU)
    fn(x)
    entry = llp.ACCURACY[(shape, "torch")]
    assert entry["tokens"] == 32  # half of 64 ignored, fewer than ACCURACY_TOKENS left
    # bf16 logits: log-probs off by about |z| * 2^-8 at most, far above an fp32 computation's error
    assert 0 < entry["log_probs"] < 5e-2 and 0 < entry["entropy"] < 5e-2
    llp.ACCURACY[(shape, "torch")] = {"marker": True}
    fn(x)  # a later call does not measure again
    assert llp.ACCURACY[(shape, "torch")] == {"marker": True}
    # in fp32 the eager provider matches the fp64 reference closely
    torch.manual_seed(0)
    x = llp.make_inputs((64, 32, 300, 7, llp.LOG_PROBS), torch.float32, CPU)
    fn(x)
    entry = llp.ACCURACY[((64, 32, 300, 7, llp.LOG_PROBS), "torch")]
    assert entry["log_probs"] < 1e-5 and entry["entropy"] is None
    llp.ACCURACY.clear()


# ---- the CLI on CPU ----


def test_cli_cpu(tmp_path, capsys):
    providers = ",".join(["torch", "torch_compile", *(["trl"] * HAS_TRL), *(["fuselm"] * HAS_OP)])
    args = ["bench", "linear_log_probs", "--device", "cpu", "--dtype", "fp32", "--quick", "--no-progress"]
    args += ["--shapes", "64x32x300x7x2,64x32x300x2x1", "--providers", providers, "--out", str(tmp_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "CPU figures" in printed and "skipping provider torch_compile" in printed
    summary = "| N x H x V x k x outputs | provider | fwd ms | bwd ms | fwd+bwd ms | x floor | extra MiB |"
    assert printed.rstrip().splitlines()[-1].startswith("| 64x32x300x2x1 |")  # the summary table comes last
    assert summary in printed
    md = (tmp_path / "linear_log_probs.md").read_text()
    assert summary in md and "max err log_probs" in md and "outputs 1 = log_probs" in md
    data = json.loads((tmp_path / "linear_log_probs.json").read_text())
    active = [p for p in providers.split(",") if p != "torch_compile"]
    assert set(data["skipped"]) == {"torch_compile"}
    assert len(data["rows"]) == 2 * len(active) * 3
    assert all(r["error"] is None for r in data["rows"])
    acc = {(tuple(a["shape"]), a["provider"]): a for a in data["accuracy"]}
    assert set(acc) == {(s, p) for s in ((64, 32, 300, 7, 2), (64, 32, 300, 2, 1)) for p in active}
    for (shape, _), a in acc.items():
        assert a["log_probs"] < 1e-4
        assert (a["entropy"] is None) == (shape[-1] == 1)
    assert (tmp_path / "linear_log_probs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "shapes, message", [("64x32x300", "takes 5 sizes"), ("64x32x300x7x3", "outputs must be 1")]
)
def test_cli_bad_shapes(tmp_path, capsys, shapes, message):
    args = ["bench", "linear_log_probs", "--device", "cpu", "--shapes", shapes, "--out", str(tmp_path)]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "linear_log_probs.md").exists()


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_gpu_small(tmp_path):
    shapes = "1024x512x8000x7x1,1024x512x8000x2x2"
    args = [
        "bench",
        "linear_log_probs",
        "--shapes",
        shapes,
        "--quick",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "linear_log_probs.json").read_text())
    ok = [r for r in data["rows"] if r["mode"] == "full" and r["error"] is None]
    assert {"torch", "torch_compile", "fuselm", "fuselm_min"} <= {r["provider"] for r in ok}
    for a in data["accuracy"]:
        assert a["log_probs"] < 0.05, a  # bf16
