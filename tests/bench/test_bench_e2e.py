"""CPU tests of ``fuselm bench e2e``: the training benchmark's config, workers, CLI and report.

Each worker is a fresh Python process (importing torch and transformers takes a few seconds), so the
tests start as few of them as they can: one CLI run with one shape (hf and fuselm), one worker that
fails. Everything else is checked in process.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from fuselm.bench import e2e, fresh_process, registry, training
from fuselm.cli import main

CPU = torch.device("cpu")
GIB = 1 << 30


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers run fuselm's CPU path (the PyTorch references), not Triton's interpreter: the kernels
    are tested per op; here the whole training step is, and it must be fast."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ---- registry and CLI wiring ----


def test_registry_lists_e2e_outside_all(capsys):
    assert "e2e" in registry.TRAINING_SUITES
    assert "e2e" not in registry.suite_names()  # `fuselm bench all` runs suite_names(): not e2e
    assert registry.get_training_runner("e2e") is e2e.run_cli
    with pytest.raises(KeyError, match="unknown training benchmark"):
        registry.get_training_runner("nope")
    assert main(["bench"]) == 0
    listing = capsys.readouterr().out
    assert "e2e" in listing and "not part of 'all'" in listing


@pytest.mark.parametrize(
    "args, message",
    [
        (["--providers", "hf,bogus"], "unknown provider 'bogus'"),
        (["--shapes", "4x64x2"], "takes 2 sizes"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
    ],
)
def test_usage_errors(args, message, tmp_path, capsys):
    rc = main(["bench", "e2e", "--device", "cpu", "--no-progress", "--out", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "e2e.md").exists()


def test_unknown_suite_lists_e2e(capsys):
    assert main(["bench", "nope"]) == 2
    assert "e2e" in capsys.readouterr().err


# ---- the model ----


def test_gpu_preset_is_llama_3_2_1b():
    config = training.llama_config(e2e.GPU_PRESET.model, "sdpa")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (2048, 8192, 16)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 64)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (128256, 131072, 1e-5)
    assert config.tie_word_embeddings and not config.use_cache
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert rope["original_max_position_embeddings"] == 8192
    assert (rope.get("rope_theta") or config.rope_theta) == 500000.0
    assert e2e.GPU_PRESET.shapes == ((4, 4096), (8, 4096), (16, 4096))
    # parameters (tied embeddings counted once): Llama-3.2-1B's 1,235,814,400
    h, i, v, kv = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_key_value_heads
    attn = 2 * h * h + 2 * h * kv * config.head_dim
    params = v * h + config.num_hidden_layers * (attn + 3 * h * i + 2 * h) + h
    assert params == 1_235_814_400


def test_hf_and_fuselm_start_from_the_same_weights():
    hf = e2e.build_model(e2e.CPU_PRESET, "hf", torch.float32, CPU)
    fl = e2e.build_model(e2e.CPU_PRESET, "fuselm", torch.float32, CPU)
    import fuselm.hf

    try:
        assert fuselm.hf.is_patched(fl) and not any("forward" in vars(m) for m in hf.modules())
        for (name, a), (_, b) in zip(hf.named_parameters(), fl.named_parameters(), strict=True):
            assert torch.equal(a, b), name
    finally:
        fuselm.hf.unpatch(fl)


# ---- liger: skipped with a reason where it cannot run ----


def test_liger_skip_reasons(monkeypatch):
    assert "needs CUDA" in e2e._precheck("liger", CPU)
    with pytest.raises(e2e.SkipProvider, match="needs CUDA"):
        e2e.apply_provider_before_build("liger", CPU)
    # not importable: the parent skips without a process, the worker (if asked anyway) says so too
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else find_spec(name, *a)
    )
    assert "not importable" in e2e._precheck("liger", torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # `import liger_kernel...` raises ImportError
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(e2e.SkipProvider, match="liger_kernel not importable"):
        e2e.apply_provider_before_build("liger", torch.device("cuda"))
    assert e2e._precheck("hf", CPU) is None and e2e._precheck("fuselm", CPU) is None


# ---- workers ----


def test_worker_error_is_reported(reference_path):
    """An exception inside the worker comes back as the row's error, with its traceback."""
    row = fresh_process.run_case(
        e2e.BENCH, "bogus", (2, 16), plan=e2e.CPU_PRESET, dtype=torch.float32, device=CPU, warmup=0, steps=1
    )
    assert row.status == "error" and row.tokens_per_s is None
    assert "ValueError: unknown provider 'bogus'" in row.error
    assert "Traceback" in row.traceback


