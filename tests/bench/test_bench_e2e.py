"""CPU tests of ``fuselm bench e2e``: the training benchmark's models, grid, workers, CLI and report.

Each worker is a fresh Python process (importing torch and transformers takes a few seconds), so the
tests start as few of them as they can: one CLI run (one configuration, hf and fuselm, two repeats), one
worker that fails. Everything else is checked in process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys

import pytest
import torch
from fuselm_bench import e2e, fresh_process, registry, step_timing, training
from fuselm_bench.arguments import UsageError
from fuselm_bench.cli import build_parser
from fuselm_bench.fresh_process import WorkerCase
from fuselm_bench.harness import SkipProvider

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
        (["--models", "gpt2"], "unknown model 'gpt2'"),
        (["--models", "llama3-8b"], "not in the default grid; give --shapes"),
        (["--repeats", "0"], "expected a positive integer"),
        (["--profile-steps", "-1"], "--profile-steps must be >= 0"),
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


# ---- the models and the grid ----


@pytest.mark.parametrize(
    "name, params",
    [
        ("llama3.2-1b", 1_235_814_400),  # Llama-3.2-1B (tied embeddings counted once)
        ("qwen3-0.6b", 596_049_920),  # Qwen3-0.6B
        ("llama3-8b", 8_030_261_248),  # Meta-Llama-3-8B
    ],
)
def test_model_shapes_have_the_real_models_parameter_counts(name, params):
    """The configs' sizes give the published parameter counts (counted from the config: a model of these
    sizes is too big to build in a test, and under the test suite's poisoned factories a meta-device build
    does not stay on the meta device)."""
    shape = e2e.MODELS[name]
    c = training.causal_lm_config(shape.family, shape.settings(), "sdpa")
    h, i, v, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    qk_norm = 2 * c.head_dim if shape.family == "qwen3" else 0
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h + qk_norm
    embeddings = v * h * (1 if c.tie_word_embeddings else 2)
    assert embeddings + layers * per_layer + h == params


def test_model_configs():
    llama = training.causal_lm_config("llama", e2e.MODELS["llama3.2-1b"].settings())
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (2048, 8192, 16)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (32, 8, 64)
    assert (llama.vocab_size, llama.max_position_embeddings, llama.rms_norm_eps) == (128256, 131072, 1e-5)
    rope = getattr(llama, "rope_parameters", None) or llama.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert (rope.get("rope_theta") or llama.rope_theta) == 500000.0 and llama.tie_word_embeddings
    qwen = training.causal_lm_config("qwen3", e2e.MODELS["qwen3-0.6b"].settings())
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_hidden_layers) == (1024, 3072, 28)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim) == (16, 8, 128)
    assert qwen.vocab_size == 151936 and qwen.tie_word_embeddings and not qwen.attention_bias
    rope = getattr(qwen, "rope_parameters", None) or {"rope_theta": qwen.rope_theta}
    assert (rope.get("rope_theta") or qwen.rope_theta) == 1e6
    big = training.causal_lm_config("llama", e2e.MODELS["llama3-8b"].settings())
    assert (big.hidden_size, big.intermediate_size, big.num_hidden_layers, big.vocab_size) == (
        4096,
        14336,
        32,
        128256,
    )
    assert not big.tie_word_embeddings
    with pytest.raises(ValueError, match="unknown model family"):
        training.causal_lm_config("gpt2", {"rope_theta": 1.0})


def test_default_grid_is_the_small_batch_grid_next_to_the_large_batches():
    assert e2e.GPU_PRESET.shapes == (
        ("llama3.2-1b", 1, 512),
        ("llama3.2-1b", 1, 2048),
        ("llama3.2-1b", 4, 2048),
        ("llama3.2-1b", 4, 4096),
        ("llama3.2-1b", 8, 4096),
        ("qwen3-0.6b", 1, 2048),
    )
    assert e2e.DEFAULT_MODEL == "llama3.2-1b" and not e2e.GPU_PRESET.tiny
    tiny = e2e.MODELS[e2e.DEFAULT_MODEL].settings(e2e.CPU_PRESET.tiny)
    assert tiny["hidden_size"] == 64 and tiny["rope_scaling"]


def test_grid_from_models_and_shapes():
    def ns(models=None, shapes=None):
        return argparse.Namespace(models=models, shapes=shapes)

    assert e2e.grid(ns(), e2e.GPU_PRESET) == list(e2e.GPU_PRESET.shapes)
    assert e2e.grid(ns("llama3.2-1b"), e2e.GPU_PRESET) == list(e2e.GPU_PRESET.shapes[:5])
    both = e2e.grid(ns(shapes="1x512,2x64"), e2e.GPU_PRESET)
    assert both == [
        ("llama3.2-1b", 1, 512),
        ("llama3.2-1b", 2, 64),
        ("qwen3-0.6b", 1, 512),
        ("qwen3-0.6b", 2, 64),
    ]
    assert e2e.grid(ns("llama3-8b", "1x128"), e2e.GPU_PRESET) == [("llama3-8b", 1, 128)]
    with pytest.raises(UsageError, match="give --shapes"):
        e2e.grid(ns("llama3-8b"), e2e.GPU_PRESET)
    with pytest.raises(UsageError, match="unknown model"):
        e2e.grid(ns("gpt2"), e2e.GPU_PRESET)


@pytest.mark.parametrize("model", ["llama3.2-1b", "qwen3-0.6b"])
def test_hf_and_fuselm_start_from_the_same_weights(model):
    import fuselm.hf

    hf = e2e.build_model(e2e.CPU_PRESET, "hf", torch.float32, CPU, model=model)
    fl = e2e.build_model(e2e.CPU_PRESET, "fuselm", torch.float32, CPU, model=model)
    try:
        assert fuselm.hf.is_patched(fl) and not any("forward" in vars(m) for m in hf.modules())
        for (name, a), (_, b) in zip(hf.named_parameters(), fl.named_parameters(), strict=True):
            assert torch.equal(a, b), name
    finally:
        fuselm.hf.unpatch(fl)


def test_trainer_providers_are_opt_in_and_train_as_the_step_loop():
    """hf-trainer runs Trainer.train() (the same losses as the step loop's, its step figures there; no
    GPU figures on a CPU); fuselm-trainer needs CUDA (the parent skips it with the reason)."""
    for provider in e2e.TRAINER_PROVIDERS:
        assert provider in e2e.BENCH.providers and provider not in e2e.DEFAULT_PROVIDERS
    assert e2e.precheck("fuselm-trainer", CPU) == "needs CUDA (CUDA graphs)"
    assert e2e.precheck("hf-trainer", CPU) is None
    runs = {
        p: e2e.train(WorkerCase(p, ("llama3.2-1b", 2, 16), e2e.CPU_PRESET, torch.float32, CPU, 1, 2))
        for p in ("hf", "hf-trainer")
    }
    out = runs["hf-trainer"]
    assert out["status"] == "ok" and len(out["step_ms_all"]) == 2 and out["cpu_ms"] > 0
    assert out["profile_steps"] == 1 and out["gpu_ms"] is None
    assert out["tokens_per_s"] == pytest.approx(32 / (out["step_ms"] / 1e3))
    assert out["losses"] == pytest.approx(runs["hf"]["losses"], rel=1e-5)


def test_fuselm_trainer_path_on_emulated_graphs(monkeypatch):
    """fuselm-trainer's path (run_trainer with capture_training_steps) on the CPU emulation of CUDA graphs
    (kit.fake_graphs): every step replayed, hf-trainer's losses."""
    from kit.fake_graphs import emulate

    from fuselm.graph_step import GraphCache

    emulate(monkeypatch)
    replayed = []
    backward = GraphCache._replay_backward
    monkeypatch.setattr(GraphCache, "_replay_backward", lambda *a: replayed.append(1) or backward(*a))
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = {}
    for provider in e2e.TRAINER_PROVIDERS:
        model = e2e.build_model(e2e.CPU_PRESET, provider, torch.float32, CPU)
        runs[provider] = step_timing.run_trainer(
            model, ids, graphs=provider == "fuselm-trainer", lr=1e-2, fused=False, warmup=1, steps=2,
            profiled=0, device=CPU, seed=0,
        )  # fmt: skip
    assert runs["fuselm-trainer"].logged == pytest.approx(runs["hf-trainer"].logged, rel=1e-5)
    assert len(runs["fuselm-trainer"].step_s) == 2 and runs["fuselm-trainer"].profile is None
    assert len(replayed) == 3  # every step's backward replayed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fuselm_trainer_trains_as_hf_trainer():
    """fuselm-trainer (fuselm's model, Trainer.train() under capture_training_steps) gives hf-trainer's
    losses step after step (fp32, the tiny Llama; hf-trainer in float64 as the reference)."""
    from fuselm.ops._common.testing import assert_numerics

    cuda = torch.device("cuda")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1)).to(cuda)
    losses = {}
    for name, provider, dtype in (
        ("ours", "fuselm-trainer", torch.float32),
        ("eager", "hf-trainer", torch.float32),
        ("reference", "hf-trainer", torch.float64),
    ):
        # built in fp32 and then cast, so the float64 reference starts from the same weights
        model = e2e.build_model(e2e.CPU_PRESET, provider, torch.float32, cuda).to(dtype)
        run = step_timing.run_trainer(
            model, ids, graphs=provider == "fuselm-trainer", lr=1e-2, fused=False, warmup=2, steps=2,
            profiled=1, device=cuda, seed=0,
        )  # fmt: skip
        assert len(run.step_s) == 2 and run.profile is not None and run.profile.kernels > 0
        losses[name] = torch.tensor(run.logged, dtype=torch.float64)
    assert len(losses["ours"]) == 5 and losses["ours"][0] != losses["ours"][-1]  # it trains
    assert_numerics("losses", losses["ours"], losses["eager"], losses["reference"], torch.float32)


