"""CPU tests of the benchmark harness and the ``fuselm`` CLI (GPU-only checks are marked ``gpu``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from fuselm_bench import harness, registry, report
from fuselm_bench.arguments import UsageError, parse_list, parse_shapes
from fuselm_bench.harness import Ceilings, Cost, Provider, SkipProvider, Suite, compute_ratios, run_suite

from fuselm.cli import main

CPU = torch.device("cpu")
CE_COLUMNS = "| N, V | provider | mode | ms | TB/s | x copy | extra MiB |"


# ---- ratios from given numbers ----


def test_ratios_bandwidth():
    # 4 GB in 2 ms = 2 TB/s; copy ceiling 4 TB/s -> 0.5
    r = compute_ratios(2.0, Cost(bytes=4e9), Ceilings(copy_tbps=4.0, gemm_tflops=700.0))
    assert r["tbps"] == pytest.approx(2.0)
    assert r["x_copy"] == pytest.approx(0.5)
    assert r["tflops"] is None and r["x_gemm"] is None and r["x_floor"] is None


def test_ratios_flops_and_floor():
    # 6NHV for N=8192, H=4096, V=128256 at 694 TFLOP/s is 37.2 ms; 47.4 ms is 1.27x the floor (docs/peers.md)
    flops = 6 * 8192 * 4096 * 128256
    r = compute_ratios(47.4, Cost(flops=flops), Ceilings(copy_tbps=4.23, gemm_tflops=694.0))
    assert r["tflops"] == pytest.approx(flops / 47.4e-3 / 1e12)
    assert r["x_gemm"] == pytest.approx(r["tflops"] / 694.0)
    assert r["x_floor"] == pytest.approx(47.4 / (flops / 694e12 * 1e3))
    assert r["x_floor"] == pytest.approx(1.27, abs=0.005)
    assert r["x_floor"] * r["x_gemm"] == pytest.approx(1.0)
    assert r["tbps"] is None and r["x_copy"] is None


def test_ratios_anchor_cross_entropy():
    # torch.compile, 8192x128256 bf16 fwd+bwd: 2.61 ms at 4 B/logit is 1.61 TB/s (docs/peers.md)
    r = compute_ratios(2.61, Cost(bytes=8192 * 128256 * 4), Ceilings(copy_tbps=4.23))
    assert r["tbps"] == pytest.approx(1.61, abs=0.005)
    assert r["x_copy"] == pytest.approx(1.61 / 4.23, abs=0.002)


@pytest.mark.parametrize("ms", [None, 0.0, -1.0, float("nan")])
def test_ratios_missing_or_bad_time(ms):
    r = compute_ratios(ms, Cost(bytes=1e9, flops=1e12), Ceilings(copy_tbps=1.0, gemm_tflops=1.0))
    assert all(v is None for v in r.values())


def test_ratios_without_ceilings():
    r = compute_ratios(1.0, Cost(bytes=1e9, flops=1e9), Ceilings())
    assert r["tbps"] == pytest.approx(1.0) and r["tflops"] == pytest.approx(1.0)
    assert r["x_copy"] is None and r["x_gemm"] is None and r["x_floor"] is None


def test_fresh_bytes_skips_aliases_and_duplicates():
    x = torch.zeros(10, 10)
    g = torch.zeros(10, 10)
    assert harness.fresh_bytes([x.view(-1)], [x]) == 0
    assert harness.fresh_bytes([g, g[1:], None], [x]) == 400


# ---- formatting and environment ----


@pytest.mark.parametrize(
    "x, text",
    [
        (0.40612, "0.406"),
        (10958.2, "10958"),
        (2.0, "2.00"),
        (13.54, "13.5"),
        (0.99996, "1.00"),
        (9.9996, "10.0"),
        (None, "—"),
        (0, "0"),
    ],
)
def test_fmt_num(x, text):
    assert report.fmt_num(x) == text


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        (None, "cpu"),
        ("CPU (x86_64)", "cpu"),
    ],
)
def test_gpu_slug(name, slug):
    assert report.gpu_slug(name) == slug


def test_runs_are_offline_unless_the_caller_says_otherwise_and_metadata_says_how(monkeypatch):
    for key in report.OFFLINE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("USE_HUB_KERNELS", "1")  # the caller's choice stays
    report.set_offline_env()
    meta = report.collect_metadata(torch.device("cpu"), ["bench", "rope"])
    assert meta["env"] == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "USE_HUB_KERNELS": "1"}


def test_git_commit_is_a_string():
    commit = report.git_commit()
    assert isinstance(commit, str) and commit


def test_parse_shapes_and_lists():
    assert parse_shapes("8192x128256, 16384X32000") == [(8192, 128256), (16384, 32000)]
    with pytest.raises(UsageError):
        parse_shapes("8192x128256", ndim=3)
    with pytest.raises(UsageError):
        parse_shapes("8192*128256")
    with pytest.raises(UsageError):
        parse_shapes("0x4")
    assert parse_list("full,fwd,full", ("fwd", "bwd", "full"), "mode") == ["full", "fwd"]
    with pytest.raises(UsageError):
        parse_list("fwd,back", ("fwd", "bwd", "full"), "mode")


# ---- a toy suite through the harness ----


def _toy_suite(providers: tuple[Provider, ...], **kw) -> Suite:
    def make_inputs(shape, dtype, device):
        return {"x": torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)}

    def cost(shape, mode, dtype):
        n = math.prod(shape) * dtype.itemsize
        return Cost(bytes={"fwd": 2 * n, "bwd": 3 * n, "full": 5 * n}[mode], flops=float(math.prod(shape)))

    return Suite(
        name="toy",
        description="toy op",
        shape_dims=("N", "H"),
        gpu_shapes=((64, 64),),
        cpu_shapes=((8, 16),),
        providers=providers,
        make_inputs=make_inputs,
        cost=cost,
        columns=kw.pop("columns", ("ms", "tbps", "x_copy", "tflops", "x_floor", "extra_mib")),
        **kw,
    )


def _boom(device):
    def fn(inputs):
        raise RuntimeError("CUDA out of memory (pretend)")

    return fn


def _skip(device):
    raise SkipProvider("not here")


def test_run_suite_records_errors_and_skips_and_continues(tmp_path):
    suite = _toy_suite(
        (
            Provider("square", lambda d: lambda x: (x["x"] * x["x"]).sum()),
            Provider("boom", _boom),
            Provider("absent", _skip),
            Provider("silu", lambda d: lambda x: torch.nn.functional.silu(x["x"])),  # non-scalar output
        )
    )
    rep = run_suite(
        suite,
        shapes=[(8, 16), (4, 4)],
        dtype=torch.float32,
        modes=["fwd", "bwd", "full"],
        providers=["square", "boom", "absent", "silu"],
        device=CPU,
        quick=True,
        ceilings=Ceilings(copy_tbps=1.0, gemm_tflops=1.0),
        progress=False,
        log=lambda s: None,
    )
    assert rep.skipped == {"absent": "not here"}
    assert len(rep.rows) == 2 * 3 * 3
    for r in rep.rows:
        if r.provider == "boom":
            assert r.ms is None and "out of memory" in r.error
        else:
            assert r.error is None and r.ms is not None
            assert r.ms > 0 and r.tbps is not None and r.x_floor is not None
    full = rep.row((8, 16), "square", "full")
    assert full.bytes == 5 * 8 * 16 * 4 and full.tbps == pytest.approx(full.bytes / full.ms / 1e9)

    paths = report.write_report(rep, tmp_path)
    md = paths["md"].read_text()
    assert "| N, H | provider | mode | ms | TB/s | x copy | TFLOP/s | x floor | extra MiB | note |" in md
    assert "RuntimeError" in md and "skipped absent: not here" in md
    data = json.loads(paths["json"].read_text())
    assert {r["provider"] for r in data["rows"]} == {"square", "boom", "silu"}
    assert paths["png"].stat().st_size > 0


class _SleepyBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``BWD_S``: a backward of known length."""

    BWD_S = 0.004

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(_SleepyBackward.BWD_S)
        return grad


