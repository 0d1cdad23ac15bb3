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
    assert registry.get_training_runner("finetune") is finetune.run_cli  # one GPU and --world-size
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
    model, _ = finetune.load_peft_model(
        "fuselm", folder, "qlora", 16, dtype=torch.float32, device=CPU, rank=4, alpha=8, dropout=0.0,
        seed=0, offload=False,
    )  # fmt: skip
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
        finetune.load_peft_model(
            "fuselm", folder, "lora", 16, dtype=torch.float32, device=CPU, rank=4, alpha=8, dropout=0.0,
            seed=0, offload=False,
        )  # fmt: skip


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
    from fuselm_bench import e2e

    from fuselm.demo import training

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

    def fake_run_case(bench, provider, shape, *, extra=None, repeat=0, **kw):
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


def test_gpu_report_in_issue_23s_layout(tmp_path):
    report = _gpu_report()
    paths = finetune.write_report(report, tmp_path)
    md = paths["md"].read_text()
    head = (
        "| scenario | HF + PEFT | + Liger | + fuselm.hf.patch | Unsloth | fuselm / Unsloth (time, memory) |"
    )
    assert "## llama3-8b, B4 x 2048: ms per step, peak allocated GiB" in md and head in md
    qlora = "| QLoRA (NF4 base) | 1358 ms, 23.75 GiB | 1154 ms, 10.38 GiB | 1148 ms, 10.38 GiB |"
    assert qlora + " 791 ms, 7.62 GiB | 1.45x, 1.36x | 0.85x, 0.44x |" in md
    lora = "| bf16 LoRA | 1376 ms, 33.40 GiB | 1174 ms, 20.09 GiB | 1168 ms, 20.09 GiB |"
    assert lora + " OOM | — | 0.85x, 0.60x |" in md
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


def _unsloth_case(tmp_path) -> dict:
    return {"model_dir": str(tmp_path / "models"), "profile_steps": 0}


def test_unsloth_worker_imports_unsloth_first(tmp_path, monkeypatch, reference_path):
    seen = tmp_path / "seen.json"
    names = ("transformers", "peft", "fuselm")
    body = (
        f"import json, sys\njson.dump({{m: m in sys.modules for m in {names}}}, open({str(seen)!r}, 'w'))\n"
    )
    _fake_unsloth(tmp_path, body, monkeypatch)
    row = fresh_process.run_case(
        finetune.BENCH, "unsloth", ("llama3-8b", "lora", 1, 8), plan=finetune.CPU_PLAN, dtype=torch.float32,
        device=CPU, warmup=0, steps=1, extra=_unsloth_case(tmp_path),
    )  # fmt: skip
    assert json.loads(seen.read_text()) == {"transformers": False, "peft": False, "fuselm": False}
    assert row.status == "skipped" and row.error == "needs CUDA"  # the stand-in imported; no GPU here


def test_unsloth_that_fails_to_import_is_skipped_with_the_reason(tmp_path, monkeypatch, reference_path):
    _fake_unsloth(tmp_path, "raise RuntimeError('Unsloth: no NVIDIA GPU found')\n", monkeypatch)
    row = fresh_process.run_case(
        finetune.BENCH, "unsloth", ("llama3-8b", "lora", 1, 8), plan=finetune.CPU_PLAN, dtype=torch.float32,
        device=CPU, warmup=0, steps=1, extra=_unsloth_case(tmp_path),
    )  # fmt: skip
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
    assert "| scenario | HF + PEFT | + fuselm.hf.patch | fuselm / Unsloth (time, memory) |" in md
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
    reference = fresh_process.run_case(
        finetune.BENCH, "hf", ("llama3-8b", "lora", 2, 32), plan=plan, dtype=torch.float64, device=CPU,
        warmup=plan.warmup, steps=plan.steps, extra=extra,
    )  # fmt: skip
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


# ---- --world-size W: each case on W ranks with FSDP2, beside its one-GPU row ----