def test_qwen3_trains_in_process_and_reports_its_step_figures(reference_path):
    """The Qwen3 path of a worker (without the process): a tiny Qwen3ForCausalLM, with q/k norms, trains;
    the CPU figures are there, the GPU ones are not (no CUDA)."""
    import fuselm.hf

    out = e2e.train(WorkerCase("hf", ("qwen3-0.6b", 1, 16), e2e.CPU_PRESET, torch.float32, CPU, 1, 2))
    assert out["status"] == "ok" and len(out["losses"]) == 1 + 2 + e2e.CPU_PRESET.profile_steps
    assert out["step_ms"] == pytest.approx(statistics.median(out["step_ms_all"]))
    assert len(out["step_ms_all"]) == 2 and out["cpu_ms"] > 0 and out["profile_steps"] == 1
    assert out["gpu_ms"] is None and out["launches"] is None and out["peak_bytes"] is None
    assert out["tokens_per_s"] == pytest.approx(16 / (out["step_ms"] / 1e3))
    assert out["params"] > 0 and all(math.isfinite(x) for x in out["losses"])
    try:
        fl = e2e.train(WorkerCase("fuselm", ("qwen3-0.6b", 1, 16), e2e.CPU_PRESET, torch.float32, CPU, 1, 2))
    finally:
        from transformers import Qwen3ForCausalLM

        fuselm.hf.unpatch(Qwen3ForCausalLM)
    assert fl["status"] == "ok" and len(fl["losses"]) == len(out["losses"])


