"""CPU tests of ``fuselm bench linear_cross_entropy --world-size W``: the vocabulary split over W gloo
processes against one process and against all-gathered logits.

One CLI run spawns the two ranks (importing torch in each takes seconds): everything that needs ranks is
checked on its report; the rest (split, rows of failed cases, usage errors) in process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from fuselm_bench import lce_parallel as par
from fuselm_bench.harness import Ceilings
from fuselm_bench.report import markdown_table

from fuselm.cli import main

SHAPE = (64, 32, 301)  # V odd: an uneven split, 151 + 150
PROVIDERS = ["fuselm_split", "allgather_logits", "fuselm_single"]


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks run fuselm's CPU path (the PyTorch references), not Triton's interpreter: fast."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("v, w", [(128256, 2), (256000, 2), (301, 2), (10, 3), (5, 8)])
def test_vocab_split_is_tensor_split(v, w):
    assert par.vocab_split(v, w) == [len(c) for c in torch.arange(v).tensor_split(w)]


# ---- command line ----


@pytest.mark.parametrize("suite", ["rms_norm", "cross_entropy", "e2e", "all"])
def test_world_size_only_for_linear_cross_entropy(suite, tmp_path, capsys):
    rc = main(["bench", suite, "--world-size", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 2
    assert f"--world-size applies to linear_cross_entropy only, not to '{suite}'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "0"], "expected a positive integer"),
        (["--world-size", "2", "--providers", "fuselm_split,torch"], "unknown provider 'torch'"),
        (["--world-size", "2", "--shapes", "64x32x301x1x7"], "takes 3 sizes"),
        (["--world-size", "4", "--shapes", "64x32x3"], "V must be at least the world size (4)"),
        (["--world-size", "2", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_usage_errors(args, message, tmp_path, capsys):
    rc = main(["bench", "linear_cross_entropy", "--device", "cpu", "--out", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cli_two_gloo_ranks(tmp_path, capsys, reference_path):
    shape = "x".join(map(str, SHAPE))
    argv = ["bench", "linear_cross_entropy", "--world-size", "2", "--device", "cpu", "--shapes", shape]
    assert main([*argv, "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for ext in ("md", "json", "png"):
        assert (tmp_path / f"linear_cross_entropy_ws2.{ext}").stat().st_size > 0

    data = json.loads((tmp_path / "linear_cross_entropy_ws2.json").read_text())
    assert data["suite"] == "linear_cross_entropy_ws2" and data["world_size"] == 2
    assert data["dtype"] == "fp32" and data["modes"] == ["full"] and data["providers"] == PROVIDERS
    rows = {r["provider"]: r for r in data["rows"]}
    assert list(rows) == PROVIDERS
    for name, r in rows.items():
        ranks = 1 if name == "fuselm_single" else 2
        assert r["error"] is None, r
        assert r["shape"] == list(SHAPE) and r["mode"] == "full" and r["ranks"] == ranks
        assert r["vocab_sizes"] == ([301] if ranks == 1 else [151, 150])
        assert len(r["rank_ms"]) == ranks and all(ms > 0 for ms in r["rank_ms"])
        assert r["ms"] == max(r["rank_ms"])
        assert r["flops"] == 6 * math.prod(SHAPE) / ranks and r["x_floor"] > 0
        # memory: measured on CUDA only; on CPU the fields are there, empty
        assert r["rank_extra_bytes"] == [None] * ranks and r["extra_bytes"] is None and r["extra_mib"] is None
    # the same loss and gradients from every provider (the baseline's dx is summed over the ranks once)
    for name in PROVIDERS[:2]:
        assert rows[name]["loss"] == pytest.approx(rows["fuselm_single"]["loss"], rel=1e-5)
        assert rows[name]["grad_norm"] == pytest.approx(rows["fuselm_single"]["grad_norm"], rel=1e-5)

    (s,) = data["summary"]
    assert s["shape"] == list(SHAPE) and s["vocab_sizes"] == [151, 150]
    assert s["split_vs_single"] == pytest.approx(rows["fuselm_split"]["ms"] / rows["fuselm_single"]["ms"])
    assert s["allgather_vs_split"] == pytest.approx(
        rows["allgather_logits"]["ms"] / rows["fuselm_split"]["ms"]
    )
    assert s["split_floor_ms"] > 0
    assert "acceptance" not in data  # measured ratios only: targets live in issues
    meta = data["metadata"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo" and meta["device_type"] == "cpu"
    assert meta["command"].startswith("fuselm bench linear_cross_entropy --world-size 2")
    assert [r["rank"] for r in meta["ranks"]] == [0, 1]
    assert all(r["ceilings"]["gemm_tflops"] > 0 for r in meta["ranks"])
    assert data["ceilings"]["gemm_tflops"] == meta["ranks"][0]["ceilings"]["gemm_tflops"]
    assert "fixed counts" in meta["timing"]

    md = (tmp_path / "linear_cross_entropy_ws2.md").read_text()
    assert md.startswith("# fuselm bench linear_cross_entropy_ws2") and "**CPU figures**" in md
    assert "| N, H, V | provider | mode | ms | x floor | extra MiB |" in md
    assert "## Split over 2 ranks vs one GPU and vs all-gathered logits" in md
    assert "| 64x32x301 | 151 + 150 |" in md and "Acceptance" not in md
    assert "- rank 1: CPU" in md
    assert "## Split over 2 ranks" in printed and "wrote " in printed


# ---- rows of failed cases, the summary (from given records, no ranks) ----


def _record(rank: int, status: str = "ok", agreed: str = "ok", **kw) -> dict:
    base = {"kind": "case", "index": 0, "rank": rank, "status": status, "agreed": agreed, "final": True}
    if status == "ok":
        base.update(ms=2.0 + rank, loss=1.0, grad_norm=1.0, extra_bytes=1 << 20, peak_bytes=2 << 20)
        base["grad_bytes"] = 1 << 20
    return {**base, **kw}


def test_rows_of_failed_cases():
    case = par.Case(0, (8192, 4096, 256000), "allgather_logits")
    ceil = Ceilings(gemm_tflops=700.0)
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 7.81 GiB."
    records = [_record(0, agreed="oom"), _record(1, "oom", "oom", error=oom)]
    row = par.case_row(case, records, 2, torch.bfloat16, ceil)
    assert row.ms is None and row.error == f"{oom} (rank 1)"
    skipped = [_record(r, "skipped", "skipped", error="fuselm.distributed not importable") for r in (0, 1)]
    row = par.case_row(case, skipped, 2, torch.bfloat16, ceil)
    assert row.error == "skipped: fuselm.distributed not importable"
    assert "missing" in par.case_row(case, records[:1], 2, torch.bfloat16, ceil).error
    hung = par.case_row(case, [], 2, torch.bfloat16, ceil, failure="no progress for 60 s")
    assert hung.error == "no progress for 60 s"

    ok = par.case_row(case, [_record(0), _record(1)], 2, torch.bfloat16, ceil)
    assert ok.ms == 3.0 and ok.rank_ms == [2.0, 3.0] and ok.extra_bytes == 1 << 20
    assert ok.flops == 6 * 8192 * 4096 * 256000 / 2
    report = par.Report(
        suite=par.make_suite(2),
        dtype=torch.bfloat16,
        modes=("full",),
        shapes=(case.shape,),
        providers=("allgather_logits",),
        metadata={},
        ceilings=ceil,
        rows=[par.case_row(case, records, 2, torch.bfloat16, ceil)],
    )
    assert "| 8192x4096x256000 | allgather_logits | full | OOM |" in markdown_table(report)


def test_summary_of_split_vs_single():
    ceil = Ceilings(gemm_tflops=700.0)
    shape = (8192, 4096, 128256)
    rows = []
    for i, (provider, ms) in enumerate((("fuselm_split", 30.0), ("fuselm_single", 55.0))):
        recs = [_record(r, ms=ms, index=i) for r in range(2)]
        rows.append(par.case_row(par.Case(i, shape, provider), recs, 2, torch.bfloat16, ceil))
    report = par.Report(
        suite=par.make_suite(2),
        dtype=torch.bfloat16,
        modes=("full",),
        shapes=(shape,),
        providers=("fuselm_split", "fuselm_single"),
        metadata={},
        ceilings=ceil,
        rows=rows,
    )
    (s,) = par.summary(report, 2)
    assert s["split_vs_single"] == pytest.approx(30 / 55)
    assert s["split_floor_ms"] == pytest.approx(6 * math.prod(shape) / 2 / 700e12 * 1e3)
    assert s["allgather_ms"] is None and s["allgather_vs_split"] is None
    md = par.extra_markdown(report, 2, [])
    assert "| 8192x4096x128256 | 64128 + 64128 |" in md and "| 0.55x |" in md
    assert "PASS" not in md and "target" not in md