def test_bwd_is_the_backward_alone_measured_on_its_own():
    """bwd was once median(full) - median(fwd), negative whenever the no-grad forward of fwd mode
    costs more than the forward inside full. Here the no-grad forward sleeps 30 ms, the recording one 10 ms,
    the backward 4 ms: the old derivation gave 14 - 30 = -16 ms; the backward alone is 4 ms and some."""

    def setup(device):
        def fn(x):
            time.sleep(0.010 if torch.is_grad_enabled() else 0.030)
            return _SleepyBackward.apply(x["x"]).sum()

        return fn

    suite = _toy_suite((Provider("sleepy", setup),))
    rep = run_suite(
        suite,
        shapes=[(8, 16)],
        dtype=torch.float32,
        modes=["fwd", "bwd", "full"],
        providers=["sleepy"],
        device=CPU,
        quick=True,
        ceilings=Ceilings(copy_tbps=1.0, gemm_tflops=1.0),
        progress=False,
        log=lambda s: None,
    )
    fwd, bwd, full = (rep.row((8, 16), "sleepy", m) for m in ("fwd", "bwd", "full"))
    assert fwd.ms >= 30 and full.ms >= 14
    assert _SleepyBackward.BWD_S * 1e3 <= bwd.ms < 10, bwd.ms  # no forward inside, nothing subtracted
    assert bwd.tbps is not None and bwd.tbps > 0 and bwd.error is None
    assert "measured on its own" in report.markdown(
        rep
    ) and "median(full) - median(fwd)" not in report.markdown(rep)