# ---- liger: skipped with a reason where it cannot run ----


def test_liger_skip_reasons(monkeypatch):
    assert "needs CUDA" in e2e.precheck("liger", CPU)
    with pytest.raises(SkipProvider, match="needs CUDA"):
        e2e.apply_provider_before_build("liger", CPU)
    # not importable: the parent skips without a process, the worker (if asked anyway) says so too
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else find_spec(name, *a)
    )
    assert "not importable" in e2e.precheck("liger", torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # `import liger_kernel...` raises ImportError
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    for family in ("llama", "qwen3"):
        with pytest.raises(SkipProvider, match="liger_kernel not importable"):
            e2e.apply_provider_before_build("liger", torch.device("cuda"), family)
    assert e2e.precheck("hf", CPU) is None and e2e.precheck("fuselm", CPU) is None


def test_graph_provider_is_opt_in_and_needs_cuda():
    """fuselm-graph (fuselm's model, forward + backward replayed from one CUDA graph) runs only when asked
    for and only on CUDA; on a CPU the parent skips it without a process, with the reason."""
    assert "fuselm-graph" in e2e.BENCH.providers and "fuselm-graph" not in e2e.DEFAULT_PROVIDERS
    assert e2e.precheck("fuselm-graph", CPU) == "needs CUDA (CUDA graphs)"
    for extra, want in (
        ([], list(e2e.DEFAULT_PROVIDERS)),
        (["--providers", "fuselm-graph"], ["fuselm-graph"]),
    ):
        argv = ["e2e", "--device", "cpu", *extra]
        args = build_parser().parse_args(argv)
        assert fresh_process.start_cli(e2e.BENCH, args, argv, grid=e2e.grid).providers == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_step_trains_as_the_eager_step():
    """The graphed step (capture after a warm-up on a side stream, replay, AdamW outside the graph) gives
    the eager step's losses, step after step (fp32, a tiny Llama; float64 eager HF as the reference)."""
    from fuselm.ops._common.testing import assert_numerics

    cuda = torch.device("cuda")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1)).to(cuda)
    losses = {}
    runs = {
        "eager": ("fuselm", torch.float32, step_timing.optimizer_step),
        "graph": ("fuselm-graph", torch.float32, functools.partial(step_timing.optimizer_step, graphed=True)),
        "reference": ("hf", torch.float64, step_timing.optimizer_step),
    }
    for name, (provider, dtype, make_step) in runs.items():
        # built in fp32 and then cast, so the float64 reference starts from the same weights
        model = e2e.build_model(e2e.CPU_PRESET, provider, torch.float32, cuda).to(dtype)
        step = make_step(
            training.causal_lm_loss(model), list(model.parameters()), [ids], lr=1e-2, fused=False
        )
        losses[name] = torch.stack([step(i).double() for i in range(4)])
    assert not torch.equal(losses["eager"][0], losses["eager"][-1])  # it trains
    assert_numerics("losses", losses["graph"], losses["eager"], losses["reference"], torch.float32)


