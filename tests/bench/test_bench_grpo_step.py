"""CPU tests of ``fuselm bench grpo_step``: the batch, the heads against each other, the loss, the runner's
bookkeeping (in process) and one CLI run (two worker processes, tiny fp32 model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from fuselm_bench import e2e, fresh_process, grpo_step, registry

import fuselm
from fuselm.cli import main

CPU = torch.device("cpu")
HAS_OP = hasattr(fuselm, "linear_log_probs")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001
        return False
    return True


HAS_TRL = _importable("trl.kernels.chunked_logprob")


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers run fuselm's CPU path (the PyTorch reference), not Triton's interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_registry_and_plans():
    assert "grpo_step" in registry.TRAINING_SUITES and "grpo_step" not in registry.suite_names()
    assert registry.get_training_runner("grpo_step") is grpo_step.run_cli
    gpu = grpo_step.GPU_PLAN
    m = grpo_step.BENCH.plan_json(SimpleNamespace(plan=gpu))["model"]  # e2e's Llama-3.2-1B shape
    assert (m["hidden_size"], m["num_hidden_layers"], m["num_attention_heads"], m["num_key_value_heads"]) == (
        2048,
        16,
        32,
        8,
    )
    assert (m["intermediate_size"], m["vocab_size"], m["tie_word_embeddings"]) == (8192, 128256, True)
    assert (8, 512, 1536) in gpu.shapes
    assert grpo_step.BENCH.plans == (grpo_step.GPU_PLAN, grpo_step.CPU_PLAN)


def test_make_batch():
    b = grpo_step.make_batch(100, 4, 5, 20, CPU)
    assert b["ids"].shape == (4, 25) and b["mask"].shape == (4, 20) and b["targets"].shape == (4, 20)
    lengths = b["mask"].sum(1)
    assert bool(((lengths >= 10) & (lengths <= 20)).all())
    assert bool((b["targets"][b["mask"]] == b["ids"][:, 5:][b["mask"]]).all())
    assert bool((b["targets"][~b["mask"]] == -100).all())
    assert b["adv"].shape == (4,) and abs(float(b["adv"].mean())) < 1e-5
    again = grpo_step.make_batch(100, 4, 5, 20, CPU)
    assert all(torch.equal(b[k], again[k]) for k in b)


def test_policy_loss_gradient_is_minus_the_advantage():
    lp = torch.randn(3, 6, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0])
    loss = grpo_step.policy_loss(lp, mask, adv)
    assert float(loss.detach()) == pytest.approx(-float((adv[:, None] * mask).sum() / mask.sum()))
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, -adv[:, None] * mask / mask.sum())


def test_heads_agree_on_a_tiny_model():
    model = e2e.build_model(e2e.CPU_PRESET, "hf", torch.float32, CPU)
    b = grpo_step.make_batch(model.config.vocab_size, 2, 4, 12, CPU)
    torch.manual_seed(0)
    h0 = torch.randn(2, 12, model.config.hidden_size)
    names = ["hf", *(["trl"] * HAS_TRL), *(["fuselm"] * HAS_OP)]
    results = {}
    for name in names:
        h = h0.clone().requires_grad_(True)
        lp, ent = grpo_step.make_head(name, model)(h, b["targets"])
        assert lp.shape == ent.shape == (2, 12) and lp.dtype == torch.float32
        assert bool((lp[~b["mask"]] == 0).all()) and bool((ent[~b["mask"]] == 0).all())
        loss = grpo_step.policy_loss(lp, b["mask"], b["adv"])
        dh, dw = torch.autograd.grad(loss, [h, model.lm_head.weight])
        results[name] = (lp.detach(), ent.detach(), dh, dw)
    for name in names[1:]:
        for got, want in zip(results[name], results["hf"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="unknown provider"):
        grpo_step.make_head("nope", model)


def _row(provider, shape, step_ms, peak, status="ok"):
    return grpo_step.StepRow(provider, *shape, status, step_ms=step_ms, peak_bytes=peak)


def test_ratios_and_tables():
    report = fresh_process.CaseReport(
        plan=grpo_step.GPU_PLAN,
        dtype=torch.bfloat16,
        device_type="cuda",
        shapes=((8, 512, 1536),),
        providers=grpo_step.PROVIDERS,
        warmup=1,
        steps=1,
        metadata={},
    )
    s = (8, 512, 1536)
    report.rows += [
        _row("hf", s, 400.0, 60 << 30),
        _row("trl", s, 300.0, 30 << 30),
        _row("fuselm", s, 240.0, 24 << 30),
    ]
    (r,) = fresh_process.ratios(grpo_step.BENCH, report)
    assert r["time_vs_trl"] == pytest.approx(0.8) and r["peak_vs_trl"] == pytest.approx(0.8)
    assert r["time_vs_hf"] == pytest.approx(0.6) and r["peak_vs_hf"] == pytest.approx(0.4)
    assert "| 8x(512+1536) | 0.80x | 0.80x | 0.60x | 0.40x |" in fresh_process.ratio_table(
        grpo_step.BENCH, report
    )
    assert "| 8x(512+1536) | fuselm | 240.0 |" in grpo_step.markdown_table(report)


def test_oom_at_a_batch_skips_larger_batches(monkeypatch, tmp_path):
    calls = []

    def fake_run_case(bench, case, repeat=0):
        provider, shape = case.provider, case.shape
        calls.append((provider, shape))
        if shape[0] >= 8:
            return grpo_step.StepRow(provider, *shape, "oom", error="OutOfMemoryError: CUDA out of memory.")
        return grpo_step.StepRow(provider, *shape, "ok", step_ms=1.0, mean_entropy=[1.0])

    monkeypatch.setattr(fresh_process, "run_case", fake_run_case)
    shapes = [(4, 8, 8), (8, 8, 8), (16, 8, 8)]
    c = fresh_process.CaseReport(
        grpo_step.CPU_PLAN, torch.float32, "cpu", shapes, ["hf"], 0, 1, {}, out_dir=tmp_path
    )
    report = fresh_process.run(grpo_step.BENCH, c, log=lambda s: None)
    assert calls == [("hf", (4, 8, 8)), ("hf", (8, 8, 8))]
    assert [r.status for r in report.rows] == ["ok", "oom", "oom"]
    assert "not run" in report.rows[2].error


@pytest.mark.parametrize(
    "args, message",
    [(["--shapes", "2x8"], "takes 3 sizes"), (["--providers", "hf,x"], "unknown provider 'x'")],
)
def test_usage_errors(args, message, tmp_path, capsys):
    assert main(["bench", "grpo_step", "--device", "cpu", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not (HAS_OP and HAS_TRL), reason="needs fuselm.linear_log_probs and trl")
def test_cli_cpu(tmp_path, capsys, reference_path):
    args = ["bench", "grpo_step", "--device", "cpu", "--shapes", "2x8x16", "--providers", "trl,fuselm"]
    assert main([*args, "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("| 2x(8+16) | fuselm |")
    data = json.loads((tmp_path / "grpo_step.json").read_text())
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"trl", "fuselm"} and all(r["status"] == "ok" for r in rows.values()), rows
    for key in ("mean_log_probs", "mean_entropy", "losses"):  # same weights and batch: step 1 agrees
        assert rows["fuselm"][key][0] == pytest.approx(rows["trl"][key][0], rel=1e-4, abs=1e-5)
        assert len(rows["fuselm"][key]) == 2
    assert rows["fuselm"]["mean_entropy"][0] > 0 and rows["fuselm"]["mean_log_probs"][0] < 0
    md = (tmp_path / "grpo_step.md").read_text()
    assert "time fuselm / TRL" in md and "PPO-clip" in md
    assert (tmp_path / "grpo_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