@pytest.mark.parametrize(
    "args, message",
    [
        (["--providers", "hf,unsloth"], "--world-size 2: unsloth cannot run sharded"),
        (["--providers", "liger,fuselm"], "--world-size 2: liger cannot run sharded"),
    ],
)
def test_world_size_refuses_providers_fsdp2_does_not_run(args, message, tmp_path, capsys):
    rc = main(["bench", "finetune", "--world-size", "2", "--device", "cpu", "--out", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _case(world_size: int = 2) -> finetune.GroupCase:
    return finetune.GroupCase(
        finetune.GPU_PLAN, "fuselm", ("llama3-8b", "lora", 4, 2048), world_size, "cuda", torch.bfloat16, 3,
        10, {},
    )  # fmt: skip


def _rank_record(rank: int, agreed: str = "ok", final: bool = True, **kw) -> dict:
    record = {"kind": "case", "index": 0, "rank": rank, "status": "ok", "final": final, **kw}
    return {**record, "agreed": agreed} if final else record


def test_group_row_takes_the_slowest_rank_and_the_largest_peak():
    ok = {"first_loss": 11.9, "losses": [11.9, 11.8], "reserved_bytes": 10 * GIB}
    records = [
        _rank_record(0, step_ms=700.0, step_ms_all=[700.0], peak_bytes=9 * GIB, **ok),
        _rank_record(1, step_ms=720.0, step_ms_all=[720.0], peak_bytes=8 * GIB, reserved_bytes=11 * GIB,
                     first_loss=11.7),
    ]  # fmt: skip
    row = finetune.group_row(_case(), records, None)
    assert isinstance(row, finetune.DataParallelRow)
    assert row.shape == ("llama3-8b", "lora", 4, 2048, 2)
    assert row.status == "ok" and row.world_size == 2 and row.step_ms == 720.0
    assert row.tokens_per_s == pytest.approx(2 * 4 * 2048 / 0.72)
    assert row.tokens_per_s_per_gpu == pytest.approx(4 * 2048 / 0.72)
    assert (row.peak_bytes, row.reserved_bytes) == (9 * GIB, 11 * GIB)
    assert row.rank_step_ms == [700.0, 720.0] and row.rank_peak_bytes == [9 * GIB, 8 * GIB]
    assert row.rank_first_losses == [11.9, 11.7] and row.first_loss == 11.9  # rank 0's batch: one GPU's


def test_group_row_of_a_failed_rank():
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    # every rank reached the agreement: the agreed status, the first failing rank's error
    records = [
        _rank_record(0, "oom", step_ms=1.0),
        _rank_record(1, "oom", status="oom", error=oom),
    ]
    row = finetune.group_row(_case(), records, None)
    assert row.status == "oom" and row.error == f"{oom} (rank 1)" and row.step_ms is None
    # rank 1 said it failed, rank 0 stuck in a collective: the group was killed, the row says rank 1's error
    said = [_rank_record(1, final=False, status="error", error="RuntimeError: boom", traceback="tb")]
    row = finetune.group_row(
        _case(), said, "no progress for 60 s (ranks stuck, e.g. in a collective); killed"
    )
    assert row.status == "error" and row.error == "RuntimeError: boom (rank 1)" and row.traceback == "tb"
    # nothing written: why the group stopped
    row = finetune.group_row(_case(), [], "a rank failed: process 1 terminated with signal SIGKILL")
    assert row.status == "error" and row.error.startswith("a rank failed")
    assert finetune.group_row(_case(), [], None).error == "no result from ranks [0, 1]"


def test_group_env_turns_nvlink_multicast_off_unless_set(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    env = finetune.group_env("cuda")
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert "NVSHMEM_DISABLE_NVLS" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert "NCCL_NVLS_ENABLE" not in finetune.group_env("cpu")


def test_world_size_report_gives_tokens_per_gpu_against_one_gpu(tmp_path):
    config = ("llama3-8b", "lora", 4, 2048)
    rows = []
    for p, one_ms, many_ms in (("hf", 1259.0, 1330.0), ("fuselm", 714.0, 760.0)):
        one = finetune.DataParallelRow(
            p, *config, "ok", step_ms=one_ms, tokens_per_s=8192 / one_ms * 1e3, peak_bytes=17 * GIB,
            losses=[11.9], first_loss=11.9,
        )  # fmt: skip
        many = finetune.DataParallelRow(
            p, *config, "ok", world_size=2, step_ms=many_ms, tokens_per_s=2 * 8192 / many_ms * 1e3,
            peak_bytes=10 * GIB, losses=[11.9], first_loss=11.9, rank_step_ms=[many_ms - 5, many_ms],
            rank_peak_bytes=[10 * GIB, 9 * GIB], rank_first_losses=[11.9, 11.8],
        )  # fmt: skip
        rows += [one, many]
    rows.append(finetune.DataParallelRow("hf", "llama3-8b", "qlora", 4, 2048, "ok", step_ms=1238.0))
    rows.append(
        finetune.DataParallelRow(
            "hf", "llama3-8b", "qlora", 4, 2048, "oom", world_size=2, error="OOM (rank 1)"
        )
    )
    shapes = [(*c, w) for c in (config, ("llama3-8b", "qlora", 4, 2048)) for w in (1, 2)]
    report = fresh_process.CaseReport(
        finetune.GPU_PLAN, torch.bfloat16, "cuda", tuple(shapes), ("hf", "fuselm"), 3, 10,
        {"device": "NVIDIA H100 80GB HBM3", "finetune": {"offload": True, "profile_steps": 2}}, rows=rows,
    )  # fmt: skip
    paths = finetune.write_data_parallel_report(report, 2, tmp_path)
    assert sorted(p.name for p in paths.values()) == [
        "finetune_ws2.json",
        "finetune_ws2.md",
        "finetune_ws2.png",
    ]
    md = paths["md"].read_text()
    assert md.startswith("# fuselm bench finetune_ws2") and "## tokens/s per GPU, 2 GPUs / 1 GPU" in md
    fuselm_line = (
        "| llama3-8b | lora | 4x2048 | fuselm | 714 | 11.5k | 17.00 | 760 | 21.6k | 10.8k | 10.00 / 9.00 |"
    )
    assert fuselm_line + f" {714 / 760:.2f}x | 11.9000 / 11.9000 |" in md
    assert "| llama3-8b | qlora | 4x2048 | hf | 1238 | — | n/a | OOM | OOM | OOM | OOM | — | — |" in md
    assert "| llama3-8b lora 4x2048 x2gpu | fuselm | 755 / 760 | 10.00 / 9.00 | 11.9000 / 11.8000 |" in md
    data = json.loads(paths["json"].read_text())
    assert data["suite"] == "finetune_ws2" and data["world_size"] == 2
    assert data["shape_fields"] == ["model", "scenario", "batch", "seq", "world_size"]
    scaling = {(s["scenario"], s["provider"]): s for s in data["scaling"]}
    assert scaling[("lora", "fuselm")]["per_gpu"] == pytest.approx(714 / 760)
    assert scaling[("lora", "hf")]["peak_bytes_per_rank"] == [10 * GIB, 9 * GIB]
    assert scaling[("qlora", "hf")]["per_gpu"] is None and scaling[("qlora", "hf")]["status"] == "oom"
    ratios = {(r["scenario"], r["world_size"]): r for r in data["ratios"]}
    assert ratios[("lora", 2)]["time_vs_hf"] == pytest.approx(760 / 1330)


def _first_losses_agree(label: str, many: dict, one: dict) -> None:
    """A group's first loss (rank 0: the one-GPU batch and weights) against the one-process row's, under
    the numerics rule with the one-process run as the reference (err <= fp32's atol)."""
    ours, single = (torch.tensor([r["first_loss"]], dtype=torch.float64) for r in (many, one))
    assert_numerics(label, ours, single, single, torch.float32)


def test_cli_world_size_2_cpu_lora(tmp_path, capsys, reference_path):
    """hf and fuselm on 2 gloo ranks (FSDP2) beside their one-process rows: every row ok, rank 0's first
    loss the one-process one, fuselm's the same as HF's; finetune_ws2.* written."""
    out = tmp_path / "out"
    args = ["bench", "finetune", "--world-size", "2", "--device", "cpu", "--scenarios", "lora"]
    rc = main([*args, "--model-dir", str(tmp_path / "models"), "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert all((out / f"finetune_ws2.{ext}").stat().st_size > 0 for ext in ("md", "json", "png"))
    assert not (out / "finetune.json").exists()
    data = json.loads((out / "finetune_ws2.json").read_text())
    assert data["providers"] == ["hf", "fuselm"] and data["metadata"]["backend"] == "gloo"
    rows = {(r["provider"], r["world_size"]): r for r in data["rows"]}
    assert set(rows) == {("hf", 1), ("fuselm", 1), ("hf", 2), ("fuselm", 2)}
    for key, r in rows.items():
        assert r["status"] == "ok" and r["error"] is None, (key, r)
        assert r["step_ms"] > 0 and all(math.isfinite(x) for x in r["losses"])
    for p in ("hf", "fuselm"):
        many = rows[(p, 2)]
        assert many["sharding"].startswith("FSDP2 over 2 ranks: fully_shard on each of 2 decoder layers")
        assert len(many["rank_step_ms"]) == 2 and many["step_ms"] == max(many["rank_step_ms"])
        assert many["tokens_per_s"] == pytest.approx(2 * 2 * 32 / many["step_ms"] * 1e3)
        assert many["rank_first_losses"][0] == many["first_loss"] != many["rank_first_losses"][1]
        _first_losses_agree(f"{p} first loss, 2 ranks vs 1 process", many, rows[(p, 1)])
    assert rows[("fuselm", 2)]["fused_modules_ran"] > 0 and rows[("fuselm", 2)]["lora_layers_peft"] == 0
    _first_losses_agree("fuselm vs hf first loss, 2 ranks", rows[("fuselm", 2)], rows[("hf", 2)])
    md = (out / "finetune_ws2.md").read_text()
    assert "## tokens/s per GPU, 2 GPUs / 1 GPU" in md and "gloo" in md
    assert {(s["provider"], s["scenario"]) for s in data["scaling"]} == {("hf", "lora"), ("fuselm", "lora")}
    assert all(s["per_gpu"] > 0 for s in data["scaling"])


def test_cli_world_size_2_cpu_qlora_fuselm(tmp_path, capsys, reference_path):
    """QLoRA (bitsandbytes' CPU 4-bit) patched by fuselm, then sharded: the row runs and rank 0's first
    loss is the one-process one."""
    if finetune.bnb_cpu_4bit_works() is not None:
        pytest.skip(finetune.bnb_cpu_4bit_works())
    out = tmp_path / "out"
    args = ["bench", "finetune", "--world-size", "2", "--device", "cpu", "--scenarios", "qlora"]
    rc = main([*args, "--providers", "fuselm", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    data = json.loads((out / "finetune_ws2.json").read_text())
    rows = {r["world_size"]: r for r in data["rows"]}
    assert rows[1]["status"] == rows[2]["status"] == "ok", data["rows"]
    _first_losses_agree("fuselm qlora first loss, 2 ranks vs 1 process", rows[2], rows[1])


def _failing_rank(rank: int, stuck: bool, init_file: str, out_dir: str) -> None:
    """A rank of a :class:`rank_group.RankGroup`: rank 1 fails; rank 0 agrees with it, or (``stuck``) waits
    forever as if inside a collective."""
    import time

    import torch.distributed as dist
    from fuselm_bench import rank_group
    from fuselm_bench.harness import run_measured

    path = Path(out_dir) / f"rank{rank}.jsonl"
    device = rank_group.join_group(rank, 2, "cpu", init_file, 60.0)

    def measure() -> dict:
        if rank == 1:
            raise RuntimeError("boom")
        if stuck:
            time.sleep(600)
        return {"step_ms": 1.0}

    record = {"kind": "case", "index": 0, "rank": rank, "status": "ok"}
    record.update(run_measured(measure, device))
    # stuck: rank 1 says its failure, then waits in the agreement for rank 0, as a real rank would (exiting
    # at once instead could end the group before rank 0 finished connecting: a gloo error, not a stuck rank)
    rank_group.finish_case(record, path, device)
    dist.destroy_process_group()


@pytest.mark.parametrize("stuck", [False, True], ids=["agreed", "stuck"])
def test_a_failing_rank_ends_the_group_and_marks_the_row(stuck):
    """A rank's error reaches every rank through the agreement (the group ends by itself), or, when the
    other rank is stuck, the parent kills the group once the failure is said; either way the row has the
    failing rank's error."""
    from fuselm_bench import rank_group

    with rank_group.RankGroup(_failing_rank, (stuck,), world_size=2, timeout_s=120.0, grace_s=2.0) as group:
        group.wait_for(0)
        records, failure = group.records(), group.failure
    if stuck:
        assert failure is not None and failure.startswith("no progress for 2 s")
    else:
        assert failure is None
        assert [r["agreed"] for r in rank_group.case_records(records, 0)] == ["error", "error"]
    row = finetune.group_row(_case(), records, failure)
    assert row.status == "error" and row.error == "RuntimeError: boom (rank 1)"


def _ranks_with_a_death(rank: int, die_at: int, init_file: str, out_dir: str) -> None:
    """Two ranks running cases 0, 1, 2; at case ``die_at`` rank 1 exits at once (a crash: no record)."""
    import os

    import torch.distributed as dist
    from fuselm_bench import rank_group

    path = Path(out_dir) / f"rank{rank}.jsonl"
    device = rank_group.join_group(rank, 2, "cpu", init_file, 60.0)
    for index in range(3):
        if index == die_at and rank == 1:
            os._exit(3)
        record = {"kind": "case", "index": index, "rank": rank, "status": "ok", "step_ms": float(index)}
        rank_group.finish_case(record, path, device)
    dist.destroy_process_group()


def test_a_group_is_waited_for_case_by_case_and_a_crash_ends_it():
    """RankGroup.wait_for returns each case's final records as the ranks finish it; after a rank crashes,
    the case it was in and every later one report the failure (the runner starts a fresh group)."""
    from fuselm_bench import rank_group

    with rank_group.RankGroup(_ranks_with_a_death, (1,), world_size=2, timeout_s=120.0, grace_s=2.0) as group:
        finished, failure = group.wait_for(0)
        assert failure is None and sorted(r["rank"] for r in finished) == [0, 1]
        assert {r["agreed"] for r in finished} == {"ok"}
        finished, failure = group.wait_for(1)
        assert failure is not None and ("a rank failed" in failure or "no progress" in failure), failure
        assert group.wait_for(2)[1] == failure  # a stopped group stays stopped
    with rank_group.RankGroup(_ranks_with_a_death, (-1,), world_size=2, timeout_s=120.0) as group:
        assert [group.wait_for(i)[1] for i in range(3)] == [None, None, None]


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
    """fuselm@graph (checkpointing="recompute", the step replayed from CUDA graphs): its own column, skipped
    on the CPU saying why."""
    out = tmp_path / "out"
    args = ["bench", "finetune", "--device", "cpu", "--providers", "fuselm@graph", "--scenarios", "lora"]
    assert main([*args, "--no-progress", "--out", str(out)]) == 1  # nothing ran
    data = json.loads((out / "finetune.json").read_text())
    assert data["rows"] == [] and data["skipped"] == {"fuselm@graph": "needs CUDA"}
    assert finetune.provider_title("fuselm@graph") == "+ fuselm.hf.patch (CUDA graphs)"
    assert "checkpointing='recompute'" in finetune.BENCH.describe("fuselm@graph")