# ---- workers ----


def test_worker_error_is_reported(reference_path):
    """An exception inside the worker comes back as the row's error, with its traceback."""
    case = WorkerCase("bogus", ("llama3.2-1b", 2, 16), e2e.CPU_PRESET, torch.float32, CPU, 0, 1)
    row = fresh_process.run_case(e2e.BENCH, case, repeat=1)
    assert row.status == "error" and row.tokens_per_s is None and row.repeat == 1
    assert "ValueError: unknown provider 'bogus'" in row.error
    assert "Traceback" in row.traceback


@pytest.mark.parametrize(
    "ending, said",
    [
        ("sys.exit(3)", "worker exited with code 3 and wrote no result"),
        (
            "os.kill(os.getpid(), signal.SIGKILL)",
            "code -9 (SIGKILL: the host out of memory?) and wrote no result",
        ),
    ],
)
def test_worker_without_result_is_reported(ending, said):
    """A worker that dies before writing its result: its last output, then how it ended (the last line, what
    a max-context search's note shows), a signal by name."""
    script = (
        f"import os, signal, sys; print('loading the model'); sys.stderr.write('worker blew up\\n'); {ending}"
    )
    bench = dataclasses.replace(e2e.BENCH, worker_prefix=lambda provider: [sys.executable, "-c", script])
    case = WorkerCase("hf", ("llama3.2-1b", 2, 16), e2e.CPU_PRESET, torch.float32, CPU, 0, 1)
    row = fresh_process.run_case(bench, case)
    assert row.status == "error"
    assert "worker blew up" in row.error and row.error.splitlines()[-1].endswith(said)


# ---- the whole CPU run through the CLI ----


