"""fuselm bench max-context: the bisection over sequence lengths (fake probes), the CLI's arguments, and a
CPU smoke run through fresh finetune workers (a tiny model, no memory cap: every length fits)."""

from __future__ import annotations

import importlib.metadata
import json
import math
from types import SimpleNamespace

import pytest
from fuselm_bench import max_context, registry
from fuselm_bench.arguments import parse_caps, parse_gpus

from fuselm.cli import main


def _fits_up_to(limit: int, seen: list[int] | None = None):
    def probe(t: int):
        if seen is not None:
            seen.append(t)
        return SimpleNamespace(status="ok" if t <= limit else "oom", step_ms=1.0, peak_gib=1.0)

    return probe


@pytest.mark.parametrize("limit", [1024, 5_000, 40_724, 153_977, 342_733])
def test_bisection_finds_the_limit_within_the_tolerance(limit):
    seen: list[int] = []
    longest, best, probes, stopped = max_context.longest_fitting(
        _fits_up_to(limit, seen), 1024, 524_288, rel_tol=0.02, max_probes=16
    )
    assert stopped is None and best.status == "ok"
    assert longest <= limit < longest * 1.02 + max_context.GRAIN  # within the tolerance (or one grain)
    assert all(t % max_context.GRAIN == 0 for t in seen) and len(probes) == len(seen) <= 16


def test_bisection_edges_and_failures():
    # HI fits: one probe, the answer is HI
    assert max_context.longest_fitting(_fits_up_to(10**9), 1024, 8192)[0] == 8192
    # LO does not fit: nothing does
    longest, best, probes, stopped = max_context.longest_fitting(_fits_up_to(100), 1024, 8192)
    assert (longest, best, stopped, len(probes)) == (None, None, None, 2)
    # one length (LO = HI) that does not fit is probed once
    longest, best, probes, stopped = max_context.longest_fitting(_fits_up_to(100), 8192, 8192)
    assert (longest, best, stopped, [t for t, _ in probes]) == (None, None, None, [8192])

    # a probe that fails otherwise (an error, a skipped provider) stops the search and says where
    def broken(t):
        return SimpleNamespace(status="ok" if t == 1024 else ("error" if t < 8192 else "oom"))

    longest, _, _, stopped = max_context.longest_fitting(broken, 1024, 8192)
    assert longest == 1024 and stopped is not None and "error" in stopped

    # the worker's error is named: the last line of its traceback
    def failing(t):
        return SimpleNamespace(
            status="error", error="Traceback (most recent call last):\nValueError: no index"
        )

    stopped = max_context.longest_fitting(failing, 1024, 8192)[3]
    assert stopped == "8192 tokens: error (ValueError: no index)"
    with pytest.raises(ValueError, match="0 < LO <= HI"):
        max_context.longest_fitting(_fits_up_to(1), 10, 5)


def test_known_bounds_are_not_probed_again():
    seen: list[int] = []
    longest, best, probes, stopped = max_context.longest_fitting(
        _fits_up_to(70_000, seen), 65_536, 72_704, rel_tol=0.02, known=True
    )
    assert 65_536 not in seen and 72_704 not in seen and len(probes) == len(seen) >= 1
    assert stopped is None and best.status == "ok" and longest <= 70_000 < longest * 1.02 + max_context.GRAIN
    # nothing between fits: LO (the earlier run's), with no row of this one
    longest, best, probes, _ = max_context.longest_fitting(_fits_up_to(65_600), 65_536, 72_704, known=True)
    assert (longest, best) == (65_536, None) and all(row.status == "oom" for _, row in probes)