def test_worker_without_result_is_reported(monkeypatch):
    """A worker that dies before writing its result: the exit code and its last output are reported."""
    script = "import sys; print('loading the model'); sys.stderr.write('worker blew up\\n'); sys.exit(3)"
    monkeypatch.setattr(fresh_process, "worker_command", lambda *a, **k: [sys.executable, "-c", script])
    row = fresh_process.run_case(
        e2e.BENCH, "hf", (2, 16), plan=e2e.CPU_PRESET, dtype=torch.float32, device=CPU, warmup=0, steps=1
    )
    assert row.status == "error"
    assert "exited with code 3 and wrote no result" in row.error and "worker blew up" in row.error


# ---- the whole CPU run through the CLI ----


def test_cli_cpu_end_to_end(tmp_path, capsys, reference_path):
    out = tmp_path / "results"
    args = ["bench", "e2e", "--device", "cpu", "--shapes", "2x64", "--warmup", "1", "--steps", "2"]
    rc = main([*args, "--providers", "hf,liger,fuselm", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "CPU figures" in printed
    md = (out / "e2e.md").read_text()
    assert (out / "e2e.png").stat().st_size > 0
    data = json.loads((out / "e2e.json").read_text())

    assert "**CPU figures**" in md and "| 2x64 | hf |" in md and "| 2x64 | fuselm |" in md
    assert "skipped liger: needs CUDA" in md
    assert data["suite"] == "e2e" and data["preset"] == "cpu" and data["dtype"] == "fp32"
    assert data["warmup"] == 1 and data["steps"] == 2
    assert data["metadata"]["transformers"] and data["metadata"]["commit"]
    assert "needs CUDA" in data["skipped"]["liger"]
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"hf", "fuselm"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["batch"] == 2 and r["seq"] == 64
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] is None
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["final_loss"] == r["losses"][-1]
    assert "| 2x64 | hf |" in md and "n/a" in md

    # Same seed, same weights, same batch: the first-step losses agree up to fp32 rounding. On the CPU
    # both providers run fp32 PyTorch math (fuselm dispatches to its reference implementations, which
    # compute HF's formulas for RMSNorm, RoPE, SwiGLU and the shifted cross-entropy); they differ only in
    # the order of summations (e.g. the chunked log-sum-exp of the fused loss), i.e. a few ulps of fp32
    # (~1e-7 relative) grown through two layers. 1e-4 is far above that and far below what any real
    # difference (a wrong shift, eps, ignore_index or casting) does to a loss of ln(512) ~ 6.2.
    hf_loss, fl_loss = rows["hf"]["first_loss"], rows["fuselm"]["first_loss"]
    assert abs(fl_loss - hf_loss) / abs(hf_loss) < 1e-4, (hf_loss, fl_loss)


# ---- report from given rows (the GPU layout: OOM, errors, ratios) ----


def _gpu_report() -> fresh_process.CaseReport:
    def ok(provider, batch, tok, gib):
        return e2e.E2ERow(
            provider, batch, 4096, "ok", tokens_per_s=tok, step_ms=batch * 4096 / tok * 1e3,
            peak_bytes=int(gib * GIB), first_loss=12.0, final_loss=11.5, losses=[12.0, 11.5],
        )  # fmt: skip

    rows = [
        ok("hf", 4, 49.1e3, 61.2),
        ok("liger", 4, 63.5e3, 26.3),
        ok("fuselm", 4, 65.0e3, 25.0),
        ok("hf", 8, 49.6e3, 115.3),
        ok("liger", 8, 64.4e3, 45.2),
        ok("fuselm", 8, 70.0e3, 38.0),
        e2e.E2ERow(
            "hf", 16, 4096, "oom", error="OutOfMemoryError: CUDA out of memory. Tried to allocate 7 GiB."
        ),
        ok("liger", 16, 65.8e3, 82.9),
        e2e.E2ERow("fuselm", 16, 4096, "error", error="RuntimeError: boom"),
    ]
    return fresh_process.CaseReport(
        plan=e2e.GPU_PRESET,
        dtype=torch.bfloat16,
        device_type="cuda",
        shapes=e2e.GPU_PRESET.shapes,
        providers=e2e.PROVIDERS,
        warmup=3,
        steps=10,
        metadata={"device": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.23.0", "commit": "abc1234"},
        rows=rows,
    )


def test_ratios():
    report = _gpu_report()
    by_batch = {r["batch"]: r for r in fresh_process.ratios(e2e.BENCH, report)}
    assert by_batch[8]["tokens_vs_liger"] == pytest.approx(70.0 / 64.4)
    assert by_batch[8]["peak_vs_liger"] == pytest.approx(38.0 / 45.2, rel=1e-6)
    assert by_batch[8]["tokens_vs_hf"] == pytest.approx(70.0 / 49.6)
    assert by_batch[16]["tokens_vs_liger"] is None and by_batch[16]["peak_vs_hf"] is None
    assert list(by_batch[4]) == [
        "batch",
        "seq",
        "tokens_vs_liger",
        "peak_vs_liger",
        "tokens_vs_hf",
        "peak_vs_hf",
    ]


def test_gpu_report_files(tmp_path):
    report = _gpu_report()
    paths = e2e.write_report(report, tmp_path)
    md = paths["md"].read_text()
    assert "| 16x4096 | hf | OOM |" in md and "| 16x4096 | fuselm | error |" in md
    assert "| 8x4096 | liger | 64.4k | 508.8 | 45.2 |" in md
    assert "| 8x4096 | 1.09x | 0.84x | 1.41x | 0.33x |" in md
    assert "Targets" not in md and ">= 1.05x" not in md  # measured ratios only: targets live in issues
    assert "CPU figures" not in md and "NVIDIA H200" in md
    data = json.loads(paths["json"].read_text())
    assert "acceptance" not in data and data["ratios"][1]["tokens_vs_liger"] == pytest.approx(70.0 / 64.4)
    assert [r["status"] for r in data["rows"]].count("oom") == 1
    assert data["rows"][0]["peak_gib"] == pytest.approx(61.2, abs=1e-3)
    assert paths["png"].stat().st_size > 0


def test_oom_at_a_batch_skips_larger_batches(monkeypatch):
    calls = []

    def fake_run_case(bench, provider, shape, **kwargs):
        (batch, seq) = shape
        calls.append((provider, batch))
        if batch >= 8:
            return e2e.E2ERow(provider, batch, seq, "oom", error="OutOfMemoryError: CUDA out of memory.")
        return e2e.E2ERow(
            provider, batch, seq, "ok", tokens_per_s=1.0, step_ms=1.0, first_loss=1.0, final_loss=1.0
        )

    monkeypatch.setattr(fresh_process, "run_case", fake_run_case)
    report = fresh_process.run(
        e2e.BENCH,
        plan=e2e.CPU_PRESET,
        shapes=[(4, 64), (8, 64), (16, 64)],
        providers=["hf"],
        dtype=torch.float32,
        device=CPU,
        warmup=0,
        steps=1,
        progress=False,
        log=lambda s: None,
    )
    assert calls == [("hf", 4), ("hf", 8)]
    assert [r.status for r in report.rows] == ["ok", "oom", "oom"]
    assert "not run: out of memory at batch 8" in report.rows[2].error