def test_cli_cpu_end_to_end(tmp_path, capsys, reference_path):
    out = tmp_path / "results"
    args = ["bench", "e2e", "--device", "cpu", "--models", "llama3.2-1b", "--shapes", "2x64"]
    args += ["--warmup", "1", "--steps", "2", "--repeats", "2", "--providers", "hf,liger,fuselm"]
    rc = main([*args, "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "CPU figures" in printed and "(repeat 2/2)" in printed
    md = (out / "e2e.md").read_text()
    assert (out / "e2e.png").stat().st_size > 0
    data = json.loads((out / "e2e.json").read_text())

    assert "**CPU figures**" in md and "skipped liger: needs CUDA" in md
    head = "| model | B x T | provider | tokens/s | ms/step | CPU ms/step | GPU ms/step | launches/step |"
    assert head in md and "| llama3.2-1b | 2x64 | hf |" in md and "| llama3.2-1b | 2x64 | fuselm |" in md
    assert data["suite"] == "e2e" and data["preset"] == "cpu" and data["dtype"] == "fp32"
    assert data["warmup"] == 1 and data["steps"] == 2 and data["repeats"] == 2 and data["profile_steps"] == 1
    assert data["shapes"] == [["llama3.2-1b", 2, 64]] and data["models"]["llama3.2-1b"]["hidden_size"] == 64
    assert data["metadata"]["transformers"] and data["metadata"]["commit"]
    assert "needs CUDA" in data["skipped"]["liger"]
    rows = data["rows"]
    assert sorted((r["provider"], r["repeat"]) for r in rows) == [
        ("fuselm", 0),
        ("fuselm", 1),
        ("hf", 0),
        ("hf", 1),
    ]
    assert [r["provider"] for r in rows] == ["hf", "fuselm", "hf", "fuselm"]  # a repeat's providers together
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["model"], r["batch"], r["seq"]) == ("llama3.2-1b", 2, 64)
        assert len(r["step_ms_all"]) == 2 and r["step_ms"] == pytest.approx(
            statistics.median(r["step_ms_all"])
        )
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_ms"] * 1e3)
        assert r["cpu_ms"] > 0 and r["gpu_ms"] is None and r["launches"] is None and r["peak_bytes"] is None
        assert r["profile_steps"] == 1 and len(r["losses"]) == 1 + 2 + 1
        assert all(math.isfinite(x) for x in r["losses"]) and r["final_loss"] == r["losses"][-1]
    assert {b["bound_by"] for b in data["bound_by"]} == {None}  # no GPU: not a host-vs-GPU question
    ratio = data["ratios"][0]
    assert len(ratio["tokens_vs_hf_repeats"]) == 2 and ratio["tokens_vs_hf"] > 0
    assert ratio["tokens_vs_liger"] is None

    # Same seed, same weights, same batch: the first-step losses agree up to fp32 rounding. On the CPU
    # both providers run fp32 PyTorch math (fuselm dispatches to its reference implementations, which
    # compute HF's formulas for RMSNorm, RoPE, SwiGLU and the shifted cross-entropy); they differ only in
    # the order of summations (e.g. the chunked log-sum-exp of the fused loss), i.e. a few ulps of fp32
    # (~1e-7 relative) grown through two layers. 1e-4 is far above that and far below what any real
    # difference (a wrong shift, eps, ignore_index or casting) does to a loss of ln(512) ~ 6.2.
    by = {(r["provider"], r["repeat"]): r for r in rows}
    for repeat in (0, 1):
        hf_loss, fl_loss = by[("hf", repeat)]["first_loss"], by[("fuselm", repeat)]["first_loss"]
        assert abs(fl_loss - hf_loss) / abs(hf_loss) < 1e-4, (hf_loss, fl_loss)
    assert by[("hf", 0)]["losses"] == by[("hf", 1)]["losses"]  # a repeat is the same run again


# ---- report from given rows (the GPU layout: repeats, OOM, errors, ratios) ----


def _gpu_report() -> fresh_process.CaseReport:
    def ok(provider, model, batch, seq, repeat, tok, gib, cpu, gpu):
        step_ms = batch * seq / tok * 1e3
        return e2e.E2ERow(
            provider, model, batch, seq, "ok", repeat=repeat, tokens_per_s=tok, step_ms=step_ms,
            step_ms_all=[step_ms] * 3, cpu_ms=cpu, gpu_ms=gpu, launches=900.0, peak_bytes=int(gib * GIB),
            first_loss=12.0, final_loss=11.5, losses=[12.0, 11.5],
        )  # fmt: skip

    rows = []
    for rep, f in enumerate((1.0, 0.98, 1.02)):
        rows += [
            ok("hf", "llama3.2-1b", 1, 2048, rep, 36.4e3 * f, 13.7, 39.1, 58.3),
            ok("liger", "llama3.2-1b", 1, 2048, rep, 19.0e3 * f, 11.0, 101.9, 69.6),
            ok("fuselm", "llama3.2-1b", 1, 2048, rep, 41.4e3 * f, 9.8, 42.3, 45.2),
            ok("hf", "llama3.2-1b", 8, 4096, rep, 49.6e3 * f, 75.3, 200.0, 640.0),
            ok("liger", "llama3.2-1b", 8, 4096, rep, 64.4e3 * f, 45.2, 210.0, 500.0),
            ok("fuselm", "llama3.2-1b", 8, 4096, rep, 70.0e3 * f, 38.0, 190.0, 460.0),
        ]
    rows += [
        e2e.E2ERow("hf", "qwen3-0.6b", 16, 4096, "oom", error="OutOfMemoryError: CUDA out of memory."),
        e2e.E2ERow("fuselm", "qwen3-0.6b", 16, 4096, "error", error="RuntimeError: boom"),
    ]  # fmt: skip
    return fresh_process.CaseReport(
        plan=e2e.GPU_PRESET,
        dtype=torch.bfloat16,
        device_type="cuda",
        shapes=(("llama3.2-1b", 1, 2048), ("llama3.2-1b", 8, 4096), ("qwen3-0.6b", 16, 4096)),
        providers=e2e.PROVIDERS,
        warmup=3,
        steps=10,
        metadata={
            "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0",
            "transformers": "5.17.0",
            "commit": "abc",
        },
        rows=rows,
        repeats=3,
    )


def test_ratios_are_medians_with_the_per_repeat_range():
    report = _gpu_report()
    by = {(r["model"], r["batch"]): r for r in fresh_process.ratios(e2e.BENCH, report)}
    small = by[("llama3.2-1b", 1)]
    assert small["tokens_vs_hf"] == pytest.approx(41.4 / 36.4)
    assert small["tokens_vs_hf_repeats"] == pytest.approx([41.4 / 36.4] * 3)
    assert small["peak_vs_hf"] == pytest.approx(9.8 / 13.7, rel=1e-6)
    assert by[("llama3.2-1b", 8)]["tokens_vs_liger"] == pytest.approx(70.0 / 64.4)
    assert by[("qwen3-0.6b", 16)]["tokens_vs_hf"] is None
    assert by[("qwen3-0.6b", 16)]["tokens_vs_hf_repeats"] == [None, None, None]


def test_trainer_ratio_is_in_the_notes():
    """The acceptance figure of capture_training_steps: fuselm-trainer's tokens/s over hf-trainer's, the
    median over the repeats and the range of the per-repeat ratios, one line per configuration."""
    report = _gpu_report()
    for rep, (ours, base) in enumerate(((45.0e3, 30.0e3), (44.0e3, 31.0e3), (46.0e3, 29.0e3))):
        for provider, tok in (("fuselm-trainer", ours), ("hf-trainer", base)):
            report.rows.append(
                e2e.E2ERow(provider, "llama3.2-1b", 1, 2048, "ok", repeat=rep, tokens_per_s=tok, step_ms=50.0)
            )
    (line,) = e2e.trainer_ratios(report)
    assert line == "llama3.2-1b 1x2048: fuselm-trainer / hf-trainer tokens/s 1.50x (1.42-1.59)."
    assert any(line in note for note in e2e.notes(report))


def test_gpu_report_files(tmp_path):
    report = _gpu_report()
    paths = fresh_process.write_report(e2e.BENCH, report, tmp_path)
    md = paths["md"].read_text()
    # medians with the range of the repeats; bound by: CPU 101.9 >= 0.9 x 107.8 ms is host, 39.1 of 56.3 GPU
    liger = (
        "| llama3.2-1b | 1x2048 | liger | 19.0k (18.6k-19.4k) | 107.8 (105.7-110.0) | 101.9 | 69.6 | 900 |"
    )
    assert liger + " host |" in md
    assert (
        "| llama3.2-1b | 1x2048 | hf | 36.4k (35.7k-37.1k) | 56.3 (55.2-57.4) | 39.1 | 58.3 | 900 | GPU |"
        in md
    )
    assert "| qwen3-0.6b | 16x4096 | hf | OOM |" in md and "| qwen3-0.6b | 16x4096 | fuselm | error |" in md
    assert "| llama3.2-1b 1x2048 | 2.18x | 0.89x | 1.14x | 0.72x |" in md  # the same ratio in every repeat
    assert (
        "CPU figures" not in md and "NVIDIA H100" in md and "fresh-process repeats per configuration: 3" in md
    )
    data = json.loads(paths["json"].read_text())
    assert data["repeats"] == 3 and len(data["rows"]) == 20
    assert [r["status"] for r in data["rows"]].count("oom") == 1
    assert data["rows"][0]["peak_gib"] == pytest.approx(13.7, abs=1e-3)
    bound = {(b["model"], b["batch"], b["provider"]): b["bound_by"] for b in data["bound_by"]}
    assert bound[("llama3.2-1b", 1, "liger")] == "host" and bound[("llama3.2-1b", 1, "fuselm")] == "GPU"
    assert bound[("qwen3-0.6b", 16, "hf")] is None
    assert paths["png"].stat().st_size > 0


def test_oom_at_a_batch_skips_larger_batches_and_later_repeats(monkeypatch, tmp_path):
    calls = []

    def fake_run_case(bench, case, repeat=0):
        provider, (model, batch, seq) = case.provider, case.shape
        calls.append((provider, batch, repeat))
        if batch >= 8:
            return e2e.E2ERow(
                provider, model, batch, seq, "oom", repeat=repeat, error="OutOfMemoryError: CUDA."
            )
        return e2e.E2ERow(provider, model, batch, seq, "ok", repeat=repeat, tokens_per_s=1.0, step_ms=1.0)

    monkeypatch.setattr(fresh_process, "run_case", fake_run_case)
    shapes = [("llama3.2-1b", 4, 64), ("llama3.2-1b", 8, 64), ("llama3.2-1b", 16, 64), ("qwen3-0.6b", 8, 64)]
    c = fresh_process.CaseReport(
        e2e.CPU_PRESET, torch.float32, "cpu", shapes, ["hf"], 0, 1, {}, repeats=2, out_dir=tmp_path
    )
    report = fresh_process.run(e2e.BENCH, c, progress=False, log=lambda s: None)
    # batch 8 of llama ran once; its second repeat and batch 16 are not run; qwen3 is another model
    assert calls == [("hf", 4, 0), ("hf", 4, 1), ("hf", 8, 0), ("hf", 8, 0)]
    assert [(r.model, r.batch, r.repeat, r.status) for r in report.rows] == [
        ("llama3.2-1b", 4, 0, "ok"),
        ("llama3.2-1b", 4, 1, "ok"),
        ("llama3.2-1b", 8, 0, "oom"),
        ("llama3.2-1b", 8, 1, "oom"),
        ("llama3.2-1b", 16, 0, "oom"),
        ("llama3.2-1b", 16, 1, "oom"),
        ("qwen3-0.6b", 8, 0, "oom"),
        ("qwen3-0.6b", 8, 1, "oom"),
    ]
    assert "not run: out of memory at batch 8" in report.rows[3].error


def test_merge_joins_an_earlier_run(tmp_path):
    """A grid split over two commands: the second, with --merge, writes one report with both parts."""
    full = _gpu_report()
    first = fresh_process.CaseReport(**{**vars(full), "shapes": full.shapes[:1], "rows": full.rows[:3]})
    first.metadata = {**full.metadata, "command": "fuselm bench e2e --shapes 1x2048", "date": "d1"}
    fresh_process.write_report(e2e.BENCH, first, tmp_path)
    second_rows = [r for r in full.rows if r.shape == ("llama3.2-1b", 8, 4096)]
    second = fresh_process.CaseReport(**{**vars(full), "shapes": full.shapes[1:2], "rows": second_rows})
    previous = json.loads((tmp_path / "e2e.json").read_text())
    merged = fresh_process.merge_previous(e2e.BENCH, second, previous)
    assert merged.shapes == (("llama3.2-1b", 1, 2048), ("llama3.2-1b", 8, 4096))
    assert len(merged.rows) == 3 + len(second_rows) and merged.rows[0].provider == "hf"
    assert merged.merged == [{"command": "fuselm bench e2e --shapes 1x2048", "date": "d1", "commit": "abc"}]
    md = fresh_process.markdown(e2e.BENCH, merged)
    assert (
        "merged rows of: `fuselm bench e2e --shapes 1x2048`" in md and "| llama3.2-1b | 1x2048 | hf |" in md
    )
    # rerunning a configuration replaces its earlier rows
    again = fresh_process.merge_previous(e2e.BENCH, first, previous)
    assert len(again.rows) == 3
    other = dict(previous, metadata={**previous["metadata"], "device": "NVIDIA H200"})
    with pytest.raises(UsageError, match="ran on 'NVIDIA H200'"):
        fresh_process.merge_previous(e2e.BENCH, second, other)


# ---- GPU: the profiler's figures ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_gpu_small_run_has_gpu_figures(tmp_path):
    args = ["bench", "e2e", "--models", "qwen3-0.6b", "--shapes", "1x256", "--providers", "hf,fuselm"]
    args += ["--warmup", "1", "--steps", "2", "--profile-steps", "1", "--repeats", "1"]
    assert main([*args, "--no-progress", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "e2e.json").read_text())
    for r in data["rows"]:
        assert r["status"] == "ok", r
        assert r["gpu_ms"] > 0 and r["launches"] >= 28 and r["peak_bytes"] > r["weights_bytes"] > 0
        assert 0 < r["cpu_ms"] and r["profile_steps"] == 1
    assert {b["bound_by"] for b in data["bound_by"]} <= {"host", "GPU"}


def test_cli_merge_from_a_path_joins_a_split_grid(tmp_path, monkeypatch, capsys):
    """How a grid is split over GPU calls whose output folders start empty: the second command names the
    first one's JSON with --merge PATH and writes one report with both parts; a JSON of the older layout
    (no model column) is refused with the reason."""

    def fake_run_case(bench, case, repeat=0):
        provider, (model, batch, seq) = case.provider, case.shape
        return e2e.E2ERow(
            provider, model, batch, seq, "ok", repeat=repeat, tokens_per_s=100.0, step_ms=1.0, cpu_ms=0.5,
            first_loss=6.0, losses=[6.0],
        )  # fmt: skip

    monkeypatch.setattr(fresh_process, "run_case", fake_run_case)
    base = ["bench", "e2e", "--device", "cpu", "--shapes", "2x16", "--providers", "hf", "--no-progress"]
    assert main([*base, "--models", "llama3.2-1b", "--out", str(tmp_path / "a")]) == 0
    first = tmp_path / "a" / "e2e.json"
    assert main([*base, "--models", "qwen3-0.6b", "--out", str(tmp_path / "b"), "--merge", str(first)]) == 0
    data = json.loads((tmp_path / "b" / "e2e.json").read_text())
    assert data["shapes"] == [["llama3.2-1b", 2, 16], ["qwen3-0.6b", 2, 16]]
    assert [(r["model"], r["repeat"]) for r in data["rows"]] == [
        ("llama3.2-1b", 0),
        ("llama3.2-1b", 1),
        ("llama3.2-1b", 2),
        ("qwen3-0.6b", 0),
        ("qwen3-0.6b", 1),
        ("qwen3-0.6b", 2),
    ]
    assert len(data["merged"]) == 1 and "--models llama3.2-1b" in data["merged"][0]["command"]
    old = json.loads(first.read_text())
    old["shape_fields"] = ["batch", "seq"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    capsys.readouterr()
    monkeypatch.setattr(fresh_process, "run_case", lambda *a, **k: pytest.fail("ran before the merge check"))
    assert main([*base, "--out", str(tmp_path / "c"), "--merge", str(tmp_path / "old.json")]) == 2
    assert "an older fuselm bench e2e wrote it" in capsys.readouterr().err


def test_bound_by_reads_the_gpu_side():
    """A step whose kernels fill its wall time is GPU-bound; one whose GPU idles is host-bound even when its
    CPU time is below its wall time (a synchronization's wait: fuselm at 1x512 on an H100, 24.6 ms of
    kernels in a 59.7 ms step with 51.8 ms of CPU). No GPU figure or no CUDA: no answer."""
    assert e2e.bound_by(44.6, 48.2) == "GPU"
    assert e2e.bound_by(24.6, 59.7) == "host"
    assert e2e.bound_by(None, 59.7) is None and e2e.bound_by(5.0, 5.0, cuda=False) is None


def test_kernel_profile_charges_device_idle_to_the_event_that_ends_it():
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    def ev(name, start, us, dev=DeviceType.CUDA):
        return E(name=name, device_type=dev, time_range=E(start=start, elapsed_us=lambda: us))

    events = [
        ev("gemm", 0, 30),
        ev("Memcpy HtoD", 10, 40),  # overlaps gemm: busy until 50
        ev("rms", 70, 10),  # 20 us idle before it
        ev("aten::mm", 80, 500, DeviceType.CPU),  # host events never count
        ev("rms", 100, 5),  # 20 us more
        ev("gemm", 104, 6),  # overlaps: no gap
    ]
    p = step_timing.KernelProfile.from_events(events, steps=2)
    assert round(p.idle_s * 1e6) == 40
    ((name, ms, gaps),) = p.top(10, "idle_before")
    assert (name, round(ms * 1e3), gaps) == ("rms", 20, 1.0)