def test_registered_outside_all():
    assert "max-context" in registry.TRAINING_SUITES and "max-context" not in registry.suite_names()
    assert registry.get_training_runner("max-context") is max_context.run_cli


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-range", "64"], "--seq-range takes LO:HI"),
        (["--seq-range", "64:16"], "--seq-range must be 0 < LO <= HI"),
        (["--seq-range", "64:64", "--bounds-known"], "--seq-range needs LO < HI"),
        (["--models", "llama3-8b,qwen3-0.6b"], "one --models and one --scenarios at a time"),
        (["--providers", "hf,axolotl"], "unknown provider 'axolotl'"),
        (["--providers", "hf@8"], "only fuselm has variants"),
        (["--providers", "fuselm@x"], "'x' is not a number of GiB"),
    ],
)
def test_usage_errors(args, message, tmp_path, capsys):
    rc = main(
        ["bench", "max-context", "--device", "cpu", "--scenarios", "lora", "--out", str(tmp_path), *args]
    )
    assert rc == 2
    assert message in capsys.readouterr().err


def test_caps_parse_and_must_be_positive():
    assert parse_caps("16,40.5") == [16.0, 40.5]
    for bad in ("16,big", "0"):
        with pytest.raises(max_context.UsageError, match="--caps"):
            parse_caps(bad)


def test_cpu_smoke_run_writes_the_report(tmp_path, monkeypatch):
    """Three providers (fuselm under a memory budget too), no cap on the CPU: HI (32 tokens) fits at once
    for each; the report says so, the budget's probe ran checkpointing="auto", plain fuselm offloaded
    keeping no outputs for its recomputes (the least device memory)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = ["bench", "max-context", "--device", "cpu", "--scenarios", "lora", "--providers", "fuselm,hf"]
    args[-1] += ",fuselm@1"
    assert main([*args, "--seq-range", "16:32", "--rank", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "max_context.json").read_text())
    found = {s["provider"]: s for s in data["searches"]}
    assert set(found) == {"fuselm", "hf", "fuselm@1"}
    assert "checkpointing='auto', memory_budget=1" in found["fuselm@1"]["best"]["checkpointing"]
    assert found["fuselm"]["best"]["checkpointing"].endswith("set_kept_output_room(0)")
    assert "set_kept_output_room" not in found["fuselm@1"]["best"]["checkpointing"]
    for s in found.values():
        assert s["longest"] == 32 and s["stopped"] is None and s["best"]["status"] == "ok"
        assert [p[0] for p in s["probes"]] == [32]
    assert "| fuselm | none | 32 |" in (tmp_path / "max_context.md").read_text()
    assert (tmp_path / "max_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    versions = {k: data["metadata"].get(k) for k in ("transformers", "peft")}  # the peers' too
    assert versions == {k: importlib.metadata.version(k) for k in versions}


def test_plot_has_a_bar_per_provider_under_each_cap(tmp_path, monkeypatch):
    """Thousands of tokens per (cap, provider); a search where nothing fitted says so at the bar's foot; a
    provider not searched under a cap has no bar there."""
    drawn = {}
    monkeypatch.setattr(max_context, "bar_chart", lambda path, *a, **k: drawn.update(args=a, path=path))
    searches = [max_context.Search("fuselm", 16.0, 89600), max_context.Search("unsloth", 16.0, 65536)]
    searches.append(max_context.Search("unsloth", 80.0, None, stopped="89600 tokens: error"))
    meta = {"model": "llama3-70b", "scenario": "qlora", "device": "NVIDIA H100 80GB HBM3"}
    max_context.write_png(searches, meta, tmp_path / "max_context.png")
    title, labels, [(_, bars)], _ = drawn["args"]
    assert title == "fuselm bench max-context, llama3-70b qlora, NVIDIA H100 80GB HBM3"
    assert labels == ["cap 16 GiB", "cap 80 GiB"] and drawn["path"] == tmp_path / "max_context.png"
    assert bars[0][0] == "fuselm" and bars[0][1][0] == 89.6 and math.isnan(bars[0][1][1])
    assert bars[1] == ("unsloth", [65.536, "none fits"])


@pytest.mark.parametrize("device, index", [("cuda", 3), ("cuda:1", 1)])
def test_memory_cap_passes_the_device_index(device, index, monkeypatch):
    """torch.cuda.set_per_process_memory_fraction refuses a device without an index ("cuda"): the cap
    passes the current device's index then (every capped probe once failed so on the GPU)."""
    import torch
    from fuselm_bench import finetune

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30)
    )
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    finetune.cap_memory(torch.device(device), 16.0)
    assert calls == [(0.2, index)]


