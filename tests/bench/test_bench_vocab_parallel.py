"""CPU tests of ``fuselm bench linear_cross_entropy|linear_log_probs --world-size W``: the vocabulary split
over W gloo processes against one process and against all-gathered logits.

One CLI run per op spawns the two ranks (importing torch in each takes seconds): everything that needs ranks
is checked on its report; the rest (split, rows of failed cases, usage errors) in process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from fuselm_bench import vocab_parallel as par
from fuselm_bench.harness import Ceilings
from fuselm_bench.report import markdown_table

from fuselm.cli import main

SHAPE = (64, 32, 301)  # V odd: an uneven split, 151 + 150
PROVIDERS = ["fuselm_split", "allgather_logits", "fuselm_single"]
OPS = ["linear_cross_entropy", "linear_log_probs"]


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks run fuselm's CPU path (the PyTorch references), not Triton's interpreter: fast."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("v, w", [(128256, 2), (256000, 2), (301, 2), (10, 3), (5, 8)])
def test_vocab_split_is_tensor_split(v, w):
    assert par.vocab_split(v, w) == [len(c) for c in torch.arange(v).tensor_split(w)]


def test_both_ops_have_the_same_providers():
    assert list(par.OPS) == OPS
    for op in OPS:
        suite = par.make_suite(op, 2)
        assert suite.name == f"{op}_ws2" and suite.provider_names == PROVIDERS
        assert suite.shape_dims == ("N", "H", "V")
    assert par.make_suite("linear_log_probs", 2).gpu_shapes == ((8192, 4096, 128256), (16384, 4096, 151936))


def _expected(op: str, shape: tuple[int, int, int]) -> tuple[float, float, int]:
    """(loss, grad norm, ignored targets) of the op's problem from the runner's seed, in float64."""
    torch.manual_seed(par.SEED)
    inputs = par.OPS[op].make_inputs(shape, torch.float32, torch.device("cpu"))
    x = inputs["input"].detach().double().requires_grad_(True)
    w = inputs["linear_weight"].detach().double().requires_grad_(True)
    target = inputs["target"]
    kept = target != -100
    logits = x @ w.T
    if op == "linear_cross_entropy":
        loss = F.cross_entropy(logits, target, ignore_index=-100)
    else:  # the sum of the log-probs of the kept targets
        loss = logits.log_softmax(-1)[kept].gather(-1, target[kept][:, None]).sum()
    dx, dw = torch.autograd.grad(loss, (x, w))
    return float(loss.detach()), math.sqrt(float(dx.pow(2).sum() + dw.pow(2).sum())), int((~kept).sum())


# ---- command line ----


@pytest.mark.parametrize("suite", ["rms_norm", "cross_entropy", "e2e", "all"])
def test_world_size_only_for_the_split_ops(suite, tmp_path, capsys):
    rc = main(["bench", suite, "--world-size", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 2
    message = (
        f"--world-size applies to linear_cross_entropy, linear_log_probs and finetune only, not to '{suite}'"
    )
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("op", OPS)
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
def test_usage_errors(op, args, message, tmp_path, capsys):
    rc = main(["bench", op, "--device", "cpu", "--out", str(tmp_path), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("op", OPS)
def test_cli_two_gloo_ranks(op, tmp_path, capsys, reference_path):
    shape = "x".join(map(str, SHAPE))
    argv = ["bench", op, "--world-size", "2", "--device", "cpu", "--shapes", shape]
    assert main([*argv, "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    name = f"{op}_ws2"
    for ext in ("md", "json", "png"):
        assert (tmp_path / f"{name}.{ext}").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.{ext}" for ext in ("json", "md", "png")]

    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["suite"] == name and data["world_size"] == 2
    assert data["dtype"] == "fp32" and data["modes"] == ["full"] and data["providers"] == PROVIDERS
    rows = {r["provider"]: r for r in data["rows"]}
    assert list(rows) == PROVIDERS
    for provider, r in rows.items():
        ranks = 1 if provider == "fuselm_single" else 2
        assert r["error"] is None, r
        assert r["shape"] == list(SHAPE) and r["mode"] == "full" and r["ranks"] == ranks
        assert r["vocab_sizes"] == ([301] if ranks == 1 else [151, 150])
        assert len(r["rank_ms"]) == ranks and all(ms > 0 for ms in r["rank_ms"])
        assert r["ms"] == max(r["rank_ms"])
        assert r["flops"] == 6 * math.prod(SHAPE) / ranks and r["x_floor"] > 0
        # memory: measured on CUDA only; on CPU the fields are there, empty
        assert r["rank_extra_bytes"] == [None] * ranks and r["extra_bytes"] is None and r["extra_mib"] is None
    # the same loss and gradients from every provider (the baseline's dx is summed over the ranks once)
    for provider in PROVIDERS[:2]:
        assert rows[provider]["loss"] == pytest.approx(rows["fuselm_single"]["loss"], rel=1e-5)
        assert rows[provider]["grad_norm"] == pytest.approx(rows["fuselm_single"]["grad_norm"], rel=1e-5)
    # ... and they are the op's: the mean cross-entropy / the sum of the log-probs, from float64
    loss, grad_norm, ignored = _expected(op, SHAPE)
    assert ignored == round(SHAPE[0] / 7)  # the suites' inputs: 1/7 of the targets ignored
    assert rows["fuselm_single"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert rows["fuselm_single"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)

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
    assert meta["command"].startswith(f"fuselm bench {op} --world-size 2")
    assert [r["rank"] for r in meta["ranks"]] == [0, 1]
    assert all(r["ceilings"]["gemm_tflops"] > 0 for r in meta["ranks"])
    assert data["ceilings"]["gemm_tflops"] == meta["ranks"][0]["ceilings"]["gemm_tflops"]
    assert "fixed counts" in meta["timing"]

    md = (tmp_path / f"{name}.md").read_text()
    assert md.startswith(f"# fuselm bench {name}") and "**CPU figures**" in md
    assert "| N, H, V | provider | mode | ms | x floor | extra MiB |" in md
    assert "## Split over 2 ranks vs one GPU and vs all-gathered logits" in md
    assert "| 64x32x301 | 151 + 150 |" in md and "Acceptance" not in md
    assert "- rank 1: CPU" in md
    split_op = (
        "linear_cross_entropy" if op == "linear_cross_entropy" else "linear_log_probs(...).log_probs.sum()"
    )
    assert f"- fuselm_split: fuselm.distributed.{split_op}, every rank" in md
    if op == "linear_log_probs":
        assert "loss: the sum of the N per-token log-probs" in md
    assert "## Split over 2 ranks" in printed and "wrote " in printed


# ---- rows of failed cases, the summary (from given records, no ranks) ----


def _record(rank: int, status: str = "ok", agreed: str = "ok", **kw) -> dict:
    base = {"kind": "case", "index": 0, "rank": rank, "status": status, "agreed": agreed, "final": True}
    if status == "ok":
        base.update(ms=2.0 + rank, loss=1.0, grad_norm=1.0, extra_bytes=1 << 20, peak_bytes=2 << 20)
        base["grad_bytes"] = 1 << 20
    return {**base, **kw}


@pytest.mark.parametrize("op", OPS)
def test_rows_of_failed_cases(op):
    suite = par.make_suite(op, 2)
    case = par.Case(0, (8192, 4096, 256000), "allgather_logits")
    ceil = Ceilings(gemm_tflops=700.0)
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 7.81 GiB."
    records = [_record(0, agreed="oom"), _record(1, "oom", "oom", error=oom)]
    row = par.case_row(suite, case, records, 2, torch.bfloat16, ceil)
    assert row.ms is None and row.error == f"{oom} (rank 1)"
    skipped = [_record(r, "skipped", "skipped", error="fuselm.distributed not importable") for r in (0, 1)]
    row = par.case_row(suite, case, skipped, 2, torch.bfloat16, ceil)
    assert row.error == "skipped: fuselm.distributed not importable"
    assert "no result from ranks [1]" in par.case_row(suite, case, records[:1], 2, torch.bfloat16, ceil).error
    hung = par.case_row(suite, case, [], 2, torch.bfloat16, ceil, failure="no progress for 60 s")
    assert hung.error == "no progress for 60 s"

    ok = par.case_row(suite, case, [_record(0), _record(1)], 2, torch.bfloat16, ceil)
    assert ok.ms == 3.0 and ok.rank_ms == [2.0, 3.0] and ok.extra_bytes == 1 << 20
    assert ok.flops == 6 * 8192 * 4096 * 256000 / 2
    report = par.Report(
        suite=suite,
        dtype=torch.bfloat16,
        modes=("full",),
        shapes=(case.shape,),
        providers=("allgather_logits",),
        metadata={},
        ceilings=ceil,
        rows=[par.case_row(suite, case, records, 2, torch.bfloat16, ceil)],
    )
    assert "| 8192x4096x256000 | allgather_logits | full | OOM |" in markdown_table(report)


@pytest.mark.parametrize("op", OPS)
def test_summary_of_split_vs_single(op):
    suite = par.make_suite(op, 2)
    ceil = Ceilings(gemm_tflops=700.0)
    shape = (8192, 4096, 128256)
    rows = []
    for i, (provider, ms) in enumerate((("fuselm_split", 30.0), ("fuselm_single", 55.0))):
        recs = [_record(r, ms=ms, index=i) for r in range(2)]
        rows.append(par.case_row(suite, par.Case(i, shape, provider), recs, 2, torch.bfloat16, ceil))
    report = par.Report(
        suite=suite,
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
