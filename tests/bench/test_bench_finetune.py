"""CPU tests of ``fuselm bench finetune``: the saved model, the workers, the CLI and the report.

A worker is a fresh Python process (importing torch, transformers and PEFT takes seconds), so the tests
start few: one CLI run of the CPU smoke path (hf and fuselm, lora and qlora: four workers), one float64 HF
worker as the numerics rule's reference, and two Unsloth boot checks with a stand-in ``unsloth`` module.
Everything else is checked in process (fake workers where only the parent's logic is under test).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from fuselm_bench import finetune, fresh_process, registry
from fuselm_bench.arguments import UsageError

from fuselm.cli import main
from fuselm.ops._common.testing import assert_numerics

CPU = torch.device("cpu")
GIB = 1 << 30


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers run fuselm's CPU path (the PyTorch references), not Triton's interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ---- registry and CLI wiring ----


def test_registry_lists_finetune_outside_all(capsys):
    assert "finetune" in registry.TRAINING_SUITES and "finetune" not in registry.suite_names()
    assert registry.get_training_runner("finetune") is finetune.run_cli
    assert main(["bench"]) == 0
    assert "finetune" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scenarios", "qlora,full"], "unknown scenario 'full'"),
        (["--models", "gpt2"], "unknown model 'gpt2'"),
        (["--providers", "hf,axolotl"], "unknown provider 'axolotl'"),
        (["--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1)"),
        (["--profile-steps", "-1"], "--profile-steps must be >= 0"),
        (["--shapes", "4x2048x2"], "takes 2 sizes"),
        (["--rank", "0"], "expected a positive integer"),
        (["--models", "llama3-70b", "--scenarios", "lora"], "llama3-70b is saved 4-bit only"),
    ],
)
def test_usage_errors(args, message, tmp_path, capsys):
    rc = main(["bench", "finetune", "--device", "cpu", "--no-progress", "--out", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "finetune.md").exists()


def test_grid():
    ns = argparse.Namespace(models=None, scenarios=None, shapes=None)
    assert finetune.grid(ns, finetune.GPU_PLAN) == [
        ("llama3-8b", "qlora", 4, 2048),
        ("llama3-8b", "lora", 4, 2048),
    ]
    ns = argparse.Namespace(models="llama3.2-1b,qwen3-0.6b", scenarios="lora", shapes="1x2048")
    assert finetune.grid(ns, finetune.GPU_PLAN) == [
        ("llama3.2-1b", "lora", 1, 2048),
        ("qwen3-0.6b", "lora", 1, 2048),
    ]
    ns = argparse.Namespace(models="llama3-70b,llama3-8b", scenarios="lora,qlora", shapes="1x2048")
    assert finetune.grid(ns, finetune.GPU_PLAN) == [  # the 4-bit-only shape: QLoRA alone
        ("llama3-70b", "qlora", 1, 2048),
        ("llama3-8b", "lora", 1, 2048),
        ("llama3-8b", "qlora", 1, 2048),
    ]


# ---- the saved model ----


def test_a_4bit_only_shape_is_saved_quantized_tensor_by_tensor_and_trains(tmp_path, monkeypatch):
    """llama3-70b (tiny here) is drawn and quantized one tensor at a time into NF4 shards that
    from_pretrained loads as 4-bit layers without being asked to quantize; its QLoRA model trains."""
    from fuselm_bench import nf4_checkpoint

    monkeypatch.setattr(nf4_checkpoint, "SHARD_BYTES", 1 << 14)  # several shards, as the 70B's 4 GiB ones
    folder = finetune.model_folder(tmp_path, "llama3-70b", True, torch.float32)
    assert folder.name == "llama3-70b-tiny-nf4"
    marker = finetune.save_model("llama3-70b", True, folder, CPU, torch.float32, seed=0)
    assert marker["dtype"] == "nf4" and finetune.saved_model_ok(folder, "llama3-70b", True, torch.float32, 0)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert (
        json.loads((folder / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"]
        == "nf4"
    )

    def case(scenario: str) -> fresh_process.WorkerCase:
        extra = {"rank": 4, "alpha": 8, "dropout": 0.0, "offload": False}
        shape = ("llama3-70b", scenario, 1, 16)
        return fresh_process.WorkerCase(
            "fuselm", shape, finetune.CPU_PLAN, torch.float32, CPU, 0, 1, 0, extra
        )

    model, _ = finetune.load_peft_model(case("qlora"), folder)
    layer = model.base_model.model.model.layers[0]
    assert type(layer.mlp.down_proj.base_layer).__name__ == "Linear4bit"
    weight = layer.mlp.down_proj.base_layer.weight
    import bitsandbytes.functional as bnb_functional

    dense = bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
    assert abs(dense.float().std().item() - 0.02) < 0.004  # HF's init, normal(0, initializer_range)
    ids = torch.randint(4, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(512)) < 1.0
    assert layer.mlp.down_proj.lora_B.default.weight.grad is not None
    with pytest.raises(finetune.SkipProvider, match="saved 4-bit only"):
        finetune.load_peft_model(case("lora"), folder)


def test_saved_model_loads_back_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = finetune.model_folder(tmp_path, "qwen3-0.6b", True, torch.float32)
    assert folder.name == "qwen3-0.6b-tiny-fp32"
    marker = finetune.save_model("qwen3-0.6b", True, folder, CPU, torch.float32, seed=0)
    assert marker["bytes"] > 0 and (folder / "model.safetensors").is_file()
    assert finetune.saved_model_ok(folder, "qwen3-0.6b", True, torch.float32, 0)
    assert not finetune.saved_model_ok(folder, "qwen3-0.6b", True, torch.float32, 1)  # another seed
    assert not finetune.saved_model_ok(folder, "llama3-8b", True, torch.float32, 0)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    settings = finetune.model_settings("qwen3-0.6b", True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == settings["vocab_size"]
    assert len(tok) == model.config.vocab_size  # no embedding resize by anyone who checks the tokenizer
    assert tok.pad_token_id == settings["pad_token_id"] != tok.eos_token_id == settings["eos_token_id"]
    assert tok.pad_token == "<pad>" and tok("t7 t9")["input_ids"] == [7, 9]
    # the same seeded init as the in-process build
    from fuselm_bench import e2e, training

    torch.manual_seed(0)
    config = training.causal_lm_config("qwen3", settings, "sdpa")
    again = training.build_causal_lm(config, CPU, torch.float32)
    for (name, a), (_, b) in zip(again.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert e2e.MODELS["qwen3-0.6b"].family == "qwen3"


def test_make_tokenizer_rejects_clashing_special_ids():
    with pytest.raises(ValueError, match="must be distinct"):
        finetune.make_tokenizer(16, 1, 2, 2)


def test_worker_environment():
    env = finetune.worker_env("hf", {"unsloth_compile": False})
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["UNSLOTH_DISABLE_STATISTICS"] == "1"
    assert env["USE_HUB_KERNELS"] == "0"  # transformers >= 5.25 would look hub kernels up (and raise offline)
    assert env["UNSLOTH_COMPILE_DISABLE"] == "1"
    assert "UNSLOTH_COMPILE_DISABLE" not in finetune.worker_env("unsloth", {"unsloth_compile": True})
    assert finetune.worker_prefix("hf")[1:] == ["-m", "fuselm_bench.finetune"]
    boot = finetune.worker_prefix("unsloth")[2]
    assert boot.index("import unsloth") < boot.index("from fuselm")  # unsloth before anything of ours


def test_allocator_setting_follows_unsloths_unless_the_parent_sets_one(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert finetune.base_env()["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert "PYTORCH_ALLOC_CONF" not in finetune.base_env()


def test_host_memory_off_cuda_has_no_pinned_figure():
    out = finetune.host_memory(CPU, finetune._rss())
    assert out["host_pinned_bytes"] is None and out["host_pinned_source"] is None
    assert out["rss_delta_bytes"] is not None and out["max_rss_bytes"] > 0


def test_host_memory_on_cuda_adds_fuselms_registered_buffers(monkeypatch):
    """fuselm.offload page-locks its large buffers itself (outside torch's pinned allocator): the pinned
    figure is the sum of both peaks, and the source says so."""
    import torch

    from fuselm import offload

    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.all.peak": 100})
    monkeypatch.setattr(offload, "host_memory_stats", lambda: {"peak_pinned_bytes": 23})
    out = finetune.host_memory(torch.device("cuda"), None)
    assert out["host_pinned_bytes"] == 123
    assert "fuselm.offload.host_memory_stats()['peak_pinned_bytes']" in out["host_pinned_source"]


def test_bitsandbytes_4bit_runs_on_this_cpu():
    """The CPU smoke path runs qlora here (bitsandbytes' CPU backend); where it does not, the CLI drops it
    with a note (next test)."""
    assert finetune.bnb_cpu_4bit_works() is None


# ---- the parent's logic with fake workers ----


def _fake_row(provider, shape, repeat, **kw):
    model, scenario, batch, seq = shape
    losses = [6.0 - 0.01 * i for i in range(5)]
    return finetune.FinetuneRow(
        provider, model, scenario, batch, seq, "ok", repeat=repeat, step_ms=10.0, tokens_per_s=1.0,
        cpu_ms=5.0, losses=losses, first_loss=losses[0], **kw,
    )  # fmt: skip


def test_cli_without_model_dir_removes_its_temporary_models_and_drops_qlora_without_bnb(
    tmp_path, monkeypatch, capsys
):
    calls = []

    def fake_run_case(bench, case, repeat=0):
        provider, shape, extra = case.provider, case.shape, case.extra
        folder = finetune.model_folder(extra["model_dir"], shape[0], True, torch.float32)
        assert (folder / finetune.MARKER).is_file()  # saved before any worker runs
        calls.append((provider, shape, extra))
        return _fake_row(provider, shape, repeat)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(fresh_process, "run_case", fake_run_case)
    monkeypatch.setattr(finetune, "bnb_cpu_4bit_works", lambda: "bitsandbytes 4-bit does not run (pretend)")
    out = tmp_path / "out"
    args = ["bench", "finetune", "--device", "cpu", "--providers", "hf,fuselm", "--rank", "8"]
    assert main([*args, "--lora-dropout", "0.1", "--no-offload", "--no-progress", "--out", str(out)]) == 0
    assert "qlora not run on this CPU" in capsys.readouterr().out
    assert [(p, s[1]) for p, s, _ in calls] == [("hf", "lora"), ("fuselm", "lora")]
    extra = calls[0][2]
    assert (extra["rank"], extra["alpha"], extra["dropout"], extra["offload"]) == (8, 8.0, 0.1, False)
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary model folder is gone
    md = (out / "finetune.md").read_text()
    assert "qlora not run on this CPU: bitsandbytes 4-bit does not run (pretend)" in md


def _gpu_report() -> fresh_process.CaseReport:
    shapes = (("llama3-8b", "qlora", 4, 2048), ("llama3-8b", "lora", 4, 2048))
    table = {  # the figures of the finetune table (ms, GiB)
        ("qlora", "hf"): (1358, 23.75),
        ("qlora", "liger"): (1154, 10.38),
        ("qlora", "fuselm"): (1148, 10.38),
        ("qlora", "unsloth"): (791, 7.62),
        ("lora", "hf"): (1376, 33.40),
        ("lora", "liger"): (1174, 20.09),
        ("lora", "fuselm"): (1168, 20.09),
    }
    rows = []
    for shape in shapes:
        for p in finetune.PROVIDERS:
            if (shape[1], p) not in table:
                rows.append(
                    finetune.FinetuneRow(p, *shape, "oom", error="OutOfMemoryError: CUDA out of memory.")
                )
                continue
            ms, gib = table[(shape[1], p)]
            row = _fake_row(p, shape, 0, peak_bytes=int(gib * GIB), reserved_bytes=int((gib + 1) * GIB))
            row.step_ms, row.step_ms_all, row.gpu_ms, row.launches = ms, [ms] * 10, ms * 0.95, 4000.0
            row.host_pinned_bytes = 2 * GIB if p in ("fuselm", "unsloth") else 0
            row.losses = [11.9 + (0.001 if p == "unsloth" else 0.0) - 0.01 * i for i in range(5)]
            if p == "fuselm":
                row.fused_modules, row.fused_modules_ran, row.modules, row.lora_layers = 420, 400, 1200, 224
                row.lora_layers_peft, row.lora_layers_fused, row.lora_layers_inside = 32, 96, 96
                row.fused_forwards = {"fuselm_LlamaMLP.forward": 32}
                row.checkpointing = "HF gradient checkpointing + fuselm.hf.patch(checkpointing='offload')"
            rows.append(row)
    metadata = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "peft": "0.21.2",
        "unsloth": "2026.10.9",
    }
    metadata["finetune"] = {"rank": 16, "alpha": 16.0, "dropout": 0.0, "offload": True, "profile_steps": 2}
    return fresh_process.CaseReport(
        plan=finetune.GPU_PLAN,
        dtype=torch.bfloat16,
        device_type="cuda",
        shapes=shapes,
        providers=finetune.PROVIDERS,
        warmup=3,
        steps=10,
        metadata=metadata,
        rows=rows,
    )


def test_gpu_report_layout(tmp_path):
    report = _gpu_report()
    paths = fresh_process.write_report(finetune.BENCH, report, tmp_path)
    md = paths["md"].read_text()
    head = "| scenario | HF + PEFT | + Liger | + fuselm.hf.patch | Unsloth |"
    assert "## llama3-8b, B4 x 2048: ms per step, peak allocated GiB" in md and head in md
    qlora = "| QLoRA (NF4 base) | 1358 ms, 23.75 GiB | 1154 ms, 10.38 GiB | 1148 ms, 10.38 GiB |"
    assert qlora + " 791 ms, 7.62 GiB |" in md
    # under each scenario, fuselm's time and peak over each peer's that ran (a failed peer: no line)
    assert "| QLoRA (NF4 base) / Unsloth (time, peak) |  |  | 1.45x, 1.36x |  |" in md
    assert "| QLoRA (NF4 base) / HF + PEFT (time, peak) |  |  | 0.85x, 0.44x |  |" in md
    lora = "| bf16 LoRA | 1376 ms, 33.40 GiB | 1174 ms, 20.09 GiB | 1168 ms, 20.09 GiB |"
    assert lora + " OOM |" in md and "bf16 LoRA / Unsloth" not in md
    assert "| bf16 LoRA / HF + PEFT (time, peak) |  |  | 0.85x, 0.60x |  |" in md
    # details: first losses, their max gap to HF's, fused modules of fuselm only, pinned host memory
    assert "| llama3-8b | qlora | 4x2048 | unsloth | 791 |" in md and "| 1.0e-03 |" in md
    assert "| 400 (PEFT LoRA 32/224) |" in md and "4000 | GPU |" in md
    assert (
        "llama3-8b qlora 4x2048: 400 modules ran fuselm's forward in the first step (420 of 1200 have it); "
        "of 224 LoRA layers, 96 ran inside a fused parent (never called), 96 ran fuselm's own forward, "
        "32 ran PEFT's"
    ) in md
    assert "fuselm_LlamaMLP.forward x32" in md and "peft 0.21.2" in md and "unsloth 2026.10.9" in md
    data = json.loads(paths["json"].read_text())
    gaps = {(g["scenario"], g["provider"]): g["max_abs_diff_vs_hf"] for g in data["loss_gaps"]}
    assert gaps[("qlora", "unsloth")] == pytest.approx(1e-3) and gaps[("qlora", "fuselm")] == 0.0
    assert gaps[("lora", "unsloth")] is None
    ratios = {r["scenario"]: r for r in data["ratios"]}
    assert ratios["qlora"]["time_vs_unsloth"] == pytest.approx(1148 / 791)
    assert ratios["lora"]["time_vs_unsloth"] is None
    assert data["finetune"]["rank"] == 16 and paths["png"].stat().st_size > 0


# ---- workers: Unsloth's boot ----


def _fake_unsloth(tmp_path: Path, body: str, monkeypatch) -> Path:
    pkg = tmp_path / "fake" / "unsloth"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    return tmp_path / "fake"


def _unsloth_case(tmp_path) -> fresh_process.WorkerCase:
    extra = {"model_dir": str(tmp_path / "models"), "profile_steps": 0}
    shape = ("llama3-8b", "lora", 1, 8)
    return fresh_process.WorkerCase(
        "unsloth", shape, finetune.CPU_PLAN, torch.float32, CPU, 0, 1, extra=extra
    )


def test_unsloth_worker_imports_unsloth_first(tmp_path, monkeypatch, reference_path):
    seen = tmp_path / "seen.json"
    names = ("transformers", "peft", "fuselm")
    body = (
        f"import json, sys\njson.dump({{m: m in sys.modules for m in {names}}}, open({str(seen)!r}, 'w'))\n"
    )
    _fake_unsloth(tmp_path, body, monkeypatch)
    row = fresh_process.run_case(finetune.BENCH, _unsloth_case(tmp_path))
    assert json.loads(seen.read_text()) == {"transformers": False, "peft": False, "fuselm": False}
    assert row.status == "skipped" and row.error == "needs CUDA"  # the stand-in imported; no GPU here


def test_unsloth_that_fails_to_import_is_skipped_with_the_reason(tmp_path, monkeypatch, reference_path):
    _fake_unsloth(tmp_path, "raise RuntimeError('Unsloth: no NVIDIA GPU found')\n", monkeypatch)
    row = fresh_process.run_case(finetune.BENCH, _unsloth_case(tmp_path))
    assert row.status == "skipped"
    assert row.error == "unsloth not importable (RuntimeError: Unsloth: no NVIDIA GPU found)"


# ---- the CPU smoke path end to end ----


def test_cli_cpu_end_to_end_and_fuselm_losses_match_hf(tmp_path, capsys, reference_path):
    out, models = tmp_path / "out", tmp_path / "models"
    args = ["bench", "finetune", "--device", "cpu", "--providers", "hf,liger,fuselm,unsloth"]
    rc = main([*args, "--model-dir", str(models), "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    md = (out / "finetune.md").read_text()
    data = json.loads((out / "finetune.json").read_text())
    assert (out / "finetune.png").stat().st_size > 0

    assert "**CPU figures**" in md and "## llama3-8b, B2 x 32: ms per step, peak allocated GiB" in md
    assert "| scenario | HF + PEFT | + fuselm.hf.patch |" in md and "/ HF + PEFT (time, peak) |" in md
    assert "| QLoRA (NF4 base) |" in md and "| bf16 LoRA |" in md and "## What fuselm ran" in md
    assert data["skipped"] == {"liger": "needs CUDA", "unsloth": "needs CUDA"}
    assert data["shapes"] == [["llama3-8b", "qlora", 2, 32], ["llama3-8b", "lora", 2, 32]]
    assert data["finetune"]["model_folders"]["llama3-8b"]["folder"].startswith(str(models))
    assert (models / "llama3-8b-tiny-fp32" / finetune.MARKER).is_file()  # --model-dir: kept
    assert {"peft", "bitsandbytes", "transformers", "commit", "host"} <= set(data["metadata"])
    rows = {(r["provider"], r["scenario"]): r for r in data["rows"]}
    assert set(rows) == {("hf", "qlora"), ("fuselm", "qlora"), ("hf", "lora"), ("fuselm", "lora")}
    plan = finetune.CPU_PLAN
    for (provider, _), r in rows.items():
        assert r["status"] == "ok", r
        assert len(r["losses"]) == plan.warmup + plan.steps + plan.profile_steps == finetune.FIRST_LOSSES
        assert all(math.isfinite(x) for x in r["losses"]) and r["first_loss"] == r["losses"][0]
        assert r["step_ms"] == pytest.approx(statistics.median(r["step_ms_all"])) and r["cpu_ms"] > 0
        assert r["gpu_ms"] is None and r["peak_bytes"] is None and r["host_pinned_bytes"] is None
        # LoRA r 16 (A [r, in], B [out, r]), 2 layers: q, o 64 -> 64; k, v 64 -> 32; gate, up, down 64 <-> 128
        assert r["trainable_params"] == 2 * 16 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))
        assert r["lora_layers"] == 14 and r["checkpointing"].startswith("HF gradient checkpointing")
        assert r["lora_layers_peft"] + r["lora_layers_fused"] + r["lora_layers_inside"] == 14
        if provider == "fuselm":  # --offload is the default: patch(checkpointing=) or fuselm.hf.offload
            assert "offload" in r["checkpointing"] and "no activation offloading" not in r["checkpointing"]
            assert 0 < r["fused_modules_ran"] <= r["fused_modules"]
            assert all(n.startswith("fuselm") for n in r["fused_forwards"])
        else:  # every LoRA layer ran PEFT's forward, nothing of fuselm's
            assert r["fused_modules"] == r["fused_modules_ran"] == 0 and r["fused_forwards"] == {}
            assert r["lora_layers_peft"] == 14

    # fuselm's losses vs HF's under the numerics rule: an HF run in float64 is the reference, HF in
    # float32 the eager baseline (same saved weights, seed, LoRA init and batch)
    extra = {"model_dir": str(models), "rank": 16, "alpha": 16.0, "dropout": 0.0, "profile_steps": 1}
    shape = ("llama3-8b", "lora", 2, 32)
    case = fresh_process.WorkerCase(
        "hf", shape, plan, torch.float64, CPU, plan.warmup, plan.steps, extra=extra
    )
    reference = fresh_process.run_case(finetune.BENCH, case)
    assert reference.status == "ok", reference.error
    assert reference.trainable_dtype == "float64"

    def losses(r):
        return torch.tensor(r["losses"] if isinstance(r, dict) else r.losses, dtype=torch.float64)

    assert_numerics(
        "losses",
        losses(rows[("fuselm", "lora")]),
        losses(rows[("hf", "lora")]),
        losses(reference),
        torch.float32,
    )


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_gpu_small_run(tmp_path):
    args = ["bench", "finetune", "--models", "qwen3-0.6b", "--scenarios", "lora,qlora", "--shapes", "1x128"]
    args += ["--providers", "hf,fuselm", "--warmup", "1", "--steps", "2", "--profile-steps", "1"]
    assert main([*args, "--no-progress", "--out", str(tmp_path), "--model-dir", str(tmp_path / "m")]) == 0
    data = json.loads((tmp_path / "finetune.json").read_text())
    for r in data["rows"]:
        assert r["status"] == "ok", r
        assert r["gpu_ms"] > 0 and r["launches"] > 0 and r["peak_bytes"] > r["weights_bytes"] > 0
        assert r["reserved_bytes"] >= r["peak_bytes"] and r["host_pinned_source"]
    gaps = [g["max_abs_diff_vs_hf"] for g in data["loss_gaps"] if g["provider"] == "fuselm"]
    assert gaps and all(g is not None and g < 1e-2 for g in gaps)  # first losses agree within 1e-2
    saved = Path(data["finetune"]["model_folders"]["qwen3-0.6b"]["folder"])
    assert json.loads((saved / finetune.MARKER).read_text())["dtype"] == "bf16"
    assert sys.modules.get("fuselm_bench.finetune") is finetune


def test_cli_cpu_memory_budgets_run_fuselm_once_per_budget(tmp_path, capsys):
    """--memory-budgets: fuselm once per budget (patch(checkpointing="auto", memory_budget=)), its plan in
    the row, a column per budget, and the plot of step time against peak memory."""
    out = tmp_path / "out"
    args = ["bench", "finetune", "--device", "cpu", "--providers", "fuselm", "--scenarios", "lora"]
    rc = main([*args, "--memory-budgets", "0.0001,1", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    data = json.loads((out / "finetune.json").read_text())
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"fuselm", "fuselm@0.0001", "fuselm@1"}
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["fuselm"]["activation_plan"] is None
    for budget, mode in (("0.0001", "2 offload"), ("1", "2 keep")):
        row = rows[f"fuselm@{budget}"]
        assert row["checkpointing"].endswith(f"fuselm.hf.patch(checkpointing='auto', memory_budget={budget})")
        assert f"2 decoder layers at 64 tokens: {mode}" in row["activation_plan"]
    assert "+ fuselm.hf.patch @ 1 GiB" in (out / "finetune.md").read_text()
    assert (out / "finetune.png").stat().st_size > 0
    with pytest.raises(UsageError, match="--memory-budgets: '-1' must be a number of GiB > 0"):
        finetune.parse_budget("-1")
    with pytest.raises(UsageError, match="only fuselm has variants"):
        finetune.split_provider("hf@8")
    with pytest.raises(UsageError, match="'x' is not a number of GiB"):
        finetune.split_provider("fuselm@x")
    capsys.readouterr()
    assert main([*args[:2], "--device", "cpu", "--providers", "hf@8", "--out", str(out)]) == 2
    assert "--providers: 'hf@8': only fuselm has variants (fuselm@<GiB>" in capsys.readouterr().err


def test_cli_cpu_graph_variant_is_named_and_needs_cuda(tmp_path, capsys):
    """fuselm@graph (checkpointing="offload", the step replayed from CUDA graphs): its own column, skipped
    on the CPU saying why."""
    out = tmp_path / "out"
    args = ["bench", "finetune", "--device", "cpu", "--providers", "fuselm@graph", "--scenarios", "lora"]
    assert main([*args, "--no-progress", "--out", str(out)]) == 1  # nothing ran
    data = json.loads((out / "finetune.json").read_text())
    assert data["rows"] == [] and data["skipped"] == {"fuselm@graph": "needs CUDA"}
    assert finetune.provider_title("fuselm@graph") == "+ fuselm.hf.patch (CUDA graphs)"
    assert "checkpointing='offload'; --no-offload: 'recompute'" in finetune.BENCH.describe("fuselm@graph")


def test_cli_cpu_trainer_steps_run_through_trainer(tmp_path, capsys):
    """--trainer: every provider's steps through transformers.Trainer.train(), said in the report; on the
    same saved model, adapters and batch its first loss (before any update) is the step loop's, and no
    module watch runs (the Trainer owns the steps)."""
    models = tmp_path / "models"
    args = ["bench", "finetune", "--device", "cpu", "--providers", "hf,fuselm", "--scenarios", "lora"]
    args += ["--model-dir", str(models), "--no-progress"]
    runs = {}
    for name, extra in (("loop", []), ("trainer", ["--trainer"])):
        assert main([*args, *extra, "--out", str(tmp_path / name)]) == 0, capsys.readouterr().out
        runs[name] = json.loads((tmp_path / name / "finetune.json").read_text())
    assert runs["trainer"]["finetune"]["trainer"] is True and runs["loop"]["finetune"]["trainer"] is False
    md = (tmp_path / "trainer" / "finetune.md").read_text()
    assert "steps: transformers.Trainer.train()" in md and "(the Trainer's steps are not watched)" in md
    assert "transformers.Trainer" not in (tmp_path / "loop" / "finetune.md").read_text()
    for provider in ("hf", "fuselm"):
        loop, trained = ({r["provider"]: r for r in runs[k]["rows"]}[provider] for k in ("loop", "trainer"))
        assert trained["status"] == "ok", trained
        assert len(trained["losses"]) == len(loop["losses"]) and all(map(math.isfinite, trained["losses"]))
        assert trained["fused_modules_ran"] is None and trained["lora_layers_peft"] is None
        assert trained["first_loss"] == pytest.approx(loop["first_loss"], rel=1e-6)