def test_model_dir_is_kept_and_reused(tmp_path, monkeypatch):
    """--model-dir keeps the saved model after the run and a second run reuses it (two searches side by
    side on one GPU share one build)."""
    from fuselm_bench import finetune

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    models = tmp_path / "models"
    args = ["bench", "max-context", "--device", "cpu", "--scenarios", "lora", "--providers", "fuselm"]
    args += ["--seq-range", "16:16", "--rank", "4", "--model-dir", str(models)]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    (folder,) = models.iterdir()
    marker = folder / finetune.MARKER
    stamp = marker.stat().st_mtime_ns
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert marker.stat().st_mtime_ns == stamp


def test_gpus_put_the_searches_side_by_side(monkeypatch):
    """--gpus: the searches take the listed GPUs in turn, and each probe's worker sees its GPU alone
    (CUDA_VISIBLE_DEVICES); refused without CUDA or for a GPU that is not there, naming the option."""
    import torch
    from fuselm_bench import finetune

    jobs = [("fuselm", 16.0), ("unsloth", 16.0), ("fuselm", 40.0)]
    assert max_context.side_by_side(jobs, [0, 1]) == [
        ("fuselm", 16.0, 0),
        ("unsloth", 16.0, 1),
        ("fuselm", 40.0, 0),
    ]
    assert max_context.side_by_side(jobs, None) == [(p, c, None) for p, c in jobs]
    assert finetune.worker_env("fuselm", {"gpu": 1})["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in finetune.worker_env("fuselm", {})
    with pytest.raises(max_context.UsageError, match="--gpus"):
        parse_gpus("0", cuda=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_gpus("0,1,1", cuda=True) == [0, 1, 1]
    for bad in ("0,2", "x"):
        with pytest.raises(max_context.UsageError, match="--gpus"):
            parse_gpus(bad, cuda=True)


def test_side_by_side_searches_run_at_once(tmp_path, monkeypatch):
    """With --gpus the searches run concurrently (a probe of each is in flight before any returns) and
    the report keeps them in the order asked."""
    import threading

    import torch
    from fuselm_bench import arguments, finetune, fresh_process

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(arguments, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(finetune, "ensure_saved_model", lambda *a, **k: (tmp_path, {}))
    monkeypatch.setattr(max_context, "collect_metadata", lambda *a: {"device": "fake GPU"})
    both_started = threading.Barrier(2, timeout=10)
    seen = []

    def fake_case(bench, case, repeat=0):
        seen.append((case.provider, case.extra["gpu"], case.extra["memory_cap_gib"]))
        both_started.wait()  # a timeout here: the searches ran one after the other
        result = {"status": "ok", "step_ms": 1.0, "peak_bytes": 1}
        return fresh_process.make_row(bench, case.provider, case.shape, result)

    monkeypatch.setattr(fresh_process, "run_case", fake_case)
    args = ["bench", "max-context", "--scenarios", "lora", "--providers", "fuselm,unsloth", "--caps", "16"]
    args += ["--seq-range", "1024:1024", "--gpus", "0,1", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    assert sorted(seen) == [("fuselm", 0, 16.0), ("unsloth", 1, 16.0)]
    data = json.loads((tmp_path / "out" / "max_context.json").read_text())
    assert [s["provider"] for s in data["searches"]] == ["fuselm", "unsloth"]
    assert data["metadata"]["gpus"] == "fuselm cap 16.0: GPU 0, unsloth cap 16.0: GPU 1"