def test_time_backward_ms_runs_a_fresh_forward_per_backward():
    """Each timed backward gets a forward of its own: designs whose backward consumes its buffers (a second
    backward raises) are timed too."""
    x = torch.randn(32, requires_grad=True)
    calls = {"forward": 0, "backward": 0}

    def forward():
        calls["forward"] += 1
        return (x * x).sum()

    def backward(y):
        calls["backward"] += 1
        return torch.autograd.grad(y, [x])  # frees y's graph: a second backward through it would raise

    ms = harness.time_backward_ms(forward, backward, CPU, quick=True)
    assert ms > 0 and calls["forward"] == calls["backward"] == harness.CPU_REPS[True]


class _SyncInBackward(torch.autograd.Function):
    """``x * 2`` whose backward makes a host sync (cannot be captured in a CUDA graph)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if grad.sum().item() > 1e30:
            return grad * 0
        return grad * 2


def _graph_suite_report(device):
    def host_sync(device):
        def fn(x):
            y = x["x"] * 2
            if y.sum().item() > 1e30:  # a host sync: cannot be captured in a CUDA graph
                return y * 0
            return y

        return fn

    suite = _toy_suite(
        (
            Provider("square", lambda d: lambda x: x["x"] * x["x"]),
            Provider("sync", host_sync),
            Provider("sync_bwd", lambda d: lambda x: _SyncInBackward.apply(x["x"])),
        ),
        columns=("ms", "ms_eager", "tbps", "x_copy"),
        cuda_graph=True,
    )
    return run_suite(
        suite,
        shapes=[(64, 64)],
        dtype=torch.float32,
        modes=["fwd", "bwd", "full"],
        providers=["square", "sync", "sync_bwd"],
        device=device,
        quick=True,
        ceilings=Ceilings(copy_tbps=1.0),
        progress=False,
        log=lambda s: None,
    )


def test_cuda_graph_suite_on_cpu_times_the_plain_call(tmp_path):
    rep = _graph_suite_report(CPU)
    for r in rep.rows:
        assert r.error is None and r.note is None and r.ms is not None and r.ms_eager is None
    assert "CUDA graph" not in rep.metadata["timing"]
    md = report.write_report(rep, tmp_path)["md"].read_text()
    assert "| N, H | provider | mode | ms | eager ms | TB/s | x copy |" in md
    assert "eager ms the plain Python call" in md


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_suite_times_replays_and_keeps_eager_time_on_gpu(tmp_path):
    rep = _graph_suite_report(torch.device("cuda"))
    assert "CUDA graph" in rep.metadata["timing"]
    for mode in ("fwd", "full"):
        ok, synced = rep.row((64, 64), "square", mode), rep.row((64, 64), "sync", mode)
        assert ok.error is None and ok.note is None and ok.ms > 0 and ok.ms_eager > 0
        # a replay has no host path: not slower than the plain call beyond do_bench's own scatter
        assert ok.ms < 2 * ok.ms_eager
        assert synced.error is None and "graph capture failed" in synced.note
        assert synced.ms == synced.ms_eager
    # bwd: a graph of the backward alone; the host sync of "sync" is in its forward, which runs eagerly
    bwd = rep.row((64, 64), "sync", "bwd")
    assert bwd.error is None and bwd.note is None and bwd.ms > 0 and bwd.ms_eager > 0
    synced_bwd = rep.row((64, 64), "sync_bwd", "bwd")
    assert "graph capture failed" in synced_bwd.note and synced_bwd.ms == synced_bwd.ms_eager > 0
    md = report.write_report(rep, tmp_path)["md"].read_text()
    assert "graph capture failed" in md
    # the failed captures left the CUDA state (random numbers included) usable: the full rows above were
    # made after the fwd capture failed; and here again
    assert torch.randn(4, device="cuda").isfinite().all().item()


def test_run_suite_rejects_unknown_names():
    suite = _toy_suite((Provider("square", lambda d: lambda x: (x["x"] ** 2).sum()),))
    kw = dict(shapes=[(2, 2)], dtype=torch.float32, device=CPU, ceilings=Ceilings(), progress=False)
    with pytest.raises(ValueError):
        run_suite(suite, modes=["sideways"], providers=["square"], **kw)
    with pytest.raises(KeyError):
        run_suite(suite, modes=["fwd"], providers=["nope"], **kw)


def test_forward_runs_without_grad_by_default():
    seen = []

    def setup(device):
        def fn(x):
            seen.append((torch.is_grad_enabled(), x["x"].requires_grad))
            return (x["x"] * 2).sum()

        return fn

    suite = _toy_suite((Provider("p", setup),))
    run_suite(
        suite,
        shapes=[(2, 2)],
        dtype=torch.float32,
        modes=["fwd"],
        providers=["p"],
        device=CPU,
        ceilings=Ceilings(),
        progress=False,
        log=lambda s: None,
    )
    # the availability check calls setup but not fn; every fwd call runs in no_grad on detached inputs
    assert seen and all(s == (False, False) for s in seen)


# ---- the cross-entropy suite and the CLI on CPU ----


def test_registry_lists_cross_entropy():
    assert "cross_entropy" in registry.suite_names()
    suite = registry.get_suite("cross_entropy")
    assert suite.provider_names == ["torch", "torch_compile", "fuselm", "fuselm_inplace", "liger"]
    assert suite.gpu_shapes == ((8192, 128256), (16384, 32000), (4096, 256000), (16384, 8192))
    with pytest.raises(KeyError):
        registry.get_suite("nope")


def test_cross_entropy_cost():
    from fuselm_bench.cross_entropy import cost

    n, v = 8192, 128256
    assert cost((n, v), "full", torch.bfloat16).bytes == 4 * n * v
    assert cost((n, v), "fwd", torch.bfloat16).bytes == 2 * n * v
    assert cost((n, v), "bwd", torch.bfloat16).bytes == 2 * n * v


def test_cli_bench_cross_entropy_cpu(tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["bench", "cross_entropy", "--device", "cpu", "--shapes", "64x100,32x257", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "CPU figures" in printed
    assert CE_COLUMNS in printed
    assert "skipping provider liger" in printed and "skipping provider torch_compile" in printed

    md = (out / "cross_entropy.md").read_text()
    assert CE_COLUMNS in md and "CPU figures" in md
    for needle in ("device:", "torch ", "triton ", "@ ", "date:", "ceilings"):
        assert needle in md
    data = json.loads((out / "cross_entropy.json").read_text())
    meta = data["metadata"]
    for key in ("device", "torch", "triton", "commit", "date"):
        assert meta[key]
    assert data["ceilings"]["copy_tbps"] > 0 and data["ceilings"]["gemm_tflops"] > 0
    assert set(data["skipped"]) == {"torch_compile", "liger"}
    rows = data["rows"]
    assert len(rows) == 2 * 3 * 3  # shapes x providers (torch, fuselm, fuselm_inplace) x modes
    assert {r["provider"] for r in rows} == {"torch", "fuselm", "fuselm_inplace"}
    assert {tuple(r["shape"]) for r in rows} == {(64, 100), (32, 257)}
    for r in rows:
        assert r["error"] is None, r
        assert r["extra_mib"] is None  # no memory figures on CPU
        assert r["ms"] > 0 and r["tbps"] > 0 and r["x_copy"] > 0  # bwd too: measured, never a difference
        assert r["bytes"] == {"fwd": 2, "bwd": 2, "full": 4}[r["mode"]] * math.prod(r["shape"])
    png = (out / "cross_entropy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_results_leave_the_checkout_clean(tmp_path, monkeypatch, capsys):
    """Without --out a CPU run wrote benchmarks/results/cpu/, untracked in the checkout. It
    now writes bench-out/cpu/, which the checkout's .gitignore ignores: in a git work tree with that
    .gitignore, the run leaves nothing untracked but the .gitignore itself."""
    import shutil
    import subprocess

    repo_root = Path(__file__).resolve().parents[2]
    shutil.copy(repo_root / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)
    args = ["bench", "cross_entropy", "--device", "cpu", "--shapes", "16x50", "--modes", "full"]
    assert main([*args, "--providers", "torch", "--quick", "--no-progress"]) == 0
    assert "bench-out/cpu/cross_entropy.md" in capsys.readouterr().out
    assert (tmp_path / "bench-out" / "cpu" / "cross_entropy.json").is_file()
    assert not (tmp_path / "benchmarks").exists()
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True, check=True
    )
    assert status.stdout.splitlines() == ["?? .gitignore"]


def test_cli_modes_and_providers_subset(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "cross_entropy",
            "--device",
            "cpu",
            "--shapes",
            "16x50",
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
    data = json.loads((tmp_path / "cross_entropy.json").read_text())
    assert [(r["provider"], r["mode"]) for r in data["rows"]] == [("torch", "full"), ("fuselm", "full")]
    assert data["skipped"] == {}


def test_cli_lists_suites_and_help(capsys):
    assert main(["bench"]) == 0
    assert "cross_entropy" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
    assert main(["bench", "--help"]) == 0
    assert "--shapes" in capsys.readouterr().out
    assert main([]) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "nope"],
        ["bench", "cross_entropy", "--device", "cpu", "--shapes", "1x2x3"],
        ["bench", "cross_entropy", "--device", "cpu", "--providers", "torch,nobody"],
        ["bench", "cross_entropy", "--device", "cpu", "--dtype", "int8"],
        ["bench", "all", "--shapes", "4x4"],
    ],
)
def test_cli_usage_errors(args, capsys):
    assert main(args) == 2
    assert "error" in capsys.readouterr().err


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_bench_cross_entropy_gpu_small(tmp_path):
    rc = main(
        ["bench", "cross_entropy", "--shapes", "512x4096", "--quick", "--no-progress", "--out", str(tmp_path)]
    )
    assert rc == 0
    data = json.loads((tmp_path / "cross_entropy.json").read_text())
    assert data["ceilings"]["copy_tbps"] > 0 and data["ceilings"]["gemm_tflops"] > 0
    for r in data["rows"]:
        if r["provider"] in ("torch", "fuselm", "fuselm_inplace"):
            assert r["error"] is None, r
            if r["mode"] != "bwd":
                assert r["extra_mib"] is not None and r["extra_mib"] >= 0


def test_bench_without_the_lab_on_the_path_says_where_it_is(monkeypatch, capsys):
    """An installed wheel has no benchmark lab, and fuselm edits no sys.path: `fuselm bench` says it
    runs from a clone with benchmarks/ on the import path (exit 2); `fuselm demo` does not need the lab."""
    import sys

    import fuselm.cli as cli

    def not_installed(name, *args, **kwargs):
        raise ModuleNotFoundError(f"No module named {name!r}", name=cli.LAB)

    monkeypatch.setattr(cli.importlib, "import_module", not_installed)
    path = list(sys.path)
    assert main(["bench"]) == 2
    assert sys.path == path
    assert "PYTHONPATH=benchmarks fuselm bench" in capsys.readouterr().err


def test_python_m_fuselm_bench_runs_the_lab():
    """`python -m fuselm_bench` in benchmarks/ is `fuselm bench`."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "fuselm_bench"], cwd=root / "benchmarks", capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "finetune" in out.stdout and "cross_entropy" in out.stdout
